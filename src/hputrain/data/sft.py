"""Supervised fine-tuning data: chat and instruction rows, tokenized with labels on what the model
should learn (TRL's SFT data formats and masking).

Row shapes, detected from the data set's columns (`detect_format`):

  messages              [{"role", "content"}, ...]  TRL's conversational format
  conversations         [{"from", "value"}, ...]    ShareGPT: human -> user, gpt -> assistant
  prompt + completion   two strings, or two message lists (TRL's prompt-completion format)

What is learned (labels other than -100, in Hugging Face's unshifted convention: labels[t] is
input_ids[t], and the model shifts):

- conversations: the assistant turns only, each with its end of turn (chat.py says exactly what
  a turn's text is); with assistant_only_loss=False, every token.
- prompt + completion strings: the completion and an eos token appended to it; as message lists,
  the completion's assistant turns, rendered after the prompt; completion_only_loss=False: all.
- the first token of an example never, whatever the options: nothing before it predicts it. In
  an unpacked batch that changes nothing (the shift drops it); in a packed block it keeps the
  previous example's last token from learning to predict this example's first.

A row with no messages, an empty conversation, an unknown role or a message without text is one
InputError line naming the row; a row with nothing to learn (no assistant turn) is skipped and
counted in SFTStats.

`sft_dataset` is the Python API's one call: rows to packed blocks (or padded rows) that
`hputrain.Trainer` takes, as `hputrain train --model DIR` makes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from ..errors import InputError, did_you_mean
from .chat import ChatTemplate

IGNORE_INDEX = -100
"""Label of a token the loss leaves out (training/loss.py's IGNORE_INDEX, which data/ may not
import)."""

FORMATS = ("messages", "conversations", "prompt_completion")
"""The row shapes, in the order `detect_format` tries them."""

ROLES = ("system", "user", "assistant", "tool")
"""Roles a message may have."""

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system",
                  "user": "user", "assistant": "assistant", "tool": "tool"}
"""ShareGPT's `from` values and the role each becomes."""


@dataclass
class SFTStats:
    """What became of a data set's rows."""

    rows: int = 0
    """Rows read."""
    examples: int = 0
    """Rows that became an example."""
    nothing_to_learn: int = 0
    """Rows skipped because no token of them is learned (a conversation without an assistant turn)."""


def detect_format(columns: Iterable[str]) -> str:
    """The row shape of a data set with these columns: "messages", "conversations" or
    "prompt_completion"; anything else is an InputError naming what was found."""
    columns = list(columns)
    if "messages" in columns:
        return "messages"
    if "conversations" in columns:
        return "conversations"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    raise InputError(f"no chat or instruction columns among {', '.join(map(repr, columns)) or 'none'}: "
                     "SFT data needs 'messages', 'conversations' (ShareGPT) or 'prompt' and "
                     "'completion'")


def normalize_messages(value, where: str, column: str = "messages", message=None) -> list[dict]:
    """A row's list of messages as [{"role", "content", ...}], ShareGPT's from/value mapped.

    Keys other than role and content (tool_calls, name) are kept unless None (a data set's
    struct column fills missing keys with None, which templates would print). `message(item,
    where, k, column)` reads one message (by default a text message; kinds/vlm/data/rows.py's also
    takes image parts)."""
    if value is None:
        raise InputError(f"{where}: no messages (the {column!r} value is empty)")
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise InputError(f"{where}: {column!r} is {type(value).__name__}, not a list of messages")
    messages = [(message or _message)(item, where, k, column) for k, item in enumerate(value)]
    if not messages:
        raise InputError(f"{where}: the conversation in {column!r} is empty")
    return messages


def _message(item, where: str, k: int, column: str) -> dict:
    sharegpt = column == "conversations"
    role_key, content_key = ("from", "value") if sharegpt else ("role", "content")
    if not isinstance(item, Mapping):
        raise InputError(f"{where}: message {k} in {column!r} is {type(item).__name__}, not a "
                         f"{{{role_key!r}, {content_key!r}}} mapping")
    role = item.get(role_key)
    known = SHAREGPT_ROLES if sharegpt else ROLES
    if role not in known:
        raise InputError(f"{where}: message {k} has {role_key} {role!r}, which is not one of "
                         f"{', '.join(known)}{did_you_mean(role, known)}")
    content = item.get(content_key)
    if not isinstance(content, str) and not (content is None and item.get("tool_calls")):
        raise InputError(f"{where}: message {k} has no text: its {content_key!r} is "
                         f"{type(content).__name__}, not a string")
    message = {"role": SHAREGPT_ROLES[role] if sharegpt else role, "content": content}
    message.update((key, v) for key, v in item.items() if key not in (role_key, content_key))
    return {key: v for key, v in message.items() if v is not None}


