"""Experiment trackers for `report_to`: MLflow and Weights & Biases, as callbacks.

The Trainer asks `tracker_callbacks` for them on global rank 0 only; TensorBoard is a metric sink of
its own (writers.py) and is not handled here. Each package is imported only when its tracker is
asked for, so `import hputrain` never pays for mlflow's or wandb's import.

Neither tracker reaches the network unless the user set it up to: MLflow writes to a local store
under output_dir when no tracking URI is configured, and W&B runs offline when no API key is found.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import netrc
import numbers
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from ..errors import InputError
from .base import Callback

# What `pip install` needs for each tracker (mlflow-skinny is mlflow without its server and UI).
_PIP_NAMES = {"mlflow": "mlflow-skinny", "wandb": "wandb"}
# The limits of MLflow's REST API that every server accepts (newer ones allow longer values).
_MLFLOW_PARAM_VALUE_CHARS = 500
_MLFLOW_PARAM_KEY_CHARS = 250
_MLFLOW_PARAMS_PER_BATCH = 100
_MLFLOW_METRICS_PER_BATCH = 1000


def tracker_callbacks(report_to: list[str] | None, output_dir, args) -> list[Callback]:
    """The tracker callbacks `report_to` asks for (validated by config.report_targets).

    None (unset) asks for none of them: only TensorBoard is on by default. ["all"] gives every
    tracker whose package is installed; a tracker named explicitly but not installed is one
    InputError line saying what to install. Names handled elsewhere ("tensorboard") are ignored.
    """
    if not report_to:
        return []
    every = "all" in report_to
    names = list(TRACKERS) if every else [name for name in report_to if name in TRACKERS]
    return [TRACKERS[name](output_dir, args) for name in names if not every or _installed(name)]


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
        return False


def _require(package: str):
    """The package, imported now; one line saying what to install when it is missing."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise InputError(f"report_to={package!r} needs the {package} package: pip install "
                         f"{_PIP_NAMES[package]} (or hputrain[trackers])") from None


def _as_dict(args) -> dict:
    if args is None:
        return {}
    return dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(args)


def _metrics(values: dict) -> dict[str, float]:
    """The numbers of a record: "step" is the x axis, not a metric; None, booleans and text are
    left out (a bool is an int to Python but not a curve to plot)."""
    return {key: float(value) for key, value in values.items()
            if key != "step" and isinstance(value, numbers.Real) and not isinstance(value, bool)}


def _end_status(trainer) -> str:
    """How the run ended, in MLflow's words. on_train_end runs in the trainer's `finally`, where
    sys.exc_info() still holds an exception on its way out of train()."""
    error = sys.exc_info()[1]
    if isinstance(error, KeyboardInterrupt) or getattr(trainer, "_stop_signal", None) is not None:
        return "KILLED"
    return "FAILED" if error is not None else "FINISHED"


def _run_name(output_dir) -> str:
    return Path(output_dir).resolve().name  # resolve: output_dir="." still names the folder


