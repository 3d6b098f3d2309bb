"""GRPO's batch source: prompts sampled, completions generated and rewarded, cut into micro-batches.

The loop asks its batch source for micro-batches (trainer.py, `iterate`); for GRPO that source is
`Rollouts`. Every `steps_per_generation × num_iterations` micro-batches it makes one generation
batch: `generation_batch_size / num_generations` prompts, the same on every rank (the order is a
function of the seed and the generation's index, as TRL's RepeatSampler draws it from one seeded
generator), each repeated num_generations times; rank r takes its slice of those rows, so a
prompt's group may span ranks, and the rewards are gathered from every rank before each group is
normalised (grpo_loss.group_advantages). The completions come from the static-shape generator
(execution/generation.py): every rollout has the same shapes, [rows, prompt bucket + C].

Because a generation's prompts, its sampling seed and its place in the run all follow from its
index, a resumed run makes the same rollouts; a checkpoint taken inside a num_iterations cycle
also holds the cycle's batches (`data_state`), whose old log-probs came from weights that are gone.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ...errors import InputError


@dataclass(frozen=True)
class Layout:
    """How completions, micro-batches, steps and generations relate (TRL's names)."""

    rows: int  # per_device_train_batch_size: completions per micro-batch on one rank
    accumulate: int  # gradient_accumulation_steps: micro-batches per optimizer step
    ranks: int
    rank: int
    num_generations: int
    steps_per_generation: int  # micro-batches one generation batch is cut into, per rank
    num_iterations: int  # times each generation batch is trained on

    @property
    def generation_rows(self) -> int:
        """Completions of one generation batch, over every rank."""
        return self.rows * self.ranks * self.steps_per_generation

    @property
    def prompts_per_generation(self) -> int:
        return self.generation_rows // self.num_generations

    @property
    def micro_per_generation(self) -> int:
        """Micro-batches (per rank) one generation serves: its split, num_iterations times."""
        return self.steps_per_generation * self.num_iterations


class PromptOrder:
    """Which prompts generation g samples: one permutation per pass over the prompts (seeded by
    seed + pass), cut into groups of `per_generation`; a remainder too small for a group is
    left out, as TRL's RepeatSampler drops it."""

    def __init__(self, count: int, per_generation: int, seed: int) -> None:
        self.count, self.per_generation, self.seed = count, per_generation, seed
        self.per_pass = count // per_generation
        if self.per_pass == 0:
            raise InputError(f"{count} prompt(s) are fewer than one generation batch needs "
                             f"({per_generation}): give more prompts, or lower "
                             "per_device_train_batch_size / generation_batch_size")

    def __call__(self, generation: int) -> list[int]:
        epoch, index = divmod(generation, self.per_pass)
        order = torch.randperm(self.count, generator=torch.Generator().manual_seed(self.seed + epoch))
        return order[index * self.per_generation:(index + 1) * self.per_generation].tolist()


class Rollouts:
    """The loop's batch source under GRPO (see the module docstring). `make(generation, rows)`
    turns this rank's rows (dataset indices, each prompt repeated) into the generation batch's
    micro-batches on this rank (the objective's rollout: grpo.py)."""

    def __init__(self, prompts: int, layout: Layout, seed: int, make, device) -> None:
        self.layout, self.make, self.device = layout, make, device
        self.order = PromptOrder(prompts, layout.prompts_per_generation, seed)
        self.accumulate = layout.accumulate
        self.global_batch_size = layout.rows * layout.ranks * layout.accumulate
        self.num_samples = prompts * layout.num_generations
        micro_per_pass = self.order.per_pass * layout.micro_per_generation
        self.steps_per_epoch = micro_per_pass // layout.accumulate
        self.buffer: tuple[int, list[dict]] | None = None  # (generation, its micro-batches)
        self._resumed: dict | None = None
        self.generation_seconds = 0.0  # spent making rollouts since the last read

    def epoch_of(self, step: int) -> float:
        return step / self.steps_per_epoch if self.steps_per_epoch else 0.0

    def rows_of(self, generation: int) -> list[int]:
        """This rank's rows of generation g: dataset indices, each prompt num_generations times."""
        layout = self.layout
        rows = [i for i in self.order(generation) for _ in range(layout.num_generations)]
        share = len(rows) // layout.ranks
        return rows[layout.rank * share:(layout.rank + 1) * share]

    def iterate(self, start_step: int = 0, epochs: int | None = None):
        """Micro-batches from optimizer step `start_step` on."""
        layout = self.layout
        micro = start_step * layout.accumulate
        while True:
            generation, within = divmod(micro, layout.micro_per_generation)
            yield self.micro_batch(generation, within % layout.steps_per_generation)
            micro += 1

    def micro_batch(self, generation: int, index: int) -> dict:
        if self.buffer is None or self.buffer[0] != generation:
            self.buffer = self._restored(generation) or (generation, self._generate(generation))
        return self.buffer[1][index]

    def _generate(self, generation: int) -> list[dict]:
        start = time.perf_counter()
        batches = self.make(generation, self.rows_of(generation))
        self.generation_seconds += time.perf_counter() - start
        return batches

    # -- checkpoints: a cycle's batches, when the checkpoint falls inside one -------------------
    def data_state(self, step: int) -> dict | None:
        """The generation batch under way at `step` when the next step still trains on it
        (num_iterations > 1, or steps_per_generation > accumulate): its micro-batches as lists."""
        layout = self.layout
        generation, within = divmod(step * layout.accumulate, layout.micro_per_generation)
        if within == 0 or self.buffer is None or self.buffer[0] != generation:
            return None
        return {"generation": generation, "batches": [_as_lists(b) for b in self.buffer[1]]}

    def load_state_dict(self, state: dict | None) -> None:
        self._resumed = state

    def _restored(self, generation: int):
        state, self._resumed = self._resumed, None
        if state is None or state.get("generation") != generation:
            return None
        return generation, [_as_tensors(b, self.device) for b in state["batches"]]


def _as_lists(batch: dict) -> dict:
    """A micro-batch as JSON: tensors as nested lists with their dtype (a float32 value survives
    the round trip exactly), plain numbers as they are."""
    return {k: {"dtype": str(v.dtype).removeprefix("torch."), "values": v.cpu().tolist()}
            if torch.is_tensor(v) else v for k, v in batch.items()}


def _as_tensors(batch: dict, device) -> dict:
    return {k: torch.tensor(v["values"], dtype=getattr(torch, v["dtype"])).to(device)
            if isinstance(v, dict) else v for k, v in batch.items()}
