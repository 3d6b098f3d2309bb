"""Will it fit? One training step traced on fake tensors, at the rank count asked for, and its peak
memory per rank by category, against a target device's memory (`hputrain plan`).

How: the model is built on the meta device (shapes only: no weight is read), its tensors made
fake inside torch's FakeTensorMode (tensors with shapes and dtypes whose operations run without
storage: nothing of the model's size is allocated), prepared by the Trainer's own
training/prepare.py (the device kernels, as this machine runs them; the precision plugin;
activation checkpointing; fsdp's sharding through hputrain's own strategy on a fake process group
of the asked world size; no compilation), and one step runs on it, with the batch the run would
see (packed SFT blocks whose block mask the Trainer's PackedInputs builds, `packed_step`): forward
under the precision's autocast, the loss (the method's Objective's, or the model's), backward,
the optimizer's step with its states already there (as in every step after the first),
zero_grad. torch.distributed._tools' MemTracker (or
FSDPMemTracker under fsdp) counts every tensor alive through the step by what it is, and keeps the
moment of the peak. Its categories become the plan's:

  parameters   the parameters and buffers (fsdp: this rank's shards and the gathered blocks)
  gradients    the gradients (fsdp: sharded and unsharded)
  optimizer    AdamW's two moments
  activations  what forward keeps for backward
  temporary    everything else alive at the peak: the logits and the loss's log-softmax,
               fsdp's all-gather and reduce-scatter buffers, ddp's gradient buckets, the inputs
  kv_cache     (GRPO only) the generation's key/value cache, held from the first rollout on
               (methods/grpo/plan.py)

ddp is traced as one process (each rank holds the whole model) plus its gradient buckets, a
flat copy of the trainable gradients that DistributedDataParallel allocates in C++ where no
tracker sees it. Under fsdp_cpu_offload the peak is what stays on the device (the shards, their
gradients and AdamW's moments live in host memory); with a backend that reduces in a copy (gloo,
the cpu target's) the copy is counted (rehearsal/plan/tracking.py says why each).

Accuracy is measured against the same step of a real run of hputrain's Trainer, counted by the
same trackers on real tensors (StepPeak; bench/plan_accuracy.py, docs/benchmarks.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...config.accelerator_config import AcceleratorConfig
from ...config.sections import Sections
from ...distributed.group import reduces_in_a_copy
from ...distributed.strategies import Strategy
from ...errors import InputError
from ...models.kind import registered
from ...execution.precision import select_precision
from ...training.evaluation import loss_of
from ...training.loss import IGNORE_INDEX
from ...training.optim import create_optimizer
from ...training.prepare import prepare_model
from ...training.extras import model_extras, token_mask
from .tracking import CATEGORIES, BucketCopies, StepPeak, Trace, breakdown, tracker



def call_model(module, input_ids, attention_mask):
    """A policy's (or reference's) forward, as the Trainer's Loop.call_model calls it: what a
    method's step model (DPO's, GRPO's) gives its objective in the trace."""
    return module(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)


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
    reference: Callable[[bool], torch.nn.Module | None] | None = None
    """A frozen model the step calls beside the trained one (DPO's reference), built as `build`
    is, given `lora`; None (or returning None): none (the adapter-disabled policy, or
    precomputed log-probs)."""
    objective: Callable | None = None
    """The step's loss as the run computes it: `objective(reference, model, sharded, args)`
    returns a callable (module, batch) -> loss (methods/dpo/plan.py, methods/grpo/plan.py); None: the model's
    own loss (causal LM)."""
    preference: object | None = None
    """DPO's settings (beta, loss_type, label_smoothing, precompute_ref_log_probs) when the step
    is a DPO step (methods/dpo/plan.py), else None."""
    held: Callable | None = None
    """What the method keeps on the device beside the step, all through it, where no tracker
    sees it allocated: `held(model, args, precision)` -> {category: bytes} (GRPO's generation
    key/value cache, methods/grpo/plan.py); None: nothing."""
    grpo: dict | None = None
    """GRPO's settings (config.grpo.GRPOOptions' fields) when the step is a GRPO step
    (methods/grpo/plan.py), else None."""
    vision: object | None = None
    """An image-text-to-text model's step: the recipe's settings (a dict), which
    plan_vlm.vlm_step turns into its VisionStep (image blocks, the tower's share); else None."""
    trainer: Callable | None = None
    """The method's own trainer for the measured step (plan/measure.py): `trainer(step, args,
    model, copies, peak)` -> a Trainer whose callbacks include `peak`, on `copies` batches of the
    step's shape (DPO's, methods/dpo/plan.py; GRPO's, methods/grpo/plan.py); None: the core
    Trainer on the step's batches."""


