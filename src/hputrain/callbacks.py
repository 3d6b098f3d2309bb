"""Callbacks: code that runs at fixed points of training, as the Hugging Face Trainer's and
Lightning's callbacks do. The progress bar, metrics.jsonl and the trackers (TensorBoard, MLflow,
W&B) are callbacks too; `EarlyStopping` ships.

Every hook is called on every rank with the trainer, in the order of `trainer.callbacks`; a
callback that writes checks `trainer.group.is_main` (the built-in writers below are only given to
rank 0). A callback asks training to end by setting `trainer.should_stop = True`: the ranks agree
before the next step (one of them asking is enough), then the trainer evaluates and saves a
checkpoint as at the end of a run (unless save_steps is -1), calls on_train_end and returns from
train().

A Trainer's callbacks are, in order: those added to every trainer (below), those passed as
`callbacks=`, then on rank 0 the built-in writers (`reporting_callbacks`).

Callbacks added to every trainer: a tool that runs a user's unmodified script and needs to
reach each Trainer it makes (`hputrain doctor`) wraps the run in

    with callbacks.added_to_every_trainer(make_callback):
        runpy.run_path(script)

and every Trainer constructed inside the block appends `make_callback()` to its callbacks. This
is the only process-wide input to a Trainer, and it exists only inside that block. A callback's
`adjust_args` may change the run's arguments before anything else of the trainer is set up (the
doctor moves the run to lazy mode on the CPU and into a temporary folder).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import InputError
from .telemetry import METRICS_FILE, open_jsonl


class Callback:
    """The hooks, in the order a run reaches them. This base does nothing."""

    def adjust_args(self, args):
        """At Trainer construction, before the device or the model is touched: the
        TrainingArguments to use instead of `args` (a new object: dataclasses.replace)."""
        return args

    def on_train_begin(self, trainer) -> None:
        """After the optimizer, schedule and resumed state exist, before the first step
        (trainer.global_step is the step training starts from, trainer.total_steps its end)."""

    def on_step_begin(self, trainer) -> None:
        """Before the first micro-batch of each optimizer step."""

    def on_step_end(self, trainer) -> None:
        """After each optimizer step and its mark_step (trainer.global_step counts it;
        trainer.step_inputs is the step's last micro-batch, on the device)."""

    def on_log(self, trainer, record: dict) -> None:
        """A record for the logs: every logging step's, each evaluation's, and the summary at
        the end."""

    def on_evaluate(self, trainer, metrics: dict) -> None:
        """After evaluate() during training, with its metrics (eval_loss, ...)."""

    def on_save(self, trainer, folder) -> None:
        """After a checkpoint folder is complete (every rank, after the last barrier)."""

    def on_train_end(self, trainer) -> None:
        """At the end of train(), also when a signal or a callback stopped it, and when an error
        ended it (so that files and tracker runs are closed)."""


# -- callbacks added to every trainer --------------------------------------------------------------

_EVERY_TRAINER: list[Callable[[], Callback]] = []


@contextlib.contextmanager
def added_to_every_trainer(factory: Callable[[], Callback]) -> Iterator[None]:
    """Inside the block, every Trainer constructed appends `factory()` to its callbacks."""
    _EVERY_TRAINER.append(factory)
    try:
        yield
    finally:
        _EVERY_TRAINER.remove(factory)


def for_every_trainer() -> list[Callback]:
    """New callbacks from the factories of the enclosing `added_to_every_trainer` blocks."""
    return [factory() for factory in _EVERY_TRAINER]


# -- the built-in writers (rank 0) -----------------------------------------------------------------

def reporting_callbacks(args) -> list[Callback]:
    """metrics.jsonl, the progress bar unless disable_tqdm, TensorBoard as report_to says (None
    or "all": when installed; "tensorboard": required), then the other trackers of report_to
    (trackers.py). An asked-for tracker that is not installed is one line."""
    found = [MetricsFile(args.output_dir)]
    if not args.disable_tqdm:
        found.append(ProgressBar())
    report_to = args.report_to
    installed = importlib.util.find_spec("tensorboard") is not None
    if report_to is not None and "tensorboard" in report_to and not installed:
        raise InputError("report_to='tensorboard' needs the tensorboard package: pip install tensorboard")
    if installed and (report_to is None or bool({"tensorboard", "all"} & set(report_to))):
        found.append(TensorBoard(args.output_dir))
    try:
        from . import trackers
    except ModuleNotFoundError as exc:  # trackers.py may be absent; a missing dependency of it is not
        if exc.name != f"{__package__}.trackers":
            raise
    else:
        found.extend(trackers.tracker_callbacks(report_to, args.output_dir, args))
    return found


class MetricsFile(Callback):
    """Every record, one JSON line, in output_dir/metrics.jsonl (appended: a resumed run goes on
    on a fresh line, see telemetry.open_jsonl)."""

    def __init__(self, output_dir) -> None:
        self.path = Path(output_dir) / METRICS_FILE
        self.file = None

    def open(self) -> None:
        self.file = open_jsonl(self.path)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()  # a killed run keeps every record written so far

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def on_train_begin(self, trainer) -> None:
        self.open()

    def on_log(self, trainer, record: dict) -> None:
        self.write(record)

    def on_train_end(self, trainer) -> None:
        self.close()


class TensorBoard(Callback):
    """Numbers of each record as TensorBoard scalars in output_dir/tensorboard: train/<key>,
    eval/<key without eval_>, summary/<key> for the summary's figures."""

    def __init__(self, output_dir) -> None:
        self.folder = Path(output_dir) / "tensorboard"
        self.writer = None

    def on_train_begin(self, trainer) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported only when used: slow to load

        self.writer = SummaryWriter(str(self.folder))

    def on_log(self, trainer, record: dict) -> None:
        step = record.get("step", 0)
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(_tensorboard_tag(key), value, step)

    def on_train_end(self, trainer) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _tensorboard_tag(key: str) -> str:
    if key.startswith("eval_"):
        return f"eval/{key[5:]}"
    if key.startswith(("train_", "throughput_", "mfu")):
        return f"summary/{key}"
    return f"train/{key}"


class ProgressBar(Callback):
    """A tqdm bar of optimizer steps with the last logged loss and tokens per second; messages
    (`trainer.log_message`) are written above it."""

    def __init__(self) -> None:
        self.bar = None

    def on_train_begin(self, trainer) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=trainer.total_steps, initial=trainer.global_step, desc="train",
                        unit="step", dynamic_ncols=True)

    def on_step_end(self, trainer) -> None:
        self.bar.update(1)

    def on_log(self, trainer, record: dict) -> None:
        if "loss" in record:
            postfix = {"loss": f"{record['loss']:.4f}"}
            if record.get("tokens_per_second"):
                postfix["tok/s"] = f"{record['tokens_per_second']:.0f}"
            self.bar.set_postfix(postfix, refresh=False)

    def on_train_end(self, trainer) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def show_message(callbacks: list[Callback], text: str) -> None:
    """`text` above an open progress bar (printing would tear it), else on stdout."""
    bar = next((c.bar for c in callbacks if isinstance(c, ProgressBar) and c.bar is not None), None)
    if bar is not None:
        bar.write(text)
    else:
        print(text)


# -- early stopping --------------------------------------------------------------------------------

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
