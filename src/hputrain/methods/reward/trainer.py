"""Reward-model training: TRL 1.16's RewardTrainer loss and metrics as an objective the training
loop calls, and `RewardTrainer`, the Trainer that trains with it.

The model is a sequence classifier with one label (num_labels=1): its score of a sequence is
logits[:, 0], which transformers takes at the last token that is not padding (so the model's
config.pad_token_id must be set; the trainer sets it from the tokenizer, as TRL does). A pair's
chosen and rejected sequences go through the model in one forward, chosen rows first.

Rows are tokenized as TRL's RewardTrainer tokenizes them: a prompt (when there is one) is joined
to each completion and the whole sequence tokenized; text gets the eos text appended (unless it
ends with it), a conversation goes through the chat template (no generation prompt, the row's
`tools` passed on). A pair whose chosen or rejected sequence is longer than max_length is left
out (counted), never cut: a cut sequence would be scored on a token that is not its end.

The loss of a pair is -log sigmoid(r_chosen - r_rejected - margin) (the margin column when the
rows have one, else 0), plus center_rewards_coefficient * (r_chosen + r_rejected)^2 when that is
set; a step's loss is the mean over the pairs of its global batch, however it is split (loss.py's
rule, with pairs for tokens: dpo.PairCount). The metrics carry TRL's names (num_tokens,
min_reward, mean_reward, max_reward, accuracy, margin), summed on the device and read back at
logging steps only. accuracy, margin and mean_reward are means over the pairs (rows) since the
last record, as TRL's means of equal micro-batches are; min_reward and max_reward are the lowest
and highest score since then (TRL averages each micro-batch's: the same for one micro-batch a
record); num_tokens counts every training token so far, padding left out.
"""
from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import RewardConfig
from ...data.batching import bucket_lengths
from ...data.chat import render_ids
from ...data.sft import normalize_messages
from ...errors import InputError
from ..dpo.trainer import PairCount
from ...training.evaluation import logits_of
from ...training.objective import Objective
from ...training.trainer import Trainer

METRICS = ("min_reward", "mean_reward", "max_reward", "accuracy", "margin")
"""TRL's metric names, beside num_tokens."""

ENCODED_KEYS = ("chosen_ids", "rejected_ids")
"""An encoded pair's token lists (TRL's column names for tokenized reward data)."""


def reward_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                center_rewards_coefficient: float | None = None) -> torch.Tensor:
    """The mean over the pairs of TRL 1.16's reward-model loss (see the module docstring)."""
    difference = chosen - rejected if margin is None else chosen - rejected - margin
    loss = -F.logsigmoid(difference).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    return loss


# -- rows to pairs ---------------------------------------------------------------------------------

@dataclass
class RewardStats:
    rows: int = 0
    pairs: int = 0
    too_long: int = 0
    """Pairs left out because their chosen or rejected sequence is longer than max_length."""


def encode_reward_pair(row: Mapping, tokenizer, *, where: str) -> dict:
    """One row as {"chosen_ids", "rejected_ids"} (and "margin" when the row has one)."""
    prompt, chosen, rejected = _sequences(row, where)
    if isinstance(chosen, list):
        tools = row.get("tools")
        tools = json.loads(tools) if isinstance(tools, str) else tools
        ids = [render_ids(tokenizer, prompt + completion, where, tools=tools) for completion in (chosen, rejected)]
    else:
        eos = tokenizer.eos_token or ""  # TRL ends each completion with it before joining
        ids = [list(tokenizer(prompt + (text if text.endswith(eos) else text + eos))["input_ids"])
               for text in (chosen, rejected)]
    pair = dict(zip(ENCODED_KEYS, ids))
    if row.get("margin") is not None:
        pair["margin"] = _margin(row["margin"], where)
    return pair


def encode_reward_pairs(rows: Iterable[tuple[str, Mapping]], tokenizer,
                        max_length: int | None = None) -> tuple[list[dict], RewardStats]:
    """Every (where, row) encoded (rows already encoded, with chosen_ids and rejected_ids, kept
    as they are); pairs longer than max_length left out and counted. Either every row has a
    margin or none does (a batch's margins are one tensor)."""
    stats, pairs, first_margin = RewardStats(), [], None
    for where, row in rows:
        stats.rows += 1
        if not isinstance(row, Mapping):
            raise InputError(f"{where} is not an object with chosen and rejected fields")
        if all(key in row for key in ENCODED_KEYS):
            pair = {key: list(row[key]) for key in ENCODED_KEYS}
            if row.get("margin") is not None:
                pair["margin"] = _margin(row["margin"], where)
        else:
            pair = encode_reward_pair(row, tokenizer, where=where)
        has_margin = "margin" in pair
        first_margin = has_margin if first_margin is None else first_margin
        if has_margin != first_margin:
            raise InputError(f"{where} {'has' if has_margin else 'has no'} 'margin' and the first row "
                             f"{'has' if first_margin else 'has none'}: give every row a margin, or none")
        if max_length is not None and max(len(pair[k]) for k in ENCODED_KEYS) > max_length:
            stats.too_long += 1
            continue
        pairs.append(pair)
    stats.pairs = len(pairs)
    return pairs, stats


