"""`hputrain doctor` on a Hugging Face Trainer script: transformers' Trainer (and Optimum's
GaudiTrainer, its subclass, where `optimum.habana` imports) rehearsed in Gaudi's lazy mode on the CPU.

The script runs unmodified under the stand-in Gaudi runtime (standin.py), so transformers' own
detection finds an HPU: `is_torch_hpu_available()` asks importlib for `habana_frameworks` and
`torch.hpu.is_available()`, and TrainingArguments' device is then `hpu:0` (accelerate's state picks
`hpu` the same way), which the stand-in maps onto the CPU's lazy device. That check is lru-cached
and, the first time it answers yes, patches torch (gather, take_along_dim, scatter, cholesky,
compile) for Gaudi: the cache is cleared on the way in and out, and those torch attributes are
put back on the way out, so that nothing of the rehearsal outlives it.

Every Trainer made while the doctor runs (its __init__ wrapped for that time) gets a TrainerCallback
that watches its first N optimizer steps, as DoctorWatch does for hputrain's Trainer (doctor.py):

- step boundaries: transformers' Trainer never calls mark_step; on a Gaudi its lazy graph would
  then grow until something reads a value back (its nan/inf check of every micro-batch's loss),
  so that the graphs are cut wherever reads happen to fall. The doctor rehearses what Optimum's
  GaudiTrainer does instead, the documented lazy-mode pattern: the lazy mark_step after each
  micro-batch's backward (on_substep_end, and on_pre_optimizer_step for the last one, which is
  after gradient clipping: clipping joins the backward's graph, not the optimizer's) and after
  the optimizer step (on_step_end). The raw lazy mark_step is called, not the stand-in's htcore
  one, which the plain-loop watcher counts.
- the batch shapes of the whole run: the Trainer's own train dataloader (get_train_dataloader:
  the same dataset, sampler, collator and removed columns) walked ahead, without the model and
  without device placement, for an epoch or the run's max_steps (shapes.py's census);
- findings named by the Trainer's arguments: padding to each batch's longest row is fixed by the
  collator's pad_to_multiple_of or padding="max_length" (train_sampling_strategy="group_by_length"
  only groups similar lengths), the per-micro-batch nan/inf read by logging_nan_inf_filter=False.

Gaps of the CPU lazy backend that Gaudi has not are routed around for the steps (LazyBackendGaps,
and here torch's AdamW lerp, clip_grad_norm_'s vector norm and isnan, as hputrain's own trainer
avoids them); the default optimizer, adamw_torch_fused, is rehearsed unfused (torch's fused kernel
has no lazy form), which the report notes.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import sys
import tempfile

import torch
from torch.overrides import TorchFunctionMode

from ...accelerators.cpu_lazy import HostReads, LazyBackendGaps, lazy_counters
from ..findings import DoctorFinished, Rehearsal, RunShapes, diagnose, mask_layout, random_state_kept
from ..shapes import batch_shapes, take_census

_TORCH_PATCHED = (("torch", "gather"), ("torch.Tensor", "gather"), ("torch", "take_along_dim"),
                  ("torch.linalg", "cholesky"), ("torch", "scatter"), ("torch.Tensor", "scatter"),
                  ("torch", "compile"))
"""What transformers' is_torch_hpu_available() replaces in torch when it finds an HPU."""


def optimum_missing(error: BaseException) -> str | None:
    """The one line for a script that stopped because optimum-habana is not installed, else None."""
    name = getattr(error, "name", None) or ""
    if not isinstance(error, ImportError) or not (name == "optimum" or name.startswith("optimum.")):
        return None
    return (f"optimum-habana is not installed: the script imports {name} (No module named "
            f"'{name}'); install it (pip install optimum-habana) to rehearse its GaudiTrainer, or "
            "rehearse the same script with transformers' Trainer and TrainingArguments")


