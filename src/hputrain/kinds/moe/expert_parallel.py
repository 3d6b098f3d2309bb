"""Expert parallelism: a mixture-of-experts model's experts split over `size` ranks of the
data-parallel group (docs/moe.md).

The layout (torchtitan's EP borrows its ranks from data parallelism the same way): the world's
ranks form a (ep_replicate, ep) grid, row-major, so that an expert-parallel group is `size`
consecutive ranks (one node, where they can be). Rank r of a group keeps experts
[r·E/size, (r+1)·E/size) of every experts module; the ranks with the same place in every group
(an ep_replicate group) hold the same experts. Tokens travel to the rank that owns their expert
and back by all-to-all (kinds/moe/experts/parallel.py, the forward registered as EXPERT_PARALLEL
in transformers' ExpertsInterface); everything else in the model is data-parallel as before.

Gradients. Every rank's loss is its share of the global batch's mean times the world size, and
the strategies average gradients over all ranks. The gradient an expert gets in backward already
sums the tokens of every rank of its expert-parallel group (the all-to-all's backward brings them
home), so it must not be averaged over that group again: it is summed over its ep_replicate group
and divided by the world size, which is one process's gradient on the global batch. The global
gradient norm adds the experts' squares over the expert-parallel group.

Checkpoints: each experts parameter is seen by DCP as a DTensor of the whole (E, ...) shape,
Shard(0) over the "ep" dimension (`global_views` / `local_values`), so that a checkpoint written
with one expert-parallel size resumes with another.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ...errors import InputError
from . import experts_and_top_k
from ...distributed.strategies import Strategy

#: The name of the expert-parallel forward in transformers' ExpertsInterface
#: (registered by kinds/moe/experts/parallel.py).
EXPERT_PARALLEL = "hputrain_expert_parallel"
#: The attribute under which an experts module carries its ExpertShard.
SHARD_ATTRIBUTE = "hputrain_expert_shard"
#: Families whose experts do not go through the ExpertsInterface (Llama 4's MoE block).
_UNSPLIT_FAMILIES = ("llama4",)


@dataclass(eq=False)
class ExpertShard:
    """One experts module's share on this rank, and the groups its tokens travel in."""

    num_experts: int
    """The model's routed experts (the router's choices)."""
    size: int
    """Ranks of the expert-parallel group."""
    rank: int
    """This rank's place in it: it holds experts [rank·local, (rank+1)·local)."""
    group: object
    """The expert-parallel process group (the device's backend): the all-to-all's."""
    host_group: object
    """The same ranks on Gloo: the token counts each rank sends (host integers, no device sync)."""
    inner: str
    """The experts implementation that computes this rank's experts (ExpertsInterface name)."""
    once_a_forward: object = None
    """The model's OnceAForward: the exchange's sizes agreed once a forward of the whole model
    (None: by each layer)."""

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.size


