"""The built-in writers, given to rank 0: metrics.jsonl, the progress bar, TensorBoard (and, through
trackers.py, MLflow and W&B)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from ..config.sections import ReportingSettings
from ..errors import InputError
from .base import Callback

METRICS_FILE = "metrics.jsonl"
SUPERSEDED_FILE = "metrics.superseded.jsonl"
"""The records a failed run wrote past the checkpoint its rerun resumed from (MetricsFile)."""
TENSORBOARD_DIR = "tensorboard"


# -- the built-in writers (rank 0) -----------------------------------------------------------------

def reporting_callbacks(settings: ReportingSettings) -> list[Callback]:
    """metrics.jsonl, the progress bar unless disable_tqdm, TensorBoard as report_to says (None
    or "all": when installed; "tensorboard": required), then the other trackers of report_to
    (trackers.py). An asked-for tracker that is not installed is one line."""
    found = [MetricsFile(settings.output_dir)]
    if not settings.disable_tqdm:
        found.append(ProgressBar())
    report_to = settings.report_to
    installed = importlib.util.find_spec("tensorboard") is not None
    if report_to is not None and "tensorboard" in report_to and not installed:
        raise InputError("report_to='tensorboard' needs the tensorboard package: pip install tensorboard")
    if installed and (report_to is None or bool({"tensorboard", "all"} & set(report_to))):
        found.append(TensorBoard(settings.output_dir))
    try:
        from . import trackers
    except ModuleNotFoundError as exc:  # trackers.py may be absent; a missing dependency of it is not
        if exc.name != f"{__package__}.trackers":
            raise
    else:
        found.extend(trackers.tracker_callbacks(report_to, settings.output_dir, settings.hyperparameters))
    return found


class MetricsFile(Callback):
    """Every record, one JSON line, in output_dir/metrics.jsonl (appended: a resumed run goes on
    on a fresh line, see open_jsonl below). A run resumed from checkpoint-N never logs a step
    twice: the records of steps after N that the run before it wrote (it failed or was killed
    after its last checkpoint) are moved to metrics.superseded.jsonl first, in their order, so
    that metrics.jsonl holds one step sequence, as the Hugging Face Trainer's log history holds
    only what its checkpoint's trainer_state.json had, and nothing written is lost."""

    def __init__(self, output_dir) -> None:
        self.path = Path(output_dir) / METRICS_FILE
        self.file = None

    def open(self, start_step: int | None = None) -> None:
        """Open for appending; `start_step`: the step the run starts from (records after it
        are superseded)."""
        if start_step is not None:
            supersede_after(self.path, start_step, self.path.with_name(SUPERSEDED_FILE))
        self.file = open_jsonl(self.path)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(json_safe(record)) + "\n")
        self.file.flush()  # a killed run keeps every record written so far

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def on_train_begin(self, trainer) -> None:
        self.open(trainer.global_step)

    def on_log(self, trainer, record: dict) -> None:
        self.write(record)

    def on_train_end(self, trainer) -> None:
        self.close()


class TensorBoard(Callback):
    """Numbers of each record as TensorBoard scalars in output_dir/tensorboard: train/<key>,
    eval/<key without eval_>, summary/<key> for the summary's figures."""

    def __init__(self, output_dir) -> None:
        self.folder = Path(output_dir) / TENSORBOARD_DIR
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


def notice(line: str) -> None:
    """A line for the user (rank 0's) on stderr, apart from training's records: "hputrain: line"."""
    print(f"hputrain: {line}", file=sys.stderr, flush=True)


def show_message(callbacks: list[Callback], text: str) -> None:
    """`text` above an open progress bar (printing would tear it), else on stdout."""
    bar = next((c.bar for c in callbacks if isinstance(c, ProgressBar) and c.bar is not None), None)
    if bar is not None:
        bar.write(text)
    else:
        print(text)



def json_safe(value):
    """`value` for a strict JSON line: NaN and infinities, which JSON lacks (Python writes bare
    `NaN`, which strict readers refuse), as null; in lists and dicts too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def open_jsonl(path: Path):
    """`path` (and its folder) opened for appending JSON lines, on a fresh line: a last line a
    killed run left unfinished is cut when it is not a whole record, and ended when it is.
    An output_dir that cannot be written is an InputError naming it and why."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file():
            _end_last_line(path)
        return open(path, "a", encoding="utf-8")
    except OSError as exc:
        raise InputError(f"Cannot write {exc.filename or path}: {exc.strerror or exc}.") from None


def _end_last_line(path: Path) -> None:
    with open(path, "r+b") as f:
        end = f.seek(0, 2)
        start = end
        while start > 0:  # back to the byte after the last newline, 64 KiB at a time
            size = min(start, 1 << 16)
            f.seek(start - size)
            newline = f.read(size).rfind(b"\n")
            if newline >= 0:
                start += newline - size + 1
                break
            start -= size
        if start == end:
            return
        f.seek(start)
        try:
            json.loads(f.read())
        except ValueError:  # torn mid-write: nothing of it can be read
            f.truncate(start)
        else:
            f.write(b"\n")


def supersede_after(path: Path, step: int, aside: Path) -> None:
    """Move the records of `path` whose step is past `step` to the end of `aside`, keeping the
    others (and any line that is not a record: open_jsonl's to deal with) in place. The moved
    lines reach `aside` before `path` is replaced (written beside it, then renamed), so a kill
    part-way leaves them in one file or in both, never in none."""
    def later(line: bytes) -> bool:
        try:
            record = json.loads(line)
        except ValueError:
            return False
        return isinstance(record, dict) and isinstance(record.get("step"), (int, float)) \
            and record["step"] > step

    try:
        if not path.is_file():
            return
        with open(path, "rb") as source:
            if not any(later(line) for line in source):
                return
            source.seek(0)
            with open(aside, "ab") as moved:
                for line in source:
                    if later(line):
                        moved.write(line if line.endswith(b"\n") else line + b"\n")
                moved.flush()
                os.fsync(moved.fileno())
            source.seek(0)
            handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            try:
                with open(handle, "wb") as kept:
                    kept.writelines(line for line in source if not later(line))
                    kept.flush()
                    os.fsync(kept.fileno())
                os.chmod(temp, path.stat().st_mode & 0o777)
                os.replace(temp, path)
            except BaseException:
                Path(temp).unlink(missing_ok=True)
                raise
    except OSError as exc:
        raise InputError(f"Cannot write {exc.filename or path}: {exc.strerror or exc}.") from None
