"""Tokenized data made once per node (issue 31 part 2): the first tokenization of a large chat data
set with 1 and 2 worker processes, the cache's size on disk, the start of a run that reuses it,
and the resident memory of each rank while 1 and then 2 ranks train on it.

Data: --conversations JSON Lines rows of `messages` cut from the standard library's source
(a question and an answer, every third row a second exchange; the text wraps around when the
source runs out), tokenized by a byte-level BPE tokenizer of 4096 tokens trained here on that
source with ChatML's template (bench/sft.py's; nothing is downloaded); --text-mb of plain text
for the causal LM path. The model is a Llama of that vocabulary, hidden 64, 2 layers.

What is measured:
  tokenize   wall time of hf_sft.load_sft (read, tokenize, write, map) into an empty cache, with
             --dataset-num-proc 1 and 2; the two caches are checked equal array for array
  cache      its size on disk (du), and tokens in it
  reuse      a new process's wall time to load_sft from the cache (after its imports), and the
             whole process's
  memory     `hputrain train --devices N` (N = 1, 2) on the cached data, every process sampled
             every 0.2 s: peak RSS, PSS and USS (/proc/PID/smaps_rollup) and the RSS / PSS of the
             cache's mapped files (/proc/PID/smaps) per rank; the goal: each extra rank adds
             less than 5% of the cache's size

    flock /tmp/hputrain-cpu.lock python bench/token_cache.py [--conversations 100000] [--text-mb 50]
                                                          [--steps 30] [--work DIR] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil

from hputrain.data.batching import read_corpus
from hputrain.recipes.hf import data as hf_data
from hputrain.methods.sft import recipe as hf_sft
from sft import conversations, tokenizer_with_template
from token_memory import smaps

HERE = Path(__file__).resolve().parent

BLOCK = 512


def source_text() -> str:
    return read_corpus(max_bytes=60_000_000).decode("utf-8", errors="replace")


def write_conversations(path: Path, text: str, count: int, seed: int = 0) -> None:
    """bench/sft.py's conversations, written as JSON Lines."""
    with open(path, "w", encoding="utf-8") as out:
        for row in conversations(text, count, seed):
            out.write(json.dumps(row) + "\n")


def model_folder(folder: Path, text: str) -> Path:
    import torch
    import transformers

    if (folder / "config.json").is_file():
        return folder
    tokenizer = tokenizer_with_template(text)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=1024, tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=3)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def first_tokenization(data: Path, model: Path, tokenizer, work: Path, workers: int) -> dict:
    options = SimpleNamespace(assistant_only_loss=True, completion_only_loss=True, packing=True,
                              validation_split_percentage=0, dataset_num_proc=workers)
    cache = work / f"cache-{workers}"
    start = time.perf_counter()
    loaded = hf_sft.load_sft(str(data), "messages", tokenizer, BLOCK, options, cache_dir=cache,
                             tokenizer_folder=model)  # as `hputrain train` keys it
    seconds = time.perf_counter() - start
    assert not loaded.from_cache
    return {"seconds": seconds, "cache": cache, "bytes": du(cache), "data": loaded,
            "tokens": int(loaded.train.ids.offsets[-1]), "examples": len(loaded.train.ids),
            "blocks": len(loaded.train)}


REUSE = """
import os, sys, time
from types import SimpleNamespace

import transformers
from hputrain.recipes import hf_sft
sys.path.append(sys.argv[4])
from token_memory import smaps
tokenizer = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
options = SimpleNamespace(assistant_only_loss=True, completion_only_loss=True, packing=True,
                          validation_split_percentage=0, dataset_num_proc=1)
before = smaps(os.getpid(), sys.argv[3])
start = time.perf_counter()
data = hf_sft.load_sft(sys.argv[2], "messages", tokenizer, %d, options, cache_dir=sys.argv[3],
                      tokenizer_folder=sys.argv[1])
seconds = time.perf_counter() - start
after = smaps(os.getpid(), sys.argv[3])
assert data.from_cache
print(seconds, after["anon"] - before["anon"], after["cache_rss"])
""" % BLOCK


