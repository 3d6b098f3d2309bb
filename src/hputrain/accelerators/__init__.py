"""Device backends: one file per device, chosen through the registry."""
from .base import Accelerator
from .registry import ACCELERATORS, AcceleratorNotFound, available_accelerators, detect_accelerator

__all__ = ["Accelerator", "ACCELERATORS", "AcceleratorNotFound", "available_accelerators",
           "detect_accelerator"]
