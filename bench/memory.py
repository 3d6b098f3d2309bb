"""Memory of strategy="fsdp", meta-device init and activation checkpointing, on CPU processes (gloo),
the built-in GPT at the "base" width with 16 blocks (113.7M parameters) unless told otherwise.

- state: model state per rank (parameters + gradients + AdamW state, each rank's local tensors,
  counted right after the first optimizer step) for one process and fsdp with 2 and 4 processes,
  against (1/N) x the single process's; and each rank's peak RSS right after the Trainer is made:
  one process with an eager model against fsdp with the model built on the meta device.
- saved: bytes autograd keeps for backward per step (telemetry.SavedForBackward), without and with
  gradient_checkpointing (one process); checkpointing: the median step time of the same two
  (one process, interleaved repeats).
- speed: median step time of fsdp against ddp at 2 processes, same model and batch per process.
- hf: `hputrain train --model DIR` on a Hugging Face Llama folder (HF_CONFIG, random weights
  written by save_pretrained into a temporary folder), 2 steps, for one process and for fsdp on
  2 and 4 processes: each rank's peak RSS when training begins (loaded and sharded), after the
  last step (before the checkpoint), when training ends (rank 0 has gathered the whole model for
  the checkpoint's model.safetensors) and at exit (again for final/), median of --repeats runs;
  also with glibc's malloc told to return freed tensors to the system (MALLOC_ENV); with fsdp,
  also the same folder
  with its tensors under names that do not map one to one (the fallback: every rank loads the
  whole model with from_pretrained, as before sharded loading).

    python bench/memory.py [--parts state,saved,checkpointing,speed,hf] [--layers 16] [--batch 4]
                           [--seq-len 128] [--steps 8] [--warmup 3] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from torch.optim.optimizer import register_optimizer_step_post_hook

from hputrain import Trainer, TrainingArguments
from hputrain.accelerators import detect_accelerator
from hputrain.data.batching import load_corpus
from hputrain.models.gpt import GPT, GPTConfig
from hputrain.training.telemetry import SavedForBackward

from common import machine, trainer_step_time

HERE = Path(__file__).parent
GiB = 2**30


# -- what one process measures ---------------------------------------------------------------------

def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of `tensor`: a DTensor's local shard, else the whole tensor."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def model_state_bytes(optimizer) -> dict[str, int]:
    """Parameters, gradients and optimizer state of this rank, from its local tensors (each
    parameter once, however many groups name it)."""
    params = {id(p): p for group in optimizer.param_groups for p in group["params"]}.values()
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {"parameters": sum(local_bytes(p) for p in params),
            "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(local_bytes(t) for t in state)}


def peak_rss() -> int:
    """This process's peak RSS in bytes: VmHWM, which starts afresh at exec. ru_maxrss does not:
    Linux carries the parent's peak into a child it forks and execs (the hf part's parent holds
    ~1 GB after writing the model folder, which a one-process worker then reported as its own)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def build(opts, meta: bool) -> GPT:
    config = GPTConfig.from_size("base", n_layer=opts.layers, block_size=opts.seq_len)
    torch.manual_seed(0)
    if not meta:
        return GPT(config)
    with torch.device("meta"):  # no storage: fsdp shards it, then draws each rank's shard
        return GPT(config)


def arguments(opts, output_dir: str, steps: int, **training) -> TrainingArguments:
    return TrainingArguments(output_dir=output_dir, max_steps=steps, learning_rate=1e-4,
                             logging_steps=steps, save_steps=0, disable_tqdm=True,
                             per_device_train_batch_size=opts.batch, accelerator="cpu", **training)


def state_worker(opts, data) -> dict:
    """Peak RSS after the Trainer is made, then the model state after one optimizer step."""
    before = peak_rss()  # torch, hputrain and the data, before any model
    model = build(opts, meta=opts.meta)
    trainer = Trainer(model, arguments(opts, os.path.dirname(opts.result), 1, strategy=opts.strategy),
                      train_dataset=data)
    result = {"rss_before_model": before, "rss_after_trainer": peak_rss()}

    def count(optimizer, args, kwargs):  # after step(), before zero_grad() frees the gradients
        result.update(model_state_bytes(optimizer))

    hook = register_optimizer_step_post_hook(count)
    try:
        trainer.train()
    finally:
        hook.remove()
    return result