def check_expert_parallel(size: int, world_size: int, *, config=None, model_name: str = "the model",
                          context_parallel_size: int = 1, strategy: str = "auto") -> None:
    """The one-line refusals of an expert-parallel layout, before any process starts or any weight
    is read: `config` is the model's (None: not known yet)."""
    if size == 1:
        return
    if context_parallel_size > 1:
        raise InputError(f"expert_parallel_size={size} with context_parallel_size="
                         f"{context_parallel_size} is not supported: the experts are split over "
                         "data-parallel ranks; use one of the two")
    if size > world_size or world_size % size:
        raise InputError(f"expert_parallel_size={size} must divide the {world_size} process"
                         f"{'es' if world_size != 1 else ''} of the run (devices × num_nodes)")
    if strategy in ("single", "fast_ddp"):
        raise InputError(f"expert_parallel_size={size} runs with strategy ddp or fsdp, not "
                         f"{strategy!r}")
    if config is None:
        return
    experts = (experts_and_top_k(config) or (None,))[0]
    if experts is None:
        raise InputError(f"expert_parallel_size={size} splits a mixture-of-experts model's experts, "
                         f"and {model_name} ({getattr(config, 'model_type', '?')}) has none: set "
                         "expert_parallel_size=1")
    if experts % size:
        raise InputError(f"{model_name} has {experts} experts, which expert_parallel_size={size} "
                         f"does not divide: choose a divisor of {experts}")
    if str(getattr(config, "model_type", "")).startswith(_UNSPLIT_FAMILIES):
        raise InputError(f"expert_parallel_size={size}: {model_name} ({config.model_type}) keeps its "
                         "experts outside transformers' ExpertsInterface, which expert parallelism "
                         "replaces; set expert_parallel_size=1")


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules that go through transformers' ExpertsInterface (those it gives an
    expert-parallel flag), by name."""
    return [(name, module) for name, module in model.named_modules()
            if hasattr(module, "_is_expert_parallel") and isinstance(getattr(module, "num_experts", None), int)]


def _unsupported_experts(model: nn.Module) -> str | None:
    """The class of experts that hold 3-D expert weights but do not go through the interface
    (Llama 4's), which the expert-parallel forward cannot replace."""
    for module in model.modules():
        if (isinstance(getattr(module, "num_experts", None), int) and not hasattr(module, "_is_expert_parallel")
                and any(p.dim() == 3 for p in module.parameters(recurse=False))):
            return type(module).__name__
    return None


@dataclass(frozen=True)
class ExpertLayout:
    """The expert-parallel groups of this rank (built once, by every rank, in the same order)."""

    size: int
    rank: int
    """This rank's place in its expert-parallel group."""
    group: object
    host_group: object
    replicate_group: object
    """The ranks that hold the same experts (None when there is one group)."""
    mesh: object
    """The (ep_replicate, ep) DeviceMesh: the "ep" dimension is what checkpoints shard over."""

    @classmethod
    def build(cls, size: int, device_type: str) -> ExpertLayout:
        from torch.distributed.device_mesh import init_device_mesh

        world, rank = dist.get_world_size(), dist.get_rank()
        mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("ep_replicate", "ep"))
        host = None
        for first in range(0, world, size):  # every rank makes every group, in the same order
            made = dist.new_group(list(range(first, first + size)), backend=dist.Backend.GLOO)
            if first <= rank < first + size:
                host = made
        replicate = mesh["ep_replicate"].get_group() if world > size else None
        return cls(size, rank % size, mesh["ep"].get_group(), host, replicate, mesh)