class HFRehearsal(Rehearsal):
    """While entered (inside the stand-in and `reads`): every transformers Trainer made gets a
    watch of its first `steps` optimizer steps (records, as doctor.DoctorWatch keeps them), in
    lazy mode, writing to a temporary folder only and saving no checkpoint. `claimed` is True once
    one was made; `report(warmup)` is then the doctor's report for its steps. transformers is
    not imported for this: its Trainer is wrapped when the script imports it."""

    def __init__(self, steps: int, reads: HostReads, runtime=None) -> None:
        self.steps, self.reads, self.runtime = steps, reads, runtime
        self.watches: list = []
        self.output_dir = ""
        self._exit = contextlib.ExitStack()

    def __enter__(self) -> HFRehearsal:
        stack = self._exit
        self.output_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="hputrain-doctor-hf-"))
        stack.callback(_forget_hpu_answers)
        stack.enter_context(_torch_attributes_kept())
        _forget_hpu_answers()  # asked again, with the stand-in in place
        stack.enter_context(_on_import("transformers.trainer", self._wrap_trainer))
        stack.enter_context(LazyBackendGaps())
        stack.enter_context(_TrainerGaps())
        return self

    def __exit__(self, *exc) -> None:
        self._exit.close()

    def _wrap_trainer(self, module) -> None:
        """Wrap transformers' Trainer.__init__ (its subclasses call it) until the rehearsal ends."""
        original = module.Trainer.__init__
        self._exit.callback(setattr, module.Trainer, "__init__", original)
        self._exit.callback(_reset_accelerate_state)

        def __init__(trainer, *args, **kwargs):
            given = kwargs.get("args", args[1] if len(args) > 1 else None)
            if given is not None:
                self._redirect(given)
            original(trainer, *args, **kwargs)
            self._redirect(trainer.args)
            watch = _watch_type()(self, trainer)
            self.watches.append(watch)
            trainer.add_callback(watch)
            trainer.training_step = watch.watched(trainer.training_step)
        module.Trainer.__init__ = __init__

    def _redirect(self, args) -> None:
        """Output to the doctor's folder, no checkpoint, no tracker, nothing pushed."""
        args.output_dir = self.output_dir
        args.save_strategy = type(args.save_strategy)("no")
        args.report_to = []
        args.push_to_hub = False

    def report(self, warmup: int, experts=()) -> dict:
        """diagnose()'s report of the watched steps, its fixes worded in the Trainer's arguments."""
        watched = [w for w in self.watches if w.records]
        walked = [w.run_shapes for w in watched if w.run_shapes is not None and w.run_shapes.census]
        run = max(walked, key=lambda r: len(r.census.shapes)) if walked else (
            watched[0].run_shapes if watched else None)
        if run is not None and run.census is not None:  # the fix in the Trainer's arguments
            run.fix = _collator_fix(run, watched)
        report = diagnose(self.records, warmup, self.reads, run, experts)
        for finding in report["findings"]:
            finding["message"] = _hf_wording(finding, self.reads)
        if any(w.unfused for w in watched):
            report["notes"].append(
                "the Trainer's fused AdamW (optim=\"adamw_torch_fused\", transformers' default) was "
                "rehearsed unfused: torch's fused kernel has no lazy CPU form; the update is the same")
        report["trainer"] = "transformers"
        return report


