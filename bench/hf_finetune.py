"""A Hugging Face fine-tune through hputrain and through the Hugging Face Trainer: the same
Llama-architecture model (built from a config), data and settings, full fine-tune and LoRA, fp32
and bf16 (bf16 only where it is native), interleaved repeats, median step time after warm-up.

- compare: hputrain's Trainer against transformers.Trainer, one configuration per (full | LoRA,
  fp32 | bf16); the ratio hputrain / Hugging Face is the issue's figure (at most 1.0).
- workers: hputrain on a dataset of raw text whose collator tokenizes on the fly (it encodes
  whole documents, then cuts them to the sequence length), with dataloader_num_workers 0 and 2,
  against the same batches tokenized beforehand and held in memory (the issue: with 2 workers the
  step is no slower than with the data in memory).

The data: the standard library's source cut into documents of --doc-chars characters, tokenized
by a byte-level BPE tokenizer trained here with `tokenizers` (nothing is downloaded). Every
sample is a document's first --seq-len tokens; labels are the inputs (the model shifts them).
Settings shared by both trainers: torch's fused AdamW (lr 1e-4, betas (0.9, 0.999), eps 1e-8,
weight decay 0.01 on matrices only), gradients clipped to 1.0, linear schedule after 2 warm-up
steps, data loaded in the main process unless said, no evaluation, no checkpoint, no tracker, no
progress bar, a log line only at the end. LoRA: peft's get_peft_model, r 8, alpha 16, dropout
0.05 on q_proj and v_proj.

Step times are stamped after every optimizer step by a callback (common.StepTimes,
transformers.TrainerCallback), the device synchronised first; the first --warmup steps are left
out. A forward pre-hook on the model stamps every step's start too: where a trainer does not call
its callbacks, both frameworks are compared on those stamps instead (the record says which), and
each record also keeps train()'s wall time over the steps. Everything runs in this one process,
after the accelerator's set-up, so both trainers work under the same allocator settings and
threads (each record keeps torch's thread count).

    python bench/hf_finetune.py [--parts compare,workers] [--steps 20] [--warmup 4] [--repeats 3]
                                [--precisions fp32,bf16] [--json FILE] [--quick]

Prints one JSON record per configuration (every repeat's median step, the median over repeats, the
ratio, train()'s wall time per step, torch's threads), then a Markdown table and one line per
configuration with the issue's ratio. On an idle 2-core CPU with native bf16 the defaults take
about 40 minutes (660 steps of 1 to 4 s, set-up included); steps of the Llama here are seconds
long, so 16 timed steps per run already give a steady median.

--quick: a tiny model and a few steps, to check the script end to end (about 10 s).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers fork after the tokenizer ran

import torch
from common import StepTimes, bf16_where_native, machine, median_step

from hputrain import Trainer, TrainingArguments
from hputrain.accelerators import detect_accelerator
from hputrain.data.batching import read_corpus

try:
    import peft
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
except ImportError as missing:  # the peers are never dependencies of hputrain
    sys.exit(f"bench/hf_finetune.py needs transformers, peft and tokenizers: {missing}")

LR, BETAS, EPS, WEIGHT_DECAY, CLIP, LR_WARMUP, SEED = 1e-4, (0.9, 0.999), 1e-8, 0.01, 1.0, 2, 0
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}


# -- the data --------------------------------------------------------------------------------------

def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE tokenizer trained on `text` (every byte has a token, so any text encodes)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<pad>")


class TokenizeCollator:
    """Raw documents to a batch: encode each whole document (as a naive on-the-fly collator does:
    the tokenizer truncates only after encoding), keep the first `seq_len` tokens, pad any short
    one. A class at module level, so worker processes can take it."""

    def __init__(self, tokenizer, seq_len: int) -> None:
        self.tokenizer, self.seq_len = tokenizer, seq_len

    def __call__(self, documents: list[str]) -> dict[str, torch.Tensor]:
        batch = self.tokenizer(documents, truncation=True, max_length=self.seq_len, padding="max_length",
                               return_tensors="pt")
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels}


def make_data(opts) -> tuple[list[str], list[dict], TokenizeCollator]:
    """The documents, the same documents tokenized beforehand (one sample each, exactly what the
    collator makes of it), and the collator."""
    needed = opts.steps * opts.batch  # one epoch covers a run: no epoch boundary in the timings
    text = read_corpus(max_bytes=needed * opts.doc_chars + 1_000_000).decode("utf-8", "replace")
    started = time.perf_counter()
    tokenizer = train_tokenizer(text[:opts.tokenizer_chars], opts.vocab)
    print(f"tokenizer: {len(tokenizer)} tokens, trained in {time.perf_counter() - started:.1f} s")
    documents = [text[i:i + opts.doc_chars] for i in range(0, len(text) - opts.doc_chars, opts.doc_chars)]
    collate = TokenizeCollator(tokenizer, opts.seq_len)
    samples = [{k: v[0] for k, v in collate([doc]).items()} for doc in documents[:needed]]
    if len(samples) < needed or any(bool((s["labels"] == -100).any()) for s in samples):
        sys.exit(f"the corpus gives too few documents of {opts.seq_len} tokens: raise --doc-chars")
    return documents[:needed], samples, collate


# -- the model -------------------------------------------------------------------------------------

def llama_config(opts, vocab_size: int):
    return transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=opts.hidden, intermediate_size=opts.intermediate,
        num_hidden_layers=opts.layers, num_attention_heads=opts.heads, num_key_value_heads=opts.heads,
        max_position_embeddings=opts.seq_len, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=3, attn_implementation="sdpa")


def build_model(config, lora: bool, stamps: list[float], synchronize):
    """The same weights every time (seed 0); LoRA adapters through peft when asked. A forward
    pre-hook stamps the start of every step (see the module docstring)."""
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(config)
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))

    def stamp(module, args, kwargs):
        synchronize()
        stamps.append(time.perf_counter())
    model.register_forward_pre_hook(stamp, with_kwargs=True)
    return model


# -- the two trainers ------------------------------------------------------------------------------

class HFStepTimer(transformers.TrainerCallback):
    """The Hugging Face Trainer's counterpart of common.StepTimes: the end of every optimizer
    step, from its on_step_end, the device synchronised first."""

    def __init__(self, synchronize) -> None:
        self.synchronize, self.stamps = synchronize, []

    def on_step_end(self, args, state, control, **kwargs):
        self.synchronize()
        self.stamps.append(time.perf_counter())


def run_hputrain(model, data, opts, bf16: bool, collator=None, workers: int = 0) -> list[float]:
    timer = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=opts.steps, seed=SEED, per_device_train_batch_size=opts.batch,
            bf16=bf16, learning_rate=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS,
            weight_decay=WEIGHT_DECAY, optim="adamw_torch_fused", max_grad_norm=CLIP,
            lr_scheduler_type="linear", warmup_steps=LR_WARMUP, logging_steps=opts.steps, save_steps=-1,
            report_to="none", disable_tqdm=True, dataloader_num_workers=workers)
        Trainer(model, args, train_dataset=data, data_collator=collator, callbacks=[timer]).train()
    return timer.stamps


def run_hf(model, data, opts, bf16: bool, device: torch.device, synchronize) -> list[float]:
    timer = HFStepTimer(synchronize)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, use_cpu=device.type == "cpu", max_steps=opts.steps, seed=SEED,
            per_device_train_batch_size=opts.batch, bf16=bf16, learning_rate=LR, adam_beta1=BETAS[0],
            adam_beta2=BETAS[1], adam_epsilon=EPS, weight_decay=WEIGHT_DECAY, optim="adamw_torch_fused",
            max_grad_norm=CLIP, lr_scheduler_type="linear", warmup_steps=LR_WARMUP,
            logging_strategy="steps", logging_steps=opts.steps, eval_strategy="no", save_strategy="no",
            report_to="none", disable_tqdm=True, dataloader_num_workers=0, dataloader_drop_last=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[timer])
        # its loss line at the end: hputrain prints nothing either
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        trainer.train()
    return timer.stamps


def timed(train, config, lora: bool, opts, synchronize) -> dict:
    """One run: `train(model)` on a fresh model; its step stamps, forward stamps and wall time."""
    forward: list[float] = []
    gc.collect()  # the previous run's trainer and model: freed now, not during this run's steps
    model = build_model(config, lora, forward, synchronize)
    started = time.perf_counter()
    stamps = train(model)
    wall = time.perf_counter() - started
    return {"callback": stamps, "forward": forward[:opts.steps], "wall_per_step": wall / opts.steps,
            "threads": torch.get_num_threads()}


def timing_source(runs: list[dict], warmup: int) -> str:
    """Which stamps the step times come from: the callbacks' where every run has them, else the
    forward pre-hook's (a trainer that does not call its callbacks yet), the same for all runs."""
    return "callback" if all(len(run["callback"]) > warmup + 1 for run in runs) else "forward"


