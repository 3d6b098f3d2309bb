"""Processes, process groups and strategies."""
from .group import ProcessGroup
from .strategies import DDP, FastDDP, Strategy, select_strategy

__all__ = ["DDP", "FastDDP", "ProcessGroup", "Strategy", "select_strategy"]
