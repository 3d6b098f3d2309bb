"""What every Hugging Face recipe (fine-tuning, DPO, GRPO, reward models) shares: the block size
a run takes, and an exception's first line for the one-line errors."""
from __future__ import annotations

from ..errors import InputError


def choose_block_size(asked: int | None, config, tokenizer) -> int:
    """`asked`, or min(1024, the longest sequence the model takes) — run_clm's default."""
    limits = [getattr(config, name) for name in ("max_position_embeddings", "n_positions",
                                                  "max_sequence_length", "seq_length")
              if isinstance(getattr(config, name, None), int)]
    if 0 < getattr(tokenizer, "model_max_length", 0) < 1_000_000:  # unset is a huge sentinel
        limits.append(tokenizer.model_max_length)
    longest = min(limits) if limits else None
    if asked is None:
        return min(1024, longest) if longest else 1024
    if longest is not None and asked > longest:
        raise InputError(f"--block-size {asked} is longer than the {longest} positions the model "
                         f"takes: give --block-size {longest} or less")
    return asked


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
