"""Vision-language SFT: trained tokens per second of `hputrain train --model DIR --dataset DATA`
(image conversations packed into fixed blocks) against TRL 1.16's SFTTrainer on the same folder
and data (the model's processor, one conversation a row padded to the longest of its batch: TRL
refuses packing and padding-free batches for vision data). TRL runs in this environment (the
test extra), imported directly, as bench/sft.py does.

The model folder and the data are built here (nothing is downloaded), as a user has them on disk:
  model  LLaVA: a CLIP tower (4 layers, hidden 128, 56x56 images in patches of 14: 16 image
         tokens an image, the class token dropped) and a Llama (4 layers, hidden 256, 8 heads,
         4 key-value heads), written by save_pretrained with its LlavaProcessor (PIL's CLIP
         image processor; a byte-level BPE tokenizer of 4096 tokens trained here on the standard
         library's source; ChatML with image parts and {% generation %} tags, which TRL's
         assistant-only loss needs).
  data   --conversations rows of TRL's `messages` + `images` (paths relative to data.jsonl):
         10% without an image, 75% with one, 15% with two, of 40 to 200 pixels a side; a question
         of 20 to 300 characters of the standard library's source, and an answer that is short
         (10 to 80 characters) in 40% of the rows, long (150 to 1,200) in the rest; every fourth
         row a second, text-only exchange.
Both train LoRA (r 8, alpha 16, dropout 0.05) on the language model's linear layers, with the
vision tower and the projector frozen (hputrain's default for an image-text-to-text folder; TRL
gets the target modules hputrain's run chose), loss on the assistant turns only, sequences of at
most --block-size tokens, AdamW lr 1e-4, fp32 on the CPU, no gradient checkpointing (TRL's default
is on: turned off here, in its favour), data loaded in the main process, no evaluation, no
checkpoint, no tracker.

  hputrain packed  `hputrain train --lora-r 8 --per-device-train-batch-size --batch`, in this
                   process (hputrain.cli.main): whole examples packed into blocks of --block-size
                   tokens with a fixed number of image slots, --batch blocks a step.
  TRL padded       SFTConfig(packing=False, assistant_only_loss=True): --trl-batch conversations a
                   step (default: the examples of one hputrain step, measured in its first run,
                   so that both see about the same examples a step), padded per batch.

What is counted, the same way for both: the trained tokens of a step are the tokens of its
examples that the model processes and that are not padding: every token of every example in the
batch (text and image tokens, the learned and the context ones); hputrain: the sum of the
blocks' seq_lens; TRL: the sum of its attention mask. The learned tokens (labels other than -100
after the causal shift) are given beside them. A run's figure is the median over its steps after
--warmup of a step's tokens over its time (stamped by each trainer's on_step_end callback), in
wall seconds and in this process's CPU seconds (which on a shared machine leave out the time
other work holds the cores; with OMP_NUM_THREADS=1 and the data loaded in the main process they
are the step's work). TRL's collator time a batch is recorded too. The two alternate in
--repeats interleaved rounds (AB BA ...); the table gives the median of rounds.

    OMP_NUM_THREADS=1 nice python bench/vlm.py [--steps 10] [--warmup 3] [--repeats 3]
                     [--batch 2] [--block-size 512] [--conversations 400] [--json FILE] [--quick]

On a shared machine run it with `nice` and OMP_NUM_THREADS set: the threads and the load average
(before and after) are recorded with the machine line and the CPU flags.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import transformers  # noqa: E402

from common import machine  # noqa: E402
from hf_finetune import train_tokenizer  # noqa: E402
from hputrain.accelerators import detect_accelerator  # noqa: E402
from hputrain.callbacks import Callback, added_to_every_trainer  # noqa: E402
from hputrain.data.batching import read_corpus  # noqa: E402
from sft import cpu_flags  # noqa: E402

TRAINERS = ("hputrain packed", "TRL padded")
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.05}
IMAGE_SIDE, PATCH = 56, 14
SPECIAL = ["<|im_start|>", "<|im_end|>", "<image>"]
DEFAULT_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
"""TRL's LoRA targets until hputrain's run has said its own (the language model's linear layers)."""

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% set content %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{% endset %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ content }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ content }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML with image parts; the assistant's text and end of turn inside {% generation %}."""


# -- the model folder and the data -----------------------------------------------------------------

def build_folder(folder: Path, text: str, opts) -> Path:
    """A LLaVA folder as save_pretrained writes it: weights, config, LlavaProcessor (tokenizer,
    chat template, PIL's CLIP image processor)."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    base = train_tokenizer(text[:500_000], opts.vocab)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>")
    tokenizer.add_tokens(SPECIAL, special_tokens=True)  # transformers 5 takes no additional_special_tokens
    side = opts.image_side
    images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    processor = transformers.LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=PATCH, chat_template=TEMPLATE,
        vision_feature_select_strategy="default", image_token="<image>", num_additional_image_tokens=1)
    tokens = (side // PATCH) ** 2
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=opts.vision_hidden, intermediate_size=4 * opts.vision_hidden,
            num_hidden_layers=opts.vision_layers, num_attention_heads=4, image_size=side,
            patch_size=PATCH, projection_dim=opts.vision_hidden),
        text_config=transformers.LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=opts.hidden, intermediate_size=opts.hidden * 11 // 4,
            num_hidden_layers=opts.layers, num_attention_heads=8, num_key_value_heads=4,
            max_position_embeddings=2 * opts.block_size, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        image_seq_length=tokens)
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def write_images(folder: Path, count: int, rng: random.Random) -> list[str]:
    """`count` PNG files of 40 to 200 pixels a side (smooth colour fields with noise), paths
    relative to `folder`."""
    import numpy as np
    from PIL import Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    noise = np.random.default_rng(rng.randrange(1 << 30))
    names = []
    for i in range(count):
        height, width = rng.randint(40, 200), rng.randint(40, 200)
        ramp = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
        colour = noise.uniform(0.2, 1.0, size=(1, 1, 3)).astype(np.float32)
        pixels = ramp * colour + noise.normal(0, 20, size=(height, width, 3))
        name = f"images/{i:03d}.png"
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / name)
        names.append(name)
    return names


def image_conversations(text: str, images: list[str], count: int, rng: random.Random) -> list[dict]:
    """TRL's `messages` + `images` rows (see the module docstring for the spread of lengths)."""
    at = 0

    def piece(low: int, high: int) -> str:
        nonlocal at
        n = rng.randint(low, high)
        if at + n > len(text):  # the source wraps around: as many rows as asked for
            at = 0
        at += n
        return text[at - n:at]

    rows = []
    for i in range(count):
        draw = rng.random()
        used = rng.sample(images, 0 if draw < 0.10 else 1 if draw < 0.85 else 2)
        answer = piece(10, 80) if rng.random() < 0.4 else piece(150, 1200)
        messages = [{"role": "user", "content": [{"type": "image"} for _ in used]
                     + [{"type": "text", "text": piece(20, 300)}]},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        if i % 4 == 3:
            messages += [{"role": "user", "content": [{"type": "text", "text": piece(20, 120)}]},
                         {"role": "assistant", "content": [{"type": "text", "text": piece(20, 300)}]}]
        rows.append({"messages": messages, "images": used})
    return rows


def write_data(folder: Path, text: str, opts) -> Path:
    rng = random.Random(0)
    images = write_images(folder, opts.images, rng)
    path = folder / "data.jsonl"
    with open(path, "w", encoding="utf-8") as out:
        for row in image_conversations(text, images, opts.conversations, rng):
            out.write(json.dumps(row) + "\n")
    return path


# -- what a step trained ---------------------------------------------------------------------------

def counted(batch: dict) -> dict:
    """The step's examples, trained tokens (not padding), learned tokens and images. A packed
    batch (hputrain's blocks) names its examples' lengths in seq_lens; a padded one (TRL's) marks
    its tokens in attention_mask."""
    if "seq_lens" in batch:
        lengths = batch["seq_lens"]
        examples, tokens = int((lengths > 0).sum()), int(lengths.sum())
    else:
        mask = batch["attention_mask"]
        examples, tokens = mask.shape[0], int(mask.sum())
    return {"examples": examples, "tokens": tokens, "slots": int(batch["input_ids"].numel()),
            "learned": int((batch["labels"][..., 1:] != -100).sum())}


def stamp() -> tuple[float, float]:
    """(wall, CPU) seconds now: the CPU time of this process (all its threads) does not count
    the time other work on a shared machine takes the cores away, the wall time does."""
    return time.perf_counter(), time.process_time()


def rates(stamps: list[float], counts: list[dict], warmup: int, key: str) -> float:
    """The median, over the steps after `warmup`, of a step's `key` count over its time (step k
    ends at stamps[k]): the median, so that a burst of other work on a shared machine during one
    step does not make the run's figure."""
    return statistics.median(counts[k][key] / (stamps[k] - stamps[k - 1])
                             for k in range(warmup + 1, len(stamps)))


def summary(stamps: list[tuple[float, float]], counts: list[dict], warmup: int) -> dict:
    """A run's figures from its step stamps ((wall, process CPU) seconds at each step's end)."""
    steps = counts[warmup + 1:]
    cpu = [c for _, c in stamps]
    stamps = [w for w, _ in stamps]
    return {"tokens_per_s": rates(stamps, counts, warmup, "tokens"),
            "tokens_per_cpu_s": rates(cpu, counts, warmup, "tokens"),
            "learned_per_s": rates(stamps, counts, warmup, "learned"),
            "step_s": statistics.median(b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1:])),
            "examples_per_step": statistics.mean(c["examples"] for c in steps),
            "padding": 1 - sum(c["tokens"] for c in steps) / sum(c["slots"] for c in steps),
            "threads": torch.get_num_threads()}


