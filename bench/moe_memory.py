"""Peak host memory per rank of a mixture of experts loaded for training (issue 47 item 1), on CPU
processes (gloo): a Mixtral folder of random fp32 weights (save_pretrained, 8 experts; by default
12 layers of width 512 and expert width 1024: 604 MB of experts) trained 1 step by `hputrain
train`, in one process, under ddp with --expert-parallel-size 2 and under fsdp with
--expert-parallel-size 2. Each rank writes its peak RSS (VmHWM) when training begins (the model
loaded, split, placed and wrapped) and after the step (AdamW's state made).

Expert parallelism under ddp reads each rank's own experts from the folder, so each rank's peak
is about the dense part plus its share of the experts: (dense + experts / 2), not the whole
model, on top of what a process holds before loading (torch, transformers).

    python bench/moe_memory.py [--layers 12] [--hidden 512] [--intermediate 1024] [--runs 1,2,3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
RUNS = {"1 process": [], "ddp + EP 2": ["--devices", "2", "--strategy", "ddp", "--expert-parallel-size", "2"],
        "fsdp + EP 2": ["--devices", "2", "--strategy", "fsdp", "--expert-parallel-size", "2"]}
TEXT = "the quick brown fox jumps over the lazy dog; a stitch in time saves nine\n"


def peak_rss() -> int:
    """This process's peak RSS in bytes (VmHWM: it starts afresh at exec, unlike ru_maxrss)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def moe_folder(root: Path, layers: int, hidden: int, intermediate: int, experts: int = 8) -> tuple[Path, dict]:
    """A Mixtral folder (random weights, a byte-level tokenizer) and its sizes in bytes."""
    import tokenizers
    import torch
    import transformers
    from tokenizers import decoders, models

    folder = root / "mixtral"
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_local_experts=experts,
        num_experts_per_tok=2, num_attention_heads=8, num_key_value_heads=4, vocab_size=260,
        max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    sizes = {"experts": sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)}
    sizes["dense"] = sum(p.numel() * 4 for p in model.parameters()) - sizes["experts"]
    del model
    alphabet = {c: i + 4 for i, c in enumerate(sorted(set(TEXT)))}
    tok = tokenizers.Tokenizer(models.BPE(vocab={"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **alphabet},
                                          merges=[], unk_token="<unk>"))
    tok.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>", pad_token="<pad>").save_pretrained(folder)
    return folder, sizes


def run(folder: Path, root: Path, name: str, extra: list[str]) -> list[dict]:
    """Each rank's peaks (bytes) of one `hputrain train` run, in rank order."""
    data = root / "data.txt"
    if not data.is_file():
        data.write_text(TEXT * 200)
    result = root / f"result-{name.replace(' ', '')}"
    train = ["--model", str(folder), "--dataset", str(data), "--max-steps", "1", "--cpu",
             "--block-size", "64", "--per-device-train-batch-size", "1", "--precision", "fp32",
             "--validation-split-percentage", "0", "--disable-tqdm", "--report-to", "none",
             "--output-dir", str(root / f"out-{name.replace(' ', '')}"), "--overwrite-output-dir", *extra]
    processes = 2 if extra else 1
    command = [sys.executable, str(HERE / "moe_memory.py"), "--worker", str(result), "--", *train]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-4000:]}")
    return [json.loads(Path(f"{result}.{rank}").read_text()) for rank in range(processes)]


def worker(result: str, train: list[str]) -> None:
    """`hputrain train ARGS` in this process; each rank writes RESULT.RANK (the process that
    only starts the ranks writes nothing)."""
    from hputrain import cli
    from hputrain.callbacks import Callback, added_to_every_trainer

    peaks = {}

    class Peaks(Callback):
        def on_train_begin(self, trainer):
            peaks["loaded"] = peak_rss()

        def on_step_end(self, trainer):
            peaks["stepped"] = peak_rss()

        def on_train_end(self, trainer):
            Path(f"{result}.{trainer.group.rank}").write_text(json.dumps(peaks))

    with added_to_every_trainer(Peaks):
        sys.exit(cli.main(["train", *train]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--runs", help="only these rows (1-based, e.g. 1,2)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("train", nargs="*", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.worker:
        return worker(opts.worker, opts.train)
    names = list(RUNS)
    names = [names[int(i) - 1] for i in opts.runs.split(",")] if opts.runs else names
    MiB = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder, sizes = moe_folder(root, opts.layers, opts.hidden, opts.intermediate)
        print(f"Mixtral, {opts.layers} layers, width {opts.hidden}, 8 experts of width {opts.intermediate}: "
              f"experts {sizes['experts'] / 1e6:,.0f} MB, the rest {sizes['dense'] / 1e6:,.0f} MB (fp32); "
              f"1 step, OMP_NUM_THREADS=1")
        print("| run | peak RSS per rank when training begins, MiB | after the step, MiB |")
        print("|---|---|---|")
        for name in names:
            ranks = run(folder, root, name, RUNS[name])
            cells = [" / ".join(f"{r[key] / MiB:,.0f}" for r in ranks) for key in ("loaded", "stepped")]
            print(f"| {name} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
