"""A GRPO step of hputrain's GRPOTrainer against TRL 1.16's GRPOTrainer on the same model, prompts,
reward and settings: step time, generated tokens per second, the share of the step spent
generating, and peak resident memory.

The model: a Llama of hidden 256, 4 layers, 4 heads, intermediate 1024, vocab 32000 (a byte-level
BPE tokenizer trained here on the standard library's source, so nothing is downloaded), saved once
with save_pretrained and loaded by every run, so both trainers start from the same weights. The
prompts: a few dozen short lines of the standard library's source. The settings, the same on
both sides: num_generations 8, per_device_train_batch_size 8 (one prompt's group a step),
max_completion_length 64, loss dapo, beta 0 (no reference), temperature 1, AdamW lr 1e-6, clip
1.0, fp32, no vLLM, no gradient checkpointing (TRL's GRPOConfig turns it on by default; it is
turned off here so that both compute the same thing), a log record every step. The reward: the
share of letters in the completion's text.

Each run is a fresh process (`--child`), so that peak memory is its own; runs are interleaved,
round after round (hputrain, TRL, hputrain, TRL, ...), never two at once. In a run, step times are
stamped after every optimizer step; the first --warmup steps are left out (for hputrain's captured
decode step they hold the compiles, whose time is reported as warm-up). Parts of a step are timed
by wrappers around the same calls on both sides: generation (hputrain's StaticGenerator.generate,
TRL's model.generate), the rollout (hputrain's objective.rollout, TRL's
_generate_and_score_completions: generation, decoding, rewards, advantages), and the loss's forward
(compute_loss); the rest of the step is backward, optimizer and the loop. hputrain's own
`generation_share` metric is reported beside the wrapper's share. Tokens generated count the
decoded positions (rows x new tokens), since both decode every row until the last ends.
Memory: VmHWM of the child process over training (reset through /proc/self/clear_refs once the
trainer is built), and its rise over the resident memory at that moment.

    python bench/grpo.py [--steps 6] [--warmup 2] [--repeats 3]
                         [--runs hputrain,hputrain-graphs,trl] [--profile] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import transformers  # noqa: E402

from common import machine  # noqa: E402
from hf_finetune import train_tokenizer  # noqa: E402
from hputrain.accelerators import detect_accelerator  # noqa: E402
from hputrain.data.batching import read_corpus  # noqa: E402

RUNS = {"hputrain": {"graphs": False, "buckets": None},
        "hputrain-graphs": {"graphs": True, "buckets": None},
        "hputrain-b32": {"graphs": False, "buckets": (32,)},
        "hputrain-b16": {"graphs": False, "buckets": (16, 32)},
        "hputrain-graphs-b32": {"graphs": True, "buckets": (32,)},
        "trl": None}
"""hputrain's variants (the captured decode step; prompt buckets of 32, or 16 and 32, instead
of the default 16, 32, 64, ... 512, which these prompts of 10 to 24 tokens meet at 16 and 32 too)
and TRL's one run."""

GROUP = 8
"""num_generations and per_device_train_batch_size."""


def letters(prompts, completions, completion_ids=None, **columns):
    """The reward: the share of letters in each completion's text."""
    return [sum(c.isalpha() for c in text) / max(len(text), 1) for text in completions]


def build_folder(folder: Path, prompts: int) -> list[str]:
    """The model folder (weights and tokenizer) every run loads, and the prompts."""
    text = read_corpus(max_bytes=6_000_000).decode("utf-8", "replace")
    tokenizer = train_tokenizer(text, 32000)  # 6 MB of source reach the full 32000
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=1024,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=512, tie_word_embeddings=False,
                                      bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # short lines of code and prose, at most 24 tokens: every prompt bucket tried holds them
    lines = [line.strip() for line in text.splitlines()[1000::97]]
    chosen = [line for line in lines if 24 <= len(line) <= 60 and len(tokenizer(line)["input_ids"]) <= 24]
    return chosen[:prompts]


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


