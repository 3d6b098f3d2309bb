"""The doctor's watch over a plain PyTorch loop written for Gaudi (no hputrain Trainer).

Under the stand-in runtime (standin.py) the loop's `hpu` tensors live on the CPU's lazy device.
A step is one optimizer step: it starts where the previous one ended and ends at the first
`htcore.mark_step()` after its `optimizer.step()` (the documented pattern calls mark_step after
backward and after the optimizer step). A loop that calls no mark_step between two optimizer
steps has none where Gaudi needs one: that is a finding, named by the optimizer.step call's
file:line, and from then on the doctor marks the step itself right after optimizer.step, so that
the rest of the loop is still rehearsed.

Per step it records what DoctorWatch records for the Trainer (findings.py): new graph
compilations, host reads (HostReads, each at the user's line), eager fallbacks, each at the
user's line that ran it, and the shapes of the tensors the loop moved to the device (its batch).
A plain loop's data loader is not walked ahead: its shapes are those the steps met, and the
report says so.

A loop written as Gaudi's docs teach keeps its running loss on the device and reads it on
logging steps, every few steps; the steps around the read compile graphs of their own once
(findings.period_compiles). Such a graph is judged by the logging period: the watch goes on past
`steps` until it has come round again (at most WATCH_LIMIT times `steps`), to see it run from the
graph cache. Gaudi's FusedAdamW ends the step's graph itself (a mark_step after its update): so
does the stand-in's (standin_hpex.py), and the step ends there.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ...accelerators.cpu_lazy import HostReads, LazyBackendGaps, lazy_counters
from ..findings import DoctorFinished, RunShapes, diagnose, period_unseen, sync_site
from ..standin import StandIn
from ..standin_hpex import ENDS_STEP

_READ_COUNTER = "aten::_local_scalar_dense"  # a value read back, counted by HostReads instead
WATCH_LIMIT = 4
"""The most steps watched, in multiples of the steps asked for, to see a logging period's
graphs come round again."""


class _LoopModes(LazyBackendGaps):
    """While the loop's steps are watched (`active()`): the lazy backend's gaps routed around
    (cpu_lazy.LazyBackendGaps, as the Trainer's forward gets them), and after each torch call,
    whether the backend ran an op eagerly meanwhile, with the user's line that called it (a
    backward pass's falls on its `.backward()` line). Otherwise it passes calls through."""

    def __init__(self, active: Callable[[], bool]) -> None:
        super().__init__()
        self.active = active
        self.sites: dict[str, list[str]] = {}
        self._seen = self._eager()

    @staticmethod
    def _eager() -> dict[str, int]:
        return {k: v for k, v in lazy_counters().items() if k.startswith("aten::") and k != _READ_COUNTER}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.active():
            return func(*args, **(kwargs or {}))
        result = super().__torch_function__(func, types, args, kwargs)
        now = self._eager()
        if now != self._seen:
            line = sync_site(getattr(func, "__name__", "op")).user
            for op in (k for k, v in now.items() if v != self._seen.get(k, 0)):
                places = self.sites.setdefault(op[6:], [])
                if line not in places:
                    places.append(line)
            self._seen = now
        return result


class LoopRehearsal:
    """Watches the optimizer steps of a plain loop while entered (see the module's docstring).
    `claimed()` says whether a Trainer watch owns the steps (an hputrain or Hugging Face
    Trainer's): its steps are then left alone. Stops the script with DoctorFinished after
    `steps` steps, or more where a logging period's graphs have not come round again yet."""

    def __init__(self, steps: int, reads: HostReads, runtime: StandIn, warmup: int = 0,
                 claimed: Callable[[], bool] = lambda: False) -> None:
        self.steps, self.reads, self.runtime, self.claimed = steps, reads, runtime, claimed
        self.warmup = warmup
        self.records: list[dict] = []
        self.missing_mark_step: str | None = None  # the optimizer.step call's file:line
        self.inputs: dict[str, str] = {}  # batch tensor name -> the line that moved it to the device
        self._sites = _LoopModes(self._watching)
        self._handles: list = []
        self._pending = False  # an optimizer step is done, its mark_step not yet come
        self._depth = 0  # optimizer.step calls under way (see _before_optimizer_step)
        self._skip = False  # the step now running is not counted (see _before_optimizer_step)
        self._step_line = "?"
        self._shapes: dict[str, list[int]] = {}  # moved to the device since the last optimizer step
        self._step_shapes: dict[str, list[int]] = {}  # the step's, once its optimizer step is done

    def _watching(self) -> bool:
        return not self.claimed()

    def __enter__(self) -> LoopRehearsal:
        from torch.optim import optimizer as optim

        self._handles = [optim.register_optimizer_step_pre_hook(self._before_optimizer_step),
                         optim.register_optimizer_step_post_hook(self._after_optimizer_step)]
        self.runtime.on_mark_step(self._mark_step)
        self.runtime.on_transfer = self._transfer
        self._sites.__enter__()
        self._start_step()
        return self

    def __exit__(self, *exc) -> None:
        self._sites.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self.runtime.on_transfer = None
        if self._watching():
            self.reads.in_step = False

    # -- the step boundaries -------------------------------------------------------------------------

    def _start_step(self) -> None:
        self._before = lazy_counters()
        self._reads_before = self.reads.count
        self._sites.sites, self._sites._seen = {}, self._sites._eager()
        self.reads.in_step = True

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        # torch hooks the step of each optimizer class it has made an instance of, so a subclass's
        # step that calls its parent's (FusedAdamW's, once an AdamW was made in the process) runs
        # the hooks again inside: one optimizer step, counted at the outermost call only.
        self._depth += 1
        if self._depth > 1:
            return
        if self._watching() and self._pending:  # no mark_step since the last optimizer step
            # What ran so far was one graph with no step boundary in it, and this optimizer
            # step's update alone is no step either: the steps are counted from the next one.
            self.missing_mark_step, self._pending = self._step_line, False
            torch._lazy.mark_step()
            self.records.clear()
            self._skip = True
            self._start_step()

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._depth -= 1
        if self._depth or not self._watching():
            return
        self._step_line = sync_site("step").user
        self._step_shapes, self._shapes = self._shapes, {}
        if getattr(optimizer, ENDS_STEP, False):  # its own mark_step after the update ended it
            self._end_step()
        elif self.missing_mark_step is not None:  # the loop has none: the doctor marks the step
            torch._lazy.mark_step()
            self._end_step()
        else:
            self._pending = True

    def _mark_step(self) -> None:
        if self._watching() and self._pending:
            self._end_step()

    def _end_step(self) -> None:
        self._pending = False
        if self._skip:
            self._skip = False
            self._start_step()
            return
        after = lazy_counters()
        new = {k: v - self._before.get(k, 0) for k, v in after.items() if v != self._before.get(k, 0)}
        self.records.append({
            "step": len(self.records) + 1,
            "compiles": new.get("UncachedCompile", 0),
            "host_syncs": self.reads.count - self._reads_before,
            "fallbacks": {k[6:]: v for k, v in new.items() if k.startswith("aten::") and k != _READ_COUNTER},
            "fallback_sites": dict(self._sites.sites),
            "shapes": self._step_shapes,
            "attention_mask": None,
        })
        if self._seen_enough():
            self.reads.in_step = False
            raise DoctorFinished
        self._start_step()

    def _seen_enough(self) -> bool:
        watched = len(self.records)
        return watched >= self.steps and (watched >= WATCH_LIMIT * self.steps
                                          or not period_unseen(self.records, self.warmup))

    def _transfer(self, tensor: torch.Tensor) -> None:
        """A host tensor the loop moved to the device: part of the step's batch. A scalar (the
        zero a running total starts from, a learning rate) is not."""
        if not self._watching() or tensor.dim() == 0:
            return
        name = str(len(self._shapes))
        self._shapes[name] = list(tensor.shape)
        self.inputs.setdefault(name, sync_site("to").user)

    # -- the report ----------------------------------------------------------------------------------

    def report(self, warmup: int, experts=()) -> dict:
        """The same report as a Trainer's (findings.diagnose), with the loop's own findings."""
        skipped = "this is a plain loop, whose data loader the doctor does not walk"
        report = diagnose(self.records, warmup, self.reads, RunShapes(None, skipped=skipped), experts)
        for finding in report["findings"]:
            if finding["kind"] == "recompilation" and report["shapes"]["growing"]:
                finding["message"] += self._changing_inputs()
        if self.missing_mark_step is not None:
            report["findings"].append(_missing_mark_step(self.missing_mark_step, self.runtime.mark_steps))
        if len(self.records) > self.steps:
            report["notes"].append(f"watched {len(self.records)} steps, not {self.steps}: until the graphs "
                                   "of the logging period came round again")
        report["loop"] = {"optimizer_step_at": self._step_line, "mark_steps": self.runtime.mark_steps,
                          "inputs_moved_at": self.inputs}
        return report

    def _changing_inputs(self) -> str:
        """Where the tensors whose shape changes from step to step are moved to the device."""
        changing = sorted({name for record in self.records for name, shape in record["shapes"].items()
                           if any(r["shapes"].get(name) != shape for r in self.records)}, key=int)
        lines = sorted({self.inputs[name] for name in changing if name in self.inputs})
        if not lines:
            return ""
        return f" The tensors whose shape changes are moved to the device at {', '.join(lines)}: pad them before."


def _missing_mark_step(line: str, script_marks: int) -> dict:
    seen = ("calls htcore.mark_step() nowhere in its steps" if script_marks == 0 else
            "calls no htcore.mark_step() between one optimizer step and the next")
    return {"kind": "missing_mark_step", "message": (
        f"the loop {seen}: after optimizer.step() at {line}, nothing ends the step's graph, so in "
        "lazy mode on Gaudi the steps pile up into one ever larger graph until something reads a "
        "value back, and each such graph compiles anew. Call htcore.mark_step() right after "
        "loss.backward() and again right after optimizer.step(). (The doctor marked the step "
        "after each optimizer.step to rehearse the rest.)")}
