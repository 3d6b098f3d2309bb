"""Group relative policy optimisation (GRPO), as TRL 1.16 computes it, as an objective of the loop.

A generation batch of prompts (rollout.py) gets `num_generations` completions each from the
static-shape generator (execution/generation.py: prompts in a few length buckets, completions to
max_completion_length, the decode step one captured graph, sampling on the device), which are
decoded on the host once per rollout for the reward functions (rewards.py: TRL's signature, or a
reward-model folder). Rewards gathered from every rank are normalised within each prompt's group
into advantages (grpo_loss.group_advantages). The training forward then sees
[rows, prompt bucket + max_completion_length] every step; the per-token log-probs are taken on
completion positions only, in chunks (logps.py), and the loss is TRL's for the chosen loss_type
(grpo_loss.grpo_loss).

How the loop weighs a micro-batch (trainer.py `_micro_batch_loss`): each counts as one unit, so a
micro-batch's loss is divided by the step's micro-batches over every rank and the strategy's
gradient mean; `grpo_loss` is therefore called as for one micro-batch with no accumulation, which
gives exactly TRL's scaling for every loss type (dapo's token normaliser included).
"""
from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass

import torch

from ...callbacks.writers import notice
from .config import GRPOConfig, generation_layout
from ...data.batching import base_model
from ...errors import InputError
from ...execution.generation import (Sampling, StaticGenerator, attention_mask, completion_mask,
                                     end_token_ids, mask_kind)
from ...execution.inference import max_length
from .evaluation import EvalPlan, EvalRollouts, first_batch
from .loss import group_advantages, grpo_loss, logged_means, logging_average, reward_metrics
from ...training.intervals import total_steps_of
from ...training.logps import token_logps
from ...training.objective import Objective, adapters_disabled
from .rewards import COMPLETIONS_FILE, CompletionsLog, RewardFunctions, RewardState, completion_for, conversational
from .rollout import Layout, Rollouts
from ...training.trainer import Trainer

IGNORE_INDEX = -100


def encode_prompts(rows: list[dict], tokenizer, longest: int | None) -> tuple[list[int], list[list[int]]]:
    """(indices of the rows kept, their prompts' token ids): text prompts tokenized as TRL does
    (the tokenizer's own special tokens), conversations through the chat template with its
    generation prompt. Prompts are kept whole, as TRL keeps them (one longer than the largest
    bucket gets the next multiple of it); an empty one, or one longer than `longest` (what the
    model's positions leave beside the completion; None: no limit), is left out."""
    kept, ids = [], []
    for index, row in enumerate(rows):
        if "prompt" not in row:
            raise InputError(f"row {index + 1} has no 'prompt' (GRPO needs prompts: text or messages)")
        prompt = row["prompt"]
        if conversational(prompt):
            tokens = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            tokens = tokens["input_ids"] if isinstance(tokens, dict) or hasattr(tokens, "keys") else tokens
        elif isinstance(prompt, str):
            tokens = tokenizer(prompt)["input_ids"]
        else:
            raise InputError(f"row {index + 1}: 'prompt' is neither text nor a list of messages")
        if 0 < len(tokens) and (longest is None or len(tokens) <= longest):
            kept.append(index)
            ids.append(list(tokens))
    return kept, ids


@dataclass
class Scored:
    """One rollout on this rank after its rewards: its batch on the device, and for the metrics
    what every rank gathered (each rank's rewards, lengths, truncation flags, active tokens,
    prompts, completions and logs), the rewards, the advantages and the active tokens over ranks."""

    batch: dict
    everyone: list
    rewards: torch.Tensor
    advantages: object
    tokens: int
    lengths_mine: list[int]
    columns: dict
    """The reward functions' log_extra columns, one value per completion of every rank."""