@dataclass
class Plan:
    peak_bytes: int
    target: str
    target_bytes: int
    breakdown: dict[str, int]
    ranks: int
    suggestions: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    """How the trace stood in for what it could not run here (the kernels, a compiled step)."""
    moe: object | None = None
    """A model kind's layout (ModelKind.plan_layout; a mixture of experts', kinds/moe/plan.py:
    experts, active parameters, the expert-parallel split and its all-to-all buffers); None for a
    dense model."""
    vision: object | None = None
    """An image-text-to-text model's vision tower share (plan_vlm.VisionShare), else None."""
    fp8: dict | None = None
    """With fp8, how the target runs it ("runs": native, emulated or None), whether it is
    counted as a speed-up there, and the note saying so (`_fp8`); None without fp8."""

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.target_bytes

    def as_json(self) -> dict:
        found = {"peak_bytes": self.peak_bytes, "target_bytes": self.target_bytes,
                 "fits": self.fits, "breakdown": self.breakdown, "suggestions": self.suggestions}
        if self.moe is not None:
            found["moe"] = self.moe.as_json()
        if self.vision is not None:
            found["vision"] = self.vision.as_json()
        if self.fp8 is not None:
            found["fp8"] = self.fp8
        return found


def packed_step(base: StepModel, examples: int = 4) -> StepModel:
    """`base` (a recipe's step on blocks of tokens) as the step of a run that packs SFT examples
    into its blocks (data/packing.py's layout): each block holds `examples` whole examples, its
    position_ids restarting at each and its `seq_lens` the examples' lengths, which the Trainer
    turns into the block mask on the device (training/packed.py: [rows, 1, block, block] in the
    compute dtype, and attention that takes a mask). Full blocks: the peak."""
    def batch(size: int) -> dict:
        rows = dict(base.batch(size))
        ids = rows["input_ids"]
        width = ids.shape[1]
        lengths = [width // examples] * (examples - 1)
        lengths.append(width - sum(lengths))
        starts = [sum(lengths[:k]) for k in range(examples)]
        labels = ids.clone()
        labels[:, starts] = IGNORE_INDEX  # nothing in an example predicts its first token
        seq_lens = torch.zeros(size, width, dtype=torch.long)
        seq_lens[:, :examples] = torch.tensor(lengths)
        positions = torch.cat([torch.arange(n) for n in lengths])
        return {**rows, "labels": labels, "position_ids": positions.repeat(size, 1),
                "seq_lens": seq_lens}

    return dataclasses.replace(base, batch=batch,
                               name=f"{base.name}, SFT examples packed {examples} to a block")


def plan(step: StepModel, args, target: str, target_bytes: int, *, accelerator,
         time_budget: float = 90.0) -> Plan:
    """The peak per rank of one step of the run `args` describes, and, when it does not fit, the
    cheapest changes that make it fit (each traced; none started that would not end within
    `time_budget` seconds, judging by the plan's own trace)."""
    from ...accelerators.registry import target_dist_backend, target_is_host

    start = time.perf_counter()
    ranks = args.devices * args.num_nodes
    backend = target_dist_backend(target)

    def trace(step_now: StepModel, args_now) -> Trace:
        return trace_step(step_now, args_now, accelerator, backend=backend)

    traced = trace(step, args)
    result = Plan(traced.peak_bytes, target, target_bytes, traced.breakdown, ranks,
                  notes=_notes(traced, args, target), moe=traced.moe, vision=traced.vision,
                  fp8=_fp8(args, target))
    if result.fp8 is not None:
        result.notes.append(result.fp8["note"])
    refused = _fsdp_refused(args)  # lazy mode: the run answers for itself, fsdp is not offered
    if refused and ranks > 1:
        result.notes.append(f"fsdp is not among the changes ({refused})")
    if not result.fits:
        changes = list(_changes(step, args, offload=not target_is_host(target),
                                fsdp=refused is None))
        # a trace is not started unless one as long as the plan's own would end in the budget
        deadline = start + time_budget - (time.perf_counter() - start)
        result.suggestions = _suggestions(changes, step, args, trace, target_bytes, deadline)
    result.seconds = time.perf_counter() - start
    return result


@dataclass
class StepTrace(Trace):
    """A traced step (plan_tracking.Trace) and the device kernels its model ran with."""

    kernels: dict[str, int] = field(default_factory=dict)
    moe: object | None = None
    vision: object | None = None


def trace_step(step: StepModel, args, accelerator, fake: bool = True,
               backend: str | None = None) -> StepTrace:
    """One training step of `args` traced (on fake tensors, or real ones to measure); `backend`
    is the communication backend the planned run would use (what its collectives copy)."""
    ranks = args.devices * args.num_nodes
    sharded = args.strategy == "fsdp" and ranks > 1
    expert_parallel = _expert_parallel_size(args) > 1
    torch.manual_seed(args.seed)
    with torch.device("meta") if fake else contextlib.nullcontext():
        model = step.build(step.lora)  # on the meta device: shapes only, nothing read
        layout = _layout(model, args)  # the whole model's, before any split
        if expert_parallel:
            _check_expert_parallel(model, args, ranks)
        reference = _frozen(step.reference(step.lora) if step.reference else None, args,
                            accelerator, like_trained=step.grpo is not None)
    mode = _fake_mode() if fake else contextlib.nullcontext()
    # the kinds' stand-ins (a mixture of experts': grouped_mm's shapes, the expert-parallel split)
    kinds = _entered([c for kind in registered() for c in kind.plan_tracing(args, fake)])
    images = getattr(step.vision, "tracing", None)  # an image step's (kinds/vlm/plan.py)
    images = images() if fake and images else contextlib.nullcontext()
    grouped = (sharded or expert_parallel) and ranks > 1
    group_of = _fake_group(ranks) if grouped else contextlib.nullcontext()
    with group_of as group, mode, kinds, images:
        if fake:  # fake tensors of the meta ones' shapes: ops run, nothing is allocated
            for module in filter(None, (model, reference)):
                module.to_empty(device="cpu")
                _tie_again(module)
        prepared, optimizer, precision, clip, strategy = _prepare(model, args, group, accelerator)
        model = prepared.model
        if reference is not None and not fake:
            reference = strategy.place_frozen(reference, torch.device("cpu"))
        elif reference is not None and sharded:  # as place_frozen does; fake tensors cannot
            strategy._shard(reference)  # be moved (.to), and are where the trace runs already
        # the method's own loss (its Objective's), else the model's, called as the Trainer calls it
        loss_fn = (step.objective(reference, model, sharded, args) if step.objective
                   else _model_loss(prepared, args, accelerator))
        _warm_up(optimizer, clip)
        batch = step.batch(args.per_device_train_batch_size)
        inputs = [v for v in _values(batch) if isinstance(v, torch.Tensor)]
        layout = layout and layout.with_tokens(_tokens(batch))
        backend = args.ddp_backend or backend
        counting = tracker(model, optimizer, sharded, inputs, backend=backend,
                           offloaded=args.fsdp_cpu_offload, frozen=reference)
        replicated = args.strategy in ("ddp", "fast_ddp", "auto") and ranks > 1  # auto: ddp
        copies = BucketCopies(counting, model, args.ddp_bucket_cap_mb, args.strategy)
        unpacked = _unpacked_rows(batch) if fake else contextlib.nullcontext()
        with counting, unpacked:
            with precision.forward_context():
                loss = loss_fn(prepared.wrapped, batch)
            if replicated and reduces_in_a_copy(backend):
                copies.install()
            loss.backward()
            copies.end_of_backward()
            clip()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        share = getattr(step.vision, "share", None)  # an image-text-to-text step's (kinds/vlm/plan.py)
        traced = StepTrace(**dataclasses.asdict(breakdown(counting)), kernels=prepared.kernels,
                           moe=layout, vision=share and share(model, counting, batch, ranks))
    if replicated:  # the gradient buckets: a flat copy of the trainable gradients, throughout
        split = {id(p) for p in getattr(strategy, "expert_params", ())}  # not DDP's: see ExpertParallel
        buckets = sum(p.numel() * p.element_size() for p in model.parameters()
                      if p.requires_grad and id(p) not in split)
        traced.breakdown["temporary"] += buckets
        traced.peak_bytes += buckets
    for category, nbytes in (step.held(model, args, precision) if step.held else {}).items():
        traced.breakdown[category] = traced.breakdown.get(category, 0) + nbytes
        traced.peak_bytes += nbytes
    return traced


def _prepare(model, args, group, accelerator):
    """(Prepared, optimizer, precision, clip, strategy): the model prepared by the Trainer's own
    training/prepare.py (kernels, precision, checkpointing, fsdp's sharding on `group` when there
    is one), then AdamW; `clip()` clips the gradients as the Trainer does (a no-op without
    max_grad_norm). The step is traced eagerly: graph capture and compilation are left out."""
    settings = Sections.of(args)
    precision = select_precision(settings.precision, AcceleratorConfig(), accelerator)
    strategy = Strategy()  # ddp: one process's step (its gradient buckets are added after)
    if group is not None and args.strategy == "fsdp":
        from ...distributed.fsdp import FSDP

        strategy = FSDP(group, settings.parallelism, precision)
        strategy.device = torch.device("cpu")  # where the trace runs (nothing is placed: fake)
    if group is not None:  # the kinds' layouts around it, as selected (the experts split)
        for kind in registered():
            strategy = kind.parallel(strategy, settings.parallelism, group)
    prepared = prepare_model(model, args, settings, accelerator=accelerator, precision=precision,
                             strategy=strategy, device=None, capture=False)
    model = prepared.model
    optimizer = create_optimizer(model, settings.optimizer, AcceleratorConfig(), accelerator)

    def clip() -> None:  # the norms' temporaries
        if args.max_grad_norm > 0:
            params = [p for p in model.parameters() if p.requires_grad]
            strategy.clip_grad_norm(accelerator, params, args.max_grad_norm)

    return prepared, optimizer, precision, clip, strategy


def _model_loss(prepared, args, accelerator):
    """The model's own loss as the Trainer's step takes it (Trainer._forward): a mixture of
    experts' router loss computed beside the model by kinds/moe/router.py, the model called with
    `output_router_logits=False`. transformers' own, inside the forward, takes a 2-D padding mask
    only: on a packed block's 4-D mask it ended the plan in a traceback. The router's counts are
    summed over no other rank here (a process group of one): E + 1 numbers, whatever the world."""
    from ...distributed.group import ProcessGroup

    router = model_extras(prepared.model, args, ProcessGroup(0, 0, 1, accelerator.dist_backend),
                          prepared.inputs)

    def loss(module, batch):
        with router.recording(token_mask(batch)):
            output = prepared.forward(module, batch, **router.forward_kwargs)
        return router.add_aux_loss(loss_of(output))

    return loss


def _frozen(reference, args, accelerator, like_trained: bool = False):
    """A frozen model as DPOTrainer (GRPOTrainer: `like_trained`) prepares its reference
    (Precision.convert_frozen). Done while its weights are meta tensors: a fake tensor's dtype
    cannot be changed in place."""
    if reference is None:
        return None
    precision = select_precision(Sections.of(args).precision, AcceleratorConfig(), accelerator)
    return precision.convert_frozen(reference, like_trained)


def _notes(traced: StepTrace, args, target: str) -> list[str]:
    """What the plan says of how its trace stood in for the run: the kernels are this machine's
    (the target's own, FusedSDPA on Gaudi, cannot run here), and a compiled or graph-captured
    step is traced as the eager one."""
    from ...accelerators.registry import target_is_host
    from ...execution.kernels import describe

    notes = []
    if traced.kernels:
        notes.append(f"kernels {describe(traced.kernels)}"
                     + ("" if target_is_host(target) else f" (this machine's, for {target}'s)"))
    if args.use_graphs_for_training or args.torch_compile or args.execution_mode == "compile":
        notes.append("the compiled step planned as the eager one")
    return notes


def _fp8(args, target: str) -> dict | None:
    """With fp8, how the target runs it: on fp8 matrix units (a speed-up, with their published
    peak over bf16's where known), emulated (the CPU: no speed-up, and the plan says so), or not
    at all (an A100). The same fp8 layers' memory is traced in each case."""
    if not args.fp8:
        return None
    from ...accelerators.registry import target_fp8, target_fp8_peak_gain
    from ...execution.fp8 import emulated

    kind, gain = target_fp8(target), target_fp8_peak_gain(target)
    if kind == "native":
        note = (f"fp8 counted as a speed-up on {target}: its fp8 matrix units"
                + (f" (peak {gain:.1f}x bf16's)" if gain else ""))
    elif kind == "emulated":
        note = f"fp8 counted as no speed-up on {target}, where it is {emulated(target)}"
    else:
        note = (f"fp8 counted as no speed-up on {target}: it has no fp8 matrix units (a run "
                "there refuses fp8)")
    return {"runs": kind, "speedup": kind == "native",
            "peak_vs_bf16": gain and round(gain, 2), "note": note}


def _warm_up(optimizer, clip) -> None:
    """The step after the first, as every later step is: the optimizer's states exist (one step
    on zero gradients creates them, cheaper than a first forward and backward), and the clipping
    and optimizer operations on sharded (DTensor) gradients have had their sharding propagated.
    DTensor caches that propagation after an operation's first call; the first call computes it
    on placeholder tensors in the fake mode that is active, which a tracker around it would
    count as memory (20 MiB of phantom activations in a 10 MiB model's first plan)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    clip()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _suggestions(changes, step: StepModel, args, trace, target_bytes: int,
                 deadline: float) -> list[dict]:
    """Each change alone, cheapest first; if none fits, the changes one on top of the other until
    they fit. Each traced (`trace(step, args)`); none started after `deadline`. The fitting ones
    come first, in order of cost: the first is the cheapest change that fits."""
    found = []
    for label, flags in changes:
        if time.perf_counter() > deadline:
            break
        try:
            traced = trace(*_apply(step, args, flags))
        except InputError:  # a change the run's other settings refuse (GRPO's generation batch)
            continue
        if traced.host_bytes:  # offload needs the host to hold it, per device, all steps long
            label += f" ({traced.host_bytes / 2**30:,.1f} GiB of host memory a device)"
        found.append({"change": label, "flags": flags, "peak_bytes": traced.peak_bytes,
                      "fits": traced.peak_bytes <= target_bytes})
    if not any(s["fits"] for s in found):
        step_now, args_now, labels, all_flags = step, args, [], []
        for label, flags in changes:
            if time.perf_counter() > deadline:
                break
            try:
                step_now, args_now = _apply(step_now, args_now, flags)
            except InputError:  # refused on top of the others: left out
                continue
            labels.append(label)
            all_flags += flags
            if len(labels) == 1:
                continue  # traced alone above
            try:
                peak = trace(step_now, args_now).peak_bytes
            except InputError:
                continue
            found.append({"change": " + ".join(labels), "flags": list(all_flags),
                          "peak_bytes": peak, "fits": peak <= target_bytes})
            if peak <= target_bytes:
                break
    return sorted(found, key=lambda s: not s["fits"])  # stable: cost order within each


def _changes(step: StepModel, args, offload: bool, fsdp: bool = True):
    """(label, flags) of each change that would lower the peak, cheapest first: the same
    training on the same devices before more devices, and more devices before a different
    training (LoRA). cpu offload only where the device has a host to offload to; none of fsdp's
    where the run's settings refuse it (lazy mode: `fsdp` False), and then no more devices
    either (under ddp each rank's peak does not fall with more of them)."""
    ranks = args.devices * args.num_nodes
    if args.strategy != "fsdp" and ranks > 1 and fsdp:
        yield f"fsdp over the {ranks} devices", ["--strategy", "fsdp"]
    if not args.gradient_checkpointing:
        yield "gradient checkpointing", ["--gradient-checkpointing"]
    if args.per_device_train_batch_size > 1:
        smaller = max(1, args.per_device_train_batch_size // 2)
        accumulate = args.gradient_accumulation_steps * args.per_device_train_batch_size // smaller
        yield (f"micro-batch {smaller} with {accumulate} accumulation steps (the same global "
               "batch)", ["--per-device-train-batch-size", str(smaller),
                          "--gradient-accumulation-steps", str(accumulate)])
    if not fsdp:
        yield from _lora(step)
        return
    if offload and ranks > 1 and not args.fsdp_cpu_offload:
        yield ("fsdp with the parameters, gradients and optimizer state in host memory",
               ["--strategy", "fsdp", "--fsdp-cpu-offload"])
    for more in (2, 4):
        nodes = args.num_nodes * more
        yield (f"fsdp over {ranks * more} devices ({nodes} nodes of {args.devices})",
               ["--strategy", "fsdp", "--num-nodes", str(nodes)])
    yield from _lora(step)


def _fsdp_refused(args) -> str | None:
    """Why the run's own settings refuse fsdp (TrainingArguments' line: lazy mode, context
    parallelism, HPU graphs), or None where they take it or use it already."""
    if args.strategy == "fsdp":
        return None
    try:
        dataclasses.replace(args, strategy="fsdp")
    except InputError as error:
        return str(error)
    return None


def _lora(step: StepModel):
    if step.lora_possible and not step.lora:
        yield "LoRA adapters (r 16) instead of every weight", ["--lora-r", "16"]


def _apply(step: StepModel, args, flags: list[str]):
    """(step, args) with the change `flags` describe."""
    values, lora = {}, step.lora
    for name, value in zip(flags, flags[1:] + [None]):
        if name == "--gradient-checkpointing":
            values["gradient_checkpointing"] = True
        elif name == "--fsdp-cpu-offload":
            values["fsdp_cpu_offload"] = True
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

def _tie_again(module) -> None:
    """Weights a model ties (its input embedding and output head: Gemma's, small Llamas' and
    Qwens') tied again after `to_empty`, which gives each module its own fake tensor (a fake
    tensor cannot replace a meta one in place): untied, the plan counted the vocabulary's
    weights, gradients and moments twice."""
    tie = getattr(module, "tie_weights", None)
    if callable(tie):
        tie()


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


@contextlib.contextmanager
def _unpacked_rows(batch):
    """A batch of rows that are one sequence each (no attention mask, no examples packed), as
    transformers finds it in the run: it reads the position ids to tell (a sequence restarting
    inside a row is packed), and on fake tensors, which it cannot read, takes the rows as
    packed and builds a full block mask (and, for sdpa with a mask, repeats the key/value heads)
    that the run never holds: 10% of a tiny mixture of experts' peak."""
    try:
        from transformers import masking_utils
    except ImportError:
        masking_utils = None
    keys = batch.keys() if isinstance(batch, dict) else ()
    if masking_utils is None or {"attention_mask", "seq_lens", "position_ids"} & set(keys):
        yield
        return
    found = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = found


def _layout(model, args):
    """The first registered kind's plan layout of `model` (ModelKind.plan_layout), or None."""
    return next((found for kind in registered() if (found := kind.plan_layout(model, args)) is not None),
                None)


@contextlib.contextmanager
def _entered(contexts):
    """`contexts` entered in order (and left in reverse), as one context."""
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def _expert_parallel_size(args) -> int:
    return int(getattr(args, "expert_parallel_size", 1) or 1)


def _check_expert_parallel(model, args, ranks: int) -> None:
    """The run's one-line refusals of its kinds' layouts (an expert-parallel one: the model's
    experts, the world)."""
    config = getattr(model, "config", None)
    settings = Sections.of(args).parallelism
    for kind in registered():
        kind.check_layout(settings, ranks, config, getattr(config, "_name_or_path", "") or "the model")


def _tokens(batch) -> int:
    """The tokens of a micro-batch (its input ids' elements)."""
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    return int(ids.numel()) if isinstance(ids, torch.Tensor) else 0


def _values(batch):
    return batch.values() if isinstance(batch, dict) else batch
