"""Fake transformer_engine.recipe: the fp8 formats and the delayed-scaling recipe."""
import enum
from dataclasses import dataclass


class Format(enum.Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"  # E4M3 forward, E5M2 backward


@dataclass
class DelayedScaling:
    margin: int = 0
    interval: int = 1
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "most_recent"
    reduce_amax: bool = True
