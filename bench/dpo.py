"""DPO through hputrain and through TRL 1.16's DPOTrainer: the same Llama-architecture model (built
from a config), reference, preference pairs and settings; interleaved repeats, median step time
after warm-up. TRL runs in this environment (it is in the test extra, pinned).

Settings shared by both: LoRA (peft, r 8, alpha 16, dropout 0 on q_proj and v_proj) with the
adapter-disabled base as the reference (no second model), sigmoid loss, beta 0.1, AdamW lr 1e-4,
gradients clipped to 1.0, fp32, no evaluation, no checkpoint, no tracker, no progress bar. The
pairs: prompts and completions cut from the standard library's source, tokenized by a byte-level
BPE tokenizer trained here (nothing is downloaded), --pairs of them, --batch a step.

Step times are stamped after every optimizer step by a callback of each trainer; the first
--warmup steps are left out. Both trainers run in this one process, one after the other, in
--repeats interleaved rounds.

Memory (--part memory): the peak of LoRA DPO with the adapter-disabled reference against LoRA SFT
on the same sequences (each pair's prompt + chosen and prompt + rejected as two SFT rows, the
completion learned), same batch of sequences, each in a fresh process. The figure is the rise of
the process's resident memory over the training steps: VmHWM (the peak, reset through
/proc/self/clear_refs once the trainer is built) minus VmRSS at that moment, so the model, the
tokenizer and Python's own memory are left out and what remains is what training adds
(gradients, optimizer state, activations, the logits and the reference's forward).

    python bench/dpo.py [--part time|memory] [--steps 12] [--warmup 3] [--repeats 3] [--batch 4]
                        [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import transformers  # noqa: E402

from common import machine  # noqa: E402
from hf_finetune import train_tokenizer  # noqa: E402
from hputrain import DPOConfig, DPOTrainer  # noqa: E402
from hputrain.accelerators import detect_accelerator  # noqa: E402
from hputrain.callbacks import Callback  # noqa: E402
from hputrain.data.batching import read_corpus  # noqa: E402


def pairs(count: int, prompt_chars: int, completion_chars: int) -> list[dict]:
    """Preference rows cut from the standard library's source: a prompt, then two different
    continuations (the chosen one is the text that really follows)."""
    text = read_corpus(max_bytes=2_000_000).decode("utf-8", "replace")
    rows, step = [], prompt_chars + 2 * completion_chars
    for i in range(count):
        start = i * step
        piece = text[start:start + step]
        rows.append({"prompt": piece[:prompt_chars],
                     "chosen": piece[prompt_chars:prompt_chars + completion_chars],
                     "rejected": piece[prompt_chars + completion_chars:]})
    return rows


def model(vocab_size: int, seed: int = 0, hidden: int = 256, layers: int = 4):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=hidden,
                                      intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=8,
                                      num_key_value_heads=4, max_position_embeddings=512,
                                      tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


def lora_config():
    import peft

    return peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                           task_type="CAUSAL_LM")


class Stamps(Callback):
    def __init__(self):
        self.stamps = []

    def on_step_end(self, trainer):
        self.stamps.append(time.perf_counter())


def run_hputrain(rows, tokenizer, opts) -> list[float]:
    import peft

    stamps = Stamps()
    policy = peft.get_peft_model(model(len(tokenizer)), lora_config())
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, max_steps=opts.steps, per_device_train_batch_size=opts.batch,
                         learning_rate=1e-4, max_grad_norm=1.0, logging_steps=opts.steps,
                         save_steps=-1, disable_tqdm=True, report_to="none", precision="fp32",
                         max_length=opts.max_length)
        DPOTrainer(policy, args, train_dataset=rows, processing_class=tokenizer,
                   callbacks=[stamps]).train()
    return stamps.stamps


def run_trl(rows, tokenizer, opts) -> list[float]:
    import datasets
    import trl

    class TRLStamps(transformers.TrainerCallback):
        def __init__(self):
            self.stamps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.stamps.append(time.perf_counter())

    stamps = TRLStamps()
    with tempfile.TemporaryDirectory() as out:
        args = trl.DPOConfig(output_dir=out, max_steps=opts.steps, per_device_train_batch_size=opts.batch,
                             learning_rate=1e-4, max_grad_norm=1.0, logging_steps=opts.steps,
                             save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                             disable_tqdm=True, max_length=opts.max_length, lr_scheduler_type="linear",
                             dataloader_num_workers=0)
        trainer = trl.DPOTrainer(model(len(tokenizer)), args=args, processing_class=tokenizer,
                                 train_dataset=datasets.Dataset.from_list(rows),
                                 peft_config=lora_config(), callbacks=[stamps])
        trainer.train()
    return stamps.stamps


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_child(method: str, opts) -> None:
    """One run in this process: prints the rise of resident memory over the training steps."""
    import peft

    from hputrain import Trainer, TrainingArguments
    from hputrain.data.batching import PadToBuckets
    from hputrain.methods.dpo.data import encode_pairs

    text = read_corpus(max_bytes=2_000_000).decode("utf-8", "replace")
    tokenizer = train_tokenizer(text[:500_000], 8192)
    rows = pairs(opts.batch * opts.steps, prompt_chars=500, completion_chars=400)
    policy = peft.get_peft_model(model(len(tokenizer), hidden=512, layers=8), lora_config())
    with tempfile.TemporaryDirectory() as out:
        common = dict(output_dir=out, max_steps=opts.steps, learning_rate=1e-4, logging_steps=opts.steps,
                      save_steps=-1, disable_tqdm=True, report_to="none", precision="fp32")
        if method == "dpo":
            args = DPOConfig(per_device_train_batch_size=opts.batch, max_length=opts.max_length, **common)
            trainer = DPOTrainer(policy, args, train_dataset=rows, processing_class=tokenizer)
        else:
            encoded, _ = encode_pairs(((str(i), r) for i, r in enumerate(rows)), tokenizer,
                                      max_length=opts.max_length)
            examples = [{"input_ids": p["prompt_ids"] + p[key],
                         "labels": [-100] * len(p["prompt_ids"]) + p[key]}
                        for p in encoded for key in ("chosen_ids", "rejected_ids")]
            args = TrainingArguments(per_device_train_batch_size=2 * opts.batch, **common)
            collate = PadToBuckets(tokenizer.pad_token_id, buckets=4, max_length=opts.max_length)
            trainer = Trainer(policy, args, train_dataset=examples, data_collator=collate)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status("VmRSS")
        trainer.train()
        print(json.dumps({"method": method, "rise_bytes": _status("VmHWM") - before}))


def memory_part(opts) -> dict:
    import subprocess

    rises = {"dpo": [], "sft": []}
    for _ in range(opts.repeats):
        for method in rises:
            out = subprocess.run([sys.executable, __file__, "--child", method, "--steps", str(opts.steps),
                                  "--batch", str(opts.batch), "--max-length", str(opts.max_length)],
                                 capture_output=True, text=True, check=True).stdout
            rises[method].append(json.loads(out.strip().splitlines()[-1])["rise_bytes"])
    dpo, sft = statistics.median(rises["dpo"]), statistics.median(rises["sft"])
    print(f"model: Llama hidden 512, 8 layers, vocab 8192, LoRA r 8 on q_proj/v_proj, {opts.batch} "
          f"pairs = {2 * opts.batch} sequences a step, max_length {opts.max_length}, fp32, "
          f"{opts.steps} steps, {opts.repeats} repeats, each a fresh process")
    print("| run | rise of resident memory over training (MiB) | vs SFT |")
    print("|---|---|---|")
    print(f"| LoRA DPO, adapter-disabled reference | {dpo / 2**20:.1f} | {dpo / sft:.3f}x |")
    print(f"| LoRA SFT, the same sequences | {sft / 2**20:.1f} | 1.000x |")
    print({k: [round(v / 2**20, 1) for v in values] for k, values in rises.items()})
    return {"rises": rises, "ratio": dpo / sft}


def median_step(stamps: list[float], warmup: int) -> float:
    return statistics.median(b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1:]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--part", choices=("time", "memory"), default="time")
    p.add_argument("--child", choices=("dpo", "sft"), help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the records here too")
    opts = p.parse_args(argv)
    if opts.child:
        return memory_child(opts.child, opts)
    if opts.part == "memory":
        accelerator = detect_accelerator("cpu")
        accelerator.setup(0)
        print(f"machine: {machine(accelerator)}")
        record = memory_part(opts)
        if opts.json:
            Path(opts.json).write_text(json.dumps(record, indent=2))
        return None
    text = read_corpus(max_bytes=2_000_000).decode("utf-8", "replace")
    tokenizer = train_tokenizer(text[:500_000], 4096)
    rows = pairs(opts.batch * opts.steps, prompt_chars=300, completion_chars=200)
    runs = {"hputrain": [], "trl": []}
    for _ in range(opts.repeats):
        runs["hputrain"].append(median_step(run_hputrain(rows, tokenizer, opts), opts.warmup))
        runs["trl"].append(median_step(run_trl(rows, tokenizer, opts), opts.warmup))
    accelerator = detect_accelerator("cpu")
    accelerator.setup(0)
    ours, theirs = statistics.median(runs["hputrain"]), statistics.median(runs["trl"])
    print(f"machine: {machine(accelerator)}")
    print(f"model: Llama hidden 256, 4 layers, vocab {len(tokenizer)}, LoRA r 8 on q_proj/v_proj, "
          f"batch {opts.batch} pairs, max_length {opts.max_length}, fp32, {opts.steps} steps, "
          f"first {opts.warmup} left out, {opts.repeats} interleaved repeats")
    print("| trainer | median step (ms) | time vs TRL |")
    print("|---|---|---|")
    print(f"| hputrain DPOTrainer | {ours * 1e3:.1f} | {ours / theirs:.3f}x |")
    print(f"| TRL 1.16 DPOTrainer | {theirs * 1e3:.1f} | 1.000x |")
    print({name: [round(v * 1e3, 1) for v in values] for name, values in runs.items()})
    if opts.json:
        Path(opts.json).write_text(json.dumps({"runs": runs, "ratio": ours / theirs}, indent=2))


if __name__ == "__main__":
    main()
