"""The model as a run prepares it, in one place: the Trainer calls `prepare_model`, and so does
`hputrain plan` (rehearsal/plan/__init__.py), which traces a step of the model prepared the same way. A
kernel, a precision or a strategy added here is then planned as it runs, with no second copy.

The order, each step before the next for a reason:

1. the device's kernels (execution/kernels.py): a module swap that keeps parameter names, made
   on the model as the user gave it, before anything looks at its modules; then the swaps of
   the model's kinds (models/kind.py's `prepare`): for an image-text-to-text model, the static
   image merge (kinds/vlm/execution.py: its image features
   merged without a count read back to the host, on blocks with padded image slots);
2. the precision's conversion (fp8 replaces Linear layers), then the model on this rank's device
   (a model on the meta device stays there: fsdp shards it before it materialises it); under
   expert parallelism the strategy's `place` first keeps this rank's experts, so that no device
   receives every expert, and under ddp fills a meta model from its weight source, each rank
   reading only its own experts (kinds/moe/expert_parallel.py);
3. activation checkpointing, before the strategy wraps the blocks it checkpoints;
4. the keyword inputs the forward takes, and PackedInputs, which turns a packed block's
   `seq_lens` into its block mask in the dtype attention computes in (known only now);
5. the strategy's wrap (DDP's wrapper, fast_ddp's broadcast, fsdp's sharding);
6. graph capture (use_graphs_for_training) or torch.compile (execution_mode="compile").
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..data.batching import model_input_names
from ..distributed.activation_checkpointing import apply_activation_checkpointing
from ..execution import kernels as device_kernels
from ..execution import modes as execution
from ..models.kind import kinds_of
from .packed import PackedInputs


@dataclass
class Prepared:
    """A model prepared for training (`prepare_model`)."""

    model: torch.nn.Module
    """What the optimizer steps and a checkpoint saves: converted, placed, checkpointed (under
    fsdp, sharded in place)."""
    wrapped: torch.nn.Module
    """What a training forward calls: the strategy's wrapper, maybe graph-captured or compiled."""
    kernels: dict[str, int]
    """The device kernels substituted, {"attention: sdpa": 2, ...} (execution/kernels.py)."""
    inputs: frozenset[str] | None
    """The keyword inputs the model's forward takes (None: it takes **kwargs only)."""
    packed: PackedInputs
    """A packed block's `seq_lens` -> its block mask, on the device (training/packed.py)."""
    contexts: tuple = ()
    """What makes the contexts each forward is called in, from the model's kinds (an
    image-text-to-text model's image merge told that the batch is hputrain's blocks:
    kinds/vlm/execution.static_batches)."""

    def forward(self, module: torch.nn.Module, batch, **loss_kwargs):
        """`module` (the wrapped model, or another view of it) on a batch: a dict by keyword (its
        packed mask built, only the keys the forward takes), with `loss_kwargs` (num_items_in_batch)
        for a model that takes them; a list or tuple by position; else the batch itself."""
        if isinstance(batch, dict):
            batch, inputs = self.packed(batch), self.inputs
            with contextlib.ExitStack() as stack:
                for context in self.contexts:  # an image model's blocks (kinds/vlm/execution.py)
                    stack.enter_context(context())
                return module(**{k: v for k, v in batch.items() if inputs is None or k in inputs},
                              **loss_kwargs)
        if isinstance(batch, (list, tuple)):
            return module(*batch)
        return module(batch)


def prepare_model(model: torch.nn.Module, args, settings, *, accelerator, precision, strategy,
                  device: torch.device | None, capture: bool = True) -> Prepared:
    """`model` prepared as a run of `args` (TrainingArguments; `settings` its Sections) prepares
    it, in the order of the module docstring. `capture=False` leaves out graph capture and
    compilation, `device=None` the placement (the plan's trace runs the step eagerly, on fake
    tensors, which are where it runs already and cannot be moved)."""
    if args.attention_recompute is not None:  # read by the attention kernel (Gaudi's FusedSDPA)
        accelerator.attention_recompute = args.attention_recompute
    with _real_tensors():
        kernels = device_kernels.substitute(model, accelerator, args.fused_kernels)
    # the kinds' swaps: the static image merge, the expert-parallel forward (models/kind.py)
    contexts = [kind.prepare(model, args) for kind in kinds_of(getattr(model, "config", None))]
    placed = precision.convert_module(model)
    if device is not None:
        placed = strategy.place(placed, device)
    apply_activation_checkpointing(placed, settings.activation_checkpointing)
    inputs = model_input_names(model)
    packed = PackedInputs(model, precision, inputs)
    wrapped = strategy.wrap(placed)
    if capture and args.use_graphs_for_training:
        wrapped = accelerator.wrap_graph_training(wrapped)
    elif capture and accelerator.execution_mode == "compile":
        wrapped = execution.compile_model(wrapped, settings.execution, accelerator)
    return Prepared(placed, wrapped, kernels, inputs, packed, tuple(filter(None, contexts)))


@contextlib.contextmanager
def _real_tensors():
    """Outside a fake-tensor mode, if one is active (hputrain plan's trace; a no-op in a run):
    the kernels check each RMSNorm they would swap on real numbers (an allclose, which a fake
    tensor cannot answer). The swap itself only moves Parameters between modules."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield
