"""GRPO on a validation set: which prompts each evaluation batch holds, and the batches as a data
set that the Trainer's evaluate() (evaluation.py) walks like any other.

As TRL 1.16's GRPOTrainer evaluates: the validation prompts in an order drawn from the seed,
each repeated num_generations_eval times (num_generations unless set); an evaluation batch holds
per_device_eval_batch_size completions on each rank, whole groups over the ranks, so a prompt's
group may span ranks and its rewards are gathered before they are normalised, as in training.
Each batch is generated when evaluate() reaches it, with training's sampling but its own seeds
(training's random streams are left as they were), rewarded, and its loss taken as TRL takes an
evaluation batch's: no accumulation, no old policy (the ratio is 1).

The last batch may hold fewer prompts. Its rows are then shared out over the ranks as evenly as
possible; where there are fewer rows than ranks, prompts from the start of the order are added
(as Accelerate's even batches add samples from the start), so that every rank has rows in every
batch: with fsdp a forward is a collective that every rank must enter.

evaluate() cuts its data set into per_device_eval_batch_size items per rank per batch (rank r
takes the r-th run of them); here the first item of each rank's run is that rank's whole batch,
made when it is read, and the others are placeholders that `first_batch` (the collator) skips.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ...errors import InputError


class EvalPlan:
    """Which prompts each evaluation batch holds and how its rows are shared over the ranks."""

    def __init__(self, prompts: int, per_rank: int, ranks: int, num_generations: int,
                 seed: int) -> None:
        if num_generations < 1:
            raise InputError(f"num_generations_eval must be at least 1, got {num_generations}")
        if (per_rank * ranks) % num_generations:
            raise InputError(f"the evaluation batch, per_device_eval_batch_size x ranks = "
                             f"{per_rank} x {ranks}, must hold whole groups of "
                             f"num_generations_eval ({num_generations}) completions: change "
                             "either, or evaluate on no validation set")
        self.per_rank, self.ranks, self.num_generations = per_rank, ranks, num_generations
        order = torch.randperm(prompts, generator=torch.Generator().manual_seed(seed)).tolist()
        per_batch = per_rank * ranks // num_generations
        self.batches = [order[i:i + per_batch] for i in range(0, prompts, per_batch)]
        last, added = self.batches[-1], 0
        while len(last) * num_generations < ranks:  # every rank gets rows
            last.append(order[added % prompts])
            added += 1

    def shares(self, index: int) -> list[list[int]]:
        """Each rank's rows (prompt indices, each num_generations times, groups side by side) of
        batch `index`: a contiguous run of the batch's rows, as even as can be."""
        rows = [p for p in self.batches[index] for _ in range(self.num_generations)]
        size, extra = divmod(len(rows), self.ranks)
        out, start = [], 0
        for rank in range(self.ranks):
            end = start + size + (rank < extra)
            out.append(rows[start:end])
            start = end
        return out


class EvalRollouts:
    """The evaluation batches as evaluate() reads them (see the module docstring): item
    (batch k, rank r, j) is rank r's batch k when j is 0, made by `make(k, rows)` as it is read,
    else None."""

    def __init__(self, plan: EvalPlan, rank: int, make: Callable[[int, list[int]], dict]) -> None:
        self.plan, self.rank, self.make = plan, rank, make

    def __len__(self) -> int:
        return len(self.plan.batches) * self.plan.per_rank * self.plan.ranks

    def __getitem__(self, index: int) -> dict | None:
        plan = self.plan
        batch, within = divmod(index, plan.per_rank * plan.ranks)
        rank, item = divmod(within, plan.per_rank)
        if rank != self.rank:  # evaluate() hands each rank its own run: anything else is a bug
            raise RuntimeError(f"rank {self.rank} read rank {rank}'s evaluation item {index}")
        return self.make(batch, plan.shares(batch)[rank]) if item == 0 else None


def first_batch(samples: list) -> dict:
    """The collator of EvalRollouts' items: the one that is a whole batch."""
    return next(sample for sample in samples if sample is not None)