class MLflowCallback(Callback):
    """One MLflow run per train(): the TrainingArguments as params, every logged number as a
    metric at its step. A run the user already started (mlflow.start_run) is logged into and
    left open; otherwise the run is created here and ended with the status training ended in.

    The client API is used rather than mlflow's fluent one so that hputrain neither changes the
    process's tracking URI nor leaves a run on mlflow's active-run stack."""

    def __init__(self, output_dir, args) -> None:
        self.output_dir, self.args = Path(output_dir), args
        self._mlflow = _require("mlflow")
        self._client = self._run_id = None
        self._owns_run = False

    def on_train_begin(self, trainer) -> None:
        if not trainer.group.is_main:
            return
        from mlflow.entities import Param

        active = self._mlflow.active_run()
        if active is not None:
            self._client = self._mlflow.MlflowClient(self._mlflow.get_tracking_uri())
            self._run_id, self._owns_run = active.info.run_id, False
        else:
            self._client = self._mlflow.MlflowClient(self._tracking_uri())
            run = self._client.create_run(self._experiment_id(), run_name=_run_name(self.output_dir))
            self._run_id, self._owns_run = run.info.run_id, True
        params = [Param(key[:_MLFLOW_PARAM_KEY_CHARS], value[:_MLFLOW_PARAM_VALUE_CHARS])
                  for key, value in _flatten(_as_dict(self.args)).items()]
        for start in range(0, len(params), _MLFLOW_PARAMS_PER_BATCH):
            self._client.log_batch(self._run_id, params=params[start:start + _MLFLOW_PARAMS_PER_BATCH])

    def on_train_end(self, trainer) -> None:
        if self._run_id is None:
            return
        if self._owns_run:
            self._client.set_terminated(self._run_id, status=_end_status(trainer))
        self._client = self._run_id = None

    def on_log(self, trainer, record: dict) -> None:
        """Every record (logging steps, evaluations, the summary) comes here once: on_evaluate's
        metrics are the evaluation record's, so this callback does not take that hook."""
        if self._run_id is None:
            return
        from mlflow.entities import Metric

        step = int(record.get("step", trainer.global_step))
        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in _metrics(record).items()]
        for start in range(0, len(metrics), _MLFLOW_METRICS_PER_BATCH):
            self._client.log_batch(self._run_id, metrics=metrics[start:start + _MLFLOW_METRICS_PER_BATCH])

    def _tracking_uri(self) -> str:
        """MLFLOW_TRACKING_URI (or mlflow.set_tracking_uri) when the user chose one; otherwise a
        file store in output_dir/mlruns, so nothing leaves the machine. mlflow-skinny has no
        SQLAlchemy for mlflow 3's default sqlite store, and mlflow 3 opens a file store only when
        MLFLOW_ALLOW_FILE_STORE is true: set it unless the user decided otherwise."""
        if self._mlflow.is_tracking_uri_set():
            return self._mlflow.get_tracking_uri()
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return (self.output_dir / "mlruns").resolve().as_uri()

    def _experiment_id(self) -> str:
        """MLFLOW_EXPERIMENT_NAME (created when new), else MLFLOW_EXPERIMENT_ID, else mlflow's
        Default experiment."""
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"
        found = self._client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self._client.create_experiment(name)


def _flatten(values: dict, prefix: str = "") -> dict[str, str]:
    """Nested dicts as "outer.inner" keys, every value as text: MLflow params are strings."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat


class WandbCallback(Callback):
    """One W&B run per train() with the TrainingArguments as its config; every logged number at
    its step. W&B needs steps that never go back: records of one step (the log, the evaluation
    and the summary at the last step) are merged into one row, which wandb commits when a later
    step arrives or the run finishes. A run the user already started (wandb.init) is logged into
    and left open."""

    def __init__(self, output_dir, args) -> None:
        self.output_dir, self.args = Path(output_dir), args
        self._wandb = _require("wandb")
        self._run = None
        self._owns_run = False

    def on_train_begin(self, trainer) -> None:
        if not trainer.group.is_main:
            return
        wandb, config = self._wandb, _as_dict(self.args)
        if wandb.run is not None:
            self._run, self._owns_run = wandb.run, False
            self._run.config.update(config, allow_val_change=True)
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # The stats sampler and console capture run in wandb's service process on every step:
        # off, as training reports its own throughput and memory.
        settings = wandb.Settings(silent=True, x_disable_stats=True, console="off")
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "hputrain",
                               name=_run_name(self.output_dir), dir=str(self.output_dir),
                               config=config, mode=_wandb_mode(), settings=settings,
                               reinit="create_new")
        self._owns_run = True

    def on_train_end(self, trainer) -> None:
        if self._run is None:
            return
        if self._owns_run:
            self._run.finish(exit_code=0 if _end_status(trainer) == "FINISHED" else 1)
            if self._run.offline:  # silent=True hid wandb's own hint
                print(f"hputrain: the W&B run is saved offline: upload it with "
                      f"`wandb sync {self._run.settings.sync_dir}`", file=sys.stderr)
        self._run = None

    def on_log(self, trainer, record: dict) -> None:
        """Every record once (see MLflowCallback.on_log); records of one step merge into a row."""
        metrics = _metrics(record)
        if self._run is not None and metrics:
            self._run.log(metrics, step=int(record.get("step", trainer.global_step)))


def _wandb_mode() -> str | None:
    """None (wandb decides: WANDB_MODE, else online) when WANDB_MODE is set or credentials are
    found; "offline" otherwise, so a run without an account never prompts or reaches the
    network (`wandb sync` uploads it later)."""
    if os.environ.get("WANDB_MODE") or _has_wandb_credentials():
        return None
    return "offline"


def _has_wandb_credentials() -> bool:
    """WANDB_API_KEY, an identity token file, or a netrc entry for the W&B host (what
    `wandb login` writes), the places wandb itself looks."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = os.environ.get("NETRC") or Path.home() / (".netrc" if os.name != "nt" else "_netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


TRACKERS = {"mlflow": MLflowCallback, "wandb": WandbCallback}