def split_experts(model: nn.Module, layout: ExpertLayout, capacity_factor: float | None = None) -> list[nn.Parameter]:
    """Keep this rank's experts in every experts module of `model` (each parameter whose first
    dimension is the experts'), switch the modules to the expert-parallel forward, have the
    module that holds them all agree on the exchange's sizes once a forward (OnceAForward;
    `capacity_factor`: the buffers' rows over the average, None: kinds/moe/experts/sizes.py's),
    and return the experts' parameters (kept out of the data-parallel reduction)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS


    if EXPERT_PARALLEL not in ALL_EXPERTS_FUNCTIONS:
        raise RuntimeError("the expert-parallel forward is not registered with transformers: call "
                           "hputrain.kinds.moe.experts.parallel.register() (the Trainer's set-up does)")
    found = experts_modules(model)
    if not found:
        other = _unsupported_experts(model)
        raise InputError(f"expert_parallel_size={layout.size}: "
                         + (f"{other} do not go through transformers' ExpertsInterface, which "
                            "expert parallelism replaces; set expert_parallel_size=1" if other else
                            f"{type(model).__name__} has no experts to split; set expert_parallel_size=1"))
    wrapped = {id(getattr(module, "base_layer", None)) for module in model.modules()}
    adapted = [name for name, experts in found if id(experts) in wrapped]
    if adapted:  # PEFT's target_parameters: its adapters hold every expert's rows
        raise InputError(f"expert_parallel_size={layout.size} with LoRA adapters on the experts "
                         f"({adapted[0]}) is not supported: adapt attention and the dense layers, "
                         "or set expert_parallel_size=1")
    params, inners = [], {}
    once = OnceAForward(capacity_factor)
    for name, module in found:
        total = module.num_experts
        if total % layout.size:
            raise InputError(f"{name} has {total} experts, which expert_parallel_size={layout.size} "
                             "does not divide")
        local = total // layout.size
        first = layout.rank * local
        for leaf, param in list(module.named_parameters(recurse=False)):
            if param.dim() and param.shape[0] == total:
                kept = nn.Parameter(param.detach()[first:first + local].clone(),
                                    requires_grad=param.requires_grad)
                setattr(module, leaf, kept)
                params.append(kept)
        config = module.config  # often shared by every layer: its implementation read once
        inner = inners.setdefault(id(config), config._experts_implementation or "eager")
        shard = ExpertShard(total, layout.size, layout.rank, layout.group, layout.host_group, inner, once)
        setattr(module, SHARD_ATTRIBUTE, shard)
        module.num_experts = local  # what the local implementation sees; ids >= local are empty
        module._is_expert_parallel = True
        config._experts_implementation = EXPERT_PARALLEL
    agree_once_a_forward(_holder(model, [name for name, _ in found]), once)
    return params


def _holder(model: nn.Module, names: list[str]) -> nn.Module:
    """The innermost module that holds every experts module named (the decoder's body, whose
    forward runs them all), not a list of layers."""
    parts = names[0].split(".")[:-1] if len(names) == 1 else names[0].split(".")
    for name in names[1:]:
        other = name.split(".")
        while parts != other[:len(parts)]:
            parts.pop()
    while parts and isinstance(model.get_submodule(".".join(parts)), (nn.ModuleList, nn.ModuleDict)):
        parts.pop()
    return model.get_submodule(".".join(parts))


class OnceAForward:
    """The all-to-all's sizes of one forward of the whole model, agreed once for all its MoE layers
    (kinds/moe/experts/parallel.py, step 2, sizes them): one per model, shared by its experts
    modules' shards; the module holding them runs its forward through `run`
    (`agree_once_a_forward`)."""

    def __init__(self, factor: float | None = None) -> None:
        self.factor, self.rank = factor, 0  # factor: expert_capacity_factor (None: the default)
        self.attempting = False  # inside a first attempt of the body's forward
        self.tokens: int | None = None  # T agreed at this forward's first MoE layer, and its own
        self.own: int | None = None
        self.flag: torch.Tensor | None = None  # any pair past C on this rank, this forward

    def flag_past(self, past: torch.Tensor) -> None:
        self.flag = past if self.flag is None else self.flag | past

    def run(self, forward, args, kwargs):
        """The body's forward, run again on the exact path when some rank's pairs overflowed. A
        decode step with a key/value cache (which a second forward would extend twice) and a
        forward inside one agree layer by layer."""
        if self.attempting or kwargs.get("past_key_values") is not None:
            return forward(*args, **kwargs)
        self.attempting, self.tokens, self.flag = True, None, None
        try:
            out = forward(*args, **kwargs)
        finally:
            self.attempting = False
        flag, self.flag = self.flag, None
        if flag is None or not _any_rank(flag):
            return out
        del out  # before the second forward: its activations are not held beside the first's
        note_overflow("forwards", self.rank, "the forward ran again, each MoE layer sizing its "
                      "exchanges itself (--expert-capacity-factor sets the buffers' rows over the average)")
        return forward(*args, **kwargs)


def _any_rank(flag: torch.Tensor) -> bool:
    """Whether `flag` is set on any rank: one all-reduce over every rank (an fsdp forward run
    again gathers parameters from all of them), read back."""
    flag = flag.to(torch.int32).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def agree_once_a_forward(body: nn.Module, once: OnceAForward) -> None:
    """Run `body`'s forward (the module that holds every MoE layer) through `once`: its class
    becomes a subclass whose forward does (as fully_shard's does), so that a copy of the model
    keeps it, with its own OnceAForward, and no bound forward held elsewhere skips it."""
    setattr(body, ONCE_ATTRIBUTE, once)
    body.__class__ = _agreeing_class(type(body))


ONCE_ATTRIBUTE = "hputrain_once_a_forward"


@functools.cache
def _agreeing_class(cls: type) -> type:
    if getattr(cls, "_hputrain_agrees_once", False):
        return cls
    original = cls.forward

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        return getattr(self, ONCE_ATTRIBUTE).run(original.__get__(self), args, kwargs)

    # the same name and module: transformers looks conversions up by them (and takes a class
    # outside its package for custom code)
    return type(cls.__name__, (cls,), {"forward": forward, "_hputrain_agrees_once": True,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__})


#: Overflows of the all-to-all's buffers in this process: forwards run again, second exchanges.
OVERFLOWS = {"exchanges": 0, "forwards": 0, "said": 0}


def forwards_run_again() -> int:
    """How many model forwards ran again because some rank's pairs overflowed."""
    return OVERFLOWS["forwards"]


def note_overflow(kind: str, rank: int, what: str) -> None:
    """Count an overflow, and say the first (then every tenfold) on rank 0's stderr."""
    OVERFLOWS[kind] += 1
    count = OVERFLOWS["exchanges"] + OVERFLOWS["forwards"]
    if rank == 0 and count >= max(1, OVERFLOWS["said"] * 10):
        OVERFLOWS["said"] = count
        print(f"hputrain: expert parallelism: a rank had more pairs for one peer than the all-to-all's "
              f"rows; {what} ({OVERFLOWS['forwards']} forward(s) run again, "
              f"{OVERFLOWS['exchanges']} second exchange(s) so far)", file=sys.stderr, flush=True)


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The state-dict names of the experts' split parameters."""
    names = []
    for name, module in experts_modules(model):
        shard = getattr(module, SHARD_ATTRIBUTE, None)
        if shard is None:
            continue
        for leaf, param in module.named_parameters(recurse=False):
            if param.dim() and param.shape[0] == shard.local_experts:
                names.append(f"{name}.{leaf}" if name else leaf)
    return names


class ExpertParallel(Strategy):
    """Another strategy (ddp, fsdp) on the rest of the model, the experts split over the
    expert-parallel group (see the module docstring for their gradients)."""

    def __init__(self, inner: Strategy, group, size: int, seed: int = 0,
                 capacity_factor: float | None = None) -> None:
        self.inner, self.group, self.size = inner, group, size
        self.capacity_factor = capacity_factor  # the all-to-all's rows over the average (None: 1.25)
        self.seed = seed  # what a meta model's weights no source fills are drawn from (ddp)
        self.name = inner.name
        self.forward_is_collective = True  # every forward exchanges tokens with the group's ranks
        self.shards_state = True  # each rank writes its experts (DCP), which reshards on load
        self.layout: ExpertLayout | None = None
        self.expert_params: list[nn.Parameter] = []

    def __getattr__(self, name: str):
        """The inner strategy's other attributes (fsdp's settings), as `hputrain plan` reads them."""
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def device(self):
        return self.inner.device

    @device.setter
    def device(self, value) -> None:  # where fsdp materialises a meta model (the plan sets it)
        self.inner.device = value

    def place(self, model, device):
        """The experts split first, then the rest placed, so that no device ever holds every
        expert. A model on the meta device (the recipe's shard-by-shard loading) gets its
        storage here under ddp, each rank reading from its weight source only its own experts
        and the rest (fsdp materialises it after sharding, in `wrap`)."""
        from ...distributed.fsdp import materialise, on_meta, weight_source

        self._split(model)
        if not self.inner.shards_state and on_meta(model):
            materialise(model, device, self.seed, weight_source(model))
        return self.inner.place(model, device)

    def _split(self, model) -> None:
        """split_experts on this rank's layout (built once), and the views under which
        checkpoints and the weight source see each split parameter whole."""
        if self.layout is not None:
            return
        self.layout = ExpertLayout.build(self.size, self.group.mesh.device_type)
        self.expert_params = split_experts(model, self.layout, self.capacity_factor)
        sharded = self.inner.shards_state and self.group.distributed
        # checkpoint/host.py's STATE_VIEWS: the weight source's fill (and DCP) see each split
        # parameter whole; named again in `wrap`, after activation checkpointing's wrappers
        model.hputrain_state_views = ExpertViews(set(expert_parameter_names(model)), self.layout.mesh, sharded)

    def wrap(self, model):
        self._split(model)  # split in `place`, unless nothing was placed (`hputrain plan`)
        names = expert_parameter_names(model)  # as named now (activation checkpointing's wrappers)
        if self.inner.name == "ddp":  # DDP leaves these to reduce_gradients
            torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
        sharded = self.inner.shards_state and self.group.distributed
        if sharded:
            self._shard_experts(model)
        model.hputrain_state_views = ExpertViews(set(names), self.layout.mesh, sharded)
        wrapped = self.inner.wrap(model)
        # fsdp registers new (DTensor) Parameters in place of those split_experts made
        self.expert_params = [model.get_parameter(name) for name in names]
        return wrapped

    def _shard_experts(self, model) -> None:
        """fsdp: each experts module a unit of its own, sharded over the ranks that hold the same
        experts (along dimension 1: dimension 0 is the experts' split), its gradients averaged
        over them, then divided by the expert-parallel size in reduce_gradients (see the module
        docstring; Gloo has no pre-multiplied sum for a divide factor). The blocks' units, made
        next, leave its parameters to it (torchtitan's EP × FSDP layout)."""
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        from ...distributed.fsdp import mixed_precision_policy

        for _, module in experts_modules(model):
            fully_shard(module, mesh=self.layout.mesh["ep_replicate"],
                        reshard_after_forward=self.inner.reshard_after_forward,
                        shard_placement_fn=lambda param: Shard(1),
                        mp_policy=mixed_precision_policy(self.inner.compute_dtype))


    def place_frozen(self, model, device):
        """A frozen model keeps every expert (it runs them itself); one on the meta device is
        read whole from its weight source under ddp, as fsdp's place_frozen reads its shards."""
        from ...distributed.fsdp import materialise, on_meta, weight_source

        if not self.inner.shards_state and on_meta(model):
            materialise(model, device, self.seed, weight_source(model))
        return self.inner.place_frozen(model, device)

    def gradient_sync(self, module, sync):
        return self.inner.gradient_sync(module, sync)

    def reduce_gradients(self, model):
        self.inner.reduce_gradients(model)
        grads = [p.grad for p in self.expert_params if p.grad is not None]
        if self.inner.shards_state:  # fsdp averaged them over the replicas (_shard_experts)
            for grad in grads:
                _local(grad).div_(self.size)
            return
        world = dist.get_world_size()
        for grad in grads:  # summed over the ranks that hold the same experts, over all ranks
            if self.layout.replicate_group is not None:
                dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.layout.replicate_group)
            grad.div_(world)

    def clip_grad_norm(self, accelerator, parameters, max_norm, fused=None):
        """torch's clipping, with the global norm: the experts' squares summed over the
        expert-parallel group, the rest as every rank holds it."""
        parameters = [p for p in parameters if p.grad is not None]
        experts = {id(p) for p in self.expert_params}
        mine = [p.grad for p in parameters if id(p) in experts]
        rest = [p.grad for p in parameters if id(p) not in experts]
        device = _local(parameters[0].grad).device
        squares = _squares(mine, device)
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.layout.group)
        total = (squares + _squares(rest, device)).sqrt()
        coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            for grad in mine + rest:
                _local(grad).mul_(coefficient.to(_local(grad).dtype))
        return total


