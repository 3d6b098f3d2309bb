"""Throughput (warm-up and pauses left out), MFU, the metric sinks, and a count of the memory
kept for backward.

Only global rank 0 writes: the trainer gives other ranks a `MetricSinks` with no sinks.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


class SavedForBackward:
    """`with SavedForBackward() as saved: loss = model(**batch)`; then `saved.nbytes` is what
    autograd kept for backward inside the block: each storage once, parameters left out (they
    exist anyway). Exact and free of allocator noise, unlike a peak-memory reading."""

    def __init__(self) -> None:
        import torch

        self._storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor):
        import torch

        if not isinstance(tensor, torch.nn.Parameter):
            storage = tensor.untyped_storage()
            self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> "SavedForBackward":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(self._storages.values())


class ThroughputClock:
    """Measures training throughput over the steps after `warmup_steps`, leaving out time spent
    in evaluation, checkpointing and logging (bracketed by `pause()` / `resume()`).

    `synchronize` waits for queued device work, so that host time covers the device's work: it is
    called only where the clock starts, pauses and stops, never inside a step.
    """

    def __init__(self, warmup_steps: int, synchronize=lambda: None) -> None:
        self.warmup_steps = warmup_steps
        self.synchronize = synchronize
        self.steps_done = 0
        self.start_time = time.perf_counter()
        self.measure_from: float | None = None  # set when warm-up ends
        self.paused_total = 0.0
        self.paused_at: float | None = None
        self.steps = self.samples = self.tokens = 0  # counted after warm-up
        self._interval = (0.0, 0)  # (measured seconds, tokens) at the previous `interval_rate`
        if warmup_steps == 0:
            self.measure_from = time.perf_counter()

    def step_done(self, samples: int, tokens: int) -> None:
        self.steps_done += 1
        if self.measure_from is not None:
            self.steps += 1
            self.samples += samples
            self.tokens += tokens
        elif self.steps_done == self.warmup_steps:
            self.synchronize()
            self.measure_from = time.perf_counter()
            self.paused_total = 0.0

    def pause(self) -> None:
        self.synchronize()
        self.paused_at = time.perf_counter()

    def resume(self) -> None:
        if self.paused_at is not None and self.measure_from is not None:
            self.paused_total += time.perf_counter() - self.paused_at
        self.paused_at = None

    def measured_seconds(self) -> float:
        if self.measure_from is None:
            return 0.0
        now = self.paused_at if self.paused_at is not None else time.perf_counter()
        return now - self.measure_from - self.paused_total

    def interval_rate(self) -> float | None:
        """Tokens per second since the previous call (None while warming up)."""
        seconds, tokens = self.measured_seconds(), self.tokens
        last_seconds, last_tokens = self._interval
        self._interval = (seconds, tokens)
        if self.measure_from is None or seconds <= last_seconds:
            return None
        return (tokens - last_tokens) / (seconds - last_seconds)

    def summary(self, flops_per_token: float | None, peak_flops: float | None) -> dict:
        """The final record: runtime of the whole run, throughput of the measured steps."""
        self.synchronize()
        seconds = self.measured_seconds()
        rate = (lambda n: n / seconds) if seconds > 0 and self.steps else (lambda n: None)
        tokens_per_second = rate(self.tokens)
        mfu = None
        if tokens_per_second and flops_per_token and peak_flops:
            mfu = flops_per_token * tokens_per_second / peak_flops
        return {
            "train_runtime": time.perf_counter() - self.start_time,
            "train_samples_per_second": rate(self.samples),
            "train_tokens_per_second": tokens_per_second,
            "train_steps_per_second": rate(self.steps),
            "mfu": mfu,
            "throughput_steps": self.steps,
        }


class MetricSinks:
    """Where records go: output_dir/metrics.jsonl, TensorBoard when installed, the progress bar."""

    def __init__(self, output_dir: str | Path | None, total_steps: int = 0, initial_step: int = 0,
                 progress: bool = True) -> None:
        self.file = self.writer = self.bar = None
        if output_dir is None:  # a rank other than 0: write nothing
            return
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(output_dir / METRICS_FILE, "a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(output_dir / "tensorboard"))
        except ImportError:  # tensorboard is an optional extra
            self.writer = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step",
                            dynamic_ncols=True)

    def write(self, record: dict) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            step = record.get("step", 0)
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(_tensorboard_tag(key), value, step)
        if self.bar is not None and "loss" in record:
            postfix = {"loss": f"{record['loss']:.4f}"}
            if record.get("tokens_per_second"):
                postfix["tok/s"] = f"{record['tokens_per_second']:.0f}"
            self.bar.set_postfix(postfix, refresh=False)

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        elif self.file is not None:
            print(text)

    def close(self) -> None:
        for sink in (self.bar, self.writer, self.file):
            if sink is not None:
                sink.close()
        self.file = self.writer = self.bar = None


def _tensorboard_tag(key: str) -> str:
    if key.startswith("eval_"):
        return f"eval/{key[5:]}"
    if key.startswith("train_") or key in ("mfu", "throughput_steps"):
        return f"summary/{key}"
    return f"train/{key}"
