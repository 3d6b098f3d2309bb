"""Evaluation and prediction: the loops behind `Trainer.evaluate` and `Trainer.predict`, and
compute_metrics.

Every rank takes its share of the data set. evaluate() sums the loss on the device and reads it
back once, at the end; only with compute_metrics does it also bring each batch's logits and
labels to the host (they are large), gathered from every rank for compute_metrics, which every
rank then calls on the whole evaluation set.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import sys
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..data.batching import MicroBatches, to_device
from ..errors import InputError
from .loss import IGNORE_INDEX

LABEL_KEYS = ("labels", "label", "label_ids")
"""The batch keys compute_metrics takes label_ids from, the first present."""


@dataclass
class PredictionOutput:
    predictions: torch.Tensor | list
    label_ids: torch.Tensor | list | None
    metrics: dict


def loss_of(output) -> torch.Tensor:
    """The loss from a model's output: a tensor, a dict with "loss", or an object with `.loss`."""
    if isinstance(output, torch.Tensor):
        return output
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if loss is None:
        raise InputError("the model returned no loss: return a tensor, a dict with 'loss' or an "
                         "object with .loss, or pass compute_loss=")
    return loss


def maybe_loss(output):
    try:
        return loss_of(output)
    except InputError:
        return None


def logits_of(output) -> torch.Tensor:
    """The predictions in a model's output: its logits, or the output itself when a tensor."""
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor):
        raise InputError("the model's output has no logits to predict or compute metrics with: "
                         "return a dict with 'logits' (or an object with .logits) beside the loss")
    return logits


def label_ids_of(batch) -> torch.Tensor | None:
    if not isinstance(batch, dict):
        return None
    return next((batch[key] for key in LABEL_KEYS if key in batch), None)


@dataclass
class Evaluator:
    """What evaluate() and predict() work with, handed over by the Trainer (as torchtitan hands
    its Validator the model, the loss and the data): no reach into the Trainer itself."""

    model: torch.nn.Module
    """The model (put in eval mode for the duration)."""
    module: Callable[[], torch.nn.Module]
    """The module to call: the training wrapper, or captured graphs (use_graphs_for_inference)."""
    forward: Callable
    """(batch, module) -> the model's output."""
    compute_loss: Callable | None
    """The user's (module, batch) -> loss, or None for the loss in the model's output."""
    compute_metrics: Callable | None
    collate: Callable
    batch_size: int
    seed: int
    group: object
    """The ProcessGroup: this rank's share, and the sums and gathers over ranks."""
    lockstep: bool
    """Whether ranks must run in step (a strategy whose forward is a collective: fsdp, ddp)."""
    device: torch.device
    non_blocking: bool
    on_host: Callable
    """batch -> this rank's part of it on the host (its slice of each sequence under context
    parallelism), where its tokens are counted."""
    count_tokens: Callable
    device_scalar: Callable
    """(value, dtype) -> a number as a device tensor that compiles nothing new in lazy mode."""
    forward_context: Callable
    mark_step: Callable
    on_device: Callable
    """A context manager keeping the model on the device for the duration."""
    uncounted: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """Entered around the loss of a batch repeated only to keep this rank in step: a loss that
    sums metrics of its own (DPO's rewards) leaves that batch out of them, as eval_loss does."""

    def steps(self, dataset, loss: bool, output: bool):
        """The one batch loop of evaluate() and predict(): per batch of this rank's share, in eval
        mode and without gradients, a Step with the model's output (when asked for or needed for
        the loss) and the loss (the user's compute_loss, else the output's; when asked for). The
        caller holds `on_device()` and no_grad around it and what it does with the results."""
        with eval_mode(self.model):
            module = self.module()
            for batch, real in eval_batches(self, dataset):
                batch = self.on_host(batch)
                count = self.count_tokens(batch) if real else 0
                batch = to_device(batch, self.device, self.non_blocking)
                with self.forward_context(), (contextlib.nullcontext() if real else self.uncounted()):
                    out = (self.forward(batch, module)
                           if output or (loss and self.compute_loss is None) else None)
                    value = None
                    if loss:
                        value = (self.compute_loss(module, batch) if self.compute_loss is not None
                                 else loss_of(out))  # the mean over its counted tokens
                yield Step(batch, out, value, count, real)
                self.mark_step()


@dataclass
class Step:
    batch: dict | list | torch.Tensor
    output: object
    loss: torch.Tensor | None
    count: int
    """Counted tokens (0 for a batch repeated only to keep this rank in step)."""
    real: bool


