"""Throughput (warm-up and pauses left out), MFU, the JSON-lines file helper, and a count of the
memory kept for backward. What writes the records (metrics.jsonl, TensorBoard, the progress bar)
are callbacks: callbacks/.
"""
from __future__ import annotations

import time


class SavedForBackward:
    """`with SavedForBackward() as saved: loss = model(**batch)`; then `saved.nbytes` is what
    autograd kept for backward inside the block: each storage once, parameters left out (they
    exist anyway). Exact and free of allocator noise, unlike a peak-memory reading.

    A layer may keep a view of a weight rather than the Parameter itself (Linear keeps
    `weight.t()`), whose storage is the weight's: counted, unless the weights are given as
    `exclude` (`SavedForBackward(exclude=model.parameters())`), whose storages are then left out
    of `nbytes` and counted apart in `excluded_nbytes`. A copy (a bf16 weight under autocast) has
    a storage of its own and is counted either way.
    """

    def __init__(self, exclude=()) -> None:
        import torch

        self._excluded = {_storage_of(t).data_ptr() for t in exclude}
        self._excluded.discard(0)  # an empty (or meta) tensor has no storage to leave out
        self._storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor):
        import torch

        if not isinstance(tensor, torch.nn.Parameter):
            storage = _storage_of(tensor)
            self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> "SavedForBackward":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        """Bytes kept for backward, the excluded tensors' storages left out."""
        return sum(n for ptr, n in self._storages.items() if ptr not in self._excluded)

    @property
    def excluded_nbytes(self) -> int:
        """Bytes kept for backward that lie in the excluded tensors' storages (weights' views)."""
        return sum(n for ptr, n in self._storages.items() if ptr in self._excluded)


def _storage_of(tensor):
    """The storage holding `tensor`'s values: a sharded parameter's (a DTensor's) is its local
    shard's."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage()


def flops_per_token(model) -> float:
    """Training FLOPs per token: the model's own count when it has one (the built-in GPT counts
    attention too), else 6 per trainable parameter (forward 2, backward 4)."""
    if hasattr(model, "flops_per_token"):
        return model.flops_per_token()
    return 6 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def job_peak_flops(accelerator, dtype, world_size: int) -> tuple[float | None, float | None]:
    """(published, measured) peak FLOP/s of the whole job for `dtype`: the device's published
    dense peak where it has one, and the rate its own probe measured where it has one (the CPU's
    matmul probe); None where unknown."""
    published, measured = accelerator.peak_flops(dtype), accelerator.measured_peak_flops(dtype)
    return (published * world_size if published else None,
            measured * world_size if measured else None)


class ThroughputClock:
    """Measures training throughput over the steps after `warmup_steps`, leaving out time spent
    in evaluation, checkpointing and logging (bracketed by `pause()` / `resume()`).

    The summary gives both views, named apart: `train_runtime` and `train_*_per_second` are the
    Hugging Face Trainer's (the whole of train(), warm-up and pauses included), `throughput_*`
    are the steps after warm-up only, which the MFU is computed from.

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
        self.all_samples = self.all_tokens = 0  # counted from the first step of this run
        self._interval = (0.0, 0)  # (measured seconds, tokens) at the previous `interval_rate`
        if warmup_steps == 0:
            self.measure_from = time.perf_counter()

    def step_done(self, samples: int, tokens: int) -> None:
        self.steps_done += 1
        self.all_samples += samples
        self.all_tokens += tokens
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

    def summary(self, flops_per_token: float | None, peak_flops: float | None,
                measured_peak_flops: float | None = None) -> dict:
        """The final record. `mfu` is against the device's published peak, `mfu_vs_measured_peak`
        against a peak measured on this machine (the CPU's), each None where there is none."""
        self.synchronize()
        runtime = time.perf_counter() - self.start_time
        seconds = self.measured_seconds()
        measured = (lambda n: n / seconds) if seconds > 0 and self.steps else (lambda n: None)
        whole = (lambda n: n / runtime) if runtime > 0 and self.steps_done else (lambda n: None)
        tokens_per_second = measured(self.tokens)
        model_flops = flops_per_token * tokens_per_second if tokens_per_second and flops_per_token else None
        return {
            "train_runtime": runtime,
            "train_samples_per_second": whole(self.all_samples),
            "train_tokens_per_second": whole(self.all_tokens),
            "train_steps_per_second": whole(self.steps_done),
            "throughput_seconds": seconds,
            "throughput_samples_per_second": measured(self.samples),
            "throughput_tokens_per_second": tokens_per_second,
            "throughput_steps_per_second": measured(self.steps),
            "throughput_steps": self.steps,
            "mfu": model_flops / peak_flops if model_flops and peak_flops else None,
            "mfu_vs_measured_peak": (model_flops / measured_peak_flops
                                     if model_flops and measured_peak_flops else None),
        }
