"""Processes, process groups and strategies."""
from .group import ProcessGroup

__all__ = ["ProcessGroup"]
