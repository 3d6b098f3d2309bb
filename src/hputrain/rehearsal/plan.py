"""Will it fit? One training step traced on fake tensors, at the rank count asked for, and its peak
memory per rank by category, against a target device's memory (`hputrain plan`).

How: the model is built on the meta device (shapes only: no weight is read), its tensors made
fake inside torch's FakeTensorMode (tensors with shapes and dtypes whose operations run without
storage: nothing of the model's size is allocated), prepared as the Trainer
prepares it (the precision plugin, activation checkpointing, fsdp's sharding through hputrain's
own strategy on a fake process group of the asked world size), and one step runs on it: forward
under the precision's autocast, the loss, backward, the optimizer's step with its states already
there (as in every step after the first), zero_grad. torch.distributed._tools' MemTracker (or
FSDPMemTracker under fsdp) counts every tensor alive through the step by what it is, and keeps the
moment of the peak. Its categories become the plan's:

  parameters   the parameters and buffers (fsdp: this rank's shards and the gathered blocks)
  gradients    the gradients (fsdp: sharded and unsharded)
  optimizer    AdamW's two moments
  activations  what forward keeps for backward
  temporary    everything else alive at the peak: the logits and the loss's log-softmax,
               fsdp's all-gather and reduce-scatter buffers, ddp's gradient buckets, the inputs

ddp is traced as one process (each rank holds the whole model) plus its gradient buckets, a
flat copy of the trainable gradients that DistributedDataParallel allocates in C++ where no
tracker sees it. The same step traced on real tensors is what accuracy is measured against
(bench/plan_accuracy.py, docs/benchmarks.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config.accelerator_config import AcceleratorConfig
from ..config.sections import Sections
from ..callbacks import Callback
from ..distributed.activation_checkpointing import apply_activation_checkpointing
from ..distributed.strategies import Strategy
from ..errors import InputError
from ..execution.precision import select_precision
from ..training.evaluation import loss_of
from ..training.optim import create_optimizer

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporary")
_KINDS = {"PARAM": "parameters", "BUFFER": "parameters", "SHARDED_PARAM": "parameters",
          "UNSHARDED_PARAM": "parameters", "GRAD": "gradients", "SHARDED_GRAD": "gradients",
          "UNSHARDED_GRAD": "gradients", "OPT": "optimizer", "ACT": "activations"}
"""MemTracker's reference types, by the plan's category (the rest are temporary)."""


@dataclass
class StepModel:
    """What one training step of a run is made of, as a recipe says: `build(lora)` returns the
    model (called inside the fake mode: it must create, not load, its weights), `batch(size)`
    a micro-batch of `size` samples; `lora` says whether the run trains LoRA adapters and
    `lora_possible` whether it could (a Hugging Face model)."""

    build: Callable[[bool], torch.nn.Module]
    batch: Callable[[int], dict | tuple]
    name: str
    lora: bool = False
    lora_possible: bool = False


@dataclass
class Trace:
    peak_bytes: int
    breakdown: dict[str, int]


@dataclass
class Plan:
    peak_bytes: int
    target: str
    target_bytes: int
    breakdown: dict[str, int]
    ranks: int
    suggestions: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.target_bytes

    def as_json(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "target_bytes": self.target_bytes,
                "fits": self.fits, "breakdown": self.breakdown, "suggestions": self.suggestions}


def plan(step: StepModel, args, target: str, target_bytes: int, *, accelerator,
         time_budget: float = 90.0) -> Plan:
    """The peak per rank of one step of the run `args` describes, and, when it does not fit, the
    cheapest changes that make it fit (each traced; tried until `time_budget` seconds)."""
    start = time.perf_counter()
    ranks = args.devices * args.num_nodes
    traced = trace_step(step, args, accelerator)
    result = Plan(traced.peak_bytes, target, target_bytes, traced.breakdown, ranks)
    if not result.fits:
        result.suggestions = _suggestions(step, args, accelerator, target_bytes,
                                          start + time_budget)
    result.seconds = time.perf_counter() - start
    return result


def trace_step(step: StepModel, args, accelerator, fake: bool = True) -> Trace:
    """One training step of `args` traced (on fake tensors, or real ones to measure)."""
    ranks = args.devices * args.num_nodes
    sharded = args.strategy == "fsdp" and ranks > 1
    torch.manual_seed(args.seed)
    with torch.device("meta") if fake else contextlib.nullcontext():
        model = step.build(step.lora)  # on the meta device: shapes only, nothing read
    mode = _fake_mode() if fake else contextlib.nullcontext()
    with _fake_group(ranks) if sharded else contextlib.nullcontext() as group, mode:
        if fake:  # fake tensors of the meta ones' shapes: ops run, nothing is allocated
            model.to_empty(device="cpu")
        settings = Sections.of(args)
        precision = select_precision(settings.precision, AcceleratorConfig(), accelerator)
        model = precision.convert_module(model)
        strategy = None
        if sharded:
            from ..distributed.fsdp import FSDP

            strategy = FSDP(group, settings.parallelism, precision)
            strategy.device = torch.device("cpu")
        apply_activation_checkpointing(model, settings.activation_checkpointing)
        if strategy is not None:
            model = strategy.wrap(model)
        optimizer = create_optimizer(model, settings.optimizer, AcceleratorConfig(), accelerator)
        _create_states(optimizer)
        batch = step.batch(args.per_device_train_batch_size)
        tracker = _tracker(model, optimizer, sharded, batch)
        with tracker:
            with precision.forward_context():
                loss = loss_of(_call(model, batch))
            loss.backward()
            if args.max_grad_norm > 0:  # as the Trainer clips: the norms' temporaries
                params = [p for p in model.parameters() if p.requires_grad]
                (strategy or Strategy()).clip_grad_norm(accelerator, params, args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        traced = _breakdown(tracker)
    if args.strategy in ("ddp", "fast_ddp") and ranks > 1:  # the flat bucket copy of the gradients
        buckets = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
        traced.breakdown["temporary"] += buckets
        traced.peak_bytes += buckets
    return traced


def _suggestions(step: StepModel, args, accelerator, target_bytes: int, deadline: float) -> list[dict]:
    """Single changes first, cheapest first; if none fits, the same changes one on top of the
    other. Each traced; stops at the deadline."""
    found, cumulative = [], args
    for label, changed, flags in _changes(step, args):
        if time.perf_counter() > deadline:
            break
        peak = trace_step(changed[0], changed[1], accelerator).peak_bytes
        found.append({"change": label, "flags": flags, "peak_bytes": peak,
                      "fits": peak <= target_bytes})
    if any(s["fits"] for s in found):
        return sorted(found, key=lambda s: (not s["fits"], s["peak_bytes"]))
    step_now, labels, all_flags = step, [], []
    for label, changed, flags in _changes(step, args):
        if time.perf_counter() > deadline:
            break
        step_now, cumulative = _apply(step_now, cumulative, flags)
        labels.append(label)
        all_flags += flags
        peak = trace_step(step_now, cumulative, accelerator).peak_bytes
        if len(labels) > 1:
            found.append({"change": " + ".join(labels), "flags": list(all_flags),
                          "peak_bytes": peak, "fits": peak <= target_bytes})
        if peak <= target_bytes:
            break
    return sorted(found, key=lambda s: (not s["fits"], s["peak_bytes"]))


def _changes(step: StepModel, args):
    """(label, (step, args) changed, the flags that make the change), cheapest first: memory
    saved for the least speed or quality lost."""
    if not args.gradient_checkpointing:
        flags = ["--gradient-checkpointing"]
        yield "gradient checkpointing", _apply(step, args, flags), flags
    if step.lora_possible and not step.lora:
        flags = ["--lora-r", "16"]
        yield "LoRA adapters (r 16) instead of every weight", _apply(step, args, flags), flags
    ranks = args.devices * args.num_nodes
    if args.strategy != "fsdp" and ranks > 1:
        flags = ["--strategy", "fsdp"]
        yield f"fsdp over the {ranks} devices", _apply(step, args, flags), flags
    for more in (2, 4):
        flags = ["--strategy", "fsdp", "--num-nodes", str(args.num_nodes * more)]
        yield (f"fsdp over {ranks * more} devices ({args.num_nodes * more} nodes of {args.devices})",
               _apply(step, args, flags), flags)
    if args.per_device_train_batch_size > 1:
        smaller = max(1, args.per_device_train_batch_size // 2)
        accumulate = args.gradient_accumulation_steps * args.per_device_train_batch_size // smaller
        flags = ["--per-device-train-batch-size", str(smaller), "--gradient-accumulation-steps",
                 str(accumulate)]
        yield (f"micro-batch {smaller} with {accumulate} accumulation steps (the same global "
               "batch)", _apply(step, args, flags), flags)


def _apply(step: StepModel, args, flags: list[str]):
    """(step, args) with the change `flags` describe."""
    values, lora = {}, step.lora
    for name, value in zip(flags[::1], flags[1:] + [None]):
        if name == "--gradient-checkpointing":
            values["gradient_checkpointing"] = True
        elif name == "--lora-r":
            lora = True
        elif name == "--strategy":
            values["strategy"] = value
        elif name == "--num-nodes":
            values["num_nodes"] = int(value)
        elif name == "--per-device-train-batch-size":
            values["per_device_train_batch_size"] = int(value)
        elif name == "--gradient-accumulation-steps":
            values["gradient_accumulation_steps"] = int(value)
    return dataclasses.replace(step, lora=lora), dataclasses.replace(args, **values)


# -- the pieces of a trace -------------------------------------------------------------------------

def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def _fake_group(ranks: int):
    """A process group of `ranks` ranks in this one process (torch's "fake" backend: collectives
    do nothing), and the layout object hputrain's fsdp strategy reads (a 1-D shard mesh)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise InputError("hputrain plan traces its own process group: run it as one process")
    dist.init_process_group("fake", rank=0, world_size=ranks, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("dp_shard",))
        yield types.SimpleNamespace(mesh=mesh, dims=types.SimpleNamespace(dp_replicate=1),
                                    distributed=True)
    finally:
        dist.destroy_process_group()


