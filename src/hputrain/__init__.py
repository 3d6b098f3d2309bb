"""hputrain: one PyTorch training script for Gaudi (HPU), NVIDIA GPUs and CPUs.

Importing hputrain detects nothing, imports no vendor runtime and starts no subprocess: the device is
resolved once, in the entry point, and passed down.
"""
__version__ = "0.1.0"

from . import registry  # noqa: F401  (the methods and model kinds made known to the core)
from .accelerators import detect_accelerator
from .callbacks import Callback, EarlyStopping
from .config.accelerator_config import AcceleratorConfig
from .config.arguments import TrainingArguments
from .methods.grpo.config import GRPOConfig
from .methods.reward.config import RewardConfig
from .methods.dpo.config import DPOConfig
from .data.sft import SFTDataset, sft_dataset
from .execution.precision import autocast
from .methods.dpo.trainer import DPOTrainer
from .methods.grpo.trainer import GRPOTrainer
from .methods.grpo.loss import grpo_loss
from .methods.reward.trainer import RewardTrainer
from .training.trainer import Trainer

__all__ = ["AcceleratorConfig", "Callback", "DPOConfig", "DPOTrainer", "EarlyStopping", "GRPOConfig",
           "GRPOTrainer", "RewardConfig", "RewardTrainer", "SFTDataset", "Trainer", "TrainingArguments",
           "autocast", "detect_accelerator", "grpo_loss", "sft_dataset", "__version__"]
