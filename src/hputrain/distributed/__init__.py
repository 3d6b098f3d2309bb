"""Processes, their mesh, process groups and strategies."""
from .group import ProcessGroup
from .mesh import MeshDims
from .strategies import DDP, FastDDP, Strategy, select_strategy

__all__ = ["DDP", "FastDDP", "MeshDims", "ProcessGroup", "Strategy", "select_strategy"]