def _create_states(optimizer) -> None:
    """The optimizer's states, as they are from the second step on: one step on zero gradients
    (cheaper than a first forward and backward)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _tracker(model, optimizer, sharded: bool, batch):
    if sharded:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs(tuple(v for v in _values(batch) if isinstance(v, torch.Tensor)))
        return tracker
    tracker = _memory_tracker()
    tracker.track_external(model, optimizer, *[v for v in _values(batch) if isinstance(v, torch.Tensor)])
    return tracker


def _memory_tracker():
    """torch's MemTracker, taught that a frozen parameter (LoRA's base weights) gets no gradient:
    as it ships, it hooks every parameter's gradient and fails on one that cannot have any."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class FrozenAwareMemTracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            memory = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if install_grad_hooks:
                for param in module.parameters():
                    if param.requires_grad and param not in self._param_to_grad_hook_handles:
                        self._param_to_grad_hook_handles[param] = (
                            param.register_hook(self._count_gradient),
                            param.register_post_accumulate_grad_hook(
                                lambda p: self._count_gradient(p.grad)))
            return memory

        def _count_gradient(self, grad) -> None:
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    return FrozenAwareMemTracker()


def _values(batch):
    return batch.values() if isinstance(batch, dict) else batch


def _call(model, batch):
    return model(**batch) if isinstance(batch, dict) else model(*batch)


