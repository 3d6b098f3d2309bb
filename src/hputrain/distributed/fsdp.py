"""strategy="fsdp": PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`), one per transformer
block (blocks.py), one on the input embedding and one on the output head when they are not tied
(blocks.end_modules), and one on the root (the rest: the final norm, position embeddings), over
the mesh's data-parallel dimensions.

- the units around the blocks: the embedding is gathered for its forward and freed; its
  backward needs only the token ids, so it is not gathered again (set_unshard_in_backward).
  The head is gathered from its forward to its backward, the next thing to run, and its
  gradient is reduce-scattered and freed before the blocks' backward. A tied embedding and
  head (one matrix used first and last) stay in the root, gathered from forward to the end of
  backward. On a Llama with untied embeddings this takes the two vocabulary-sized matrices and
  their gradients out of what each rank holds gathered through the whole step (torchtitan wraps
  its models the same way).

- full_shard: parameters, gradients and optimizer state sharded over every data-parallel rank;
  each block's parameters are gathered for its forward and backward and freed after each
  (fsdp_reshard_after_forward=False, Hugging Face's shard_grad_op, keeps them from forward to
  backward: more memory, one all-gather less per block).
- hybrid_shard: sharded within a node, replicated across nodes (a dp_replicate × dp_shard mesh).
- bf16: FSDP2's MixedPrecisionPolicy, bf16 parameters for compute and fp32 gradient reduction,
  the fp32 shards staying the master weights the optimizer updates; autocast runs on top.
- A model whose parameters are on the meta device (or any model with fsdp_init_on_meta=True) is
  sharded first and materialised afterwards, one module at a time (see `materialise`). Its
  tensors that are already real (buffers computed in __init__, such as rotary frequencies;
  adapters PEFT drew) keep their values. A model that carries a *weight source*
  (`set_weight_source`: the recipe's explicit word on where its weights come from, e.g.
  checkpoint/hf_weights.py's FolderWeights) has its shards filled by it, each rank its own;
  what the source does not fill is drawn by replaying the modules' initialisation.

The gradients are DTensors sharded over the mesh: the trainer's clipping takes their global norm.
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from ..config.sections import ParallelismSettings
from ..errors import InputError
from .blocks import block_modules, end_modules
from .placement import move_to_device
from .strategies import Strategy


class FSDP(Strategy):
    """FSDP2 sharding of the model state; with one process, no sharding (a meta model is still
    materialised)."""

    name = "fsdp"
    shards_state = True
    forward_is_collective = True  # each block's weights are gathered from every rank

    def __init__(self, group, settings: ParallelismSettings, precision=None) -> None:
        self.group = group
        self.block_classes = settings.fsdp_block_classes
        self.reshard_after_forward = reshard_after_forward(settings)
        self.cpu_offload = settings.fsdp_cpu_offload
        self.init_on_meta = settings.fsdp_init_on_meta
        self.seed = settings.seed
        self.compute_dtype = getattr(precision, "compute_dtype", torch.float32)

    def place(self, model, device):
        """A model to be materialised after sharding stays where it is (on the meta device)."""
        if self.init_on_meta or on_meta(model):
            self.device = device
            return model
        return super().place(model, device)

    def wrap(self, model):
        meta = self.init_on_meta or on_meta(model)
        if self.init_on_meta and not on_meta(model):  # drop the eager weights: drawn again below
            move_to_device(model, torch.device("meta"))
        if self.group.distributed:
            self._shard(model)
        if meta:
            materialise(model, self.device, self.seed, weight_source(model))
        return model

    def place_frozen(self, model, device):
        """Sharded like the trained model (its forward gathers each block in turn), from the
        weights it has, or on the meta device, from its weight source: never drawn again as
        fsdp_init_on_meta does."""
        meta = on_meta(model)
        if not meta:
            model = move_to_device(model, device)
        if self.group.distributed:
            self._shard(model)
        if meta:
            materialise(model, device, self.seed, weight_source(model))
        return model

    def _shard(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = self.group.mesh  # hybrid_shard: replicate across nodes, shard within each
        mesh = mesh["dp_shard"] if self.group.dims.dp_replicate == 1 else mesh["dp_replicate", "dp_shard"]
        options = {"mesh": mesh,
                   "mp_policy": mixed_precision_policy(self.compute_dtype)}
        if self.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        blocks = block_modules(model, self.block_classes)
        if not blocks:
            raise InputError(f"strategy='fsdp' shards one transformer block at a time, but "
                             f"{type(model).__name__} has none hputrain can find: name their class "
                             "in fsdp_block_classes")
        embedding, head = end_modules(model, blocks)
        if embedding is not None:
            # Used first in forward and last in backward: gathered for its forward, freed, and
            # (a plain embedding's backward needs only the indices) never gathered in backward.
            fully_shard(embedding, reshard_after_forward=self.reshard_after_forward, **options)
            if _backward_needs_no_weights(embedding):
                embedding.set_unshard_in_backward(False)
        for index, block in enumerate(blocks):
            # The last block's parameters are gathered again at once by backward: keep them.
            last = index == len(blocks) - 1
            fully_shard(block, reshard_after_forward=self.reshard_after_forward and not last, **options)
        if head is not None:  # the last in forward, the first in backward: kept gathered between
            fully_shard(head, reshard_after_forward=False, **options)
        fully_shard(model, reshard_after_forward=False, **options)  # the root is used first in backward

    def gradient_sync(self, module, sync):
        # No reduce-scatter on the micro-batches before the step's last: gradients accumulate
        # unsharded in each block until then.
        if self.group.distributed:
            module.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def clip_grad_norm(self, accelerator, parameters, max_norm, fused=None):
        """torch's clipping on the DTensor gradients, whose norm is the global one; a device's
        fused kernel would take only this rank's shards."""
        norm = accelerator.clip_grad_norm(parameters, max_norm, fused=False)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _backward_needs_no_weights(module: nn.Module) -> bool:
    """A plain embedding (its one parameter the table; a subclass that scales its output by a
    constant too): its gradient comes from the indices alone. A LoRA embedding's adapters are
    needed in backward."""
    return isinstance(module, nn.Embedding) and [n for n, _ in module.named_parameters()] == ["weight"]


