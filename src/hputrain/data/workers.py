"""Training batches loaded by worker processes (dataloader_num_workers), in exactly the order and
with exactly the contents that data.MicroBatches gives in the training process.

The workers come from torchdata's StatefulDataLoader. MicroBatches keeps deciding what each
micro-batch holds; the loader only carries that decision out ahead of the step:

- a map-style dataset: MicroBatches' index lists (its order for (seed, epoch), this rank's slice,
  from the resumed step on, epoch after epoch) are the loader's sampler, one list per item, and a
  worker turns a list into `collate([dataset[i] for i in list])`, as the training process would.
  The loader's in-order delivery keeps the order. Resume is exact without the loader's own
  state_dict, because the lists start at the resumed step; one loader spans all epochs, so the
  workers start once per run.
- an iterable dataset: one stream, read by one worker that runs MicroBatches.stream (skip the
  steps already trained, cut micro-batches, take this rank's slice). Resume is exact the same
  way. Several workers would each read their own copy of the stream, and a dataset that splits
  itself among workers (a Hugging Face IterableDataset does) would hand them different parts,
  so the order of a run without workers could not be kept: one worker it is, whatever
  num_workers says.
- a data set that reads its own shards (data/streaming.py): one worker per pass over them, from
  the data set's position, sending each micro-batch with the position after it (MicroBatches
  keeps those for the checkpoint, and ends the pass when the ranks agree to).

Workers are forked where the platform can fork (Linux), so the dataset and the collator are
inherited, not pickled; elsewhere (macOS, Windows) they are started by spawn and receive both
pickled. The Trainer's collator is a data.DropUnusedColumns around the user's collator (or
default_collate, or PadToBuckets), which pickles without the Trainer. The workers' own random
state is seeded from a generator of their own, so starting them draws nothing from the training
process's RNG; a collator that draws random numbers (masking) draws from the workers' state
instead, so its batches differ from those of a run without workers.
"""
from __future__ import annotations

import multiprocessing
import sys
import warnings

import torch
from torch.utils.data import Dataset, IterableDataset

from ..errors import InputError

WORKER_SEED_OFFSET = 7919
"""Added to the run's seed for the workers' base seed, to keep it apart from the data order's."""


class _Failed:
    """An InputError raised in a worker, sent back as a batch and raised again in the training
    process: the loader would wrap it in a multi-line 'Caught ... in DataLoader worker' message."""

    def __init__(self, error: InputError) -> None:
        self.error = error


class _CollatedLists(Dataset):
    """The dataset seen by the workers: an index list to its collated micro-batch."""

    def __init__(self, dataset, collate) -> None:
        self.dataset, self.collate = dataset, collate

    def __getitem__(self, indices: list[int]):
        try:
            return self.collate([self.dataset[i] for i in indices])
        except InputError as error:
            return _Failed(error)


class _IndexLists:
    """The loader's sampler: MicroBatches' index lists from a step on."""

    def __init__(self, batches, start_step: int, epochs: int | None) -> None:
        self.batches, self.start_step, self.epochs = batches, start_step, epochs

    def __iter__(self):
        return self.batches.index_lists(self.start_step, self.epochs)


class _Stream(IterableDataset):
    """An iterable dataset's micro-batches, as MicroBatches.stream makes them, for one worker."""

    def __init__(self, batches, start_step: int, epochs: int | None) -> None:
        self.batches, self.start_step, self.epochs = batches, start_step, epochs

    def __iter__(self):
        try:
            yield from self.batches.stream(self.start_step, self.epochs)
        except InputError as error:
            yield _Failed(error)


class _LocalPass(IterableDataset):
    """One pass of a rank-local stream (MicroBatches.pass_batches), for one worker: each item is
    (micro-batch, the stream's position after it), so the training process knows the position of
    what it trains on, however far ahead the worker reads."""

    def __init__(self, batches) -> None:
        self.batches = batches

    def __iter__(self):
        try:
            yield from self.batches.pass_batches()
        except InputError as error:
            yield _Failed(error)


def local_pass(batches):
    """(micro-batch, position) pairs of one pass of a rank-local stream (a data set that reads its
    own shards), read ahead by one worker that starts from the data set's current position."""
    loader = _loader(batches, _LocalPass(batches), None, 1)
    for item in loader:
        if isinstance(item, _Failed):
            raise item.error
        yield item


def _as_is(batch):
    """The loader's collate_fn: the workers' items are already batches."""
    return batch


def in_workers(batches, start_step: int = 0, epochs: int | None = None):
    """The micro-batches of `batches` (a MicroBatches) from `start_step` on, loaded by workers."""
    if batches.num_samples is None:
        dataset, sampler, workers = _Stream(batches, start_step, epochs), None, 1
    else:
        dataset = _CollatedLists(batches.dataset, batches.collate)
        sampler, workers = _IndexLists(batches, start_step, epochs), batches.loading.num_workers
    for batch in _loader(batches, dataset, sampler, workers):
        if isinstance(batch, _Failed):
            raise batch.error
        yield batch


def _loader(batches, dataset, sampler, workers: int):
    """The loader of `dataset`'s items, already batches, as `batches.loading` asks."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    options = batches.loading
    # A generator of our own: the loader draws the workers' base seed from it, which would
    # otherwise come from (and move) the training process's global RNG.
    generator = torch.Generator().manual_seed(batches.seed + WORKER_SEED_OFFSET)
    with warnings.catch_warnings():  # torchdata 0.11 calls torch's deprecated set_vital: not ours
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(dataset, batch_size=None, sampler=sampler, num_workers=workers,
                                  collate_fn=_as_is, pin_memory=options.pin_memory,
                                  prefetch_factor=options.prefetch_factor, generator=generator,
                                  multiprocessing_context=_start_method())


def _start_method():
    """fork where the platform has it and it is safe (Linux): workers then inherit the dataset
    and the collator instead of unpickling them, and start at once. Elsewhere (macOS, Windows)
    the platform's default, spawn, which pickles them."""
    if sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return None