def encode_conversation(chat: ChatTemplate, messages: list[dict], *, learned: list[int] | None = None,
                        assistant_only_loss: bool = True, where: str = "a row") -> dict:
    """{"input_ids", "labels"} of a conversation rendered by its chat template. Learned: the
    assistant turns among message indices `learned` (all of them by default), each with its end
    of turn; every token with assistant_only_loss=False."""
    if learned is None:
        learned = list(range(len(messages)))
    if assistant_only_loss:
        ids, mask = chat.assistant_mask(messages, learned, where)
    else:
        ids, _ = chat.tokenize(chat.render(messages, False, where))
        mask = [True] * len(ids)
    return _example(ids, mask)


def encode_prompt_completion(tokenizer, prompt: str, completion: str, *,
                             completion_only_loss: bool = True, where: str = "a row") -> dict:
    """{"input_ids", "labels"} of prompt + completion text, an eos token appended; learned: the
    completion's tokens (any token with a character of it) and the eos, or every token."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise InputError(f"{where}: the tokenizer has no eos token to end the completion with")
    text = prompt + completion
    encoded = tokenizer(text, return_offsets_mapping=True)  # with the tokenizer's bos, if it adds one
    ids = list(encoded["input_ids"])
    mask = [not completion_only_loss or end > len(prompt) for _, end in encoded["offset_mapping"]]
    if ids and ids[-1] == eos:  # a tokenizer that adds eos itself (at the empty offset)
        mask[-1] = True
    else:
        ids.append(eos)
        mask.append(True)
    return _example(ids, mask)


def _example(ids: list[int], mask: list[bool]) -> dict:
    labels = [t if learn and k > 0 else IGNORE_INDEX for k, (t, learn) in enumerate(zip(ids, mask))]
    return {"input_ids": ids, "labels": labels}


def encode_row(row: Mapping, fmt: str, tokenizer, chat: ChatTemplate | None = None, *,
               assistant_only_loss: bool = True, completion_only_loss: bool = True,
               where: str = "a row") -> dict | None:
    """One row of shape `fmt` (see `detect_format`) as {"input_ids", "labels"}; None when it has
    nothing to learn. `chat` is needed for conversations (ChatTemplate(tokenizer))."""
    if fmt in ("messages", "conversations"):
        messages = normalize_messages(row.get(fmt), where, fmt)
        example = encode_conversation(_need(chat, tokenizer), messages, where=where,
                                      assistant_only_loss=assistant_only_loss)
    elif fmt == "prompt_completion":
        prompt, completion = row.get("prompt"), row.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            example = encode_prompt_completion(tokenizer, prompt, completion, where=where,
                                               completion_only_loss=completion_only_loss)
        elif isinstance(prompt, str) or isinstance(completion, str):
            raise InputError(f"{where}: 'prompt' and 'completion' must both be text or both be "
                             f"message lists, not {type(prompt).__name__} and "
                             f"{type(completion).__name__}")
        else:
            before = normalize_messages(prompt, where, "prompt")
            after = normalize_messages(completion, where, "completion")
            example = encode_conversation(
                _need(chat, tokenizer), before + after, where=where,
                learned=list(range(len(before), len(before) + len(after))),
                assistant_only_loss=completion_only_loss)
    else:
        raise InputError(f"unknown SFT row format {fmt!r}: one of {', '.join(FORMATS)}")
    return example if any(label != IGNORE_INDEX for label in example["labels"]) else None


def _need(chat: ChatTemplate | None, tokenizer) -> ChatTemplate:
    return chat if chat is not None else ChatTemplate(tokenizer)


def encode_rows(rows: Iterable[Mapping], tokenizer, *, fmt: str | None = None,
                columns: Iterable[str] | None = None, template_name: str | None = None,
                assistant_only_loss: bool = True,
                completion_only_loss: bool = True) -> tuple[list[dict], SFTStats]:
    """Every row of a data set (a list of dicts, a datasets.Dataset) as {"input_ids", "labels"}
    lists, rows with nothing to learn left out and counted. The format is detected from `columns`
    (the data set's column_names, else the first row's keys) unless `fmt` is given."""
    rows = list(rows) if not hasattr(rows, "column_names") else rows
    if fmt is None:
        if columns is None:
            columns = getattr(rows, "column_names", None) or (list(rows[0]) if len(rows) else [])
        fmt = detect_format(columns)
    chat = None
    if fmt != "prompt_completion" or _has_message_lists(rows):
        chat = ChatTemplate(tokenizer, template_name)
    stats, examples = SFTStats(), []
    for index, row in enumerate(rows):
        stats.rows += 1
        example = encode_row(row, fmt, tokenizer, chat, where=f"row {index}",
                             assistant_only_loss=assistant_only_loss,
                             completion_only_loss=completion_only_loss)
        if example is None:
            stats.nothing_to_learn += 1
        else:
            examples.append(example)
    stats.examples = len(examples)
    return examples, stats


def _has_message_lists(rows) -> bool:
    """Whether a prompt-completion data set holds messages rather than text (its first row says)."""
    return len(rows) > 0 and not isinstance(rows[0].get("prompt"), str)


# -- the Python API: rows to a data set the Trainer takes ---------------------------------------

class SFTDataset:
    """Blocks (or rows) for `hputrain.Trainer`, made by `sft_dataset`: a map-style data set of
    tensor dicts, and the collator to pass with it (None for packed blocks, which are all of one
    shape; the Trainer turns their `seq_lens` into the block mask on the device)."""

    def __init__(self, items: list[dict], collator, rows: SFTStats, packed) -> None:
        self.items = items
        self.collator = collator
        """`data_collator` for the Trainer: length buckets for unpacked rows, else None."""
        self.rows = rows
        """What became of the rows (SFTStats)."""
        self.packed = packed
        """What cutting and packing did to the examples (packing.PackingStats)."""

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def sft_dataset(data, tokenizer, block_size: int, *, packing: bool = True,
                assistant_only_loss: bool = True, completion_only_loss: bool = True,
                buckets: int = 4) -> SFTDataset:
    """Chat or instruction rows (a datasets.Dataset, or a list of dicts, in any shape that
    `detect_format` knows) as a data set for `hputrain.Trainer`: what `hputrain train --model DIR`
    does with them, in one call.

        train = hputrain.sft_dataset(dataset, tokenizer, block_size=1024)
        Trainer(model, args, train_dataset=train, data_collator=train.collator).train()

    TRL's SFTConfig names: `packing`, `assistant_only_loss`, `completion_only_loss`; `block_size`
    is its `max_length` (an example longer than it is cut, and counted in `.packed`). Packed:
    whole examples in blocks of block_size tokens with restarting position_ids and their lengths
    (data/packing.py), so the model must take attention_mask and position_ids. Unpacked: one
    example a row, padded per batch to one of `buckets` lengths by `.collator`. Rows are encoded
    with the tokenizer's chat template; a bad row is an InputError naming it."""
    from .packing import pack, unpacked

    examples, rows = encode_rows(data, tokenizer, assistant_only_loss=assistant_only_loss,
                                 completion_only_loss=completion_only_loss)
    pad = next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None)
    if packing:
        (items, stats), collator = pack(examples, block_size, pad), None
    else:
        items, collator, stats = unpacked(examples, block_size, pad, buckets)
    if not items:
        raise InputError(f"none of the {rows.rows} rows has anything to learn within {block_size} "
                         "tokens (block_size)")
    return SFTDataset(items, collator, rows, stats)


def hold_out(count: int, percentage: float, path: str) -> tuple[np.ndarray, np.ndarray]:
    """(the examples trained on, those held out): the last `percentage` percent, at least one."""
    if percentage <= 0:
        return np.arange(count), np.arange(0)
    held_out = max(1, int(count * percentage / 100))
    if held_out >= count:
        raise InputError(f"--dataset {path} has {count} example(s), too few to hold "
                         f"{percentage:g}% out for validation: give more rows, or "
                         "--validation-split-percentage 0")
    return np.arange(count - held_out), np.arange(count - held_out, count)
