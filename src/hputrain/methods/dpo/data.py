"""Preference pairs (DPO data): rows of a prompt, a chosen and a rejected completion, tokenized as
TRL 1.16's DPOTrainer tokenizes them, and batched with the chosen and rejected sequences in one
batch of static shape.

Row shapes (TRL's), detected from the columns (recipes/hf/methods.is_preference):

  prompt + chosen + rejected   strings, or a message list as prompt and assistant message lists
                               as chosen / rejected (rendered through the chat template)
  chosen + rejected            full conversations (or texts) sharing a prefix: the implicit
                               prompt, split off as TRL's extract_prompt does

Tokenization (TRL's): text completions get the eos text appended (unless they end with it); the
prompt and prompt + completion are tokenized whole (a conversation through the chat template, the
prompt with the generation prompt), and the completion starts where those token lists first
differ, which is after the prompt unless tokens merge across the boundary. So a completion's
log-probability is the sum over exactly the tokens TRL sums.

Length: `max_length` keeps the first tokens of prompt + completion (TRL's keep_start), and a row
whose prompt alone fills it is left out and counted. `max_prompt_length` (TRL up to 0.2x and
Optimum's GaudiDPOTrainer) first keeps only the prompt's last tokens when the pair is too long.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import InputError
from ...data.batching import bucket_lengths
from ...data.chat import render_ids
from ...data.sft import normalize_messages
from ...data.token_store import Ragged

PAIR_KEYS = ("prompt_ids", "chosen_ids", "rejected_ids")
"""An encoded pair's token lists."""

REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
"""An encoded pair's precomputed reference log-probabilities, when there are any."""


@dataclass
class PairStats:
    rows: int = 0
    pairs: int = 0
    prompt_fills_block: int = 0
    """Rows left out because their prompt alone fills max_length (nothing to compare)."""
    truncated: int = 0
    """Pairs whose prompt or completions were cut."""


def pair_shape(columns: Iterable[str]) -> str:
    """How the header names the data: explicit or implicit prompt."""
    return "prompt_chosen_rejected" if "prompt" in set(columns) else "implicit_prompt"


def split_implicit_prompt(chosen, rejected):
    """(prompt, chosen, rejected) from two completions sharing a prefix: the longest common run
    of messages (or characters, for text, ending before a space), as TRL's extract_prompt."""
    index = 0
    for index in range(min(len(chosen), len(rejected))):
        if chosen[index] != rejected[index]:
            if index and chosen[index - 1] == " ":
                index -= 1
            break
    else:
        index = min(len(chosen), len(rejected))
    return chosen[:index], chosen[index:], rejected[index:]


def encode_pair(row: Mapping, tokenizer, *, where: str, max_length: int | None = None,
                max_prompt_length: int | None = None, stats: PairStats | None = None) -> dict | None:
    """One row as {"prompt_ids", "chosen_ids", "rejected_ids"} (see the module docstring); None
    for a row whose prompt fills max_length."""
    stats = stats if stats is not None else PairStats()
    stats.rows += 1
    prompt, chosen, rejected = _fields(row, where)
    if isinstance(chosen, list):
        prompt_ids = render_ids(tokenizer, prompt, where, generation_prompt=True)
        with_chosen = render_ids(tokenizer, prompt + chosen, where)
        with_rejected = render_ids(tokenizer, prompt + rejected, where)
    else:
        eos = tokenizer.eos_token or ""
        chosen, rejected = (text if text.endswith(eos) else text + eos for text in (chosen, rejected))
        prompt_ids, with_chosen, with_rejected = (
            list(tokenizer(text)["input_ids"]) for text in (prompt, prompt + chosen, prompt + rejected))
    start = min(_common_prefix(prompt_ids, with_chosen), _common_prefix(prompt_ids, with_rejected))
    pair = {"prompt_ids": prompt_ids[:start], "chosen_ids": with_chosen[start:],
            "rejected_ids": with_rejected[start:]}
    return _fit(pair, max_length, max_prompt_length, stats)


def encode_pairs(rows: Iterable[tuple[str, Mapping]], tokenizer, *, max_length: int | None = None,
                 max_prompt_length: int | None = None) -> tuple[list[dict], PairStats]:
    """Every (where, row) encoded; the rows left out counted in the stats."""
    stats, pairs = PairStats(), []
    for where, row in rows:
        pair = encode_pair(row, tokenizer, where=where, max_length=max_length,
                           max_prompt_length=max_prompt_length, stats=stats)
        if pair is not None:
            pairs.append(pair)
    stats.pairs = len(pairs)
    return pairs, stats


def _fields(row: Mapping, where: str):
    if not isinstance(row, Mapping):
        raise InputError(f"{where} is not an object with prompt, chosen and rejected fields")
    missing = [key for key in ("chosen", "rejected") if row.get(key) is None]
    if missing:
        raise InputError(f"{where} has no {missing[0]!r} field: preference rows need 'chosen' and "
                         "'rejected' (and 'prompt', unless it is the start both share)")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    conversational = any(isinstance(v, list) for v in (prompt, chosen, rejected))
    if conversational:
        chosen = normalize_messages(chosen, where, "chosen")
        rejected = normalize_messages(rejected, where, "rejected")
        if prompt is None:
            prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
        else:
            prompt = normalize_messages(prompt, where, "prompt")
        if not chosen or not rejected:
            raise InputError(f"{where}: chosen and rejected are the same conversation; a pair needs "
                             "two different completions")
        return prompt, chosen, rejected
    for key, value in (("chosen", chosen), ("rejected", rejected), ("prompt", prompt)):
        if value is not None and not isinstance(value, str):
            raise InputError(f"{where}: {key!r} is {type(value).__name__}, expected text or a list "
                             "of messages")
    if prompt is None:
        prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
    return prompt, chosen, rejected


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _fit(pair: dict, max_length: int | None, max_prompt_length: int | None,
         stats: PairStats) -> dict | None:
    prompt, chosen, rejected = (pair[k] for k in PAIR_KEYS)
    longest = len(prompt) + max(len(chosen), len(rejected))
    cut = False
    if max_length is not None and max_prompt_length is not None and longest > max_length:
        if len(prompt) > max_prompt_length:
            prompt, cut = prompt[-max_prompt_length:], True
    if max_length is not None:
        if len(prompt) >= max_length:
            stats.prompt_fills_block += 1
            return None
        room = max_length - len(prompt)
        cut = cut or max(len(chosen), len(rejected)) > room
        chosen, rejected = chosen[:room], rejected[:room]
    stats.truncated += cut
    return {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}