def _sequences(row: Mapping, where: str):
    """(prompt, chosen, rejected): text, or message lists; the prompt empty when the row has none
    (the shared start stays in both sequences, so it is not split off: TRL scores them whole)."""
    missing = [key for key in ("chosen", "rejected") if row.get(key) is None]
    if missing:
        raise InputError(f"{where} has no {missing[0]!r} field: preference rows need 'chosen' and "
                         "'rejected' (and optionally 'prompt')")
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if any(isinstance(v, list) for v in (prompt, chosen, rejected)):
        prompt = [] if prompt is None else normalize_messages(prompt, where, "prompt")
        return (prompt, normalize_messages(chosen, where, "chosen"),
                normalize_messages(rejected, where, "rejected"))
    for key, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if value is not None and not isinstance(value, str):
            raise InputError(f"{where}: {key!r} is {type(value).__name__}, expected text or a list "
                             "of messages")
    return prompt or "", chosen, rejected


def _margin(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"{where}: 'margin' is {value!r}, expected a finite number")
    return float(value)


class RewardCollator:
    """Pairs to one batch: the chosen sequences then the rejected ones, padded on the right to one
    of a few lengths (static shapes: lazy mode compiles a bounded set of graphs), with `margin`
    (one per pair) when the pairs carry it. Right padding leaves each score alone: the model
    reads it at the last token that is not padding, which sees no padding (causal attention)."""

    def __init__(self, pad_token_id: int, max_length: int, buckets: int = 4) -> None:
        self.pad_token_id = pad_token_id
        self.lengths = bucket_lengths(buckets, max_length)

    def __call__(self, pairs: list[dict]) -> dict:
        rows = [p["chosen_ids"] for p in pairs] + [p["rejected_ids"] for p in pairs]
        longest = max(map(len, rows))
        width = next((n for n in self.lengths if n >= longest), longest)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, :len(row)] = 1
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if "margin" in pairs[0]:
            batch["margin"] = torch.tensor([p["margin"] for p in pairs], dtype=torch.float32)
        return batch


# -- the objective ---------------------------------------------------------------------------------

class RewardObjective(Objective):
    """Reward modelling as the loop's objective (objective.py): pairs collated chosen-then-
    rejected, the loss a mean over pairs, TRL's metrics summed on the device (`metrics` reads
    them). Evaluation sets are encoded here too (`eval_dataset`)."""

    has_perplexity = False  # exp of a pairwise loss means nothing

    def __init__(self, config: RewardConfig, *, pad: int, max_length: int, tokenizer=None) -> None:
        self.config = config
        self.collate = RewardCollator(pad, max_length)
        self.tokenizer = tokenizer
        self.sums: torch.Tensor | None = None  # scores, correct pairs, margins, tokens
        self.low: torch.Tensor | None = None  # the lowest and highest score since the last record
        self.high: torch.Tensor | None = None
        self.pairs = 0  # this rank's pairs summed into `sums`
        self.num_tokens = 0  # training tokens so far, every rank's (TRL's num_tokens)
        self.training = True  # False inside evaluating(): tokens count for training only

    def bind(self, loop) -> None:
        super().bind(loop)
        if loop.group.cp_size > 1:
            raise InputError("reward-model training under context parallelism is not supported: "
                             "set context_parallel_size=1")

    def count_tokens(self, model):
        return PairCount()  # the step's loss is a mean over pairs

    def eval_dataset(self, dataset):
        return encoded(dataset, self.tokenizer, self.config.max_length)

    @contextlib.contextmanager
    def evaluating(self):
        training = self.sums, self.low, self.high, self.pairs  # summed since the last log: kept
        self.sums, self.low, self.high, self.pairs, self.training = None, None, None, 0, False
        try:
            yield
        finally:
            self.sums, self.low, self.high, self.pairs = training
            self.training = True

    def compute_loss(self, module, batch) -> torch.Tensor:
        """The reward-model loss of a batch: the mean over its pairs."""
        output = self.loop.call_model(module, batch["input_ids"], batch["attention_mask"])
        scores = logits_of(output)[:, 0].float()
        chosen, rejected = scores.chunk(2)
        margin = batch.get("margin")
        loss = reward_loss(chosen, rejected, None if margin is None else margin.float(),
                           self.config.center_rewards_coefficient)
        self._add_metrics(scores.detach(), batch["attention_mask"])
        return loss

    def _add_metrics(self, scores: torch.Tensor, attention_mask: torch.Tensor) -> None:
        if not self.counting:
            return
        chosen, rejected = scores.chunk(2)
        tokens = attention_mask.sum().float() if self.training else scores.new_zeros(())
        sums = torch.stack([scores.sum(), (chosen > rejected).float().sum(),
                            (chosen - rejected).sum(), tokens])
        low, high = scores.min(), scores.max()
        if self.sums is None:
            self.sums, self.low, self.high = sums, low, high
        else:
            self.sums = self.sums + sums
            self.low, self.high = torch.minimum(self.low, low), torch.maximum(self.high, high)
        self.pairs += chosen.shape[0]

    def metrics(self, group, prefix: str = "") -> dict:
        """The metrics over every rank's pairs since the last call (one device read), then zeroed;
        {} when no rank summed a pair. Every rank calls it and enters the collectives, with
        zeros when its share of the data gave it nothing to sum."""
        device = self.loop.device
        mine = self.sums if self.sums is not None else torch.zeros(4, device=device)
        sums = torch.cat([mine.float(), torch.tensor([float(self.pairs)]).to(mine.device)])
        scores, correct, margins, tokens, pairs = group.all_reduce_sum(sums).tolist()
        bounds = [(self.low.item(), self.high.item()) if self.low is not None else (math.inf, -math.inf)]
        if getattr(group, "distributed", False):
            bounds = group.gather_objects(bounds[0])
        self.sums, self.low, self.high, self.pairs = None, None, None, 0
        self.num_tokens += int(tokens)
        if pairs == 0:
            return {}
        values = {"num_tokens": self.num_tokens, "min_reward": min(low for low, _ in bounds),
                  "mean_reward": scores / (2 * pairs), "max_reward": max(high for _, high in bounds),
                  "accuracy": correct / pairs, "margin": margins / pairs}
        return {f"{prefix}{name}": value for name, value in values.items()}


