"""Counting the live tensor bytes of one training step by what they are: the trackers behind
`hputrain plan` (on fake tensors) and behind its measurement (StepPeak, on a real run's tensors).

Both are torch.distributed._tools' MemTracker (FSDPMemTracker under fsdp): a TorchDispatchMode
that sees every tensor an operation returns, keeps a weak reference to its storage and counts its
bytes until the storage is freed, by kind (parameter, gradient, optimizer state, activation,
temporary...). What we change, and why:

- the peak. torch's trackers copy a snapshot for every module that is running, at every
  operation, for per-module statistics the plan does not use (a trace of Llama-3-70B's shape on
  8 ranks: 28.7 s with them, 16.1 s without). We keep one figure: the largest total seen, and
  its parts then.
- what the device holds. With fsdp_cpu_offload, FSDP2 keeps the sharded parameters, their
  gradients and the optimizer's states in host memory: the device's peak leaves them out, so
  the peak is taken over what stays on the device, not over everything.
- a backend's own copy. Gloo (the CPU's backend) reduces a collective's input in a copy of it,
  inside the collective, where no tracker on a fake process group can see it. Measured: the
  2-process bf16 fsdp step's peak is at the root's reduce-scatter, 32 MiB (its fp32 input) above
  the fake trace without it; under ddp each bucket's copy lives from its all-reduce to the end
  of backward, one more copy of the gradients there (BucketCopies). HCCL and NCCL
  reduce in place.
- frozen parameters. MemTracker hooks every parameter's gradient and fails on one that can have
  none (LoRA's frozen base weights): only trainable ones are hooked.
- a frozen model beside the trained one (DPO's reference). Its weights exist before the step, so
  no operation shows them to the tracker (and FSDPMemTracker's track_external does nothing):
  they are registered as parameters (sharded parameters under fsdp) before the step.
- the model called twice in one step. torch's trackers take a second call of the root module
  for the next iteration and refuse it; DPO under LoRA calls the policy twice in every step
  (the reference's forward, adapters disabled, and the policy's). Its per-module statistics,
  which the plan does not read, start again instead.
- a mixture of experts' own share (the "experts" category, of a model that has experts: see
  plan_moe.experts_modules). What the experts modules allocate while they run, in forward, in
  its recomputation and in backward (the routed rows, the all-to-all's send and receive buffers
  under expert parallelism, the (rows, 2I) intermediates kept for backward, the grouped
  products' temporaries, a LoRA adapter's folded weights), is counted as it is alive at the
  peak, taken out of the activations and temporaries it would otherwise be: the tracker tags
  each storage created while an experts module is among the modules running (ModTracker's
  parents, which backward fills too). The modules are the model kinds' to name
  (ModelKind.counted_apart).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...callbacks import Callback
from ...distributed.group import reduces_in_a_copy
from ...models.kind import registered

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporary")
EXPERTS = "experts"
"""The category of a mixture of experts' buffers and intermediates (see the module docstring),
after activations; only in the breakdown of a model that has experts."""
_KINDS = {"PARAM": "parameters", "BUFFER": "parameters", "SHARDED_PARAM": "parameters",
          "UNSHARDED_PARAM": "parameters", "GRAD": "gradients", "SHARDED_GRAD": "gradients",
          "UNSHARDED_GRAD": "gradients", "OPT": "optimizer", "ACT": "activations"}
"""MemTracker's reference types, by the plan's category (the rest are temporary: inputs, the
backward's temporaries, fsdp's all-gather and reduce-scatter buffers)."""
_OFFLOADED = ("SHARDED_PARAM", "SHARDED_GRAD", "OPT")
"""What FSDP2's CPUOffloadPolicy keeps in host memory."""


@dataclass
class Trace:
    peak_bytes: int
    breakdown: dict[str, int]
    host_bytes: int = 0
    """The most fsdp_cpu_offload keeps in host memory through the step, for this device."""


