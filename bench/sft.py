"""SFT on conversations: counted (trained) tokens per second of hputrain's packed blocks against
TRL 1.16's SFTTrainer, padded and with its own packing. TRL runs in this environment (it is in the
test extra, pinned), imported directly, as bench/dpo.py does.

The same conversations, model and settings for all three: a Llama-architecture model built from
a config (hidden 256, 4 layers, vocab of a byte-level BPE tokenizer trained here on the standard
library's source, ChatML's two markers added; nothing is downloaded), the ChatML template with
`{% generation %}` tags (tests/chat_templates/chatml_tagged.jinja, which TRL's assistant-only loss
needs), loss on the assistant turns only, sequences of at most --block-size tokens, --batch
sequences a step, AdamW lr 1e-4, fp32 on the CPU, no evaluation, no checkpoint, no tracker.

  hputrain packed  hputrain.sft_dataset: whole examples packed by best-fit decreasing into blocks
                   of --block-size, the block mask built on the device; every batch [batch, block].
  TRL padded       SFTConfig(packing=False): one conversation a row, padded to the longest of
                   the batch.
  TRL packed       SFTConfig(packing=True): TRL's best-fit decreasing packing, which turns on its
                   padding-free batches (one row of the batch's packs laid end to end).

What is measured: each trainer's steps are stamped by a callback; the counted tokens of each step
(labels other than -100 after the causal shift) are read from the batch (hputrain: the step's
inputs; TRL: its collator's output, recorded in order). A run's figure is the median over the
steps after the first --warmup of a step's counted tokens over its time. The three run in this
one process, one after the other, in --repeats interleaved rounds; the table gives the median
of the rounds.

    python bench/sft.py [--steps 12] [--warmup 4] [--repeats 5] [--batch 4] [--block-size 512]
                        [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import random
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
from hputrain import Trainer, TrainingArguments, sft_dataset  # noqa: E402
from hputrain.accelerators import detect_accelerator  # noqa: E402
from hputrain.callbacks import Callback  # noqa: E402
from hputrain.data.batching import read_corpus  # noqa: E402

TEMPLATE = Path(__file__).resolve().parents[1] / "tests" / "chat_templates" / "chatml_tagged.jinja"
TRAINERS = ("hputrain packed", "TRL padded", "TRL packed")


def tokenizer_with_template(text: str, vocab_size: int = 4096):
    tokenizer = train_tokenizer(text[:500_000], vocab_size)
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.chat_template = TEMPLATE.read_text()
    return tokenizer


def conversations(text: str, count: int, seed: int = 0) -> list[dict]:
    """Conversations cut from the standard library's source, of very different lengths: a
    question of 40 to 600 characters and an answer of 60 to 900, and every third one a second
    exchange (a short question, another answer)."""
    rng = random.Random(seed)
    rows, at = [], 0

    def piece(low: int, high: int) -> str:
        nonlocal at
        n = rng.randint(low, high)
        if at + n > len(text):  # the source wraps around: as many conversations as asked for
            at = 0
        at += n
        return text[at - n:at]

    for i in range(count):
        messages = [{"role": "user", "content": piece(40, 600)},
                    {"role": "assistant", "content": piece(60, 900)}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": piece(20, 120)},
                         {"role": "assistant", "content": piece(40, 400)}]
        rows.append({"messages": messages})
    return rows


def model(vocab_size: int, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=704,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=4, max_position_embeddings=1024,
                                      tie_word_embeddings=False, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def counted(batch: dict) -> int:
    return int((batch["labels"][..., 1:] != -100).sum())


def tokens_per_second(stamps: list[float], counts: list[int], warmup: int) -> float:
    """The median, over the steps after `warmup`, of a step's counted tokens over its time (step
    k ends at stamps[k]): the median, not the total over the total time, so that a burst of other
    work on a shared machine during one step does not make the run's figure."""
    return statistics.median(counts[k] / (stamps[k] - stamps[k - 1])
                             for k in range(warmup + 1, len(stamps)))


class Stamps(Callback):
    def __init__(self):
        self.stamps, self.counts = [], []

    def on_step_end(self, trainer):
        self.stamps.append(time.perf_counter())
        self.counts.append(counted(trainer.step_inputs))