class Clock:
    """Seconds spent in wrapped calls, per label, one entry a call; tokens each generation made."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.tokens: list[int] = []

    def wrap(self, owner, name: str, label: str, count=None) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            self.seconds[label].append(time.perf_counter() - start)
            if count is not None:
                self.tokens.append(count(out, kwargs))
            return out

        setattr(owner, name, timed)  # an instance attribute: hides the method for this object only


def load(folder: Path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), tokenizer


def run_hputrain(folder: Path, prompts: list[str], opts, variant: dict) -> dict:
    from hputrain import GRPOConfig, GRPOTrainer
    from hputrain.callbacks import Callback

    clock, stamps, shares = Clock(), [], []

    class Probe(Callback):
        def on_train_begin(self, trainer):
            stamps.append(time.perf_counter())
            clock.wrap(trainer.objective.generator, "generate", "generate",
                       lambda out, kwargs: out.completion_ids.numel())

        def on_step_end(self, trainer):
            stamps.append(time.perf_counter())
            # from the end of the last warm-up step to the next step's end: its rollout included
            if opts.profile and len(stamps) == opts.warmup + 1:
                profile_start()
            elif opts.profile and len(stamps) == opts.warmup + 2:
                profile_stop()

        def on_log(self, trainer, record):
            if "generation_share" in record:
                shares.append(record["generation_share"])

    model, tokenizer = load(folder)
    extra = {"prompt_buckets": variant["buckets"]} if variant["buckets"] else {}
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, max_steps=opts.steps, per_device_train_batch_size=GROUP,
                          num_generations=GROUP, max_completion_length=opts.completion,
                          loss_type="dapo", beta=0.0, temperature=1.0, top_p=1.0, top_k=0,
                          learning_rate=1e-6, max_grad_norm=1.0, logging_steps=1, save_steps=-1,
                          disable_tqdm=True, report_to="none", precision="fp32", seed=0,
                          use_graphs_for_inference=variant["graphs"], **extra)
        trainer = GRPOTrainer(model, args, reward_funcs=[letters],
                              train_dataset=[{"prompt": p} for p in prompts],
                              processing_class=tokenizer, callbacks=[Probe()])
        clock.wrap(trainer.objective, "rollout", "rollout")
        clock.wrap(trainer.objective, "compute_loss", "loss_forward")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status_kb("VmRSS")
        trainer.train()
    return {"stamps": stamps, "seconds": clock.seconds, "tokens": clock.tokens, "shares": shares,
            "rss_kb": before, "hwm_kb": _status_kb("VmHWM")}


def run_trl(folder: Path, prompts: list[str], opts) -> dict:
    import datasets
    import trl

    clock, stamps = Clock(), []

    class Probe(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    model, tokenizer = load(folder)
    clock.wrap(model, "generate", "generate",
               lambda out, kwargs: out.shape[0] * (out.shape[1] - kwargs["input_ids"].shape[1]))
    with tempfile.TemporaryDirectory() as out:
        args = trl.GRPOConfig(output_dir=out, max_steps=opts.steps, per_device_train_batch_size=GROUP,
                              num_generations=GROUP, max_completion_length=opts.completion,
                              loss_type="dapo", beta=0.0, temperature=1.0, top_p=1.0, top_k=0,
                              learning_rate=1e-6, max_grad_norm=1.0, logging_steps=1,
                              save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                              gradient_checkpointing=opts.trl_checkpointing, disable_tqdm=True,
                              seed=0, dataloader_num_workers=0)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=[letters], args=args,
                                  train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in prompts]),
                                  processing_class=tokenizer, callbacks=[Probe()])
        clock.wrap(trainer, "_generate_and_score_completions", "rollout")
        clock.wrap(trainer, "compute_loss", "loss_forward")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status_kb("VmRSS")
        trainer.train()
    return {"stamps": stamps, "seconds": clock.seconds, "tokens": clock.tokens, "shares": [],
            "rss_kb": before, "hwm_kb": _status_kb("VmHWM")}


_PROFILER = []


def profile_start() -> None:
    """torch.profiler over one measured hputrain step (--profile)."""
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    profiler.__enter__()
    _PROFILER.append(profiler)


def profile_stop() -> None:
    profiler = _PROFILER.pop()
    profiler.__exit__(None, None, None)
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)


def summary(result: dict, warmup: int) -> dict:
    """One run's figures over the steps after warm-up."""
    stamps = result["stamps"]
    steps = [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1:])]
    parts = {label: sum(values[warmup:]) for label, values in result["seconds"].items()}
    total = sum(steps)
    parts["rest"] = total - parts["rollout"] - parts["loss_forward"]
    shares = result["shares"][warmup:]
    return {"step_s": statistics.median(steps), "warmup_s": stamps[warmup] - stamps[0],
            "tokens_per_s": sum(result["tokens"][warmup:]) / parts["generate"],
            "share": parts["generate"] / total,
            "metric_share": statistics.median(shares) if shares else None,
            "parts": {k: v / len(steps) for k, v in parts.items()},
            "peak_mib": result["hwm_kb"] / 1024, "rise_mib": (result["hwm_kb"] - result["rss_kb"]) / 1024}