class RolloutCount:
    """What a GRPO step's loss is weighed by: a micro-batch counts its completions, which in
    training are the same in every micro-batch, so each weighs alike (see the module docstring),
    and which weigh an evaluation batch in eval_loss as TRL weighs it; throughput's samples are
    completions and its tokens the prompt and completion tokens (counted on the host during the
    rollout: no device read)."""

    takes_item_count = False
    shifts_labels = False

    def __call__(self, batch) -> int:
        return int(batch["advantages"].shape[0])

    def samples(self, batch) -> int:
        return int(batch["advantages"].shape[0])

    def seen(self, batches: list, counts: list[int]) -> int:
        return sum(batch["seen_tokens"] for batch in batches)


class StepRollouts(Rollouts):
    """Rollouts that tell the objective which optimizer step the latest micro-batch is for: the
    step an evaluation's reward functions are told (their trainer_state), as TRL tells them."""

    def __init__(self, prompts, layout, seed, make, device, objective) -> None:
        super().__init__(prompts, layout, seed, make, device)
        self.objective = objective

    def iterate(self, start_step: int = 0, epochs: int | None = None):
        for micro, batch in enumerate(super().iterate(start_step, epochs),
                                      start=start_step * self.accumulate):
            self.objective.step = micro // self.accumulate + 1
            yield batch