def reuse(model: Path, data: Path, cache: Path) -> dict:
    """A second run's start: load_sft from the cache in a new process; what it costs in anonymous
    memory (the packing plan: the rank's own copy) and in cache pages it maps (shared)."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", REUSE, str(model), str(data), str(cache), str(HERE)],
                         check=True, capture_output=True, text=True).stdout
    seconds, uss, cache_rss = out.split()[-3:]
    return {"load_seconds": float(seconds), "process_seconds": time.perf_counter() - start,
            "private_bytes": int(uss), "cache_rss": int(cache_rss)}


def train_memory(model: Path, data: Path, cache: Path, work: Path, devices: int, steps: int) -> dict:
    """Peak memory facts of each process of `hputrain train --devices N` (ranks: those mapping
    the cache)."""
    out = work / f"run-{devices}"
    command = [str(Path(sys.executable).with_name("hputrain")), "train", "--model", str(model), "--dataset", str(data),
               "--cache-dir", str(cache), "--devices", str(devices), "--max-steps", str(steps),
               "--block-size", str(BLOCK), "--per-device-train-batch-size", "4",
               "--validation-split-percentage", "0", "--output-dir", str(out), "--save-steps", "0",
               "--logging-steps", str(steps), "--disable-tqdm", "--precision", "32",
               "--dataset-num-proc", "1"]
    env = {**os.environ, "HPUTRAIN_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, dict] = {}
    total: dict[str, int] = {}  # the peak of the ranks' sum, sampled at one time
    root = psutil.Process(process.pid)
    while process.poll() is None:
        now: dict[str, int] = {}
        for proc in [root, *root.children(recursive=True)]:
            try:
                facts = smaps(proc.pid, cache)
            except (OSError, ValueError, psutil.Error):
                continue
            peak = peaks.setdefault(proc.pid, dict.fromkeys(facts, 0))
            for key, value in facts.items():
                peak[key] = max(peak[key], value)
                if facts["cache_rss"]:
                    now[key] = now.get(key, 0) + value
        for key, value in now.items():
            total[key] = max(total.get(key, 0), value)
        time.sleep(0.2)
    log = process.stdout.read()
    if process.returncode != 0:
        raise SystemExit(f"hputrain train --devices {devices} failed:\n{log[-3000:]}")
    ranks = [p for p in peaks.values() if p["cache_rss"] > 0]
    return {"devices": devices, "seconds": time.perf_counter() - start, "ranks": ranks, "total": total,
            "others": [p for p in peaks.values() if p["cache_rss"] == 0]}


def text_tokenization(text: str, megabytes: int, tokenizer, work: Path) -> dict:
    path = work / "text.txt"
    if not path.is_file():
        body = (text * (1 + megabytes * 1_000_000 // len(text)))[:megabytes * 1_000_000]
        path.write_text(body, encoding="utf-8")
    times = {}
    for workers in (1, 2):
        start = time.perf_counter()
        blocks = hf_data.load_blocks(str(path), tokenizer, BLOCK, validation_percentage=0,
                                     cache_dir=work / f"text-cache-{workers}", workers=workers)
        times[workers] = time.perf_counter() - start
        assert not blocks.from_cache
    return {"megabytes": megabytes, "seconds_1": times[1], "seconds_2": times[2],
            "tokens": int(blocks.train.blocks.size), "bytes": du(work / "text-cache-2")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=100_000)
    p.add_argument("--text-mb", type=int, default=50, help="0: no plain-text measurement")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--work", default=None, help="folder for the data, model and caches (kept)")
    p.add_argument("--json", default=None)
    opts = p.parse_args(argv)
    work = Path(opts.work or tempfile.mkdtemp(prefix="hputrain-tokenize-"))
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("cache-*"):
        raise SystemExit(f"{old} exists: give an empty --work folder (the first tokenization is measured)")
    text = source_text()
    model = model_folder(work / "model", text)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    data = work / "chat.jsonl"
    write_conversations(data, text, opts.conversations)
    one = first_tokenization(data, model, tokenizer, work, 1)
    two = first_tokenization(data, model, tokenizer, work, 2)
    same = all(np.array_equal(np.load(f, mmap_mode="r"), np.load(two["cache"] / f.relative_to(one["cache"]), mmap_mode="r"))
               for f in one["cache"].rglob("*.npy"))
    results = {"conversations": opts.conversations, "data_bytes": data.stat().st_size,
               "tokenize_1_worker_s": one["seconds"], "tokenize_2_workers_s": two["seconds"],
               "caches_equal": same, "cache_bytes": one["bytes"], "tokens": one["tokens"],
               "examples": one["examples"], "blocks": one["blocks"],
               "reuse": reuse(model, data, one["cache"]),
               "train": [train_memory(model, data, one["cache"], work, n, opts.steps) for n in (1, 2)]}
    if opts.text_mb:
        results["text"] = text_tokenization(text, opts.text_mb, tokenizer, work)
    report(results)
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=1))


def report(r: dict) -> None:
    mb = 1 / 2 ** 20
    print(f"{r['conversations']} conversations ({r['data_bytes'] * mb:.0f} MiB of JSON Lines): "
          f"{r['examples']} examples, {r['tokens']:,} tokens, {r['blocks']} blocks of {BLOCK}")
    print(f"first tokenization: 1 worker {r['tokenize_1_worker_s']:.1f} s, 2 workers "
          f"{r['tokenize_2_workers_s']:.1f} s (caches equal: {r['caches_equal']})")
    print(f"cache on disk: {r['cache_bytes'] * mb:.1f} MiB ({r['cache_bytes'] / r['tokens']:.2f} "
          f"bytes a token; blocks of 4 int64 tensors would hold {r['blocks'] * BLOCK * 32 * mb:.0f} MiB)")
    print(f"second run: load_sft from the cache {r['reuse']['load_seconds']:.2f} s, the whole "
          f"process (imports included) {r['reuse']['process_seconds']:.1f} s")
    for run in r["train"]:
        for k, rank in enumerate(run["ranks"]):
            print(f"train --devices {run['devices']} rank {k}: RSS {rank['rss'] * mb:.0f} MiB, "
                  f"PSS {rank['pss'] * mb:.0f}, USS {rank['uss'] * mb:.0f}; cache pages: RSS "
                  f"{rank['cache_rss'] * mb:.1f} MiB, PSS {rank['cache_pss'] * mb:.1f}")
    solo, pair = (run["total"] for run in r["train"])
    if solo and pair:
        extra, extra_cache = pair["pss"] - solo["pss"], pair["cache_pss"] - solo["cache_pss"]
        print(f"ranks' sum, peak: 1 rank PSS {solo['pss'] * mb:.0f} MiB (cache pages "
              f"{solo['cache_pss'] * mb:.1f}), 2 ranks PSS {pair['pss'] * mb:.0f} MiB (cache pages "
              f"{pair['cache_pss'] * mb:.1f}): the second rank adds {extra * mb:.0f} MiB in all "
              f"(its own Python, torch and model), {extra_cache * mb:.2f} MiB of cache pages")
    private = r["reuse"]["private_bytes"]
    print(f"data memory of a rank: {private * mb:.1f} MiB private (the packing plan: "
          f"{private / r['cache_bytes']:.2%} of the cache; goal < 5%) and "
          f"{r['reuse']['cache_rss'] * mb:.1f} MiB of shared cache pages mapped at load")
    if "text" in r:
        t = r["text"]
        print(f"plain text {t['megabytes']} MB: 1 worker {t['seconds_1']:.1f} s, 2 workers "
              f"{t['seconds_2']:.1f} s, {t['tokens']:,} tokens in blocks, cache {t['bytes'] * mb:.0f} MiB")


if __name__ == "__main__":
    main()