def saved_worker(opts, data) -> dict:
    """Bytes kept for backward in the last of `steps` steps, counted around the model's forward:
    all of them, and without the parameters' storages (SavedForBackward's exclude), which count
    when autograd keeps a view of a weight (Linear keeps weight.t(), not the Parameter itself)."""
    counts = []

    def loss(module, batch):
        with SavedForBackward(exclude=module.parameters()) as saved:
            out = module(**batch)["loss"]
        counts.append({"saved": saved.nbytes + saved.excluded_nbytes, "activations": saved.nbytes})
        return out

    with tempfile.TemporaryDirectory() as scratch:
        Trainer(build(opts, meta=False), arguments(opts, scratch, 2, gradient_checkpointing=opts.checkpointing),
                train_dataset=data, compute_loss=loss).train()
    return counts[-1]


def time_worker(opts, data) -> dict:
    seconds = trainer_step_time(build(opts, meta=False), data, opts, output_dir=os.path.dirname(opts.result),
                                strategy=opts.strategy, accelerator="cpu",
                                gradient_checkpointing=opts.checkpointing)
    return {"step": seconds}


WORKERS = {"state": state_worker, "saved": saved_worker, "time": time_worker}


def hf_worker(opts) -> None:
    """`hputrain train ARGS` in this process, which writes into RESULT.RANK this rank's peak RSS
    when training begins (the model loaded, sharded and on its device), when it ends (before the
    final export, where rank 0 gathers the whole model to write final/) and at exit. A process
    that only starts the ranks writes RESULT.launcher."""
    import atexit

    from hputrain import cli
    from hputrain.callbacks import Callback, added_to_every_trainer

    result = {}

    class Peaks(Callback):
        def on_train_begin(self, trainer):
            result["loaded"] = peak_rss()

        def on_step_end(self, trainer):  # the last one: after the steps, before the checkpoint
            result["stepped"] = peak_rss()

        def on_train_end(self, trainer):
            result["trained"] = peak_rss()

    rank = os.environ.get("RANK", "0" if opts.processes == 1 else "launcher")
    atexit.register(lambda: Path(f"{opts.result}.{rank}").write_text(
        json.dumps(result | {"at_exit": peak_rss()})))
    with added_to_every_trainer(Peaks):
        status = cli.main(["train", *opts.train])
    sys.exit(status)


def worker(opts) -> None:
    if opts.worker == "hf":
        return hf_worker(opts)
    data, _ = load_corpus(seq_len=opts.seq_len, max_bytes=1_000_000)
    result = WORKERS[opts.worker](opts, data)
    Path(f"{opts.result}.{os.environ.get('RANK', '0')}").write_text(json.dumps(result))


# -- the runs ---------------------------------------------------------------------------------------