def tracker(model, optimizer, sharded: bool, inputs=(), *, offloaded: bool = False,
            backend: str | None = None, frozen=None):
    """A tracker of one step of `model` and `optimizer` (FSDPMemTracker when `sharded`), whose
    peak leaves out what fsdp offloads to the host and adds what `backend` copies, and counts
    the weights of `frozen` (a module called beside the model, or None) as parameters."""
    if sharded:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        found = _peak_tracker(FSDPMemTracker)(model, optimizer)
        found.track_inputs(tuple(inputs))
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        found = _peak_tracker(MemTracker)()
        found.track_external(model, optimizer, *inputs)
    found.host_kinds = _OFFLOADED if offloaded and sharded else ()
    found.copies_reduce_scatter_input = reduces_in_a_copy(backend)
    found.experts = _experts_of(model, frozen)
    if frozen is not None:
        kinds = found._ref_class
        weights = kinds.SHARDED_PARAM if sharded else kinds.PARAM
        for tensor in frozen.parameters():
            found._update_and_maybe_create_winfos(tensor, weights)
        for tensor in frozen.buffers():
            found._update_and_maybe_create_winfos(tensor, kinds.BUFFER)
    return found


def breakdown(found) -> Trace:
    """The tracker's peak, by the plan's categories."""
    experts = found.plan_experts if found.experts else None
    return Trace(found.plan_peak_bytes, _categorised(found.plan_peak.items(), experts),
                 found.plan_host_bytes)


def _categorised(items, experts: dict | None = None) -> dict[str, int]:
    """The plan's categories of a peak's parts by kind; with `experts` (the experts' tagged bytes
    by kind, a model with experts), those moved from their kind's category into EXPERTS."""
    parts = dict.fromkeys(CATEGORIES, 0)
    for kind, value in items:
        parts[_KINDS.get(_name(kind), "temporary")] += int(value)
    if experts is None:
        return parts
    own = 0
    for kind, value in experts.items():
        parts[_KINDS.get(_name(kind), "temporary")] -= int(value)
        own += int(value)
    order = [*CATEGORIES[:CATEGORIES.index("activations") + 1], EXPERTS,
             *CATEGORIES[CATEGORIES.index("activations") + 1:]]
    return {name: own if name == EXPERTS else parts[name] for name in order}


def _experts_of(*models) -> tuple:
    """The modules of `models` (None skipped) the model kinds count apart (ModelKind.counted_apart:
    a mixture of experts' experts modules), and the PEFT wrappers around them (LoRA on the
    experts: ParamWrapper, whose forward folds the adapters into their weights first)."""
    found = []
    for model in filter(None, models):
        experts = {id(m) for kind in registered() for m in kind.counted_apart(model)}
        for module in model.modules():
            inner = module
            while isinstance(getattr(inner, "base_layer", None), torch.nn.Module):
                inner = inner.base_layer
            if id(inner) in experts:
                found.append(module)
    return tuple(found)


def _name(kind) -> str:
    """A reference type's member name (SHARDED_PARAM, OPT, ...)."""
    return getattr(kind, "name", str(kind))


