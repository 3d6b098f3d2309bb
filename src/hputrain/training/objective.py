"""A training method as an objective the loop calls.

The loop (trainer.py) is the same for every method; what differs is asked of its `Objective`:
how samples become a batch (`collate`), what a step's loss is the mean of (`count_tokens`), the
loss of a batch (`compute_loss`), what each logging record adds (`metrics`), what is prepared
beside the model before training (`prepare`: DPO's precomputed reference), and where a step's
batches come from (`train_batches`: GRPO's rollouts). The base class is causal language
modelling, whose hooks leave the loop as it is: the model's own loss over its labels.

A method never reaches into the Trainer: at the end of the Trainer's set-up it is handed a
`Loop` (`bind`), the few handles it may use (the device, the process group, how to call the
model and under what context, how to place a frozen module), as the Evaluator is handed its own.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .loss import TokenCount
from .extras import ModelExtras, token_mask


@dataclass
class Loop:
    """What a method may use of the Trainer it runs in (handed over once, by `bind`)."""

    model: torch.nn.Module
    """The model as the user gave it (a PEFT model, a sharded module), on its device."""
    module: torch.nn.Module
    """What a training forward calls: the strategy's wrapper, maybe compiled."""
    device: torch.device
    group: object
    """The process group (distributed/group.py): ranks, all-reduces, barriers."""
    args: object
    """The run's TrainingArguments (or the method's config that extends it)."""
    accelerator: object
    precision: object
    sharded: bool
    """The policy is sharded (fsdp): its forward is a collective every rank must enter."""
    inputs: set | None
    """The keyword inputs the model's forward takes (None: it takes a tensor)."""
    forward_context: Callable[[], contextlib.AbstractContextManager]
    """What a forward runs under: the device's needs, context parallelism, autocast."""
    on_device: Callable[[], contextlib.AbstractContextManager]
    """The model on this rank's device for the duration (a no-op inside train())."""
    place_frozen: Callable[..., torch.nn.Module]
    """A frozen module (a reference) on the device in the policy's precision, sharded like it;
    `like_trained=True` keeps the policy's dtype too (Precision.convert_frozen)."""
    device_scalar: Callable[[float], torch.Tensor]
    """A number copied to the device as graph input data (no new lazy graph when it changes)."""
    router: ModelExtras = field(default_factory=ModelExtras)
    """The model's extra losses (training/extras.py: a mixture of experts' router): the logits of
    call_model's forwards recorded, so that the loop adds its load-balancing loss to the method's."""

    def call_model(self, module: torch.nn.Module, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, **extra) -> object:
        """`module` on token ids and their mask, without a key/value cache (a training forward)."""
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, **extra,
                  **self.router.forward_kwargs}
        if self.inputs is None or "use_cache" in self.inputs:
            inputs["use_cache"] = False
        with self.router.recording(token_mask({"attention_mask": attention_mask})):
            return module(**inputs)


class Objective:
    """Causal language modelling: the model's own loss, a mean over the step's counted tokens
    (loss.py). Every hook leaves the loop as it is; methods override what they need."""

    collate: Callable | None = None
    """The method's collator, which builds the model's inputs itself (every key kept); None means
    the data set's collator with the columns the model does not take dropped."""
    compute_loss: Callable | None = None
    """`(module, batch) -> loss`, a mean over the batch's counted units; None means the model's own
    loss over its labels."""
    has_perplexity = True
    """Whether exp(eval_loss) means something (not for a preference or policy loss)."""

    def bind(self, loop: Loop) -> None:
        """Called once, at the end of the Trainer's set-up."""
        self.loop = loop

    def count_tokens(self, model: torch.nn.Module):
        """What a step's loss is the mean of (loss.py's TokenCount: counted tokens)."""
        return TokenCount(model)

    def prepare(self, train_dataset, eval_dataset):
        """Before training, the model on its device: the data sets as training will read them."""
        return train_dataset, eval_dataset

    def train_batches(self, batches):
        """The source of the step's micro-batches (data.batching.MicroBatches, or one built on it)."""
        return batches

    def eval_dataset(self, dataset):
        """The evaluation set as evaluate() will read it."""
        return dataset

    def metrics(self, group, prefix: str = "") -> dict:
        """What a logging record adds, over the steps since the last one (every rank calls it)."""
        return {}

    @contextlib.contextmanager
    def evaluating(self):
        """Around an evaluation: metrics summed for training's next record are kept aside."""
        yield

    def state(self) -> dict:
        """The method's settings a checkpoint records (trainer_state.json), for resume_notes."""
        return {}

    def resume_notes(self, state: dict) -> list[str]:
        """One line for each recorded setting (`state`, a checkpoint's) a resumed run changes."""
        return []

    counting = True
    """False around a batch a rank repeats only to keep in step with its peers (`uncounted`): a
    method that sums metrics of its own leaves that batch out of them."""

    @contextlib.contextmanager
    def uncounted(self):
        """Around a batch a rank repeats only to keep in step with its peers: counts in no metric."""
        self.counting = False
        try:
            yield
        finally:
            self.counting = True


@contextlib.contextmanager
def adapters_disabled(model):
    """PEFT's `disable_adapter()` with every parameter's requires_grad left as it was. PEFT clears
    it on the adapters for the duration, but FSDP2 reads it at its first forward to choose the
    dtype of the gradients it reduces and hands back (a group with nothing trainable: none, so
    bf16 under mixed precision): a reference forward that comes first (a precomputed reference,
    or step 1's) would leave the float32 LoRA weights with bf16 gradients FSDP2 then refuses."""
    flags = [(param, param.requires_grad) for param in model.parameters()]
    try:
        with model.disable_adapter():
            for param, flag in flags:
                param.requires_grad_(flag)
            yield
    finally:  # PEFT's way back sets the active adapter's flags: the same ones, kept exact
        for param, flag in flags:
            param.requires_grad_(flag)
