"""Context parallelism's memory: activation memory per rank of the built-in GPT on one long
sequence, cp=1 (one process) vs cp=2 (two processes, gloo), measured as the bytes autograd saves for
backward (each storage counted once), plus the peak RSS of the step.

    python bench/context_parallel.py [--seq-len 4096] [--size tiny] [--batch 1]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from hputrain.distributed.context_parallel import ContextParallel, NoContextParallel
from hputrain.models.gpt import GPT, GPTConfig
from hputrain.training.telemetry import SavedForBackward


def saved_activation_bytes(model, batch, context) -> int:
    """Bytes of the tensors autograd keeps for backward during one forward, storages once."""
    with SavedForBackward() as saved, context.forward_context():
        loss = model(**batch)["loss"]
    loss.backward()
    return saved.nbytes


def worker(opts) -> None:
    cp = int(os.environ.get("WORLD_SIZE", "1"))
    if cp > 1:
        dist.init_process_group("gloo")
        context = ContextParallel(dist.new_group(list(range(cp))), dist.get_rank(), cp)
    else:
        context = NoContextParallel()
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_size(opts.size, block_size=opts.seq_len))
    tokens = torch.randint(0, 256, (opts.batch, opts.seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch = context.shard({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    saved = saved_activation_bytes(model, batch, context)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rank = int(os.environ.get("RANK", "0"))
    Path(f"{opts.result}.{rank}").write_text(json.dumps({"saved": saved, "peak_rss": peak_rss}))


def run(opts, cp: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "r")
        args = [__file__, "--worker", "--result", result, "--seq-len", str(opts.seq_len),
                "--size", opts.size, "--batch", str(opts.batch)]
        command = ([sys.executable, *args] if cp == 1 else
                   [sys.executable, "-m", "hputrain.cli", "launch", "--cpu", "--nproc-per-node", str(cp), *args])
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return [json.loads(Path(f"{result}.{r}").read_text()) for r in range(cp)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--size", default="tiny")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.worker:
        return worker(opts)
    one, two = run(opts, 1), run(opts, 2)
    mib = 1024**2
    print(f"model: {opts.size} GPT, one sequence of {opts.seq_len} tokens, batch {opts.batch}")
    print("| cp | rank | saved activations (MiB) | vs cp=1 | peak RSS (MiB) |")
    print("|---|---|---|---|---|")
    for cp, ranks in ((1, one), (2, two)):
        for rank, r in enumerate(ranks):
            print(f"| {cp} | {rank} | {r['saved'] / mib:.1f} | {r['saved'] / one[0]['saved']:.3f} | "
                  f"{r['peak_rss'] / mib:.0f} |")


if __name__ == "__main__":
    main()
