"""--streaming against the cached path: tokens per second of making text blocks (no training) from
the same JSON Lines shards, and how long a resumed stream takes to give its next block.

The shards are the Python standard library's source cut into rows of 2,000 characters, spread
over 8 JSON Lines files; the tokenizer is a 4096-token byte-level BPE trained on the same text
(bench/sft.py's, nothing downloaded); blocks of --block-size tokens. Each figure is the median of
--repeats runs, in this one process (hold the CPU lock: nothing else may run beside it).

    flock /tmp/hputrain-cpu.lock python bench/streaming.py [--files 200] [--block-size 256] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

from hputrain.accelerators import detect_accelerator
from hputrain.data.streaming import ShardStream, find_shards
from hputrain.recipes.hf import data as hf_data
from hputrain.recipes.hf.stream import TextEncoder

from common import machine
from sft import tokenizer_with_template

SHARDS = 8
ROW_CHARS = 2000


def write_shards(root: Path, files: int) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents = [p.read_text(errors="ignore") for p in sorted(stdlib.glob("*.py"))][:files]
    for shard in range(SHARDS):
        with open(root / f"part-{shard}.jsonl", "w") as out:
            for document in documents[shard::SHARDS]:
                for start in range(0, len(document), ROW_CHARS):
                    out.write(json.dumps({"text": document[start:start + ROW_CHARS]}) + "\n")
    return find_shards(root)


def streamed(shards, tokenizer, block: int) -> tuple[int, float]:
    start = time.perf_counter()
    count = sum(1 for _ in ShardStream(shards, TextEncoder(tokenizer, "text"), block_size=block))
    return count, time.perf_counter() - start


def cached_path(shards, tokenizer, block: int) -> tuple[int, float]:
    """What the cached path does before it writes its cache: every row tokenized in batches, joined, cut."""
    texts = (json.loads(line)["text"] for shard in shards for line in open(shard))
    start = time.perf_counter()
    blocks = hf_data.pack(hf_data.token_ids(texts, tokenizer), block, "bench")
    return len(blocks), time.perf_counter() - start


def resume_time(shards, tokenizer, block: int, at: int) -> tuple[float, int]:
    """(seconds from a new stream loading the position after `at` blocks to its next block, the
    position's size in bytes as a checkpoint saves it)."""
    stream = ShardStream(shards, TextEncoder(tokenizer, "text"), block_size=block)
    blocks = iter(stream)
    for _ in range(at):
        next(blocks)
    state = json.dumps(stream.state_dict())
    start = time.perf_counter()
    again = ShardStream(shards, TextEncoder(tokenizer, "text"), block_size=block)
    again.load_state_dict(json.loads(state))
    next(iter(again))
    return time.perf_counter() - start, len(state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=200, help="standard library files to cut into rows")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    print(machine(detect_accelerator("cpu")))
    with tempfile.TemporaryDirectory() as folder:
        shards = write_shards(Path(folder), opts.files)
        tokenizer = tokenizer_with_template("".join(open(s).read() for s in shards))
        runs = {"streaming": [], "cached path": []}
        for _ in range(opts.repeats):
            for name, fn in (("streaming", streamed), ("cached path", cached_path)):
                runs[name].append(fn(shards, tokenizer, opts.block_size))
        for name, results in runs.items():
            blocks = results[0][0]
            seconds = statistics.median(s for _, s in results)
            print(f"{name}: {blocks} blocks of {opts.block_size}, "
                  f"{blocks * opts.block_size / seconds / 1e3:.0f} K tokens/s (median {seconds:.2f} s)")
        at = int(runs["streaming"][0][0] * 0.9)
        seconds, size = resume_time(shards, tokenizer, opts.block_size, at)
        print(f"resume after block {at}: next block in {seconds * 1e3:.1f} ms; position {size} bytes")


if __name__ == "__main__":
    main()
