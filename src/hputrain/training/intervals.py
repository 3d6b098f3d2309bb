"""When a run logs, evaluates and saves (every N steps, or at the end of each epoch: the Hugging
Face "epoch" strategies), and which of its checkpoints is best (load_best_model_at_end).

Steps are optimizer steps counted from 1. The end of training always logs, evaluates (with an
eval_dataset) and saves (unless save_steps is -1): the trainer does that after the loop, so the
intervals here only say which steps inside the run do.
"""
from __future__ import annotations

import math
from pathlib import Path

from ..callbacks.early_stopping import lower_is_better, metric_key, metric_value
from ..config.sections import ScheduleSettings
from ..errors import InputError


class Intervals:
    """The run's logging, evaluation and saving steps. "epoch" means every `steps_per_epoch`
    steps, which an iterable dataset without a length does not have."""

    def __init__(self, settings: ScheduleSettings, steps_per_epoch: int | None, total_steps: int) -> None:
        epochs = [f"{name}_strategy='epoch'" for name in ("eval", "save", "logging")
                  if getattr(settings, f"{name}_strategy") == "epoch"]
        if epochs and not steps_per_epoch:
            raise InputError(f"{epochs[0]} needs a train_dataset with a length (an iterable one has "
                             "no epochs): set eval_steps, save_steps and logging_steps instead")
        self.total_steps = total_steps
        self.log_every = steps_per_epoch if settings.logging_strategy == "epoch" else settings.logging_steps
        self.eval_every = steps_per_epoch if settings.eval_strategy == "epoch" else settings.eval_steps
        self.save_every = steps_per_epoch if settings.save_strategy == "epoch" else settings.save_steps
        self.saves_at_all = self.save_every >= 0  # -1: never, 0: only at the end

    def logs(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.total_steps

    def evaluates(self, step: int) -> bool:
        """Whether step `step` evaluates inside the loop (0: only at the end)."""
        return self.eval_every > 0 and step % self.eval_every == 0

    def saves(self, step: int) -> bool:
        """Whether step `step` saves inside the loop (0: only at the end, -1: never)."""
        return self.save_every > 0 and step % self.save_every == 0

    def check_best_model(self, settings: ScheduleSettings, has_eval_dataset: bool) -> None:
        """load_best_model_at_end ranks checkpoints by an evaluation of their own step: every
        save must come with one. One line where the settings do not give that."""
        if not settings.load_best_model_at_end:
            return
        if not has_eval_dataset:
            raise InputError("load_best_model_at_end needs an eval_dataset to rank checkpoints by")
        if not self.saves_at_all:
            raise InputError("load_best_model_at_end needs checkpoints, but save_steps is -1 "
                             "(save_strategy 'no'): set save_steps or save_strategy")
        saves_inside = range(self.save_every, self.total_steps, self.save_every) if self.save_every else ()
        for step in saves_inside:  # the end evaluates and saves anyway
            if not self.evaluates(step):
                raise InputError(
                    f"load_best_model_at_end needs an evaluation at every save, but step {step} saves "
                    f"(every {self.save_every} steps) without one (every {self.eval_every or 'no'} "
                    "steps): make save_steps a multiple of eval_steps, or set eval_strategy and "
                    "save_strategy both to 'epoch'")


class BestCheckpoint:
    """The checkpoint whose evaluation had the best metric_for_best_model (load_best_model_at_end),
    kept in trainer_state.json as best_metric and best_model_checkpoint, as the Hugging Face
    Trainer keeps them, so that a resumed run goes on ranking against it."""

    def __init__(self, settings: ScheduleSettings, state: dict) -> None:
        self.enabled = settings.load_best_model_at_end
        self.key = metric_key(settings.metric_for_best_model or "eval_loss")
        self.lower = lower_is_better(self.key, settings.greater_is_better)
        self.metric = state.get("best_metric")
        folder = state.get("best_model_checkpoint")
        self.folder = Path(folder) if folder and Path(folder).is_dir() else None
        if self.folder is None:
            self.metric = None
        self.last: tuple[int, float] | None = None  # (step, value) of the latest evaluation

    def evaluated(self, step: int, metrics: dict) -> None:
        if self.enabled:
            self.last = (step, metric_value(metrics, self.key, "metric_for_best_model"))

    def saving(self, step: int, folder: Path) -> None:
        """Before checkpoint `folder` of step `step` is written: it becomes the best when this
        step's evaluation beats the best so far (a NaN never does)."""
        if not self.enabled or self.last is None or self.last[0] != step:
            return
        value = self.last[1]
        better = self.metric is None or (value < self.metric if self.lower else value > self.metric)
        if value == value and better:
            self.metric, self.folder = value, Path(folder)

    def state(self) -> dict:
        if not self.enabled or self.folder is None:
            return {}
        return {"best_metric": self.metric, "best_model_checkpoint": str(self.folder)}

    def keep_limit(self, limit: int | None, saved: Path) -> int | None:
        """How many checkpoints rotation keeps when it also keeps the best: one more where the
        best is not the newest and the limit is 1 (the Hugging Face Trainer's rule), so that
        training can still resume from the newest."""
        if limit is None or self.folder is None or self.folder == saved:
            return limit
        return max(limit, 2)


def total_steps_of(batches, max_steps: int, num_train_epochs: float) -> int:
    """The run's optimizer steps: max_steps when set, else the epochs' worth of global batches."""
    if batches.steps_per_epoch == 0:
        raise InputError(f"the training set ({batches.num_samples} samples) is smaller than "
                         f"one global batch ({batches.global_batch_size} samples): lower "
                         "per_device_train_batch_size or gradient_accumulation_steps")
    if max_steps > 0:
        return max_steps
    if batches.steps_per_epoch is None:
        raise InputError("an iterable train_dataset has no length: set max_steps")
    return math.ceil(num_train_epochs * batches.steps_per_epoch)
