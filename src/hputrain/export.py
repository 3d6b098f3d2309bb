"""What `save_pretrained` writes, for every kind of model the Trainer takes.

TODO(issue 17): transformers models, PEFT adapters, the built-in GPT.
"""
from __future__ import annotations


def save_model(model, folder, tokenizer=None, group=None) -> None:
    raise NotImplementedError
