"""Issue 31 part 2: tokenized data made once per node (a file lock beside the cache), in several
processes, kept as memory-mapped int32 arrays, and blocks built when read that equal the eager
blocks of before, bit for bit."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ..hf_fixtures import tiny_tokenizer

pytest.importorskip("transformers", reason="the Hugging Face recipe needs transformers")

from hputrain.data import packing, token_store  # noqa: E402
from hputrain.methods.dpo import data as preference
from hputrain.data import sft
from hputrain.data.chat import ChatTemplate  # noqa: E402
from hputrain.errors import InputError  # noqa: E402
from hputrain.recipes.hf import data as hf_data  # noqa: E402
from hputrain.methods.dpo import recipe as hf_dpo
from hputrain.methods.sft import recipe as hf_sft

TEMPLATES = Path(__file__).parents[1] / "chat_templates"
BLOCK = 160  # tokens: two examples a block, the longest cut
WORDS = "the quick brown fox jumps over the lazy dog a stitch in time saves nine".split()


@pytest.fixture(scope="module")
def tokenizer():
    tok = tiny_tokenizer()
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tok.chat_template = (TEMPLATES / "chatml_tagged.jinja").read_text()
    return tok


def _text(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(n))


def chat_row(i: int) -> dict:
    turns = [{"role": "user", "content": f"{i}: {_text(i, 1 + i % 4)}"},
             {"role": "assistant", "content": _text(i + 1, 1 + i % 6)}]
    if i % 5 == 0:  # long ones, cut by the block, some with nothing left to learn
        turns = [{"role": "system", "content": _text(i, 16 + i % 40)}] + turns
    if i % 13 == 0:  # nothing to learn: no assistant turn
        turns = turns[:1]
    return {"messages": turns}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def options(**changes) -> SimpleNamespace:
    values = dict(assistant_only_loss=True, completion_only_loss=True, packing=True,
                  validation_split_percentage=10, dataset_num_proc=1, dataset=None,
                  max_prompt_length=None)
    return SimpleNamespace(**(values | changes))


def eager_examples(rows: list, fmt: str, tokenizer) -> list[dict]:
    """The examples as the recipe made them before: sft.encode_row on every row, in order."""
    chat = ChatTemplate(tokenizer) if fmt != "prompt_completion" else None
    encoded = (sft.encode_row(row, fmt, tokenizer, chat) for row in rows)
    return [e for e in encoded if e is not None]


def eager_pack(examples: list[dict], block_size: int, pad: int) -> list[dict]:
    """The blocks of data/packing.py's `pack` as it was before blocks were built when read (four
    int64 tensors a block, made at once): the reference the lazy blocks must equal."""
    kept, _ = packing.truncate(examples, block_size)
    lengths = [len(e["input_ids"]) for e in kept]
    blocks = []
    for members in packing.best_fit_decreasing(lengths, block_size):
        input_ids = torch.full((block_size,), pad, dtype=torch.long)
        labels = torch.full((block_size,), -100, dtype=torch.long)
        position_ids = torch.zeros(block_size, dtype=torch.long)
        seq_lens = torch.zeros(block_size, dtype=torch.long)
        at = 0
        for k, i in enumerate(members):
            n = lengths[i]
            input_ids[at:at + n] = torch.tensor(kept[i]["input_ids"])
            labels[at:at + n] = torch.tensor(kept[i]["labels"])
            labels[at] = -100
            position_ids[at:at + n] = torch.arange(n)
            seq_lens[k] = n
            at += n
        position_ids[at:] = torch.arange(block_size - at)
        blocks.append({"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
                       "seq_lens": seq_lens})
    return blocks


def assert_same_items(ours, theirs) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


# -- blocks built on read equal the eager ones ----------------------------------------------------

@pytest.mark.parametrize("packed", [True, False])
def test_sft_blocks_and_batches_built_on_read_equal_the_eager_ones(tmp_path, tokenizer, packed):
    rows = [chat_row(i) for i in range(120)]
    data = hf_sft.load_sft(str(write_jsonl(tmp_path / "chat.jsonl", rows)), "messages", tokenizer,
                           BLOCK, options(packing=packed), cache_dir=tmp_path / "cache")
    examples = eager_examples(rows, "messages", tokenizer)
    held = max(1, len(examples) // 10)
    pad = tokenizer.pad_token_id
    if packed:
        train, stats = packing.pack(examples[:-held], BLOCK, pad)
        assert_same_items(data.train, eager_pack(examples[:-held], BLOCK, pad))
        assert_same_items(data.validation, eager_pack(examples[-held:], BLOCK, pad))
        assert stats.truncated and stats.nothing_to_learn  # the cut is exercised
    else:
        train, collate, stats = packing.unpacked(examples[:-held], BLOCK, pad)
        batches = [list(range(k, min(k + 8, len(train)))) for k in range(0, len(train), 8)]
        for batch in batches:  # what the Trainer gets: the collated batches
            assert_same_items([data.collator([data.train[i] for i in batch])],
                              [collate([train[i] for i in batch])])
    assert_same_items(data.train, train)
    assert data.rows.rows == len(rows) and data.rows.nothing_to_learn == len(rows) - len(examples)
    assert data.packed.truncated >= stats.truncated
    assert isinstance(data.train.ids.values, np.memmap) and isinstance(data.train.labels.values, np.memmap)
    assert data.train.ids.values.dtype == np.int32 and not data.from_cache
    again = hf_sft.load_sft(str(tmp_path / "chat.jsonl"), "messages", tokenizer, BLOCK,
                            options(packing=packed), cache_dir=tmp_path / "cache")
    assert again.from_cache and again.cache_file == data.cache_file
    assert_same_items(again.train, train)


def test_prompt_completion_blocks_equal_the_eager_ones(tmp_path, tokenizer):
    rows = [{"prompt": _text(i, 2 + i % 9) + " ?", "completion": " " + _text(i + 3, 1 + i % 30)}
            for i in range(60)]
    data = hf_sft.load_sft(str(write_jsonl(tmp_path / "pc.jsonl", rows)), "prompt_completion",
                           tokenizer, 40, options(validation_split_percentage=0),
                           cache_dir=tmp_path / "cache")
    examples = eager_examples(rows, "prompt_completion", tokenizer)
    assert_same_items(data.train, eager_pack(examples, 40, tokenizer.pad_token_id))
    assert data.validation is None


def test_dpo_pairs_read_from_the_cache_equal_the_eager_ones(tmp_path, tokenizer):
    rows = [{"prompt": _text(i, 2 + i % 7), "chosen": " " + _text(i + 1, 1 + i % 11),
             "rejected": " " + _text(i + 2, 1 + i % 13)} for i in range(40)]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    opts = options(dataset=str(path), max_prompt_length=6)
    train, held, stats = hf_dpo.load_pairs(opts, tokenizer, 16, cache_dir=tmp_path / "cache")
    eager, eager_stats = preference.encode_pairs(hf_data.records(str(path)), tokenizer,
                                                 max_length=16, max_prompt_length=6)
    assert list(train) + list(held) == eager and stats == eager_stats and stats.truncated
    assert len(held) == 4 and train[1:3] == eager[1:3]
    collate = preference.PairCollator(tokenizer.pad_token_id, 16)
    assert_same_items([collate(list(train)[:8])], [collate(eager[:8])])
    assert all(isinstance(c.values, np.memmap) for c in train.columns.values())
    again, _, _ = hf_dpo.load_pairs(opts, tokenizer, 16, cache_dir=tmp_path / "cache")
    assert list(again) == eager[:-4]
    in_memory, _, _ = hf_dpo.load_pairs(opts, tokenizer, 16)  # no cache_dir: nothing written
    assert list(in_memory) == eager[:-4]


def test_text_blocks_are_memory_mapped_int32(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "text.jsonl", [{"text": _text(i, 5 + i % 20)} for i in range(80)])
    blocks = hf_data.load_blocks(str(path), tokenizer, 16, cache_dir=tmp_path / "cache")
    assert isinstance(blocks.train.blocks, np.memmap) and blocks.train.blocks.dtype == np.int32
    assert (blocks.cache_file.parent / (blocks.cache_file.name + ".lock")).is_file()


def test_a_bad_worker_count_is_one_line():
    with pytest.raises(InputError, match="--dataset-num-proc must be a whole number of at least 1"):
        token_store.check_workers(0)
    assert 1 <= token_store.check_workers(None) <= token_store.MAX_DEFAULT_WORKERS


@pytest.mark.parametrize("code", ["ENOLCK", "EOPNOTSUPP", "ENOSYS"])
def test_a_file_system_without_locks_is_one_line_naming_the_folder(tmp_path, tokenizer, monkeypatch,
                                                                    code):
    """Issue 39 item 12: flock refused (some NFS and Lustre mounts) is one line naming the cache
    folder and the way out (--cache-dir on a local disk) (an InputError: the CLI's exit 2);
    nothing is written under the cache's name. It was a traceback."""
    import errno
    import fcntl

    def refused(handle, operation):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(fcntl, "flock", refused)
    path = write_jsonl(tmp_path / "chat.jsonl", [chat_row(i) for i in range(20)])
    cache = tmp_path / "nfs" / "cache"
    with pytest.raises(InputError, match="without file locks") as error:
        hf_sft.load_sft(str(path), "messages", tokenizer, 160, options(), cache_dir=cache)
    message = str(error.value)
    assert str(cache) in message and "--cache-dir on a local disk" in message
    assert os.strerror(getattr(errno, code)) in message
    assert not [p for p in cache.iterdir() if not p.name.endswith(".lock")]


# -- several processes ----------------------------------------------------------------------------

@pytest.mark.slow
def test_two_workers_make_the_same_cache_as_one(tmp_path, tokenizer):
    rows = [chat_row(i) for i in range(3 * hf_sft.ROWS_PER_PART)]  # several parts each
    path = str(write_jsonl(tmp_path / "chat.jsonl", rows))
    one, one_stats = hf_sft.encode(path, "messages", tokenizer, options(), workers=1)
    two, two_stats = hf_sft.encode(path, "messages", tokenizer, options(), workers=2)
    assert one_stats == two_stats and len(one) > hf_sft.ROWS_PER_PART
    for a, b in ((one.ids, two.ids), (one.labels, two.labels)):
        assert np.array_equal(a.values, b.values) and np.array_equal(a.offsets, b.offsets)
    assert np.array_equal(one.learned_from, two.learned_from)
    documents = [_text(i, 3 + i % 50) for i in range(3 * hf_data.BATCH_PIECES)]
    assert np.array_equal(hf_data.token_ids(documents, tokenizer, 1),
                          hf_data.token_ids(documents, tokenizer, 2))
    bad = rows + [{"messages": [{"role": "robot", "content": "x"}]}]  # an error in a worker
    with pytest.raises(InputError, match=rf"line {len(bad)}: message 0 has role 'robot'"):
        hf_sft.encode(str(write_jsonl(tmp_path / "bad.jsonl", bad)), "messages", tokenizer,
                      options(), workers=2)


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _load_in_child(name, data, tokenizer, cache, signals: Path, results) -> None:
    """One 'rank': load_sft, with its encode (the tokenizing) recorded and, for the first rank,
    held until the test lets it go."""
    real = hf_sft.encode

    def encode(*args, **kwargs):
        (signals / f"{name}-encodes").touch()
        if name == "first":
            _wait_for(signals / "go")
        return real(*args, **kwargs)

    hf_sft.encode = encode
    (signals / f"{name}-starts").touch()
    loaded = hf_sft.load_sft(data, "messages", tokenizer, BLOCK, options(), cache_dir=cache)
    blocks = [block["input_ids"] for block in loaded.train]
    results.put((name, loaded.from_cache, torch.stack(blocks).numpy(),
                 isinstance(loaded.train.ids.values, np.memmap)))


def test_the_first_process_tokenizes_and_the_second_waits_then_reads(tmp_path, tokenizer):
    data = str(write_jsonl(tmp_path / "chat.jsonl", [chat_row(i) for i in range(40)]))
    signals, cache = tmp_path / "signals", tmp_path / "cache"
    signals.mkdir()
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    first = context.Process(target=_load_in_child,
                            args=("first", data, tokenizer, cache, signals, results))
    first.start()
    _wait_for(signals / "first-encodes")  # the first holds the lock, tokenizing
    second = context.Process(target=_load_in_child,
                             args=("second", data, tokenizer, cache, signals, results))
    second.start()
    _wait_for(signals / "second-starts")
    time.sleep(0.3)  # the second is now waiting on the lock (nothing is written yet)
    assert [p.name.endswith(".lock") for p in cache.glob("sft-*")] == [True]  # no cache yet
    (signals / "go").touch()
    first.join(120)
    second.join(120)
    assert first.exitcode == second.exitcode == 0
    got = {name: rest for name, *rest in (results.get(timeout=10) for _ in range(2))}
    assert not (signals / "second-encodes").exists()  # exactly one tokenized
    assert got["first"][0] is False and got["second"][0] is True
    assert np.array_equal(got["first"][1], got["second"][1])
    assert got["first"][2] and got["second"][2]


def _write_then_hang(cache: Path, signals: Path) -> None:
    class Halfway(dict):
        def items(self):
            yield "a", np.arange(1000, dtype=np.int32)
            (signals / "half-written").touch()
            time.sleep(600)
            yield "b", np.arange(10, dtype=np.int32)

    token_store.made_once(cache, lambda f: token_store.read_arrays(f, ("a", "b")),
                          lambda: None, lambda f, _: token_store.write_arrays(f, Halfway()))


@pytest.mark.slow
def test_a_writer_killed_mid_write_leaves_no_cache_and_the_lock_free(tmp_path):
    cache, signals = tmp_path / "cache" / "x", tmp_path / "signals"
    signals.mkdir()
    writer = multiprocessing.get_context("fork").Process(target=_write_then_hang, args=(cache, signals))
    writer.start()
    _wait_for(signals / "half-written")
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(30)
    assert not cache.exists()  # only a .tmp- folder is left: never read as the cache
    assert [p.name.startswith(".tmp-") for p in cache.parent.iterdir() if p.is_dir()] == [True]
    names = ("a", "b")
    made, cached = token_store.made_once(
        cache, lambda f: token_store.read_arrays(f, names),
        lambda: {"a": np.arange(5, dtype=np.int32), "b": np.arange(3, dtype=np.int32)},
        token_store.write_arrays)  # the lock was let go with the process: no wait
    assert not cached and isinstance(made["a"], np.memmap) and made["b"].tolist() == [0, 1, 2]