# -- the two trainers ------------------------------------------------------------------------------

class Stamps(Callback):
    """hputrain: the end of every optimizer step and what its batch held; the LoRA targets."""

    latest: "Stamps | None" = None

    def __init__(self):
        self.stamps, self.counts, self.targets = [], [], None
        Stamps.latest = self

    def on_train_begin(self, trainer):
        config = getattr(trainer.model, "peft_config", {}).get("default")
        if config is not None:
            self.targets = config.target_modules

    def on_step_end(self, trainer):
        self.stamps.append(stamp())
        self.counts.append(counted(trainer.step_inputs))


def run_hputrain(folder: Path, data: Path, opts) -> dict:
    from hputrain import cli

    with tempfile.TemporaryDirectory() as out, added_to_every_trainer(Stamps):
        status = cli.main([
            "train", "--model", str(folder), "--dataset", str(data), "--cpu", "--precision", "fp32",
            "--lora-r", str(LORA["r"]), "--lora-alpha", str(LORA["lora_alpha"]),
            "--lora-dropout", str(LORA["lora_dropout"]), "--block-size", str(opts.block_size),
            "--per-device-train-batch-size", str(opts.batch), "--max-steps", str(opts.steps),
            "--learning-rate", "1e-4", "--lr-scheduler-type", "linear", "--warmup-steps", "0",
            "--validation-split-percentage", "0", "--eval-strategy", "no", "--save-strategy", "no",
            "--logging-steps", str(opts.steps), "--dataloader-num-workers", "0", "--disable-tqdm",
            "--report-to", "none", "--seed", "0", "--output-dir", out])
    if status:
        raise SystemExit(f"hputrain train exited with {status}")
    run = Stamps.latest
    return summary(run.stamps, run.counts, opts.warmup) | {"targets": run.targets}


class Recording:
    """TRL's collator, recording what each batch it makes holds, in order."""

    def __init__(self, collate):
        self.collate, self.counts, self.seconds = collate, [], []

    def __call__(self, examples):
        started = time.perf_counter()
        batch = self.collate(examples)
        self.seconds.append(time.perf_counter() - started)
        self.counts.append(counted(batch))
        return batch


def trl_dataset(data: Path):
    """data.jsonl as TRL reads image rows: `images` a list of datasets.Image (decoded from the
    files when a row is read)."""
    import datasets

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    for row in rows:
        row["images"] = [str(data.parent / name) for name in row["images"]]
    table = datasets.Dataset.from_list(rows)
    return table.cast_column("images", datasets.Sequence(datasets.Image()))


def run_trl(folder: Path, dataset, opts, targets, batch: int) -> dict:
    import peft
    import trl

    class TRLStamps(transformers.TrainerCallback):
        def __init__(self):
            self.stamps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.stamps.append(stamp())

    stamps = TRLStamps()
    torch.manual_seed(0)
    processor = transformers.AutoProcessor.from_pretrained(folder)
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as out:
        args = trl.SFTConfig(output_dir=out, max_steps=opts.steps, per_device_train_batch_size=batch,
                             learning_rate=1e-4, lr_scheduler_type="linear", logging_steps=opts.steps,
                             save_strategy="no", eval_strategy="no", report_to=[], use_cpu=True,
                             bf16=False, disable_tqdm=True, max_length=opts.block_size, packing=False,
                             assistant_only_loss=True, gradient_checkpointing=False,
                             dataloader_num_workers=0, dataset_num_proc=None, seed=0)
        trainer = trl.SFTTrainer(model, args=args, processing_class=processor, train_dataset=dataset,
                                 peft_config=peft.LoraConfig(target_modules=targets, **LORA),
                                 callbacks=[stamps])
        recording = trainer.data_collator = Recording(trainer.data_collator)
        trainer.train()
    # the share of its step TRL's collator takes (chat template, tokenizer, image processor)
    collate = statistics.median(recording.seconds[opts.warmup + 1:])
    return summary(stamps.stamps, recording.counts, opts.warmup) | {"collate_s": collate}


# -- the command -----------------------------------------------------------------------------------

QUICK = {"steps": 5, "warmup": 1, "repeats": 1, "batch": 1, "block_size": 256, "conversations": 40,
         "images": 8, "vocab": 600, "hidden": 64, "layers": 2, "vision_hidden": 32, "vision_layers": 1,
         "image_side": 28}