def reshard(model: nn.Module) -> None:
    """Every FSDP2 module of `model` back to its shards (nothing for a model that is not sharded).
    The root and the last block keep their gathered parameters from a forward to its backward
    (`_shard`); after a forward with no backward (a pass over the data before training) they would
    stay gathered, registered in the modules in place of the shards, and an optimizer built then
    would hold those gathered tensors, which never receive a gradient."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def reshard_after_forward(settings) -> bool:
    """fsdp_reshard_after_forward, else what the fsdp mode says (shard_grad_op: False)."""
    if settings.fsdp_reshard_after_forward is not None:
        return settings.fsdp_reshard_after_forward
    return settings.fsdp != "shard_grad_op"


def dp_shard_size(settings: ParallelismSettings, world_size: int) -> int:
    """The ranks that shard the model state between them: all data-parallel ranks, or with
    hybrid_shard those of one node (LOCAL_WORLD_SIZE, as the launcher sets it)."""
    dp = world_size // settings.context_parallel_size
    if settings.fsdp != "hybrid_shard":
        return dp
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or world_size // settings.num_nodes
    if per_node <= 0 or dp % per_node:
        raise InputError(f"fsdp='hybrid_shard' shards within a node of {per_node} processes, which "
                         f"does not divide the {dp} data-parallel ranks")
    rank, local = os.environ.get("RANK"), os.environ.get("LOCAL_RANK")
    if rank and local and int(local) != int(rank) % per_node:  # the mesh's node groups are blocks
        raise InputError(f"fsdp='hybrid_shard' shards within each node's block of {per_node} "
                         f"consecutive ranks, and rank {rank} is local rank {local} of its node: the "
                         "launcher placed the ranks round-robin over the nodes; place them in blocks "
                         "(mpirun --map-by slot, srun --distribution=block), or use full_shard")
    return per_node


def mixed_precision_policy(compute_dtype: torch.dtype):
    """FSDP2's policy for the precision plugin's compute dtype: fp32 throughout, or bf16
    parameters for compute with fp32 gradient reduction (fp8 computes inside bf16)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if compute_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


