"""`hputrain train --model DIR --dataset FOLDER --streaming`: a folder of JSON Lines or Parquet
shards, larger than a token cache should hold, read as a stream (data/streaming.py): each rank its
own shards, rows tokenized and packed on the fly, the stream's position saved per rank with each
checkpoint and restored on resume.

The method comes from the first row's fields, as without --streaming: the text column means causal
LM on packed text (hf_data.token_ids, cut into blocks as hf_data does); messages, conversations
or prompt + completion mean SFT (sft.encode_row), packed a buffer of examples at a time
(packing.pack) or, with --no-packing, one example a row. Preference pairs (DPO) are refused.

A stream has no length: --max-steps sets the run's length. A pass over a rank's shards is an
epoch; when one rank's shards run out, every rank starts its next pass (data.MicroBatches), so
what the others had left is never read: the header says when the shards do not split evenly over
the ranks, and a line at the first pass's end names what is left (ShardStream.pass_ended). A
shard folder has no split to hold out: its validation split (a `validation` subfolder of shards, or
shards named for it, data/splits.py) is evaluated on (read whole, so keep it small), else there is
no evaluation; its test shards are never read.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...data import packing
from ...data import sft
from ...data.chat import chat_template, use_chat_template
from ...data.streaming import ShardStream, find_shards, first_row, read_rows, validation_shards
from ...errors import InputError
from . import data as hf_data
from .common import counted
from .methods import is_preference


@dataclass
class StreamData:
    """What the recipe trains and evaluates on, and what its header says of it."""

    train: ShardStream
    validation: list[dict] | None
    method: str
    """"text", or the SFT row shape (sft.FORMATS)."""
    collator: object | None
    """Length buckets for unpacked SFT rows; None for blocks."""
    validation_files: int = 0


def check_stream(options, training_args) -> None:
    """The refusals that need no model, each in one line, before any weight is read: no shards,
    preference pairs (DPO), no --max-steps, fewer shards than data-parallel ranks."""
    shards = find_shards(options.dataset)
    record, where = first_row(shards)
    if options.method == "dpo" or is_preference(record):
        raise InputError("--streaming trains causal LM and SFT rows; DPO (preference pairs) reads "
                         "its data set whole: leave out --streaming")
    if training_args.max_steps <= 0:
        raise InputError("--streaming needs --max-steps N: a stream's epoch has no length known in "
                         "advance")
    devices, nodes = training_args.devices, training_args.num_nodes
    if isinstance(devices, int) and isinstance(nodes, int):
        ranks = devices * nodes // max(1, training_args.context_parallel_size)
        if len(shards) < ranks:
            raise InputError(f"--streaming: --dataset {options.dataset} has {len(shards)} shard(s) "
                             f"for {ranks} data-parallel ranks, and each rank reads its own "
                             f"shards: split the data into at least {ranks} files")


def stream_data(options, tokenizer, block_size: int) -> StreamData:
    """The training stream and the validation blocks (or rows) of a shard folder."""
    use_chat_template(tokenizer, options.chat_template)
    shards = find_shards(options.dataset)
    record, where = first_row(shards)
    method = row_method(record, where, options)
    pad = next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None)
    if method == "text":
        encode, kind = TextEncoder(tokenizer, options.text_column), "text"
    else:
        encode, kind = SFTEncoder(tokenizer, method, record, options), "packed" if options.packing else "rows"
    train = ShardStream(shards, encode, block_size=block_size, packing=kind, pad_token_id=pad)
    held_out = validation_shards(options.dataset)
    validation = validation_set(held_out, encode, kind, block_size, pad, tokenizer) if held_out else None
    collator = packing.unpacked([], block_size, pad)[1] if kind == "rows" else None
    return StreamData(train, validation, method, collator, len(held_out))


def row_method(record: dict, where: str, options) -> str:
    """"text" or the SFT row shape, from one row's fields and --method."""
    columns = list(record)
    try:
        method = sft.detect_format(columns)
    except InputError:
        if options.text_column not in columns:
            raise InputError(f"{where} has no {options.text_column!r} field (it has: "
                             f"{', '.join(map(str, columns)) or 'nothing'}): name the text field "
                             "with --text-column, or give chat rows in 'messages' or "
                             "'conversations', or 'prompt' and 'completion'") from None
        method = "text"
    if options.method in ("lm", "sft") and (options.method == "lm") != (method == "text"):
        found = "text" if method == "text" else f"{method} rows"
        raise InputError(f"--method {options.method}: --dataset {options.dataset} holds {found}: "
                         "leave --method at auto, or give data of that shape")
    return method


