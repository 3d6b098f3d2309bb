"""Execution modes: eager (op by op), lazy (graphs accumulated and run at mark_step) and compile
(torch.compile with the accelerator's backend); and what the trainer watches of each step.

The accelerator resolves "auto" (lazy on Gaudi, eager elsewhere) and knows how to run lazily; this
module holds what is the same on every device.
"""
from __future__ import annotations

import torch

from ..config.sections import ExecutionSettings


def compile_model(module: torch.nn.Module, settings: ExecutionSettings, accelerator) -> torch.nn.Module:
    """torch.compile with `torch_compile_backend`, else the accelerator's own backend."""
    backend = settings.torch_compile_backend or accelerator.compile_backend()
    return torch.compile(module, backend=backend)


class StepWatch:
    """Watches each optimizer step. This base does nothing: eager and compile runs, and lazy runs
    on devices without a compile counter."""

    def step_begin(self, step: int) -> None:
        """Called before the first micro-batch of optimizer step `step` (counted from 1)."""

    def step_end(self, step: int, batch) -> None:
        """Called after the optimizer step and its mark_step, with the step's last batch."""

    def summary(self) -> dict:
        return {}


class GraphCompiles(StepWatch):
    """Lazy mode: graphs compiled inside training steps, in total and after the warm-up steps. A
    step that keeps compiling after warm-up has shapes that change (or reads values back); the
    compiles of evaluation, logging and checkpointing fall outside steps and are not counted."""

    def __init__(self, counter, warmup_steps: int) -> None:
        self.counter, self.warmup_steps = counter, warmup_steps
        self.total = self.after_warmup = 0
        self.steps_seen = 0
        self._at_begin = 0

    def step_begin(self, step: int) -> None:
        self._at_begin = self.counter()

    def step_end(self, step: int, batch) -> None:
        new = self.counter() - self._at_begin
        self.steps_seen += 1
        self.total += new
        if self.steps_seen > self.warmup_steps:
            self.after_warmup += new

    def summary(self) -> dict:
        return {"graph_compiles": self.total, "graph_compiles_after_warmup": self.after_warmup}


def step_watch(settings: ExecutionSettings, accelerator) -> StepWatch:
    """The trainer's own watch: graph compiles in lazy mode where the device counts them. (Tools
    that watch steps from outside, such as `hputrain doctor`, are callbacks: callbacks.py.)"""
    if accelerator.lazy and accelerator.graph_compiles() is not None:
        return GraphCompiles(accelerator.graph_compiles, settings.throughput_warmup_steps)
    return StepWatch()
