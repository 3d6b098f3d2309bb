"""Every training method and model kind, named once.

A method is a folder under methods/ (its config, data, objective, recipe, plan and doctor parts),
a model kind a folder under kinds/ (its family table, loading, execution swaps, parallel layout
and plan). The core (the loop, evaluation, packing, batching, checkpoints, execution modes,
strategies, config) names none of them: it asks through the interfaces they implement, which are
registered here when hputrain is imported (nothing else runs then: no device, no vendor import).
Adding a method or a kind is a new folder and its line below (docs/contributing.md).
"""
from __future__ import annotations

from .checkpoint.folder import register_run_file
from .kinds.moe import MixtureOfExperts
from .kinds.vlm import ImageTextToText
from .models.kind import register

#: The methods of `hputrain train --model`, by the name --method takes, and their folders.
METHODS = {
    "lm": "recipes/hf (the core's causal LM on packed text)",
    "sft": "methods/sft",
    "dpo": "methods/dpo",
    "grpo": "methods/grpo",
    "reward": "methods/reward",
}

#: The model kinds, in the order their words go in the run header (an image model's first).
KINDS = (ImageTextToText(), MixtureOfExperts())


def register_all() -> None:
    for kind in KINDS:
        register(kind)
    from .methods.grpo.rewards import COMPLETIONS_FILE

    register_run_file(COMPLETIONS_FILE)  # GRPO's sampled completions, beside metrics.jsonl


register_all()