def child(opts) -> None:
    os.environ.setdefault("HPUTRAIN_ACCELERATOR", "cpu")
    folder = Path(opts.folder)
    prompts = json.loads((folder / "prompts.json").read_text())
    if opts.child == "trl":
        result = run_trl(folder, prompts, opts)
    else:
        result = run_hputrain(folder, prompts, opts, RUNS[opts.child])
    print(json.dumps(summary(result, opts.warmup)))


def run_child(name: str, folder: str, opts) -> dict:
    command = [sys.executable, __file__, "--child", name, "--folder", folder, "--steps", str(opts.steps),
               "--warmup", str(opts.warmup), "--completion", str(opts.completion)]
    command += ["--profile"] if opts.profile else []
    command += ["--trl-checkpointing"] if opts.trl_checkpointing else []
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-4000:]}")
    if opts.profile and name != "trl":
        print(done.stderr[-12000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(runs: dict[str, list[dict]], opts, prompts: list[str]) -> None:
    accelerator = detect_accelerator("cpu")
    accelerator.setup(0)
    print(f"machine: {machine(accelerator)}")
    print(f"transformers {transformers.__version__}, trl {__import__('trl').__version__}")
    print(f"model: Llama hidden 256, 4 layers, 4 heads, intermediate 1024, vocab 32000, fp32; "
          f"{len(prompts)} prompts, num_generations {GROUP}, batch {GROUP}, "
          f"max_completion_length {opts.completion}, dapo, beta 0; {opts.steps} steps, first "
          f"{opts.warmup} left out, {opts.repeats} interleaved rounds (medians over rounds)")
    med = {name: {key: statistics.median(r[key] for r in results)
                  for key in ("step_s", "warmup_s", "tokens_per_s", "share", "peak_mib", "rise_mib")}
           for name, results in runs.items()}
    base = med.get("trl")
    print("| run | median step (s) | vs TRL | generated tok/s | generating | peak VmHWM (MiB) "
          "| rise (MiB) | warm-up steps (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, m in med.items():
        ratio = f"{m['step_s'] / base['step_s']:.2f}x" if base else "-"
        metric = [r["metric_share"] for r in runs[name] if r["metric_share"] is not None]
        shown = f"{m['share']:.0%}" + (f" (metric {statistics.median(metric):.0%})" if metric else "")
        print(f"| {name} | {m['step_s']:.2f} | {ratio} | {m['tokens_per_s']:.0f} | {shown} | "
              f"{m['peak_mib']:.0f} | {m['rise_mib']:.0f} | {m['warmup_s']:.1f} |")
    print("\nper step (s): generate / rest of rollout / loss forward / backward+optimizer+loop")
    for name, results in runs.items():
        parts = {k: statistics.median(r["parts"][k] for r in results)
                 for k in ("generate", "rollout", "loss_forward", "rest")}
        print(f"| {name} | {parts['generate']:.2f} | {parts['rollout'] - parts['generate']:.2f} | "
              f"{parts['loss_forward']:.2f} | {parts['rest']:.2f} |")
    print({name: [round(r["step_s"], 3) for r in results] for name, results in runs.items()})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--completion", type=int, default=64, help="max_completion_length")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--runs", default="hputrain,hputrain-graphs,trl",
                   help=f"comma-separated, in the order of a round: {', '.join(RUNS)}")
    p.add_argument("--trl-checkpointing", action="store_true",
                   help="TRL with its default gradient_checkpointing=True")
    p.add_argument("--profile", action="store_true", help="torch.profiler over one hputrain step")
    p.add_argument("--json", help="write the records here too")
    p.add_argument("--child", choices=tuple(RUNS), help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.child:
        return child(opts)
    names = opts.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        p.error(f"unknown run {unknown[0]!r}: choose from {', '.join(RUNS)}")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as folder:
        prompts = build_folder(Path(folder), opts.prompts)
        (Path(folder) / "prompts.json").write_text(json.dumps(prompts))
        for _ in range(opts.repeats):
            for name in names:
                runs[name].append(run_child(name, folder, opts))
                print(name, json.dumps(runs[name][-1]), flush=True)
    report(runs, opts, prompts)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"runs": runs, "prompts": prompts}, indent=2))
    return None


if __name__ == "__main__":
    main()