def _forget_hpu_answers() -> None:
    """transformers caches is_torch_hpu_available() and accelerate is_hpu_available() (which the
    Trainer's device comes from): clear both, so that they ask again."""
    for name, function in (("transformers.utils.import_utils", "is_torch_hpu_available"),
                           ("accelerate.utils.imports", "is_hpu_available")):
        cached = getattr(sys.modules.get(name), function, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


class _ThenCall(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `name` is imported, wraps its loader to call `then(module)`."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            found = None if finder is self else getattr(finder, "find_spec", None)
            spec = found(fullname, path, target) if found else None
            if spec is not None and spec.loader is not None:
                load = spec.loader.exec_module

                def exec_module(module):
                    load(module)
                    self.then(module)
                spec.loader.exec_module = exec_module
                return spec
        return None


@contextlib.contextmanager
def _on_import(name: str, then):
    """Call `then(module)` for module `name` now if imported, else once the script imports it."""
    if name in sys.modules:
        then(sys.modules[name])
        yield
        return
    finder = _ThenCall(name, then)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)


@contextlib.contextmanager
def _torch_attributes_kept():
    """Puts back the torch functions transformers replaces when it finds an HPU."""
    owners = {"torch": torch, "torch.Tensor": torch.Tensor, "torch.linalg": torch.linalg}
    saved = [(owners[owner], name, getattr(owners[owner], name)) for owner, name in _TORCH_PATCHED]
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _reset_accelerate_state() -> None:
    """accelerate keeps its process state (device hpu) in a class-wide singleton: forget it."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        return
    AcceleratorState._reset_state(reset_partial_state=True)


# -- the watch ----------------------------------------------------------------------------------------

_WATCH_TYPE = None


def _watch_type():
    """HFWatch, a transformers TrainerCallback (made on first use: transformers is optional)."""
    global _WATCH_TYPE
    if _WATCH_TYPE is None:
        from transformers import TrainerCallback
        _WATCH_TYPE = type("HFWatch", (_HFWatch, TrainerCallback), {})
    return _WATCH_TYPE


class _HFWatch:
    """Delimits, counts and measures one Trainer's steps (see the module's docstring)."""

    def __init__(self, rehearsal: HFRehearsal, trainer) -> None:
        self.rehearsal, self.trainer, self.reads = rehearsal, trainer, rehearsal.reads
        self.records: list[dict] = []
        self.run_shapes: RunShapes | None = None
        self.unfused = False
        self._before: dict[str, int] = {}
        self._reads_before = 0
        self._inputs = None

    def watched(self, training_step):
        """The Trainer's training_step, keeping each micro-batch for the step's shapes."""
        def step(model, inputs, *args, **kwargs):
            self._inputs = inputs
            return training_step(model, inputs, *args, **kwargs)
        return step

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.unfused = _unfuse(optimizer) or self.unfused
        if self.run_shapes is None:
            self.run_shapes = walk_hf_batches(self.trainer, state.max_steps)

    def on_step_begin(self, args, state, control, **kwargs):
        self._before = lazy_counters()
        self._reads_before = self.reads.count
        self.reads.in_step = True

    def on_substep_end(self, args, state, control, **kwargs):
        torch._lazy.mark_step()  # after a micro-batch's backward

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        torch._lazy.mark_step()  # after the last micro-batch's backward (and the clipping)

    def on_step_end(self, args, state, control, **kwargs):
        torch._lazy.mark_step()  # after the optimizer step
        self.reads.in_step = False
        after = lazy_counters()
        new = {k: v - self._before.get(k, 0) for k, v in after.items() if v != self._before.get(k, 0)}
        self.records.append({
            "step": state.global_step,
            "compiles": new.get("UncachedCompile", 0),
            "host_syncs": self.reads.count - self._reads_before,
            "fallbacks": {k[6:]: v for k, v in new.items()
                          if k.startswith("aten::") and k != "aten::_local_scalar_dense"},
            "shapes": batch_shapes(self._inputs),
            "attention_mask": mask_layout(self._inputs),
        })
        if len(self.records) >= self.rehearsal.steps:
            raise DoctorFinished


def _unfuse(optimizer) -> bool:
    """Turn torch's fused Adam/AdamW into its single-tensor form (same update); True if it was."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    groups = getattr(inner, "param_groups", [])
    if not any(group.get("fused") for group in groups):
        return False
    for group in groups:
        group["fused"] = False
    inner.defaults["fused"] = False
    return True


# -- the run's batches ------------------------------------------------------------------------------

def walk_hf_batches(trainer, max_steps: int) -> RunShapes:
    """The census of the micro-batches this Trainer's run takes: from its own train dataloader
    (get_train_dataloader), collated here without workers and without moving them to the device,
    for one epoch or the run's max_steps if fewer, with the random generators put back."""
    from torch.utils.data import DataLoader, IterableDataset

    if isinstance(trainer.train_dataset, IterableDataset) or not hasattr(trainer.train_dataset, "__len__"):
        return RunShapes(None, skipped="the train_dataset is an iterable data set, which walking "
                         "its batches ahead would read twice")
    with random_state_kept():
        prepared = trainer.get_train_dataloader()
        base = getattr(prepared, "base_dataloader", prepared)
        loader = DataLoader(base.dataset, batch_sampler=base.batch_sampler, collate_fn=base.collate_fn)
        accumulate = trainer.args.gradient_accumulation_steps
        per_epoch = len(loader) // accumulate or 1
        if max_steps <= 0 or per_epoch < max_steps:
            steps, walked = per_epoch, f"an epoch of {per_epoch} steps"
        else:
            steps, walked = max_steps, f"the run's {max_steps} steps (max_steps)"
        census = take_census(loader, steps * accumulate)
    return RunShapes(census, walked, "yours")