# -- the parts -------------------------------------------------------------------------------------

def compare_part(opts, setting, data, config) -> list[dict]:
    """hputrain against the Hugging Face Trainer, interleaved, for every method and precision."""
    records = []
    for precision in opts.precisions:
        bf16 = precision == "bf16"
        for method in ("full", "lora"):
            lora = method == "lora"
            runs = {"hputrain": [], "hf": []}
            trainers = {"hputrain": partial(run_hputrain, data=data, opts=opts, bf16=bf16),
                        "hf": partial(run_hf, data=data, opts=opts, bf16=bf16, device=setting.device,
                                      synchronize=setting.synchronize)}
            for repeat in range(opts.repeats):
                # interleaved, so drift in the machine hits both alike, and in alternating order
                # (AB BA ...), so that neither always runs just after the other
                for name in (("hputrain", "hf") if repeat % 2 == 0 else ("hf", "hputrain")):
                    runs[name].append(timed(trainers[name], config, lora, opts, setting.synchronize))
            records.append(record(f"{method} {precision}", "compare", opts, runs, baseline="hf"))
    return records


def workers_part(opts, setting, documents, samples, collate, config) -> list[dict]:
    """hputrain with the data tokenized in memory against on-the-fly tokenizing with 0 and 2 workers."""
    runs = {"in memory": [], "on the fly, 0 workers": [], "on the fly, 2 workers": []}
    feeds = {"in memory": (samples, None, 0), "on the fly, 0 workers": (documents, collate, 0),
             "on the fly, 2 workers": (documents, collate, 2)}
    bf16 = "bf16" in opts.precisions  # the cheaper precision where it is native
    for _ in range(opts.repeats):
        for name, (data, collator, workers) in feeds.items():
            train = partial(run_hputrain, data=data, opts=opts, bf16=bf16, collator=collator, workers=workers)
            runs[name].append(timed(train, config, False, opts, setting.synchronize))
    result = record(f"workers full {'bf16' if bf16 else 'fp32'}", "workers", opts, runs, baseline="in memory")
    result["collate_ms_per_batch"] = round(collate_cost(documents, collate, opts.batch) * 1e3, 2)
    return [result]


