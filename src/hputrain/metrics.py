"""Ready-made `compute_metrics` functions for Trainer(compute_metrics=...): the public path of
training/metrics.py."""
from .training.metrics import accuracy, token_accuracy

__all__ = ["accuracy", "token_accuracy"]