class PairCollator:
    """Pairs to one batch: the chosen sequences (prompt + chosen) then the rejected ones, padded on
    the right to one of a few lengths (static shapes: lazy mode compiles a bounded set of graphs),
    with `completion_mask` on the completion tokens and the reference log-probs as `ref_logps`
    (chosen then rejected) when the pairs carry them."""

    def __init__(self, pad_token_id: int, max_length: int, buckets: int = 4) -> None:
        self.pad_token_id = pad_token_id
        self.lengths = bucket_lengths(buckets, max_length)

    def __call__(self, pairs: list[dict]) -> dict:
        rows = ([p["prompt_ids"] + p["chosen_ids"] for p in pairs]
                + [p["prompt_ids"] + p["rejected_ids"] for p in pairs])
        starts = [len(p["prompt_ids"]) for p in pairs] * 2
        longest = max(map(len, rows))
        width = next((n for n in self.lengths if n >= longest), longest)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        completion_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (row, start) in enumerate(zip(rows, starts)):
            input_ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, :len(row)] = 1
            completion_mask[i, start:len(row)] = 1
        batch = {"input_ids": input_ids, "attention_mask": attention_mask,
                 "completion_mask": completion_mask}
        if all(REF_KEYS[0] in p for p in pairs):
            batch["ref_logps"] = torch.tensor([p[REF_KEYS[0]] for p in pairs]
                                              + [p[REF_KEYS[1]] for p in pairs], dtype=torch.float32)
        return batch


def pairs_in(batch) -> int:
    """The pairs in a PairCollator batch (on the host: its shape, no device read)."""
    return int(batch["input_ids"].shape[0]) // 2


# -- pairs kept flat: made once per node, memory-mapped -------------------------------------------

class EncodedPairs:
    """Encoded pairs kept as three flat int32 arrays (token_store.Ragged, memory-mapped when read
    from a cache): a sequence whose items are the dicts `encode_pairs` makes, built when read.
    `index` picks which pairs, in order (a split held out for validation). `ref_logps`, when
    given, are the pairs' precomputed reference log-probs, kept as an array beside the tokens
    and added to each item under REF_KEYS."""

    def __init__(self, columns: dict[str, Ragged], index: np.ndarray | None = None,
                 ref_logps: np.ndarray | None = None) -> None:
        self.columns = columns
        """PAIR_KEYS -> Ragged."""
        self.index = np.arange(len(columns[PAIR_KEYS[0]])) if index is None else index
        self.ref_logps = ref_logps
        """[len, 2] float64, pair i's reference log-probs of its chosen and rejected completions
        (row i), or None."""

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        pair = {key: tokens.tolist() for key, tokens in self.tokens(i).items()}
        if self.ref_logps is not None:
            chosen, rejected = self.ref_logps[i]
            pair.update({REF_KEYS[0]: float(chosen), REF_KEYS[1]: float(rejected)})
        return pair

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def tokens(self, i: int) -> dict[str, np.ndarray]:
        """Pair i's token ids as int32 views of the flat arrays (no list built)."""
        pair = int(self.index[i])
        return {key: self.columns[key][pair] for key in PAIR_KEYS}

    def take(self, start: int, stop: int) -> EncodedPairs:
        """Pairs start to stop (exclusive), as a view."""
        refs = None if self.ref_logps is None else self.ref_logps[start:stop]
        return EncodedPairs(self.columns, self.index[start:stop], refs)

    def with_reference(self, ref_logps: np.ndarray) -> EncodedPairs:
        """The same pairs (the same arrays) carrying `ref_logps` ([len, 2]: chosen, rejected)."""
        ref_logps = np.asarray(ref_logps, dtype=np.float64)
        if ref_logps.shape != (len(self), 2):
            raise ValueError(f"{len(self)} pairs need [{len(self)}, 2] reference log-probs, "
                             f"got {list(ref_logps.shape)}")
        return EncodedPairs(self.columns, self.index, ref_logps)

    @classmethod
    def of(cls, pairs: list[dict]) -> EncodedPairs:
        return cls({key: Ragged.of([p[key] for p in pairs]) for key in PAIR_KEYS})

    @classmethod
    def join(cls, parts: list[EncodedPairs]) -> EncodedPairs:
        """The pairs of every part (whole, not views), in order."""
        return cls({key: Ragged.join([p.columns[key] for p in parts]) for key in PAIR_KEYS})


def encode_part(context, rows: list) -> tuple[EncodedPairs, PairStats]:
    """`encode_pairs` of some (where, row), kept flat: the work of one tokenizing process;
    `context` is (tokenizer, max_length, max_prompt_length)."""
    tokenizer, max_length, max_prompt_length = context
    pairs, stats = encode_pairs(rows, tokenizer, max_length=max_length,
                                max_prompt_length=max_prompt_length)
    return EncodedPairs.of(pairs), stats
