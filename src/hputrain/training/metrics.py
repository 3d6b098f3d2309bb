"""Ready compute_metrics functions: `Trainer(..., compute_metrics=metrics.accuracy)`.

Each takes the evaluation's prediction (transformers.EvalPrediction or evaluation.py's tuple of
the same fields: the logits and the label ids of the whole evaluation set, numpy arrays) and
returns {"accuracy": float}; the trainer records it as eval_accuracy. Labels of -100 (padding,
prompt tokens) are left out, as the loss leaves them out.
"""
from __future__ import annotations

import numpy as np

from ..errors import InputError
from .loss import IGNORE_INDEX


def accuracy(eval_pred) -> dict:
    """A classifier's: the argmax of its logits (batch, classes) against the labels (batch,)."""
    predictions, labels = _arrays(eval_pred)
    if predictions.ndim == labels.ndim + 1:  # logits: the class is the largest
        predictions = predictions.argmax(-1)
    return {"accuracy": _share_equal(predictions, labels)}


def token_accuracy(eval_pred) -> dict:
    """A causal language model's: the token predicted at position t (argmax of the logits,
    (batch, length, vocabulary)) against the label at t + 1, the shift the model's own loss
    makes."""
    logits, labels = _arrays(eval_pred)
    if logits.ndim != 3 or labels.ndim != 2:
        raise InputError(f"token_accuracy needs logits (batch, length, vocabulary) and labels (batch, "
                         f"length), got shapes {logits.shape} and {labels.shape}: use accuracy for a "
                         "classifier")
    return {"accuracy": _share_equal(logits[:, :-1].argmax(-1), labels[:, 1:])}


def _arrays(eval_pred) -> tuple[np.ndarray, np.ndarray]:
    predictions, labels = eval_pred  # EvalPrediction unpacks as (predictions, label_ids)
    if isinstance(predictions, tuple):  # a model that returns more than logits: the first
        predictions = predictions[0]
    if labels is None:
        raise InputError("accuracy needs labels: the evaluation batches have no 'labels'")
    return np.asarray(predictions), np.asarray(labels)


def _share_equal(predictions: np.ndarray, labels: np.ndarray) -> float:
    counted = labels != IGNORE_INDEX
    total = int(counted.sum())
    if total == 0:
        raise InputError("accuracy found no label other than -100 in the evaluation set")
    return float(((predictions == labels) & counted).sum() / total)