def _peak_tracker(base):
    """`base` (MemTracker or FSDPMemTracker) keeping one peak, of what the device holds."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    class PeakTracker(_ExpertsTagging, base):
        host_kinds: tuple = ()
        copies_reduce_scatter_input = False

        def __enter__(self):
            entered = super().__enter__()
            if self._depth == 1:
                self.plan_peak_bytes, self.plan_peak, self.plan_host_bytes = -1, {}, 0
                self.plan_experts, self.experts_alive, self._tagged = {}, {}, {}
                self._experts_names = None
                self._update_peak_stats(None)
            return entered

        def _update_peak_stats(self, peak_state) -> None:
            resident, parts, host = 0, {}, 0
            for snapshot in self._curr_mem_snap.values():
                for kind, value in snapshot.items():
                    if kind == _TOTAL_KEY:
                        continue
                    if _name(kind) in self.host_kinds:
                        host += value
                    else:
                        parts[kind] = parts.get(kind, 0) + value
                        resident += value
            self.plan_host_bytes = max(self.plan_host_bytes, host)
            if resident > self.plan_peak_bytes:
                self.plan_peak_bytes, self.plan_peak = resident, parts
                self.plan_experts = dict(self.experts_alive)

        def _called_again(self, module) -> None:
            """Forget `module`'s per-module statistics when it is called again at the top of
            the step (see the module docstring)."""
            name = self._mod_tracker.get_known_fqn(module)
            if (module in self.memory_tracking and not self._mod_tracker.is_bw
                    and set(self._mod_tracker.parents) - {name} == {"Global"}):
                del self.memory_tracking[module]

        def _pre_fw_hook(self, module, inputs) -> None:  # MemTracker's
            self._called_again(module)
            super()._pre_fw_hook(module, inputs)

        def _fsdp_state_pre_forward(self, fsdp_mod, original):  # FSDPMemTracker's
            tracked = super()._fsdp_state_pre_forward(fsdp_mod, original)

            def pre_forward(*args, **kwargs):
                self._called_again(fsdp_mod)
                return tracked(*args, **kwargs)

            return pre_forward

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            memory = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if install_grad_hooks:  # only parameters that can have a gradient
                for param in module.parameters():
                    if param.requires_grad and param not in self._param_to_grad_hook_handles:
                        self._param_to_grad_hook_handles[param] = (
                            param.register_hook(self._count_gradient),
                            param.register_post_accumulate_grad_hook(
                                lambda p: self._count_gradient(p.grad)))
            return memory

        def _count_gradient(self, grad) -> None:
            self._update_and_maybe_create_winfos(grad, self._ref_class.GRAD)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            copied = 0
            if (self.copies_reduce_scatter_input
                    and func is torch.ops.c10d._reduce_scatter_base_.default):
                copied = args[1].untyped_storage().nbytes()
                self.add_temporary(copied)
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                if copied:
                    self.add_temporary(-copied)

        def add_temporary(self, nbytes: int) -> None:
            snapshot = next(iter(self._curr_mem_snap.values()))
            snapshot[self._ref_class.TEMP] += nbytes
            snapshot[_TOTAL_KEY] += nbytes
            self._update_peak_stats(None)

    return PeakTracker


class BucketCopies:
    """ddp on a backend that reduces in a copy (gloo): each gradient bucket's copy, from the
    moment the bucket is full and its all-reduce starts, to the end of backward where DDP waits
    for them all. Buckets fill in the order gradients become ready (the order DDP rebuilds them
    in after its first step), the first up to torch's first-bucket size, the others up to
    ddp_bucket_cap_mb; fast_ddp reduces one flat buffer after backward."""

    def __init__(self, counting, model, cap_mb: int | None, strategy: str) -> None:
        import torch.distributed as dist
        from torch.nn.parallel.distributed import _DEFAULT_BUCKET_CAP_MB

        self.counting, self.model, self.handles = counting, model, []
        self.cap = int((cap_mb or _DEFAULT_BUCKET_CAP_MB) * 2**20)
        self.limit = dist._DEFAULT_FIRST_BUCKET_BYTES if cap_mb is None else self.cap
        if strategy == "fast_ddp":  # one buffer, reduced when backward is over
            self.cap = self.limit = 2**62
        self.filling = self.held = 0

    def install(self) -> None:
        for param in self.model.parameters():
            if param.requires_grad:
                self.handles.append(param.register_post_accumulate_grad_hook(self._ready))

    def _ready(self, param) -> None:
        self.filling += param.numel() * param.element_size()
        if self.filling >= self.limit:
            self._reduce()

    def _reduce(self) -> None:
        self.counting.add_temporary(self.filling)
        self.held, self.filling, self.limit = self.held + self.filling, 0, self.cap

    def end_of_backward(self) -> None:
        if not self.handles:
            return
        if self.filling:
            self._reduce()
        self.counting.add_temporary(-self.held)
        for handle in self.handles:
            handle.remove()


class _ExpertsTagging:
    """The tracker's part that tags what the experts modules allocate (the module docstring's
    last point): `experts_alive`, their live bytes by kind, follows every change of a tagged
    storage (freed, resized, re-kinded: one that becomes a gradient is the gradients' again)."""

    experts: tuple = ()
    _KEPT = ("ACT", "TEMP")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.plan_experts, self.experts_alive, self._tagged, self._experts_names = {}, {}, {}, None

    def _track(self, reftype, t) -> None:
        if not self.experts or not self._in_experts():
            return super()._track(reftype, t)
        from torch.distributed._tools.common_utils import get_untyped_storages

        fresh = [st for st in get_untyped_storages(t) if st not in self._WINFO]
        super()._track(reftype, t)
        for st in fresh:
            winfo = self._WINFO.get(st, (None, None))[0]
            if winfo is not None and _name(winfo.reftype) in self._KEPT:
                self._tagged[id(winfo)] = winfo
                self._add_experts(winfo.reftype, winfo.mem_consumed)

    def _in_experts(self) -> bool:
        names = self._experts_names
        if names is None:  # ModTracker names a module once its parent's forward has begun
            known = {self._mod_tracker.get_known_fqn(m) for m in self.experts}
            names = frozenset(known - {None})
            if None not in known:
                self._experts_names = names
        return not names.isdisjoint(self._mod_tracker.parents)

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        if self._tagged.get(id(winfo)) is not winfo:
            return
        kind = _name(u_type)
        if kind == "DEL":
            self._add_experts(winfo.reftype, -winfo.mem_consumed)
            del self._tagged[id(winfo)]
        elif kind == "SIZE":
            self._add_experts(winfo.reftype, winfo.mem_consumed - old_mem_consumed)
        elif kind == "REF":
            self._add_experts(old_reftype, -winfo.mem_consumed)
            if _name(winfo.reftype) in self._KEPT:
                self._add_experts(winfo.reftype, winfo.mem_consumed)
            else:
                del self._tagged[id(winfo)]

    def _add_experts(self, kind, nbytes: int) -> None:
        self.experts_alive[kind] = self.experts_alive.get(kind, 0) + nbytes


class StepPeak(Callback):
    """Measures, in a real run, the live tensor bytes of one training step (`step`, counted from
    1; the third by default: the optimizer's states exist then, as the plan assumes, and ddp has
    rebuilt its buckets, which it does in the second step's forward), with the same trackers and
    categories as the plan, on the real tensors; under DistributedDataParallel its gradient
    buckets (allocated at wrapping, in C++, before any tracker) are added from DDP's own account
    of them. What `hputrain plan` is checked against (bench/plan_accuracy.py)."""

    def __init__(self, step: int = 3) -> None:
        self.step, self.tracker, self.trace = step, None, None

    def on_step_begin(self, trainer) -> None:
        if trainer.global_step + 1 != self.step:
            return
        # fsdp's tracker where fsdp wraps the model (expert parallelism shards its checkpoints,
        # not the model's other parameters)
        sharded = trainer.strategy.name == "fsdp" and trainer.group.distributed
        frozen = getattr(getattr(trainer, "objective", None), "reference", None)  # DPO's
        self.tracker = tracker(trainer.model, trainer.optimizer, sharded, frozen=frozen)
        self.tracker.__enter__()

    def on_step_end(self, trainer) -> None:
        if self.tracker is None or trainer.global_step != self.step:
            return
        self.tracker.__exit__(None, None, None)
        self.trace, self.tracker = breakdown(self.tracker), None
        if isinstance(trainer.wrapped, torch.nn.parallel.DistributedDataParallel):
            sizes = str(trainer.wrapped._get_ddp_logging_data().get("bucket_sizes", ""))
            buckets = sum(int(size) for size in sizes.replace(" ", "").split(",") if size)
            self.trace.breakdown["temporary"] += buckets
            self.trace.peak_bytes += buckets
