"""hputrain: one PyTorch training script for Gaudi (HPU), NVIDIA GPUs and CPUs.

Importing hputrain detects nothing, imports no vendor runtime and starts no subprocess: the device is
resolved once, in the entry point, and passed down.
"""
__version__ = "0.1.0"

from .accelerators import detect_accelerator
from .callbacks import Callback, EarlyStopping
from .precision import autocast
from .config import AcceleratorConfig, TrainingArguments
from .trainer import Trainer

__all__ = ["AcceleratorConfig", "Callback", "EarlyStopping", "Trainer", "TrainingArguments", "autocast", "detect_accelerator", "__version__"]