def collate_cost(documents: list[str], collate, batch: int) -> float:
    """Median seconds the collator takes for one batch, in this process."""
    times = []
    for start in range(0, min(len(documents), 20 * batch) - batch + 1, batch):
        started = time.perf_counter()
        collate(documents[start:start + batch])
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def record(name: str, part: str, opts, runs: dict[str, list[dict]], baseline: str) -> dict:
    """One configuration's JSON record: every repeat's median step (s), the median over repeats,
    the ratio to `baseline`, the wall time per step and torch's threads."""
    source = timing_source([run for values in runs.values() for run in values], opts.warmup)
    medians = {name: [median_step(run[source], opts.warmup) for run in values] for name, values in runs.items()}
    base = statistics.median(medians[baseline])
    return {"configuration": name, "part": part, "timing": source, "steps": opts.steps, "warmup": opts.warmup,
            "repeats": opts.repeats, "batch": opts.batch, "seq_len": opts.seq_len,
            "runs": {run: {"step_s": statistics.median(values),
                           "ratio": statistics.median(values) / base,
                           "repeats_s": [round(v, 5) for v in values],
                           "wall_per_step_s": [round(r["wall_per_step"], 5) for r in runs[run]],
                           "threads": sorted({r["threads"] for r in runs[run]})}
                     for run, values in medians.items()}}