def options(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument("--batch", type=int, default=2, help="hputrain's packed blocks a step")
    p.add_argument("--trl-batch", type=int, help="TRL's conversations a step (default: the "
                   "examples of one hputrain step, measured in its first run)")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--conversations", type=int, default=400)
    p.add_argument("--images", type=int, default=64, help="distinct image files")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vision-hidden", type=int, default=128)
    p.add_argument("--vision-layers", type=int, default=4)
    p.add_argument("--image-side", type=int, default=IMAGE_SIDE, help="the processor's image size")
    p.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS)
    p.add_argument("--work", help="keep the model folder and the data here (default: a temporary folder)")
    p.add_argument("--json", help="write the records here too")
    p.add_argument("--quick", action="store_true", help="a tiny model and a few steps, once")
    opts = p.parse_args(argv)
    if opts.quick:
        for key, value in QUICK.items():
            setattr(opts, key, value)
    if opts.steps < opts.warmup + 2:
        p.error(f"--steps must exceed --warmup by at least 2, got {opts.steps} and {opts.warmup}")
    return opts


def main(argv=None) -> None:
    opts = options(argv)
    transformers.logging.set_verbosity_error()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(opts.work or scratch)
        text = read_corpus(max_bytes=2_000_000).decode("utf-8", "replace")
        folder = build_folder(work / "model", text, opts)
        data = write_data(work / "data", text[500_000:], opts)
        dataset = trl_dataset(data)
        runs: dict[str, list[dict]] = {name: [] for name in opts.trainers}
        targets, batch = DEFAULT_TARGETS, opts.trl_batch
        if "hputrain packed" not in runs:
            batch = batch or 4
        for repeat in range(opts.repeats):
            order = opts.trainers if repeat % 2 == 0 else opts.trainers[::-1]
            for name in order:
                if name == "hputrain packed":
                    runs[name].append(run_hputrain(folder, data, opts))
                    targets = runs[name][0]["targets"] or DEFAULT_TARGETS
                    batch = batch or max(1, round(runs[name][0]["examples_per_step"]))
                else:
                    runs[name].append(run_trl(folder, dataset, opts, targets, batch))
    report(runs, opts, batch, targets, load_before)


def report(runs: dict[str, list[dict]], opts, trl_batch: int, targets, load_before) -> None:
    accelerator = detect_accelerator("cpu")
    accelerator.setup(0)
    median = {name: {key: statistics.median(run[key] for run in values)
                     for key in ("tokens_per_s", "tokens_per_cpu_s", "learned_per_s", "step_s",
                                 "examples_per_step", "padding")}
              for name, values in runs.items()}
    base = median.get("TRL padded") or next(iter(median.values()))
    print(f"machine: {machine(accelerator)}, {os.cpu_count()} cores, OMP_NUM_THREADS "
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; load average before "
          f"{' '.join(f'{v:.2f}' for v in load_before)}, after {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"cpu flags: {' '.join(cpu_flags())}; transformers {transformers.__version__}, "
          f"trl {_version('trl')}, peft {_version('peft')}")
    tokens = (opts.image_side // PATCH) ** 2
    print(f"model: LLaVA, CLIP {opts.vision_layers} layers hidden {opts.vision_hidden} at "
          f"{opts.image_side}x{opts.image_side} ({tokens} image tokens), Llama {opts.layers} layers "
          f"hidden {opts.hidden}, vocab {opts.vocab}, fp32, LoRA r {LORA['r']} on {targets}; "
          f"{opts.conversations} conversations; block {opts.block_size}, hputrain {opts.batch} "
          f"blocks a step, TRL {trl_batch} conversations a step; {opts.steps} steps, first "
          f"{opts.warmup} left out, {opts.repeats} interleaved rounds; threads "
          f"{sorted({run['threads'] for values in runs.values() for run in values})}")
    print("| trainer | trained tokens/s | vs TRL | trained tokens / CPU s | vs TRL | learned tokens/s "
          "| median step (s) | examples a step | padding |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, m in median.items():
        print(f"| {name} | {m['tokens_per_s']:.0f} | {m['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
              f"{m['tokens_per_cpu_s']:.0f} | {m['tokens_per_cpu_s'] / base['tokens_per_cpu_s']:.2f}x | "
              f"{m['learned_per_s']:.0f} | {m['step_s']:.2f} | {m['examples_per_step']:.1f} | "
              f"{m['padding']:.1%} |")
    for key in ("tokens_per_s", "tokens_per_cpu_s"):
        print(key, {name: [round(run[key]) for run in values] for name, values in runs.items()})
    collate = [run["collate_s"] for run in runs.get("TRL padded", [])]
    if collate:
        print(f"TRL's collator: {statistics.median(collate) * 1e3:.0f} ms a batch (median), inside "
              f"its step of {median['TRL padded']['step_s']:.2f} s")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"runs": runs, "medians": median, "trl_batch": trl_batch},
                                              indent=2, default=str))


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


if __name__ == "__main__":
    main()