def launch(opts, processes: int, role: str, strategy: str = "single", meta: bool = False,
           checkpointing: bool = False, threads: int = 1) -> list[dict]:
    """Run one worker role in `processes` processes (through `hputrain launch` when more than one);
    each rank's result."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result")
        args = [str(HERE / "memory.py"), "--worker", role, "--strategy", strategy, "--result", result,
                "--layers", str(opts.layers), "--batch", str(opts.batch), "--seq-len", str(opts.seq_len),
                "--steps", str(opts.steps), "--warmup", str(opts.warmup)]
        args += ["--meta"] * meta + ["--checkpointing"] * checkpointing
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(HERE)}
        command = [sys.executable, *args] if processes == 1 else [
            sys.executable, "-m", "hputrain.cli", "launch", "--cpu", "--nproc-per-node", str(processes), *args]
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode:
            sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-4000:]}")
        return [json.loads(Path(f"{result}.{rank}").read_text()) for rank in range(processes)]


def state_part(opts) -> None:
    runs = {"1 process, eager model": (1, "single", False),
            "fsdp, 2 processes, meta model": (2, "fsdp", True),
            "fsdp, 4 processes, meta model": (4, "fsdp", True),
            "fsdp, 4 processes, eager model (for contrast)": (4, "fsdp", False)}
    results = {name: launch(opts, n, "state", strategy, meta) for name, (n, strategy, meta) in runs.items()}
    single = results["1 process, eager model"][0]
    whole = single["parameters"] + single["gradients"] + single["optimizer"]
    print("| run | state per rank, largest (MiB): params + grads + AdamW | vs (1/N) x 1 process "
          "| peak RSS before model (MiB) | peak RSS after Trainer, largest rank (MiB) |")
    print("|---|---|---|---|---|")
    for name, ranks in results.items():
        n = runs[name][0]
        states = [r["parameters"] + r["gradients"] + r["optimizer"] for r in ranks]
        top = max(range(n), key=lambda r: states[r])
        parts = ranks[top]
        print(f"| {name} | {states[top] / 2**20:,.1f} = {parts['parameters'] / 2**20:,.1f} + "
              f"{parts['gradients'] / 2**20:,.1f} + {parts['optimizer'] / 2**20:,.1f} | "
              f"{states[top] / (whole / n):.3f} | {max(r['rss_before_model'] for r in ranks) / 2**20:,.0f} | "
              f"{max(r['rss_after_trainer'] for r in ranks) / 2**20:,.0f} |")
    print({name: [{k: v for k, v in r.items()} for r in ranks] for name, ranks in results.items()})


def saved_part(opts) -> None:
    saved = {on: launch(opts, 1, "saved", checkpointing=on, threads=opts.threads)[0] for on in (False, True)}
    # torch.utils.checkpoint keeps each checkpointed block's input itself, not through autograd's
    # saved-tensor hooks: those bytes, one fp32 residual stream per block, are added below
    inputs = opts.layers * opts.batch * opts.seq_len * 768 * 4
    rows = {"SavedForBackward.nbytes": (saved[False]["saved"], saved[True]["saved"]),
            "activations only (weights' storages left out)": (saved[False]["activations"],
                                                              saved[True]["activations"]),
            "activations + checkpointed blocks' inputs": (saved[False]["activations"],
                                                          saved[True]["activations"] + inputs)}
    print("| saved for backward per step | without (MiB) | with gradient_checkpointing (MiB) | ratio |")
    print("|---|---|---|---|")
    for name, (without, with_) in rows.items():
        print(f"| {name} | {without / 2**20:,.1f} | {with_ / 2**20:,.1f} | {with_ / without:.3f} |")


def checkpointing_time_part(opts) -> None:
    times = {False: [], True: []}
    for _ in range(opts.repeats):
        for on in times:
            times[on].append(launch(opts, 1, "time", checkpointing=on, threads=opts.threads)[0]["step"])
    report_times({"without checkpointing": times[False], "gradient_checkpointing": times[True]})


def speed_part(opts) -> None:
    times = {"ddp": [], "fsdp": []}
    for _ in range(opts.repeats):
        for strategy in times:
            times[strategy].append(launch(opts, 2, "time", strategy)[0]["step"])
    report_times(times)


def report_times(times: dict[str, list[float]]) -> None:
    base = statistics.median(next(iter(times.values())))
    print("| run | median step (s) | vs first |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.3f} | {statistics.median(values) / base:.3f}x |")
    print({name: [round(v, 3) for v in values] for name, values in times.items()})


HF_CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=3)
"""The Llama of the hf part: 158.6M parameters, 605 MiB in fp32."""


def hf_config(opts) -> dict:
    """HF_CONFIG, with untied embeddings under --untied (lm_head a matrix of its own)."""
    return HF_CONFIG | {"tie_word_embeddings": not opts.untied}


def hf_folder(root: Path, config: dict = HF_CONFIG) -> Path:
    """A Llama folder as a user has it: config, random fp32 weights (save_pretrained) and a small
    byte-level BPE tokenizer trained here, so that nothing is downloaded."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    folder = root / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(folder)
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([HF_TEXT] * 20, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>", pad_token="<pad>").save_pretrained(folder)
    return folder


HF_TEXT = "the quick brown fox jumps over the lazy dog; a stitch in time saves nine\n"


def renamed_copy(folder: Path) -> Path:
    """`folder` with its tensors under the base model's names (no `model.` prefix):
    from_pretrained maps them, hputrain's one-to-one match does not, so every rank loads it whole."""
    import shutil

    from safetensors.torch import load_file, save_file

    target = folder.with_name("llama-renamed")
    shutil.copytree(folder, target)
    state = load_file(target / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in state.items()}, target / "model.safetensors",
              metadata={"format": "pt"})
    return target


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
"""glibc's malloc with a fixed mmap threshold: a tensor of 1 MiB or more gets its own mapping,
returned to the system when freed. By default the threshold rises to the size of each mapped
block freed (up to 32 MiB), after which such tensors come from the heap, which keeps what is
freed (measured: ~0.6-0.8 GB per rank kept after 2 fsdp steps of the Llama below)."""


def hf_run(opts, folder: Path, data: Path, processes: int, strategy: str, root: Path,
           malloc: bool = False) -> list[dict]:
    """Each rank's peaks of one `hputrain train` run (bytes), rank order; `malloc`: under MALLOC_ENV."""
    result = str(root / f"result-{processes}-{strategy}-{folder.name}-{malloc}")
    train = ["--model", str(folder), "--dataset", str(data), "--max-steps", "2", "--cpu",
             "--devices", str(processes), "--strategy", strategy, "--block-size", "128",
             "--per-device-train-batch-size", "2", "--validation-split-percentage", "0",
             "--logging-steps", "1", "--disable-tqdm", "--report-to", "none",
             "--output-dir", str(root / f"out-{processes}-{strategy}-{folder.name}"), "--overwrite-output-dir"]
    command = [sys.executable, str(HERE / "memory.py"), "--worker", "hf", "--result", result,
               "--processes", str(processes), "--", *train]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE), **(MALLOC_ENV if malloc else {})}
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-4000:]}")
    return [json.loads(Path(f"{result}.{rank}").read_text()) for rank in range(processes)]


