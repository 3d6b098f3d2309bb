"""What a state IO does: write a model's and optimizer's state into a checkpoint folder and load
it back. Two implement it: FullState (full.py: whole files, written by rank 0) and ShardedState
(sharded.py: every rank's shards, through torch.distributed.checkpoint); `saving.state_io_for`
picks one for a strategy, and the folder protocol (folder.py) around them is the same."""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path


class StateIO(ABC):
    """The model and optimizer state of a checkpoint folder. Every rank calls `write`, `load` and
    `consolidate` with its `rank`; `model` is the module that owns the weights (host.unwrap_model)."""

    shards: bool = False
    """Whether the state is written as each rank's shards (resumable on another number of
    processes), rather than whole."""

    @staticmethod
    @abstractmethod
    def found_in(folder: Path) -> bool:
        """Whether `folder` holds state written this way."""

    @abstractmethod
    def write(self, folder: Path, *, model, optimizer, rank: int) -> None:
        """Write the state of `model` and `optimizer` (None: none) into the folder being saved."""

    @abstractmethod
    def load(self, folder: Path, *, model, optimizer, rank: int) -> None:
        """Load the folder's state into `model` and `optimizer` (None: the model only), checked
        against them first; a folder that does not fit is a CheckpointError."""

    @abstractmethod
    def consolidate(self, path: Path, *, model, rank: int) -> None:
        """Write the whole model to `path` (safetensors, from rank 0) at the end of training,
        where what `write` wrote is not it already; a model with frozen parameters is left out
        (its base is on disk already)."""
