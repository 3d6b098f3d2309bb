"""Fake HCCL: the real module registers the "hccl" process-group backend on import."""
from habana_frameworks import fake

fake.record("hccl_registered")