# -- findings in the Trainer's words ----------------------------------------------------------------

def _hf_wording(finding: dict, reads: HostReads) -> str:
    """The finding's message, with the fix for the Trainer's own host read where it made one."""
    message = finding["message"]
    if finding["kind"] == "host_sync" and any(_nan_filter_read(site) for site in reads.where):
        message += (" The read in transformers/trainer.py is its check of every micro-batch's loss "
                    "for nan or inf (logging_nan_inf_filter=True, the default): set "
                    "logging_nan_inf_filter=False in TrainingArguments.")
    return message


def _nan_filter_read(site) -> bool:
    library = getattr(site, "library", None) or ""
    return library.startswith("transformers/trainer.py") and site.read == "__bool__"


def _collator_fix(run: RunShapes, watches: list) -> str:
    """How to pad to a few lengths with transformers' collators and tokenizers."""
    census = run.census
    suggested = census.multiple_for()
    multiple = (f"pad_to_multiple_of={suggested[0]} on the collator (here at most {suggested[1]} "
                "shapes)" if suggested else "pad_to_multiple_of=64 on the collator")
    fixed = (f'padding="max_length" with max_length={max(census.widths)} in the tokenizer call '
             "(one shape)" if census.widths else 'padding="max_length" in the tokenizer call')
    name = _collator_name(watches)
    if census.padding == "longest row":
        return (f"Your data_collator ({name}) pads each batch to its longest row. "
                "train_sampling_strategy=\"group_by_length\" (group_by_length=True before "
                "transformers 5) is not enough: it puts rows of similar length together, but each "
                "batch is still padded to its own longest row, so the lengths stay as many. Pad "
                f"to fixed lengths: {multiple}, or {fixed}.")
    return f"Pad to fewer lengths: a larger {multiple}, or {fixed}."


def _collator_name(watches: list) -> str:
    collator = watches[0].trainer.data_collator if watches else None
    collator = getattr(collator, "data_collator", collator)  # transformers' RemoveColumnsCollator
    return type(collator).__name__ if collator is not None else "default_data_collator"


# -- the CPU lazy backend's gaps in the Trainer's step ------------------------------------------------

class _TrainerGaps(TorchFunctionMode):
    """Routes the lazy backend's gaps met in transformers' step (beyond LazyBackendGaps) into ops
    it has, for lazy tensors only: torch AdamW's lerp_, clip_grad_norm_'s 2-norm, isnan. Gaudi runs
    each in its graph, so they are not the script's fallbacks."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = _ROUTES.get(func)
        if route is not None and args and _lazy(args[0]):
            routed = route(*args, **kwargs)
            if routed is not NotImplemented:
                return routed
        return func(*args, **kwargs)


def _lazy(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "lazy"


def _lerp_(tensor, end, weight):
    return tensor.add_((end - tensor) * weight)


def _lerp(tensor, end, weight):
    return tensor + (end - tensor) * weight


def _vector_norm(tensor, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    if ord != 2 or dim is not None or keepdim or out is not None:
        return NotImplemented
    tensor = tensor if dtype is None else tensor.to(dtype)
    return tensor.pow(2).sum().sqrt()


def _isnan(tensor):
    return tensor.ne(tensor)  # NaN is the one value not equal to itself


_ROUTES = {torch.Tensor.lerp_: _lerp_, torch.Tensor.lerp: _lerp, torch.lerp: _lerp,
           torch.linalg.vector_norm: _vector_norm, torch.isnan: _isnan, torch.Tensor.isnan: _isnan}