# -- the trainer -----------------------------------------------------------------------------------

class RewardTrainer(Trainer):
    """A Trainer whose objective is a reward model's (see the module docstring). `model`: a
    sequence classifier with num_labels=1 (or a PEFT model of one); `train_dataset` and
    `eval_dataset`: preference rows (chosen / rejected, an optional prompt and margin, text or
    messages, encoded with `processing_class`) or pairs already encoded (chosen_ids /
    rejected_ids). The tokenizer's pad token (its eos token when it has none) becomes the
    model's config.pad_token_id, as in TRL; dropout is switched off unless
    args.disable_dropout is False."""

    def __init__(self, model, args: RewardConfig | dict | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, **kwargs) -> None:
        args = args if isinstance(args, RewardConfig) else RewardConfig(**(args or {}))
        _check_one_label(model)
        pad = set_pad_token(model, processing_class)
        if args.disable_dropout:
            disable_dropout(model)
        train_dataset, eval_dataset = (encoded(d, processing_class, args.max_length)
                                       for d in (train_dataset, eval_dataset))
        longest = max((len(p[k]) for d in (train_dataset, eval_dataset) if d for p in d
                       for k in ENCODED_KEYS), default=2)
        objective = RewardObjective(args, pad=pad, max_length=min(longest, args.max_length or longest),
                                    tokenizer=processing_class)
        super().__init__(model, args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, objective=objective, **kwargs)


def encoded(dataset, tokenizer, max_length: int | None) -> list[dict] | None:
    """Preference rows (or rows already encoded) as a list of pairs no longer than max_length."""
    if dataset is None:
        return None
    rows = list(dataset)
    if rows and not all(k in rows[0] for k in ENCODED_KEYS) and tokenizer is None:
        raise InputError("RewardTrainer needs processing_class (the tokenizer) to encode "
                         "preference rows")
    pairs, _ = encode_reward_pairs(((f"row {i + 1}", row) for i, row in enumerate(rows)),
                                   tokenizer, max_length)
    if rows and not pairs:
        raise InputError(f"every one of the {len(rows)} pairs is longer than max_length "
                         f"({max_length}): raise max_length")
    return pairs


def set_pad_token(model, tokenizer) -> int:
    """The pad id the model finds each sequence's last token by (TRL's choice: the tokenizer's pad
    token, else its eos token), set in the model's config and the tokenizer; the id."""
    config = model.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if tokenizer is not None:
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise InputError("the tokenizer has neither a pad token nor an eos token: set "
                                 "tokenizer.pad_token (the score is read at the last token "
                                 "before the padding)")
            tokenizer.pad_token = tokenizer.eos_token
        config.pad_token_id = tokenizer.pad_token_id
    if getattr(config, "pad_token_id", None) is None:
        raise InputError("the model's config has no pad_token_id and no processing_class gives "
                         "one: pass the tokenizer as processing_class")
    return config.pad_token_id


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout layer's probability set to 0 (TRL's disable_dropout), so that a pair's two
    sequences are scored by the same function."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def _check_one_label(model) -> None:
    labels = getattr(getattr(model, "config", None), "num_labels", None)
    if labels != 1:
        raise InputError(f"a reward model scores each sequence with one number: the model has "
                         f"num_labels={labels}; load it with "
                         "AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1)")

