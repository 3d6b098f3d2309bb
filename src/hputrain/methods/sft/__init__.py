"""Supervised fine-tuning on chat and instruction rows (TRL 1.16's SFTTrainer's loss masks): the
method as the Hugging Face recipe asks it (recipes/hf/methods.py), and its data (recipe.py: rows
encoded through the chat template, cached, packed without cross-talk or padded to a few lengths).

Its rows train through the causal LM's run (recipes/hf's train_blocks, the Trainer's own loss);
the recipe asks this method for the rows whose shape it names (`words`).
"""
from __future__ import annotations

from ...recipes.hf.methods import Method


class SFT(Method):
    name = "sft"
    label = "SFT"
    data_words = "chat and instruction rows"
    words = {"messages": "SFT on conversations ('messages')",
             "conversations": "SFT on ShareGPT conversations ('conversations')",
             "prompt_completion": "SFT on prompt-completion pairs ('prompt', 'completion')"}

    def load_rows(self, path: str, fmt: str, tokenizer, block_size: int, options, *, cache_dir,
                  tokenizer_folder=None, split: str = "train"):
        from .recipe import load_sft

        return load_sft(path, fmt, tokenizer, block_size, options, cache_dir=cache_dir,
                        tokenizer_folder=tokenizer_folder, split=split)

    def describe_rows(self, data, options, block_size: int, source: str) -> str:
        from .recipe import describe

        return describe(data, options, block_size, source)
