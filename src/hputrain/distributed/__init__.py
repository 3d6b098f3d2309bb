"""Processes, their mesh, process groups and strategies."""
from .group import ProcessGroup
from .mesh import MeshDims
from .selection import select_strategy
from .strategies import DDP, FastDDP, Strategy

__all__ = ["DDP", "FastDDP", "MeshDims", "ProcessGroup", "Strategy", "select_strategy"]
