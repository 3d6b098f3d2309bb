"""EarlyStopping, and how an evaluation metric is named, read and compared (load_best_model_at_end
ranks checkpoints the same way)."""
from __future__ import annotations

import math

from ..errors import InputError
from .base import Callback


def metric_key(name: str) -> str:
    """An evaluation metric's key: the "eval_" prefix may be left out, as in the Hugging Face
    Trainer's metric_for_best_model."""
    return name if name.startswith("eval_") else f"eval_{name}"


def lower_is_better(name: str, greater_is_better: bool | None) -> bool:
    """Unset greater_is_better: a loss is better lower, any other metric higher."""
    return "loss" in name if greater_is_better is None else not greater_is_better


def metric_value(metrics: dict, key: str, setting: str) -> float:
    """metrics[key] as a float, or one line naming the metrics there are."""
    if key not in metrics:
        raise InputError(f"{setting} {key!r} is not among the evaluation metrics "
                         f"({', '.join(sorted(metrics))}): name one of those, or pass "
                         "compute_metrics= returning it")
    return float(metrics[key])


class EarlyStopping(Callback):
    """Stops training after `patience` evaluations in a row whose `metric` did not improve on
    the best so far by more than `threshold`. `greater_is_better` unset: False for a metric
    whose name contains "loss", else True."""

    def __init__(self, metric: str = "eval_loss", patience: int = 1, threshold: float = 0.0,
                 greater_is_better: bool | None = None) -> None:
        if not isinstance(patience, int) or patience < 1:
            raise InputError(f"EarlyStopping patience must be a whole number of evaluations >= 1, got {patience!r}")
        if not threshold >= 0:
            raise InputError(f"EarlyStopping threshold must be >= 0, got {threshold!r}")
        self.metric, self.patience, self.threshold = metric_key(metric), patience, threshold
        self.lower = lower_is_better(self.metric, greater_is_better)
        self.best, self.waited = None, 0

    def on_train_begin(self, trainer) -> None:
        self.best, self.waited = None, 0  # an instance may serve several runs

    def on_evaluate(self, trainer, metrics: dict) -> None:
        value = metric_value(metrics, self.metric, "EarlyStopping metric")
        if self.best is None or self._improves(value):
            self.best, self.waited = value, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            trainer.should_stop = True
            trainer.log_message(f"early stopping at step {trainer.global_step}: {self.metric} has not "
                                f"improved on {self.best:g} for {self.waited} evaluation(s)")

    def _improves(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.lower:
            return value < self.best - self.threshold
        return value > self.best + self.threshold