WEIGHT_SOURCE = "hputrain_weight_source"
"""The attribute under which a meta-device model carries its weight source (set_weight_source)."""


def set_weight_source(model: nn.Module, source) -> nn.Module:
    """Say where the weights of `model`, built on the meta device, come from: `source.fill(model)`
    is called once the model is sharded and has storage, writes this rank's part of each
    parameter it knows (by name: wrappers' name parts are the source's to ignore) and returns
    their names. It travels with the model (a PEFT wrapper forwards the attribute; a deep copy,
    DPO's reference, keeps it), as `init_steps` does for the built-in GPT."""
    setattr(model, WEIGHT_SOURCE, source)
    return model


def weight_source(model: nn.Module):
    """The weight source `model` carries, or None (its weights are drawn by `materialise`)."""
    return getattr(model, WEIGHT_SOURCE, None)


# -- meta-device initialisation ----------------------------------------------------------------------

def materialise(model: nn.Module, device: torch.device, seed: int, weights=None) -> None:
    """Give a (sharded) meta model storage on `device` and the weights an eager build draws after
    torch.manual_seed(seed), holding one module's full weights at a time.

    Tensors already real keep their values (buffers computed in __init__, adapters drawn on
    the CPU). `weights`, a weight source (set_weight_source), fills the parameters it knows,
    each rank its own part. The rest are drawn: the eager draws replayed in their order, each
    module's own `reset_parameters` in module order (what its constructor drew), then the
    model's `init_steps()` when it has them (the built-in GPT's re-initialisation). Each step
    runs on full CPU tensors of that module's parameters, made with the CPU generator exactly
    as eagerly; each rank keeps its shard."""
    # detached: to_empty may swap a parameter's .data in place, and these must keep the values
    kept = {name: _local(tensor).detach() for name, tensor in _named_tensors(model) if not tensor.is_meta}
    _to_empty(model, device)
    with torch.no_grad():
        for name, local in kept.items():
            _local(_tensor_of(model, name)).copy_(local)
    done = [*kept, *(weights.fill(model) if weights is not None else [])]
    done_ids = {id(_tensor_of(model, name)) for name in done}
    steps = [(m, type(m).reset_parameters) for m in model.modules()
             if callable(getattr(m, "reset_parameters", None)) and _own_parameters(m)
             and not all(id(p) in done_ids for p in _own_parameters(m).values())]
    steps += list(getattr(model, "init_steps", lambda: [])())
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for module, step in steps:
            _run_on_full_weights(module, step)
    for buffer in model.buffers():
        if buffer.is_meta:
            raise InputError(f"{type(model).__name__} has buffers on the meta device that hputrain "
                             "cannot initialise: build it eagerly, or without fsdp_init_on_meta")


def _to_empty(model: nn.Module, device: torch.device) -> None:
    """model.to_empty(device=device), a weight shared by two modules still shared after it."""
    shared: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    model.to_empty(device=device)
    for first, *others in shared.values():
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, model.get_parameter(first))


def _named_tensors(model: nn.Module):
    return [*model.named_parameters(), *model.named_buffers()]


def _tensor_of(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    return module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]


def _own_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    return dict(module.named_parameters(recurse=False))


def _run_on_full_weights(module: nn.Module, step) -> None:
    """`step(module)` with the module's own parameters swapped for full CPU tensors, then each
    parameter's shard of the result copied back into it."""
    params = _own_parameters(module)
    full = {name: torch.empty(p.shape, dtype=p.dtype) for name, p in params.items()}
    for name, tensor in full.items():
        setattr(module, name, nn.Parameter(tensor, requires_grad=False))
    try:
        step(module)
    finally:
        for name, param in params.items():
            setattr(module, name, param)  # the same Parameter: ties between modules stay
    for name, param in params.items():
        _local(param).copy_(_shard_of(full[name], param))


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def _shard_of(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full` as `param` (a DTensor, or a plain tensor) holds it."""
    if not hasattr(param, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    # every rank drew the same full tensor: each slices its own shard, no communication
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
