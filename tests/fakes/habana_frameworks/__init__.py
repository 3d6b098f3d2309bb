"""Fake habana_frameworks (tests only)."""
