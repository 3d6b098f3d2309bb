"""Where the time goes: torch.profiler over a few training steps (--profile-steps A-B, or
Optimum's profiling_warmup_steps + profiling_steps), on every rank, with the device's activities.

The profiler starts when step A begins and stops when step B ends. `ProfilerStep#N` in the trace
is training step N: from the start of step N to the start of step N + 1 (step N's logging,
evaluation and saving included, since they run after its optimizer step), the last one to the end
of its optimizer step. Nothing outside those steps is recorded, so a long run can profile two
steps late in training at no cost elsewhere.

Written under output_dir/profile/:

  rank{R}.steps{A}-{B}.pt.trace.json   one Chrome trace per rank (Perfetto, chrome://tracing and
                                       TensorBoard's profiler plugin open it)
  top_ops.txt                          rank 0's operations by self time on the device (the host
                                       where the device records nothing), also printed at the end
  rank{R}.memory.html                  the memory timeline of the profiled steps, where the
                                       device records one (CUDA)
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config.sections import ProfilingSettings
from ..errors import InputError
from .base import Callback

TOP_OPS = 15
"""Operations listed in top_ops.txt and the summary."""


class StepProfiler(Callback):
    """torch.profiler over training steps `settings.steps` (see the module docstring)."""

    def __init__(self, settings: ProfilingSettings, accelerator, rank: int) -> None:
        self.first, self.last = settings.steps
        self.settings, self.accelerator, self.rank = settings, accelerator, rank
        self.folder = Path(settings.output_dir) / "profile"
        self.profiler = None
        self.trace: Path | None = None

    def on_train_begin(self, trainer) -> None:
        if self.last > trainer.total_steps:
            raise InputError(f"profile_steps {self.first}-{self.last} ends after the run's last "
                             f"step, {trainer.total_steps}: profile steps the run reaches")

    def on_step_begin(self, trainer) -> None:
        step = trainer.global_step + 1
        if step == self.first:
            self._start()
        elif self.profiler is not None and self.first < step <= self.last:
            self.profiler.step()  # ends ProfilerStep#(step - 1), begins ProfilerStep#step

    def on_step_end(self, trainer) -> None:
        if self.profiler is not None and trainer.global_step == self.last:
            self.accelerator.synchronize()  # the device's work of the last step, inside the trace
            self._stop(trainer)

    def on_train_end(self, trainer) -> None:
        if self.profiler is not None:  # stopped early (a signal, a callback): keep what was seen
            self._stop(trainer)

    def _start(self) -> None:
        memory = self.accelerator.profiler_records_memory()
        self.profiler = torch.profiler.profile(
            activities=self.accelerator.profiler_activities(),
            record_shapes=self.settings.record_shapes or memory,  # the timeline needs shapes
            with_stack=self.settings.with_stack or memory, profile_memory=memory,
            schedule=_record_every_step)  # a schedule is what makes the profiler mark steps
        self.profiler.step_num = self.first  # ProfilerStep#N is training step N
        self.profiler.start()

    def _stop(self, trainer) -> None:
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.trace = self.folder / f"rank{self.rank}.steps{self.first}-{self.last}.pt.trace.json"
        profiler.export_chrome_trace(str(self.trace))
        if self.accelerator.profiler_records_memory():
            profiler.export_memory_timeline(str(self.folder / f"rank{self.rank}.memory.html"),
                                            device=str(trainer.device))
        if self.rank == 0:
            table = profiler.key_averages().table(sort_by=self._sort_key(), row_limit=TOP_OPS)
            (self.folder / "top_ops.txt").write_text(table + "\n")
            trainer.log_message(f"profile of steps {self.first}-{self.last}: {self.trace} "
                                f"(one trace per rank); top operations:\n{table}")

    def _sort_key(self) -> str:
        """Self time on the device when the profiler records a device, else on the host."""
        device = [a for a in self.accelerator.profiler_activities()
                  if a != torch.profiler.ProfilerActivity.CPU]
        return "self_device_time_total" if device else "self_cpu_time_total"


def _record_every_step(step: int) -> torch.profiler.ProfilerAction:
    return torch.profiler.ProfilerAction.RECORD


def profiling_callbacks(settings: ProfilingSettings, accelerator, rank: int) -> list[Callback]:
    """The profiler when steps are asked for (every rank writes its own trace), else none."""
    return [] if settings.steps is None else [StepProfiler(settings, accelerator, rank)]