@torch.no_grad()
def evaluate(evaluator: Evaluator, dataset) -> dict:
    """Mean loss over `dataset` weighted by counted tokens, its perplexity, and compute_metrics'
    results prefixed "eval_"."""
    collect = evaluator.compute_metrics is not None
    if collect and evaluator.group.cp_size > 1:
        raise InputError("compute_metrics under context parallelism is not supported: each rank "
                         "holds a slice of every sequence; evaluate with context_parallel_size=1")
    predictions, labels = [], []
    with evaluator.on_device():
        total = torch.zeros(2, dtype=torch.float64, device=evaluator.device)  # (sum of losses, tokens)
        for step in evaluator.steps(dataset, loss=True, output=collect):
            count = evaluator.device_scalar(step.count, torch.float64)
            total += torch.stack([step.loss.detach().double() * count, count])
            if collect and step.real:
                predictions.append(logits_of(step.output).float().cpu())
                if (label_ids := label_ids_of(step.batch)) is not None:
                    labels.append(label_ids.cpu())
        evaluator.group.all_reduce_sum(total)
        loss_sum, count = total.tolist()
    if count == 0:
        raise InputError("the evaluation set gave no batch with a counted token: evaluate on "
                         "at least one sample (with labels other than -100)")
    eval_loss = loss_sum / count
    metrics = {"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 50.0))}
    if collect:
        group = evaluator.group
        predictions, labels = gathered(group, predictions), gathered(group, labels)
        metrics.update(run_compute_metrics(evaluator.compute_metrics, predictions, labels))
    return metrics


@torch.no_grad()
def predict(evaluator: Evaluator, dataset) -> PredictionOutput:
    """Model outputs on `dataset` (this rank's share), with the loss when labels exist. Batches
    of different lengths are padded with -100 into one tensor, as the Hugging Face Trainer pads
    them; the loss is weighted by counted tokens, as in evaluate()."""
    predictions, labels, loss_sum, tokens = [], [], 0.0, 0
    with evaluator.on_device():
        for step in evaluator.steps(dataset, loss=False, output=True):
            if not step.real:  # a repeat that kept this rank in step with the others
                continue
            predictions.append(logits_of(step.output).float().cpu())
            if isinstance(step.batch, dict) and "labels" in step.batch:
                labels.append(step.batch["labels"].cpu())
                if (loss := maybe_loss(step.output)) is not None:
                    loss_sum, tokens = loss_sum + float(loss) * step.count, tokens + step.count
    metrics = {"test_loss": loss_sum / tokens} if tokens else {}
    return PredictionOutput(pad_and_concat(predictions), pad_and_concat(labels) if labels else None,
                            metrics)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """The model in eval mode for the duration, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def eval_batches(evaluator: Evaluator, dataset):
    """(batch, real) pairs of this rank's share. Under a strategy whose forward is a collective
    (fsdp gathers each block's weights, DDP broadcasts rank 0's buffers), ranks run in step: one
    that has run out of batches repeats its last one, not counted (real False), until every rank
    is done. A rank that would skip a forward its peers run would hang them."""
    group = evaluator.group
    batches = MicroBatches(dataset, evaluator.collate, evaluator.batch_size, 1, group.dp_rank,
                           group.dp_size, evaluator.seed, shuffle=False, drop_last=False).iterate(0, epochs=1)
    if not evaluator.lockstep:
        yield from ((batch, True) for batch in batches)
        return
    last = None
    while True:
        batch = next(batches, None)
        if not group.host_sum([batch is not None])[0]:
            return
        if batch is None and last is None:  # fewer samples than ranks: borrow one, uncounted
            if not hasattr(dataset, "__getitem__"):
                raise InputError("the evaluation set is too small to give every rank a batch "
                                 "(ranks evaluate in step under fsdp and ddp): evaluate on more "
                                 "samples")
            last = evaluator.collate([dataset[0]])
        last = batch if batch is not None else last
        yield last, batch is not None


def gathered(group, tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """This rank's per-batch host tensors and every other rank's, as one padded tensor (None
    when no rank has any). One all_gather_object over the host group: simple, and evaluation
    sets are small next to training."""
    if group.distributed:
        every = [None] * group.world_size
        dist.all_gather_object(every, tensors, group=group.host_group)
        tensors = [t for rank_tensors in every for t in rank_tensors]
    return pad_and_concat(tensors) if tensors else None


EvalPredictionTuple = namedtuple("EvalPrediction", ["predictions", "label_ids"])
"""transformers.EvalPrediction's fields, where transformers is not installed."""


def eval_prediction(predictions: np.ndarray, label_ids: np.ndarray | None):
    """transformers.EvalPrediction where the script already imported transformers (importing
    it only for this would take seconds), else a tuple with the same fields."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return EvalPredictionTuple(predictions, label_ids)
    return transformers.EvalPrediction(predictions=predictions, label_ids=label_ids)


def run_compute_metrics(compute_metrics, predictions: torch.Tensor, label_ids: torch.Tensor | None) -> dict:
    """compute_metrics on numpy arrays (as the Hugging Face Trainer gives them), called as
    `compute_metrics(eval_pred)` or, for a function of two parameters, `(predictions,
    label_ids)`; its results as floats, prefixed "eval_"."""
    predictions = predictions.numpy()
    label_ids = label_ids.numpy() if label_ids is not None else None
    if _positional_parameters(compute_metrics) == 2:
        results = compute_metrics(predictions, label_ids)
    else:
        results = compute_metrics(eval_prediction(predictions, label_ids))
    if not isinstance(results, dict):
        raise InputError(f"compute_metrics returned {type(results).__name__}: return a dict of "
                         "metric names to numbers")
    metrics = {}
    for name, value in results.items():
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise InputError(f"compute_metrics returned {name}={value!r}: every value must be "
                             "a number") from None
        metrics[name if str(name).startswith("eval_") else f"eval_{name}"] = value
    return metrics


def _positional_parameters(function) -> int | None:
    """How many positional parameters `function` requires (None when it cannot be told)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
               for p in parameters)


def pad_and_concat(tensors: list[torch.Tensor], pad: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-batch tensors as one, each padded with `pad` to the largest size in every dimension
    after the first (ragged sequence lengths across batches)."""
    if any(t.dim() != tensors[0].dim() for t in tensors):
        raise InputError(f"predict() got outputs of different ranks: {sorted({t.dim() for t in tensors})}")
    if tensors[0].dim() == 0:
        return torch.stack(tensors)
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for tensor in tensors:
        if list(tensor.shape[1:]) != shape:
            out = tensor.new_full((tensor.shape[0], *shape), pad)
            out[tuple(slice(0, size) for size in tensor.shape)] = tensor
            tensor = out
        padded.append(tensor)
    return torch.cat(padded)
