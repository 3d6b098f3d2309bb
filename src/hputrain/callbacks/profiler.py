"""Where the time goes: torch.profiler over a few training steps (--profile-steps A-B, or
Optimum's profiling_warmup_steps + profiling_steps), on every rank, with the device's activities.

The profiler starts when step A begins and stops when step B ends. `ProfilerStep#N` in the trace
is training step N (the trainer's global_step once the step is done): from the start of step N to
the start of step N + 1 (step N's logging, evaluation and saving included, since they run after its
optimizer step), the last one to the end of its optimizer step. Nothing outside those steps is
recorded, so a long run can profile two steps late in training at no cost elsewhere. The numbers
are global steps: a run resumed at step 3 with --profile-steps 2-4 records steps 3 and 4, the ones
it runs (its trace is then named steps3-4).

Written under output_dir/profile/:

  rank{R}.steps{A}-{B}.pt.trace.json   one Chrome trace per rank (Perfetto, chrome://tracing and
                                       TensorBoard's profiler plugin open it)
  top_ops.txt                          rank 0's operations by self time on the device (on the host
                                       where the device records none), also printed at the end
  rank{R}.memory.html                  the memory timeline of the profiled steps, where the device
                                       records one (CUDA); .json (the plot's points) when
                                       matplotlib, which draws the HTML's plot, is not installed
"""
from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import torch

from ..config.sections import ProfilingSettings
from ..errors import InputError
from .base import Callback

TOP_OPS = 15
"""Operations listed in top_ops.txt and the summary."""
PROFILE_DIR = "profile"
"""In output_dir: the traces and tables."""


class StepProfiler(Callback):
    """torch.profiler over training steps `settings.steps` (see the module docstring)."""

    def __init__(self, settings: ProfilingSettings, accelerator, rank: int) -> None:
        self.first, self.last = settings.steps
        self.settings, self.accelerator, self.rank = settings, accelerator, rank
        self.folder = Path(settings.output_dir) / PROFILE_DIR
        self.profiler = None
        self.begun: int | None = None  # the first step recorded, and the step under way
        self.current = 0
        self.trace: Path | None = None  # written once the profiler stops
        self.table: str | None = None  # rank 0's top operations, printed at the run's end

    def on_train_begin(self, trainer) -> None:
        # max_steps is checked with the arguments; a run counted in epochs knows its end only here
        if self.last > trainer.total_steps:
            raise InputError(f"profile_steps {self.first}-{self.last} ends after the run's last "
                             f"step, {trainer.total_steps}: profile steps the run reaches")

    def on_step_begin(self, trainer) -> None:
        step = trainer.global_step + 1
        if not self.first <= step <= self.last:
            return
        self.current = step
        if self.profiler is not None:
            self.profiler.step()  # ends ProfilerStep#(step - 1), begins ProfilerStep#step
        elif self.begun is None:  # step A, or the first step of the range a resumed run reaches
            self._start(step)

    def on_step_end(self, trainer) -> None:
        if self.profiler is not None and trainer.global_step == self.last:
            self._stop(trainer)

    def on_train_end(self, trainer) -> None:
        if self.profiler is not None:  # stopped early (a signal, a callback, an error)
            self._stop(trainer)
        if self.table is not None:
            trainer.log_message(f"profile of steps {self.begun}-{self.current}: {self.trace} "
                                f"(one trace per rank); top operations:\n{self.table}")

    def _start(self, step: int) -> None:
        memory = self.accelerator.profiler_records_memory()
        self.profiler = torch.profiler.profile(
            activities=self.accelerator.profiler_activities(),
            # the memory timeline is built from shapes, stacks and allocations together
            record_shapes=self.settings.record_shapes or memory,
            with_stack=self.settings.with_stack or memory, profile_memory=memory,
            schedule=_record_every_step)  # a schedule is what makes the profiler mark steps
        self.profiler.step_num = step  # ProfilerStep#N is training step N
        self.begun = step
        self.profiler.start()

    def _stop(self, trainer) -> None:
        self.accelerator.synchronize()  # the device's work of the last step, inside the trace
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}.steps{self.begun}-{self.current}"
        self.trace = self.folder / f"{name}.pt.trace.json"
        profiler.export_chrome_trace(str(self.trace))
        if self.accelerator.profiler_records_memory():
            self._export_memory_timeline(profiler, str(trainer.device))
        if self.rank == 0:
            self.table = profiler.key_averages().table(sort_by=self._sort_key(),
                                                       row_limit=TOP_OPS)
            (self.folder / "top_ops.txt").write_text(self.table + "\n")

    def _export_memory_timeline(self, profiler, device: str) -> None:
        """The timeline as an HTML plot where matplotlib can draw it, else as its JSON points,
        rather than failing at the end of the profiled steps over an optional package."""
        html = importlib.util.find_spec("matplotlib") is not None
        path = self.folder / f"rank{self.rank}.memory.{'html' if html else 'json'}"
        with warnings.catch_warnings():  # torch marks it deprecated, naming a CUDA-only successor
            warnings.simplefilter("ignore", FutureWarning)
            profiler.export_memory_timeline(str(path), device=device)

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