def print_table(records: list[dict]) -> None:
    print("| configuration | run | median step (ms) | time ratio | wall / step (ms) | timed by |")
    print("|---|---|---|---|---|---|")
    for rec in records:
        for run, fig in rec["runs"].items():
            wall = statistics.median(fig["wall_per_step_s"])
            print(f"| {rec['configuration']} | {run} | {fig['step_s'] * 1e3:.1f} | {fig['ratio']:.3f}x | "
                  f"{wall * 1e3:.1f} | {rec['timing']} |")
    baselines = {"compare": "hf", "workers": "in memory"}
    for rec in records:
        target = "hputrain" if rec["part"] == "compare" else "on the fly, 2 workers"
        ratio = rec["runs"][target]["ratio"]
        collator = rec.get("collate_ms_per_batch")
        print(f"{rec['configuration']}: {target} / {baselines[rec['part']]} = {ratio:.3f} "
              f"({'within' if ratio <= 1.0 else 'above'} 1.0)"
              + (f"; the collator takes {collator} ms a batch" if collator is not None else ""))


# -- the command -----------------------------------------------------------------------------------

QUICK = {"steps": 6, "warmup": 2, "repeats": 1, "hidden": 64, "layers": 2, "heads": 4, "intermediate": 128,
         "vocab": 500, "seq_len": 64, "batch": 4, "doc_chars": 1000, "tokenizer_chars": 200_000}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="compare,workers", help="compare, workers, or both")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=4, help="first steps left out of the timing")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of every configuration")
    p.add_argument("--precisions", default="fp32,bf16", help="fp32, bf16 (only where native), or both")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=16000,
                   help="the tokenizer's vocabulary, trained here (16000: 22.9M parameters)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--doc-chars", type=int, default=8000, help="characters per document (sample)")
    p.add_argument("--tokenizer-chars", type=int, default=2_000_000, help="text the tokenizer trains on")
    p.add_argument("--json", help="also write the records to this file")
    p.add_argument("--quick", action="store_true", help="a tiny run that checks the script end to end")
    opts = p.parse_args(argv)
    if opts.quick:
        for key, value in QUICK.items():
            setattr(opts, key, value)
    opts.parts = [part.strip() for part in opts.parts.split(",")]
    opts.precisions = [name.strip() for name in opts.precisions.split(",")]
    unknown = set(opts.parts) - {"compare", "workers"} or set(opts.precisions) - {"fp32", "bf16"}
    if unknown:
        p.error(f"unknown part or precision: {', '.join(sorted(unknown))}")
    if opts.steps < opts.warmup + 3:
        p.error(f"--steps must exceed --warmup by at least 3, got {opts.steps} and {opts.warmup}")
    return opts


class Setting:
    """The device every run uses, set up once before any trainer (allocator settings included)."""

    def __init__(self) -> None:
        self.accelerator = detect_accelerator()
        self.device = self.accelerator.setup(0)
        self.synchronize = self.accelerator.synchronize


def main(argv=None) -> None:
    opts = parse_args(argv)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # peft asks a deprecated transformers name
    setting = Setting()
    if "bf16" in opts.precisions and not bf16_where_native(setting.accelerator, True):
        opts.precisions = [name for name in opts.precisions if name != "bf16"] or ["fp32"]
    documents, samples, collate = make_data(opts)
    config = llama_config(opts, len(collate.tokenizer))
    parameters = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    print(f"machine: {machine(setting.accelerator)}, {os.cpu_count()} cores")
    print(f"model: Llama, hidden {opts.hidden}, {opts.layers} layers, {opts.heads} heads, intermediate "
          f"{opts.intermediate}, vocabulary {config.vocab_size}: {parameters / 1e6:.1f}M parameters; seq "
          f"{opts.seq_len}, batch {opts.batch}; {opts.steps} steps, first {opts.warmup} left out, "
          f"{opts.repeats} interleaved repeats; precisions {', '.join(opts.precisions)}")
    records = []
    if "compare" in opts.parts:
        records += compare_part(opts, setting, samples, config)
    if "workers" in opts.parts:
        records += workers_part(opts, setting, documents, samples, collate, config)
    for rec in records:
        rec["parameters"] = parameters
        print(json.dumps(rec))
    print_table(records)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"machine": machine(setting.accelerator), "records": records},
                                              indent=1))


if __name__ == "__main__":
    main()