class GRPOObjective(Objective):
    """GRPO's rollout, loss and metrics (see the module docstring)."""

    has_perplexity = False
    unscorable_said = False
    """True once the warning about completions no reward function scored is out."""
    evaluation = False
    """True inside evaluating(): a batch is then its own generation batch."""

    def __init__(self, config: GRPOConfig, reward_funcs, rows: list[dict], tokenizer, *,
                 reference=None, adapters=None, complete=None, positions=None) -> None:
        self.config, self.rows, self.tokenizer = config, rows, tokenizer
        self.reward_funcs = reward_funcs
        self.reference, self.adapters = reference, adapters
        self.mask_kind = None  # the training forward's 4-D mask (_logps), from the model at bind
        self.complete = complete  # a test's fixed completions: (generation, prompt ids) -> ids
        self.sampling = Sampling(temperature=config.temperature, top_p=config.top_p,
                                 top_k=config.top_k, min_p=config.min_p,
                                 repetition_penalty=config.repetition_penalty).check()
        self.positions = positions  # (the model's positions, its config's name for them) or None
        self.longest_prompt = _longest_prompt(config.max_completion_length, positions)
        self.kept, self.prompt_ids = encode_prompts(rows, tokenizer, self.longest_prompt)
        self.left_out = len(rows) - len(self.kept)
        if not self.kept:
            raise InputError(f"no prompt is left to train on: every one is empty{self._too_long()}")
        self.sums: list[torch.Tensor] = []  # each micro-batch's (grpo_loss.METRIC_SLOTS)
        self.extremes: list[torch.Tensor] = []  # each micro-batch's (grpo_loss.EXTREMES)
        self.rollout_metrics: list[dict] = []
        self.step = 0  # the optimizer step the latest micro-batch belongs to (reward functions')
        self.max_steps = 0  # the run's steps (reward functions' trainer_state), from train_batches
        self.logged: dict[str, list[float]] = {}  # the functions' log_metric values since a record
        self._eval_prompts = None  # (data set, its rows, kept indices, prompt ids): encoded once
        self.collate = first_batch  # evaluation's batches come whole (methods/grpo/evaluation.py)
        self.generation_seconds, self.since = 0.0, time.perf_counter()

    def bind(self, loop) -> None:
        super().bind(loop)
        cfg, group = self.config, loop.group
        if group.cp_size > 1:
            raise InputError("GRPO under context parallelism is not supported: set "
                             "context_parallel_size=1")
        size, steps = generation_layout(cfg, cfg.per_device_train_batch_size,
                                        cfg.gradient_accumulation_steps, group.dp_size)
        self.layout = Layout(cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps,
                             group.dp_size, group.dp_rank, cfg.num_generations, steps,
                             cfg.num_iterations)
        if not isinstance(self.reward_funcs, RewardFunctions):
            self.reward_funcs = RewardFunctions(self.reward_funcs, cfg.reward_weights,
                                                device=loop.device)
        if self.reference is not None:  # in the policy's dtype: at the start their KL is 0
            self.reference = loop.place_frozen(self.reference, like_trained=True)
        tokenizer = self.tokenizer
        # every end the model's generation config names (a chat model's end of turn), as TRL
        generation = getattr(loop.model, "generation_config", None)
        self.eos_ids = end_token_ids(tokenizer.eos_token_id, getattr(generation, "eos_token_id", None))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
            next(iter(self.eos_ids), None)
        self.pad = pad
        self.mask_kind = mask_kind(loop.model)  # the training forward's 4-D mask (_logps)
        self.generator = StaticGenerator(loop.model, loop.accelerator,
                                         max_completion_length=cfg.max_completion_length,
                                         eos_token_ids=self.eos_ids, pad_token_id=pad,
                                         buckets=tuple(cfg.prompt_buckets),
                                         graphs=cfg.use_graphs_for_inference)
        # the run's output_dir (loop.args'), which the doctor moves to its own folder (for_rehearsal)
        self.log = (CompletionsLog(f"{loop.args.output_dir}/{COMPLETIONS_FILE}") if group.is_main else None)

    def count_tokens(self, model):
        return RolloutCount()

    def train_batches(self, batches):
        rollouts = StepRollouts(len(self.kept), self.layout, self.config.seed, self.rollout,
                                self.loop.device, self)
        self.max_steps = total_steps_of(rollouts, self.config.max_steps, self.config.num_train_epochs)
        return rollouts

    def state(self) -> dict:
        """What a checkpoint records of the run's GRPO settings (for resume_notes)."""
        cfg = self.config
        return {"grpo": {"num_generations": cfg.num_generations, "reward_funcs": self.reward_funcs.names,
                         "max_completion_length": cfg.max_completion_length}}

    def resume_notes(self, state: dict) -> list[str]:
        """A line for each GRPO setting a resumed run changes: it works, with the new value from
        here on (other groups, rewards or completion lengths than the checkpoint's run had)."""
        saved, now = state.get("grpo") or {}, self.state()["grpo"]
        return [f"resuming with {name} {_shown(now[name])} where the checkpoint's run had "
                f"{_shown(saved[name])}: the new one holds from here on"
                for name in now if name in saved and saved[name] != now[name]]

    def _too_long(self) -> str:
        """", or longer than ..." for the lines about prompts left out ("" without a limit)."""
        if self.longest_prompt is None:
            return ""
        return (f" or longer than {self.longest_prompt} tokens (the model's {self.positions[0]} "
                f"positions less max_completion_length {self.config.max_completion_length})")


    # -- a rollout --------------------------------------------------------------------------------
    def rollout(self, generation: int, rows: list[int]) -> list[dict]:
        """This rank's micro-batches of generation batch `generation`, whose rows (indices into
        the kept prompts, each num_generations times) are `rows`."""
        layout = self.layout
        step = generation * layout.micro_per_generation // layout.accumulate + 1
        scored = self._score(generation, rows, self.prompt_ids, self.rows, self.kept,
                             self.config.num_generations, step)
        batch = scored.batch
        self._old_and_reference(batch)
        self._note(generation, step, scored)
        seen = sum(len(self.prompt_ids[r]) for r in rows) + sum(scored.lengths_mine)  # this rank's
        return self._split(batch, generation, self.loop.device_scalar(float(scored.tokens)), seen)

    def _score(self, generation: int, rows: list[int], prompt_ids, source: list[dict], kept,
               num_generations: int, step: int) -> Scored:
        """Completions of `rows` (indices into `prompt_ids`, each repeated, this rank's share of
        a batch whose other shares the other ranks hold), their rewards gathered from every rank
        and normalised in groups of `num_generations`: this rank's batch on the device (ids, masks,
        advantages) and what the metrics need. Training's rollouts and evaluation's share it."""
        loop, cfg, layout = self.loop, self.config, self.layout
        prompt_ids, prompt_mask, completion_ids, mask = self._complete(generation, rows, prompt_ids)
        # the rollout's one host read: the tokens and where each completion ends
        ids, ended = torch.stack([completion_ids, mask.to(completion_ids.dtype)]).cpu().unbind(0)
        ended = ended.bool()
        tokens_kept = [row[m].tolist() for row, m in zip(ids, ended)]
        ends = {*self.eos_ids, self.pad}  # TRL's: a completion whose last token is none of these
        truncated = [k[-1] not in ends for k in tokens_kept]
        data = [source[kept[r]] for r in rows]
        prompts = [row["prompt"] for row in data]
        texts = self.tokenizer.batch_decode(tokens_kept, skip_special_tokens=True)
        completions = [completion_for(p, t) for p, t in zip(prompts, texts)]
        columns = {k: [row.get(k) for row in data] for k in data[0] if k != "prompt"}
        rewards = self.reward_funcs(prompts, completions, tokens_kept, columns, step,
                                    state=RewardState(step, self.max_steps))
        logs = self.reward_funcs.take_logs()  # what the functions logged: columns and metrics
        if cfg.mask_truncated_completions:
            mask = mask * torch.tensor([not t for t in truncated], device=mask.device)[:, None]
        # the tokens the loss counts (a truncated completion's none, when they are masked)
        active = [0 if cfg.mask_truncated_completions and t else len(k)
                  for k, t in zip(tokens_kept, truncated)]
        everyone = loop.group.gather_objects(
            (rewards.tolist(), [len(k) for k in tokens_kept], truncated, active, prompts, completions,
             logs))
        for _, metrics in (part[6] for part in everyone):  # averaged into the next record, as TRL
            for name, values in metrics.items():
                self.logged.setdefault(name, []).extend(values)
        # checked on every rank at every rollout, not only where rank 0 writes completions.jsonl
        columns = logged_columns([part[6][0] for part in everyone],
                                 sum(len(part[4]) for part in everyone), step)
        all_rewards = torch.tensor([r for part in everyone for r in part[0]], dtype=torch.float32)
        all_rewards = all_rewards.view(-1, len(self.reward_funcs.names))
        self._warn_unscorable(all_rewards, everyone, step)
        advantages = group_advantages(all_rewards, self.reward_funcs.weights, num_generations,
                                      cfg.scale_rewards)
        offset = sum(len(part[1]) for part in everyone[:layout.rank])  # ranks' shares, in order
        mine = advantages.advantages[offset:offset + len(rows)]
        batch = {"input_ids": torch.cat([prompt_ids, completion_ids], dim=1),
                 "attention_mask": torch.cat([prompt_mask, mask], dim=1),
                 "completion_mask": mask, "advantages": mine.to(loop.device)}
        return Scored(batch, everyone, all_rewards, advantages,
                      sum(a for part in everyone for a in part[3]), [len(k) for k in tokens_kept],
                      columns)

    def _warn_unscorable(self, rewards: torch.Tensor, everyone: list, step: int) -> None:
        """TRL's warning when every reward function returned None for a completion (it counts for
        nothing: no reward, advantage 0), in one line, once a run, on rank 0."""
        unscorable = rewards.isnan().all(dim=1)
        if self.unscorable_said or not bool(unscorable.any()) or not self.loop.group.is_main:
            return
        self.unscorable_said = True
        prompts = [p for part in everyone for p in part[4]]
        first = repr(prompts[int(unscorable.nonzero()[0, 0])])
        first = first if len(first) <= 60 else first[:57] + "..."
        notice(f"warning: every reward function returned None for {int(unscorable.sum())} of "
               f"{len(prompts)} completions at step {step} (the first for prompt {first}): such a "
               "completion counts for nothing (no reward, advantage 0); make at least one reward "
               "function return a number for it (said once)")

    def _complete(self, generation: int, rows: list[int], prompt_ids: list[list[int]]):
        """(prompt ids, prompt mask, completion ids, completion mask) on the device: generated,
        or a test's fixed completions (`complete`) laid out the same way. Evaluation's batch k
        is generation -1 - k: its own sampling seed, and what the `complete` hook is told."""
        loop = self.loop
        prompts = [prompt_ids[r] for r in rows]
        if self.complete is not None:
            prompt_ids, prompt_mask = self.generator.prepare(prompts)
            fixed = self.complete(generation, prompts)
            width = self.config.max_completion_length
            ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
            for i, tokens in enumerate(fixed):
                ids[i, :len(tokens)] = torch.tensor(tokens[:width], dtype=torch.long)
            ids = ids.to(loop.device)
            mask = completion_mask(ids, self.generator.eos)
            return prompt_ids, prompt_mask, ids, mask
        seed = (self.config.seed * 1_000_003 + generation * 7919 + loop.group.rank) % 2**62
        try:
            random = torch.Generator(device=loop.device).manual_seed(seed)
        except RuntimeError:  # a device without generators of its own (the CPU's lazy backend):
            # a CPU one, whose draws the generator copies over (generation.uniform_noise), so
            # that rollouts are eager mode's and a resumed run draws what an uninterrupted one did
            random = torch.Generator().manual_seed(seed)
        with loop.forward_context():
            out = self.generator.generate(prompts, self.sampling, random)
        self.generation_seconds += out.seconds
        return out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask

    def _old_and_reference(self, batch: dict) -> None:
        """The old policy's log-probs when a generation batch is trained on after an update
        (num_iterations > 1, or more micro-batches per generation than per step), and the
        reference's when beta != 0: computed now, without gradients, a micro-batch at a time."""
        layout, loop = self.layout, self.loop
        old = layout.accumulate % layout.micro_per_generation != 0
        if old:
            batch["old_logps"] = self._no_grad_logps(loop.module, batch)
        self._reference(batch)

    def _reference(self, batch: dict) -> None:
        """The reference's log-probs of `batch` when beta != 0 (the training rollout's and the
        evaluation's)."""
        cfg, loop = self.config, self.loop
        if cfg.beta != 0.0:
            if self.reference is not None:
                batch["ref_logps"] = self._no_grad_logps(self.reference, batch)
            else:
                with adapters_disabled(self.adapters):
                    batch["ref_logps"] = self._no_grad_logps(loop.module, batch)

    def _no_grad_logps(self, module, batch: dict) -> torch.Tensor:
        """`module`'s log-probs of `batch`, a micro-batch at a time, in the training forward's
        context (autocast, the lazy backend's): at the rollout the old policy's are then the
        training forward's own, bit for bit, and the reference's run on the same numerical path.
        Each part's graph runs (mark_step) outside that context, as the training step's does: on
        the CPU's lazy backend a graph run inside autocast would compute in bfloat16."""
        size, parts = self.config.per_device_train_batch_size, []
        for begin in range(0, batch["input_ids"].shape[0], size):
            part = {k: v[begin:begin + size] for k, v in batch.items() if torch.is_tensor(v)}
            with torch.no_grad(), self.loop.forward_context():
                parts.append(self._logps(module, part)[0])
            self.loop.accelerator.mark_step()
        return torch.cat(parts)

    def _split(self, batch: dict, generation: int, num_items: torch.Tensor, seen: int) -> list[dict]:
        """The generation batch shuffled (as TRL shuffles it) and cut into micro-batches."""
        layout = self.layout
        rows = batch["input_ids"].shape[0]
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(self.config.seed + generation))
        order = order.to(batch["input_ids"].device)
        size = rows // layout.steps_per_generation
        out = []
        for i in range(layout.steps_per_generation):
            index = order[i * size:(i + 1) * size]
            micro = {k: v.index_select(0, index) for k, v in batch.items()}
            micro["num_items"] = num_items
            micro["seen_tokens"] = seen // layout.steps_per_generation
            out.append(micro)
        return out

    def _note(self, generation: int, step: int, scored: Scored) -> None:
        """The rollout's metrics (TRL's names) for the next logging record, and its completions in
        completions.jsonl when it serves a logged step."""
        self.rollout_metrics.append(self._rollout_metrics(scored))
        every = self.config.logging_steps
        last = (generation + 1) * self.layout.micro_per_generation // self.layout.accumulate
        if self.log is not None and ((step - 1) // every != last // every or step == 1):
            everyone = scored.everyone
            prompts = [p for part in everyone for p in part[4]]
            completions = [c for part in everyone for c in part[5]]
            self.log.write(step, prompts, completions, [a for part in everyone for a in part[3]],
                           scored.rewards, self.reward_funcs.names, self.reward_funcs.weights,
                           scored.advantages.advantages,
                           extra=scored.columns)

    def _rollout_metrics(self, scored: Scored) -> dict:
        """TRL's completion-length and reward metrics of one rollout (every rank's completions)."""
        lengths = torch.tensor([n for part in scored.everyone for n in part[1]], dtype=torch.float32)
        ended = torch.tensor([not t for part in scored.everyone for t in part[2]])
        terminated = lengths[ended] if ended.any() else torch.zeros(1)
        return {"completions/mean_length": lengths.mean().item(),
                "completions/min_length": lengths.min().item(),
                "completions/max_length": lengths.max().item(),
                "completions/clipped_ratio": 1.0 - ended.float().mean().item(),
                "completions/mean_terminated_length": terminated.mean().item(),
                "completions/min_terminated_length": terminated.min().item(),
                "completions/max_terminated_length": terminated.max().item(),
                **reward_metrics(scored.rewards, self.reward_funcs.weights, self.reward_funcs.names,
                                 scored.advantages.std_is_zero)}

    # -- the loss ---------------------------------------------------------------------------------
    def compute_loss(self, module, batch) -> torch.Tensor:
        cfg, layout = self.config, self.layout
        logps, entropy = self._logps(module, batch, entropy=True)
        out = grpo_loss(logps, batch.get("old_logps"), batch.get("ref_logps"), batch["advantages"],
                        batch["completion_mask"], loss_type=cfg.loss_type, beta=cfg.beta,
                        epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, delta=cfg.delta,
                        importance_sampling_level=cfg.importance_sampling_level,
                        use_bias_correction_kl=cfg.use_bias_correction_kl,
                        num_items_in_batch=batch["num_items"], num_processes=layout.ranks,
                        gradient_accumulation_steps=1,
                        # an evaluation batch is its own generation batch, as in TRL
                        steps_per_generation=1 if self.evaluation else layout.steps_per_generation,
                        max_completion_length=cfg.max_completion_length, entropies=entropy)
        if self.counting:  # not a batch a rank repeats only to keep in step
            self.sums.append(out.sums.detach())  # TRL logs each micro-batch's
            self.extremes.append(out.extremes)
        return out.loss

    def _logps(self, module, batch: dict, entropy: bool = False):
        """Per-token log-probs (and entropies) of the completion tokens, [rows, C]."""
        completion = batch["completion_mask"].shape[1]
        input_ids = batch["input_ids"]
        start = input_ids.shape[1] - completion - 1  # position t predicts token t + 1
        ignored = input_ids.new_full((input_ids.shape[0], 1), IGNORE_INDEX)
        # made whole, not written into a slice (a copy into a view runs eagerly in lazy mode)
        labels = torch.cat([ignored.expand(-1, start), input_ids[:, start + 1:], ignored], dim=1)
        # the 4-D mask transformers would make from the 2-D one, made here on the device
        mask = attention_mask(batch["attention_mask"], torch.arange(input_ids.shape[1], device=input_ids.device),
                              *(self.mask_kind or mask_kind(module)))
        inputs = {"input_ids": input_ids, "attention_mask": mask}
        # temperature 0 decodes greedily: the log-probs are then the model's own (temperature 1)
        scored = token_logps(lambda m, x: self.loop.call_model(m, **x), module, inputs, labels,
                             temperature=self.config.temperature or 1.0, entropy=entropy, start=start)
        logps = scored.logps[:, start:-1]
        return logps, (scored.entropy[:, start:-1] if entropy else None)

    # -- what users read ----------------------------------------------------------------------------
    def metrics(self, group, prefix: str = "") -> dict:
        """TRL's logged values since the last record: the loss metrics of each micro-batch over
        every rank's tokens, then averaged over the micro-batches (one device read; with TRL's
        clip_ratio/low_min and high_max: grpo_loss.logged_means), the rollouts' metrics averaged,
        each average leaving NaN out (None where nothing is left: a reward no function gave), and
        (training) the share of the time spent generating."""
        sums, extremes = self.sums, self.extremes
        self.sums, self.extremes = [], []
        local = torch.cat([torch.stack(sums), torch.stack(extremes)], dim=1).float().tolist() \
            if sums else []
        means = logged_means(group.gather_objects(local))
        rollouts, self.rollout_metrics = self.rollout_metrics, []
        for name in (rollouts[0] if rollouts else ()):
            means[name] = logging_average([r[name] for r in rollouts])
        logged, self.logged = self.logged, {}  # the reward functions' log_metric values
        means.update({name: logging_average(values) for name, values in logged.items() if values})
        if not self.evaluation:
            now = time.perf_counter()
            means["generation_share"] = self.generation_seconds / max(now - self.since, 1e-9)
            self.generation_seconds, self.since = 0.0, now
        return {f"{prefix}{k}": v for k, v in means.items()}

    # -- evaluation ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def evaluating(self):
        """Around an evaluation: training's sums, extremes and rollout metrics since the last
        record kept aside, and the evaluation's time left out of training's generation share."""
        kept = self.sums, self.extremes, self.rollout_metrics, self.generation_seconds, self.logged
        self.sums, self.extremes, self.rollout_metrics, self.logged = [], [], [], {}
        self.evaluation, start = True, time.perf_counter()
        try:
            yield
        finally:
            self.sums, self.extremes, self.rollout_metrics, self.generation_seconds, self.logged = kept
            self.evaluation = False
            self.since += time.perf_counter() - start

    def eval_dataset(self, dataset) -> EvalRollouts:
        """The validation prompts as evaluate() reads them (methods/grpo/evaluation.py): one batch per rank
        per evaluation batch, generated and rewarded when evaluate() comes to it."""
        if self._eval_prompts is None or self._eval_prompts[0] is not dataset:
            rows = [dict(row) for row in dataset]
            kept, ids = encode_prompts(rows, self.tokenizer, self.longest_prompt)
            if not kept:
                raise InputError(f"no evaluation prompt is left: every one is empty{self._too_long()}")
            self._eval_prompts = (dataset, rows, kept, ids)
        _, rows, kept, ids = self._eval_prompts
        plan = self.eval_plan(len(kept))
        return EvalRollouts(plan, self.layout.rank,
                            lambda k, mine: self.eval_rollout(k, mine, rows, kept, ids, plan))

    def eval_plan(self, prompts: int) -> EvalPlan:
        """The evaluation batches of `prompts` validation prompts (one line if the sizes do not
        make whole groups)."""
        cfg = self.config
        return EvalPlan(prompts, cfg.per_device_eval_batch_size, self.layout.ranks,
                        cfg.num_generations_eval or cfg.num_generations, cfg.seed)

    def eval_rollout(self, index: int, mine: list[int], rows, kept, ids, plan: EvalPlan) -> dict:
        """This rank's batch of evaluation batch `index` (its rows `mine`, indices into `kept`):
        completions sampled as in training, rewarded, the rewards gathered from every rank and
        normalised in groups of num_generations_eval; the reference's log-probs when beta > 0."""
        scored = self._score(-1 - index, mine, ids, rows, kept, plan.num_generations, self.step)
        batch = scored.batch
        self._reference(batch)
        self.rollout_metrics.append(self._rollout_metrics(scored))
        batch["num_items"] = self.loop.device_scalar(float(scored.tokens))
        return batch


def _longest_prompt(completion: int, positions) -> int | None:
    """The prompt tokens the model's positions leave beside `completion` tokens (None: no limit);
    one line naming max_completion_length when they leave none."""
    if positions is None:
        return None
    if completion >= positions[0]:
        raise InputError(f"max_completion_length (--max-completion-length) {completion} leaves no "
                         f"room for a prompt in the model's {positions[0]} positions "
                         f"(config.{positions[1]}): give {positions[0] - 1} or less")
    return positions[0] - completion


def _shown(value) -> str:
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


def logged_columns(parts: list[dict], count: int, step: int) -> dict[str, list]:
    """The log_extra columns of every rank's share (`parts`, in rank order) joined into one column
    of `count` values each; one line for a column that is not one value per completion."""
    columns: dict[str, list] = {}
    for part in parts:
        for name, values in part.items():
            columns.setdefault(name, []).extend(values)
    for name, values in columns.items():
        if len(values) != count:
            raise InputError(f"a reward function logged {len(values)} values in log_extra column "
                             f"{name!r} at step {step}, for {count} completions (one per completion)")
    return columns


class GRPOTrainer(Trainer):
    """A Trainer whose objective is GRPO's (see the module docstring), with TRL's arguments:
    `reward_funcs` (callables with TRL's signature, reward models, "FILE.py:NAME" strings or
    reward-model folders), `train_dataset` rows with a `prompt` (text or messages; every other
    column goes to the reward functions), `processing_class` the tokenizer. The reference
    (beta != 0): `ref_model`, else the adapter-disabled base of a PEFT model, else a frozen copy
    of the starting weights."""

    def __init__(self, model, args: GRPOConfig | dict | None = None, reward_funcs=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, ref_model=None,
                 **kwargs) -> None:
        args = args if isinstance(args, GRPOConfig) else GRPOConfig(**(args or {}))
        if reward_funcs is None or (isinstance(reward_funcs, (list, tuple)) and not reward_funcs):
            raise InputError("GRPO needs reward_funcs: functions f(prompts, completions, "
                             "completion_ids, **columns), reward models, or FILE.py:NAME entries")
        if processing_class is None:
            raise InputError("GRPOTrainer needs processing_class (the tokenizer)")
        if train_dataset is None:
            raise InputError("train() needs a train_dataset of prompts")
        complete = kwargs.pop("complete", None)
        adapters = None
        if args.beta != 0.0 and ref_model is None:
            if hasattr(model, "disable_adapter"):
                adapters = model
            else:
                ref_model = copy.deepcopy(model)  # the starting weights, frozen
        if args.disable_dropout:  # the same tokens' log-probs agree between rollout and training
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
        rows = [dict(row) for row in train_dataset]
        objective = GRPOObjective(args, reward_funcs, rows, processing_class,
                                  reference=ref_model, adapters=adapters, complete=complete,
                                  positions=max_length(base_model(model)))
        super().__init__(model, args, train_dataset=rows, eval_dataset=eval_dataset,
                         processing_class=processing_class, objective=objective, **kwargs)
        if eval_dataset is not None:  # the batch sizes, checked before training starts
            objective.eval_plan(1)

    def described_batches(self, batches, steps: int, walked: str):
        from .doctor import is_rollouts, walk_rollouts  # the doctor's part, imported when it runs

        return walk_rollouts(self, batches, steps, walked) if is_rollouts(batches) else None