@dataclass(frozen=True)
class ExpertViews:
    """The split experts' parameters (and their optimizer state) as the whole (E, ...) tensors,
    Shard(0) over the "ep" dimension and the same on every ep_replicate rank: what a checkpoint
    saves, so that it resumes on another expert-parallel size (checkpoint/sharded.py)."""

    names: set
    mesh: object
    """The (ep_replicate, ep) mesh."""
    sharded: bool = False
    """Whether fsdp shards the parameters over ep_replicate (DTensors there), else plain."""

    def whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole tensor, as a DTensor over the mesh (no copy)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 2:
            return tensor
        over_replicas = tensor.placements[0] if isinstance(tensor, DTensor) else Replicate()
        shape = (tensor.shape[0] * self.mesh["ep"].size(), *tensor.shape[1:])
        return DTensor.from_local(_local(tensor), self.mesh, [over_replicas, Shard(0)], run_check=False,
                                  shape=torch.Size(shape), stride=_contiguous_stride(shape))

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """Back to what the model holds: fsdp's DTensor over ep_replicate, or a plain tensor."""
        from torch.distributed.tensor import DTensor

        if not isinstance(tensor, DTensor) or tensor.device_mesh.ndim != 2:
            return tensor
        if not self.sharded:
            return tensor.to_local()
        shape = (tensor.shape[0] // self.mesh["ep"].size(), *tensor.shape[1:])
        return DTensor.from_local(tensor.to_local(), self.mesh["ep_replicate"], [tensor.placements[0]],
                                  run_check=False, shape=torch.Size(shape), stride=_contiguous_stride(shape))


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of `grads` (a DTensor's over its whole mesh), in float32."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        total = total + norm * norm
    return total