def _breakdown(tracker) -> Trace:
    """The tracker's peak, by the plan's categories."""
    snapshot = tracker.get_tracker_snapshot("peak")
    breakdown = dict.fromkeys(CATEGORIES, 0)
    total = 0
    for device_stats in snapshot.values():
        for kind, value in device_stats.items():
            name = str(kind).rsplit(".", 1)[-1]
            if name == "Total":
                total += int(value)
            else:
                breakdown[_KINDS.get(name, "temporary")] += int(value)
    return Trace(total, breakdown)


class StepPeak(Callback):
    """Measures, in a real run, the live tensor bytes of one training step (`step`, counted from
    1; the third by default: the optimizer's states exist then, as the plan assumes, and ddp has
    rebuilt its buckets, which it does in the second step's forward), with the
    same trackers and categories as the plan; under DistributedDataParallel its gradient buckets
    (allocated at wrapping, before any tracker) are added from DDP's own account of them.
    What `hputrain plan` is checked against (bench/plan_accuracy.py)."""

    def __init__(self, step: int = 3) -> None:
        self.step, self.tracker, self.trace = step, None, None

    def on_step_begin(self, trainer) -> None:
        if trainer.global_step + 1 != self.step:
            return
        sharded = trainer.strategy.shards_state and trainer.group.distributed
        self.tracker = _tracker(trainer.model, trainer.optimizer, sharded, ())
        self.tracker.__enter__()

    def on_step_end(self, trainer) -> None:
        if self.tracker is None or trainer.global_step != self.step:
            return
        self.tracker.__exit__(None, None, None)
        self.trace, self.tracker = _breakdown(self.tracker), None
        if isinstance(trainer.wrapped, torch.nn.parallel.DistributedDataParallel):
            sizes = str(trainer.wrapped._get_ddp_logging_data().get("bucket_sizes", ""))
            buckets = sum(int(size) for size in sizes.replace(" ", "").split(",") if size)
            self.trace.breakdown["temporary"] += buckets
            self.trace.peak_bytes += buckets
