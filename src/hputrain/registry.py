"""Every training method and model kind, named once.

A method is a folder under methods/ (its config, data, objective, recipe, plan and doctor parts),
a model kind a folder under kinds/ (its family table, loading, execution swaps, parallel layout
and plan). The core (the loop, evaluation, packing, batching, checkpoints, execution modes,
strategies, config, and the Hugging Face recipe's loading and dispatch) names none of them: it
asks through the interfaces they implement (recipes/hf/methods.py's `Method`, models/kind.py's
`ModelKind`), which are registered here when hputrain is imported (nothing else runs then: no
device, no vendor import). Adding a method or a kind is a new folder and its line below
(docs/contributing.md).
"""
from __future__ import annotations

from .checkpoint.folder import register_run_file
from .kinds.moe import MixtureOfExperts
from .kinds.vlm import ImageTextToText
from .methods.dpo import DPO
from .methods.grpo import GRPO
from .methods.reward import RewardModel
from .methods.sft import SFT
from .models.kind import register
from .recipes.hf.methods import register_method

#: The methods of `hputrain train --model`, beside the causal LM's (recipes/hf/methods.py's
#: `Method`, which takes the data no other claims), in the order they are asked and listed
#: in --help.
METHODS = (SFT(), DPO(), GRPO(), RewardModel())

#: The model kinds, in the order their words go in the run header (an image model's first).
KINDS = (ImageTextToText(), MixtureOfExperts())


def register_all() -> None:
    for method in METHODS:
        register_method(method)
    for kind in KINDS:
        register(kind)
    from .methods.grpo.rewards import COMPLETIONS_FILE

    register_run_file(COMPLETIONS_FILE)  # GRPO's sampled completions, beside metrics.jsonl


register_all()