def run_hputrain(data, tokenizer, opts) -> float:
    stamps = Stamps()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=opts.steps,
                                 per_device_train_batch_size=opts.batch, learning_rate=1e-4,
                                 logging_steps=opts.steps, save_steps=-1, disable_tqdm=True,
                                 report_to="none", precision="fp32", accelerator="cpu")
        Trainer(model(len(tokenizer)), args, train_dataset=data, data_collator=data.collator,
                callbacks=[stamps]).train()
    return tokens_per_second(stamps.stamps, stamps.counts, opts.warmup)


class Recording:
    """TRL's collator, recording the counted tokens of each batch it makes, in order."""

    def __init__(self, collate):
        self.collate, self.counts = collate, []

    def __call__(self, examples):
        batch = self.collate(examples)
        self.counts.append(counted(batch))
        return batch


def run_trl(rows, tokenizer, opts, packing: bool) -> float:
    import datasets
    import trl

    class TRLStamps(transformers.TrainerCallback):
        def __init__(self):
            self.stamps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.stamps.append(time.perf_counter())

    stamps = TRLStamps()
    with tempfile.TemporaryDirectory() as out:
        args = trl.SFTConfig(output_dir=out, max_steps=opts.steps,
                             per_device_train_batch_size=opts.batch, learning_rate=1e-4,
                             logging_steps=opts.steps, save_strategy="no", report_to=[],
                             use_cpu=True, bf16=False, disable_tqdm=True,
                             max_length=opts.block_size, packing=packing, assistant_only_loss=True,
                             lr_scheduler_type="linear", dataloader_num_workers=0,
                             dataset_num_proc=None)
        trainer = trl.SFTTrainer(model(len(tokenizer)), args=args, processing_class=tokenizer,
                                 train_dataset=datasets.Dataset.from_list(rows), callbacks=[stamps])
        recording = trainer.data_collator = Recording(trainer.data_collator)
        trainer.train()
    return tokens_per_second(stamps.stamps, recording.counts, opts.warmup)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--conversations", type=int, default=400)
    p.add_argument("--json", help="write the records here too")
    opts = p.parse_args(argv)
    text = read_corpus(max_bytes=2_000_000).decode("utf-8", "replace")
    tokenizer = tokenizer_with_template(text)
    rows = conversations(text[500_000:], opts.conversations)
    data = sft_dataset(rows, tokenizer, opts.block_size)
    runs: dict[str, list[float]] = {name: [] for name in TRAINERS}
    for _ in range(opts.repeats):
        runs["hputrain packed"].append(run_hputrain(data, tokenizer, opts))
        runs["TRL padded"].append(run_trl(rows, tokenizer, opts, packing=False))
        runs["TRL packed"].append(run_trl(rows, tokenizer, opts, packing=True))
    report(runs, data, tokenizer, opts)


def report(runs: dict[str, list[float]], data, tokenizer, opts) -> None:
    accelerator = detect_accelerator("cpu")
    accelerator.setup(0)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    print(f"machine: {machine(accelerator)}")
    print(f"cpu flags: {' '.join(cpu_flags())}")
    print(f"model: Llama hidden 256, 4 layers, vocab {len(tokenizer)}, fp32; "
          f"{data.rows.rows} conversations, {data.packed.tokens} tokens "
          f"({data.packed.truncated} cut to {opts.block_size}), packed by hputrain into "
          f"{len(data)} blocks ({data.packed.padding_fraction:.1%} padding); batch {opts.batch}, "
          f"{opts.steps} steps, first {opts.warmup} left out, {opts.repeats} interleaved rounds")
    print("| trainer | counted tokens/s (median) | vs TRL padded | vs TRL packed |")
    print("|---|---|---|---|")
    for name, value in medians.items():
        print(f"| {name} | {value:.0f} | {value / medians['TRL padded']:.2f}x | "
              f"{value / medians['TRL packed']:.2f}x |")
    print({name: [round(v) for v in values] for name, values in runs.items()})
    if opts.json:
        Path(opts.json).write_text(json.dumps({"runs": runs, "medians": medians}, indent=2))


def cpu_flags() -> list[str]:
    """The CPU flags that decide the kernels here, as /proc/cpuinfo lists them."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("flags"))
    except (OSError, StopIteration):
        return ["unknown"]
    present = set(line.split(":", 1)[1].split())
    return [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in present]


if __name__ == "__main__":
    main()