class TextEncoder:
    """A row's text as token ids followed by eos (hf_data.token_ids: the tokens the cached path
    makes of the same document). A class, not a closure: data workers started by spawn pickle it."""

    def __init__(self, tokenizer, column: str) -> None:
        self.tokenizer, self.column = tokenizer, column

    def __call__(self, record: dict, where: str):
        value = record.get(self.column)
        if not isinstance(value, str):
            has = "no such field" if self.column not in record else type(value).__name__
            raise InputError(f"{where}: field {self.column!r} is {has}, not text (name the text "
                             "field with --text-column)")
        return hf_data.token_ids([value], self.tokenizer)


class SFTEncoder:
    """A chat or instruction row as {"input_ids", "labels"} (sft.encode_row), None when it has
    nothing to learn; the chat template is needed unless the rows are prompt + completion text."""

    def __init__(self, tokenizer, fmt: str, first: dict, options) -> None:
        self.tokenizer, self.fmt = tokenizer, fmt
        text_pairs = fmt == "prompt_completion" and isinstance(first.get("prompt"), str)
        self.chat = None if text_pairs else chat_template(tokenizer, fmt)
        self.assistant_only_loss = options.assistant_only_loss
        self.completion_only_loss = options.completion_only_loss

    def __call__(self, record: dict, where: str):
        return sft.encode_row(record, self.fmt, self.tokenizer, self.chat, where=where,
                              assistant_only_loss=self.assistant_only_loss,
                              completion_only_loss=self.completion_only_loss)


def validation_set(shards: list[Path], encode, kind: str, block_size: int, pad: int, tokenizer):
    """The validation shards, read whole: packed as the training stream packs its rows."""
    where = f"--dataset {shards[0].parent}"
    rows = [(record, f"{where} {shard.name} row {row}") for shard in shards
            for record, row, _ in read_rows(shard)]
    if kind == "text":
        ids = np.concatenate([encode(record, at) for record, at in rows]) if rows else np.zeros(0, np.int32)
        blocks = hf_data.pack(ids, block_size, where)
        return [{"input_ids": torch.from_numpy(b.astype(np.int64)), "labels": torch.from_numpy(b.astype(np.int64))}
                for b in blocks]
    examples = [e for e in (encode(record, at) for record, at in rows) if e is not None]
    items = (packing.pack(examples, block_size, pad)[0] if kind == "packed"
             else packing.unpacked(examples, block_size, pad)[0])
    if not items:
        raise InputError(f"{where} (its validation split): no example has anything to learn within "
                         "--block-size tokens")
    return items


def stream_header(first_line: str, trainer, options, data: StreamData, block_size: int) -> str:
    """The run header of a streaming run: `first_line` (the model, hf.model_line), the method,
    the shards and the validation."""
    from .methods import rows_method

    stream, ranks = data.train, trainer.group.dp_size
    shape = {"text": "blocks of text", "packed": "blocks packed with attention kept inside each "
             f"example ({stream.buffer} examples at a time)", "rows": "one example a row, unpacked "
             "(--no-packing)"}[stream.packing]
    if data.validation is not None:
        validation = (f"the validation split of --dataset, {data.validation_files} "
                      f"shard(s), {counted(len(data.validation), 'block' if stream.packing != 'rows' else 'row')}")
    else:
        validation = ("none (--streaming evaluates on the validation split of --dataset, a "
                      "validation/ subfolder or shards named for it, and it has none)")
    count = len(stream.all_shards)
    uneven = (f"; {count} shards do not split evenly over {ranks} ranks: a pass ends when the first "
              "rank's run out, and a line says what the others leave unread" if count % ranks else "")
    return (f"{first_line}\n"
            f"hputrain: method: {rows_method(data.method).words[data.method]}\n"
            f"hputrain: streaming {count} shard(s) of {options.dataset} (shard i on "
            f"data-parallel rank i % {ranks}; rank 0 reads {len(stream.all_shards[::ranks])}{uneven}): "
            f"{shape} of {block_size} tokens, made on the fly; each checkpoint saves every rank's "
            "position in its stream (data_state_rankR.json)\n"
            + hf_data.splits_line(options.dataset) + f"hputrain: validation: {validation}")