def hf_part(opts) -> None:
    import transformers

    malloc = " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items())
    runs = {"1 process": (1, "single", False, False), "fsdp, 2 processes": (2, "fsdp", False, False),
            "fsdp, 4 processes": (4, "fsdp", False, False),
            "fsdp, 4 processes, whole model on every rank (fallback)": (4, "fsdp", True, False),
            f"1 process, {malloc}": (1, "single", False, True),
            f"fsdp, 2 processes, {malloc}": (2, "fsdp", False, True),
            f"fsdp, 4 processes, {malloc}": (4, "fsdp", False, True)}
    if opts.hf_runs:  # a subset, by position in the table above (1-based)
        names = list(runs)
        runs = {names[int(i) - 1]: runs[names[int(i) - 1]] for i in opts.hf_runs.split(",")}
    peaks: dict[str, list[list[dict]]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = hf_folder(root, hf_config(opts))
        renamed = renamed_copy(folder)
        data = root / "data.txt"
        data.write_text(HF_TEXT * 4000)
        for _ in range(opts.repeats):
            for name, (n, strategy, whole, malloc_env) in runs.items():
                peaks[name].append(hf_run(opts, renamed if whole else folder, data, n, strategy, root,
                                          malloc_env))
    params = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(opts))).num_parameters()
    print(f"model: Llama {hf_config(opts)}, {params / 1e6:.1f}M parameters, {params * 4 / 2**20:,.0f} MiB fp32; "
          f"2 steps of 2 x 128 tokens per process, AdamW; median of {opts.repeats} runs")
    singles = {malloc_env: statistics.median(r[0]["at_exit"] for r in peaks[name])
               for name, (n, _, _, malloc_env) in runs.items() if n == 1}
    print("peak RSS per rank, MiB, rank 0 / the largest other rank (x the one-process peak at exit "
          "under the same malloc setting)")
    print("| run | when training begins (model loaded and sharded) | after the steps | when training ends "
          "(rank 0 has gathered the model for the checkpoint) | at exit (and for final/) |")
    print("|---|---|---|---|---|")
    for name, repeats in peaks.items():
        single = singles[runs[name][3]]
        others = range(1, len(repeats[0])) or range(1)
        cells = []
        for key in ("loaded", "stepped", "trained", "at_exit"):
            zero, other = (statistics.median(max(r[rank][key] for rank in ranks) for r in repeats)
                           for ranks in ([0], others))
            cells.append(f"{zero / 2**20:,.0f} / {other / 2**20:,.0f} ({zero / single:.2f} / {other / single:.2f})")
        print(f"| {name} | {' | '.join(cells)} |")
    print({name: [[{k: round(v / 2**20) for k, v in r.items()} for r in ranks] for ranks in repeats]
           for name, repeats in peaks.items()})


PARTS = {"state": state_part, "saved": saved_part, "checkpointing": checkpointing_time_part,
         "speed": speed_part, "hf": hf_part}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="state,saved,checkpointing,speed")
    p.add_argument("--layers", type=int, default=16, help="blocks of width 768 (16: 113.7M parameters)")
    p.add_argument("--batch", type=int, default=4, help="per process")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the timings")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the timings")
    p.add_argument("--threads", type=int, default=2, help="threads of the one-process checkpointing runs")
    p.add_argument("--untied", action="store_true", help="hf: the Llama with untied embeddings")
    p.add_argument("--hf-runs", help="hf: only these rows of its table (1-based, e.g. 1,3,5,7)")
    p.add_argument("--worker", choices=[*WORKERS, "hf"], help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="single", help=argparse.SUPPRESS)
    p.add_argument("--meta", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--processes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("train", nargs="*", help=argparse.SUPPRESS)  # the hf worker's `hputrain train` arguments
    opts = p.parse_args()
    if opts.worker:
        return worker(opts)
    config = GPTConfig.from_size("base", n_layer=opts.layers, block_size=opts.seq_len)
    print(f"machine: {machine(detect_accelerator('cpu'))}, {os.cpu_count()} cores")
    print(f"model: GPT width 768, {opts.layers} blocks, {config.num_parameters():,} parameters, fp32, AdamW; "
          f"seq {opts.seq_len}, batch {opts.batch} per process; timings: {opts.steps} steps, first "
          f"{opts.warmup} left out, {opts.repeats} interleaved repeats")
    for part in opts.parts.split(","):
        print(f"\n## {part}")
        PARTS[part](opts)


if __name__ == "__main__":
    main()
