"""Tiny vision-language models (tests/vlm_fixtures.py) trained under strategy="fsdp", for
tests/kinds/vlm/test_vlm_fsdp.py: started by `hputrain launch` on 2 processes, or called in-process as the
one-process reference (`run`).

    vlm_fsdp_script.py FOLDER RUN [RUN ...]    RUN: OUTPUT_DIR,CHOICE[,FLAG ...]

CHOICE, as the recipe makes it (kinds/vlm/recipe.py): `lora` (LoRA r=4 on the language model's
linear layers, everything else frozen), `full` (full fine-tuning, the vision tower frozen, the
projector trained) or `tower` (everything trained, the vision tower too). FLAGs: `checkpointing` (gradient_checkpointing=True), `save2`
(a sharded checkpoint every 2 steps), `from=DIR` (resume from DIR, another run's checkpoint),
`blocks=DATA` (train on the packed blocks of the image data set DATA, TRL's `messages` rows,
made by data.vision.load_image_data and batched by its ImageCollator, in place of the
hand-built batches), `bf16` (bf16=True).

Under fsdp across processes the model is built on the meta device and each rank reads its own
shards of the folder (hf_vision.load_vision(sharded=True): recipes/hf/sharded.py meta_model
with AutoModelForImageTextToText); in one process it is transformers' own from_pretrained. The batches are built by hand: each example
one image (random pixel values; Qwen2.5-VL a 4x4-patch grid) whose image tokens stand in
input_ids as transformers' processors expand them, the rest random text, labels -100 on the
image tokens and the prompt; no packing, so transformers' own forward runs unchanged.

Global rank 0 writes OUTPUT_DIR/initial.pt (every tensor before the first step, gathered whole),
OUTPUT_DIR/weights.pt (after the last) and OUTPUT_DIR/layout.json (the modules that are FSDP
units, "" the root, and those checkpointed); the losses are in OUTPUT_DIR/metrics.jsonl. Each
rank records its reads of the weight files (the tensor's name and the rows read) in
OUTPUT_DIR.reads.RANK.json, beside OUTPUT_DIR.
"""
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hputrain import Trainer, TrainingArguments  # noqa: E402
from hputrain.checkpoint.hf_weights import FolderWeights  # noqa: E402

READS: list = []
_read = FolderWeights.read


def recording_read(self, key, index):
    """FolderWeights.read, recording what each call read."""
    part = _read(self, key, index)
    READS.append({"key": key, "index": [[s.start, s.stop] for s in index], "shape": list(part.shape)})
    return part

LENGTH = 24
"""Tokens per example."""
STEPS = 3


def examples(config, count: int = 12) -> list[dict]:
    """`count` examples of one image each, for `config`'s family (see the module's docstring)."""
    from hputrain.kinds.vlm.family import image_token_id, vision_family

    family = vision_family(config)
    g = torch.Generator().manual_seed(7)
    image = image_token_id(config)
    rows = []
    for _ in range(count):
        text = torch.randint(10, config.text_config.vocab_size, (LENGTH,), generator=g)
        row = {}
        if family.positions == "3d":  # Qwen2.5-VL: 16 patches of 2x14x14x3, merged 2x2: 4 tokens
            tokens = [config.vision_start_token_id, *[image] * 4, config.vision_end_token_id]
            row["pixel_values"] = torch.randn(16, 3 * 2 * 14 * 14, generator=g)
            row["image_grid_thw"] = torch.tensor([[1, 4, 4]])
        else:  # LLaVA, Gemma 3: one 28x28 image, 4 image tokens
            tokens = [*[image] * 4]
            row["pixel_values"] = torch.randn(1, 3, 28, 28, generator=g)
        ids = text.clone()
        ids[2:2 + len(tokens)] = torch.tensor(tokens)
        labels = ids.clone()
        labels[:2 + len(tokens) + 3] = -100  # the prompt (its image tokens among it) is not learned
        rows.append({"input_ids": ids, "labels": labels, **row})
    return rows


def collate(samples: list[dict]) -> dict:
    """Rows stacked; the images of the batch one after another (pixel_values and image_grid_thw
    concatenated), as transformers' processors give them for a batch."""
    return {key: torch.cat([s[key] for s in samples]) if key in ("pixel_values", "image_grid_thw")
            else torch.stack([s[key] for s in samples]) for key in samples[0]}


def packed_blocks(folder: Path, data: str):
    """The packed blocks (128 tokens) of the image data set `data` as the recipe makes them, and
    their collator."""
    from hputrain.kinds.vlm.data import Processing, load_image_data, split_rows
    from hputrain.recipes.hf import data as hf_data
    from hputrain.recipes.hf import HFOptions

    options = HFOptions(model=str(folder), dataset=data, validation_split_percentage=0, dataset_num_proc=1)
    made = load_image_data(data, "messages", Processing.load(folder), 128, options,
                           rows=lambda split: split_rows(data, split, hf_data.records, hf_data.source_files))
    return made.train, made.collator


def load(folder: Path, sharded: bool):
    """The folder's model as the recipe loads it (recipes/hf_vision.load_vision, float32): on the
    meta device, filled shard by shard by fsdp, or transformers' from_pretrained."""
    from hputrain.kinds.vlm.recipe import load_vision

    return load_vision(folder, sharded=sharded)[0]


def prepared(folder: Path, choice: str, sharded: bool):
    """The model to train for `choice`, loaded, frozen and wrapped as the recipe does it
    (hf_vision.prepare_parts) after torch.manual_seed(0) (recipes/hf/__init__.py run: the loading must not
    move the generator LoRA's adapters are then drawn from), without LoRA dropout (each rank
    would draw its own)."""
    from hputrain.recipes.hf import HFOptions
    from hputrain.kinds.vlm.recipe import prepare_parts

    torch.manual_seed(0)
    model = load(folder, sharded)
    lora = {"lora_r": 4, "lora_dropout": 0.0} if choice == "lora" else {}
    options = HFOptions(model=str(folder), dataset="unused", train_vision_tower=choice == "tower", **lora)
    return prepare_parts(model, options)


def gathered(model) -> dict:
    """Every tensor of the state dict, whole (every rank: full_tensor is a collective)."""
    return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            for name, t in model.state_dict().items()}


def layout(model) -> dict:
    from torch.distributed.fsdp import FSDPModule

    from hputrain.distributed.activation_checkpointing import is_checkpointed

    return {"units": [name for name, m in model.named_modules() if isinstance(m, FSDPModule)],
            "checkpointed": [name for name, m in model.named_modules() if is_checkpointed(m)]}


def run(folder, output_dir, choice: str, *flags: str, strategy: str | None = None, batch: int = 1):
    """One run (see the module's docstring); returns the Trainer."""
    folder, output_dir = Path(folder), Path(output_dir)
    READS.clear()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    strategy = strategy or ("fsdp" if world > 1 else "single")
    model = prepared(folder, choice, sharded=strategy == "fsdp" and world > 1)
    args = TrainingArguments(output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=batch,
                             learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1,
                             save_steps=2 if "save2" in flags else -1, disable_tqdm=True,
                             throughput_warmup_steps=0, seed=0, accelerator="cpu", strategy=strategy,
                             ddp_timeout=60, report_to="none",
                             gradient_checkpointing="checkpointing" in flags, bf16="bf16" in flags)
    data = next((flag.removeprefix("blocks=") for flag in flags if flag.startswith("blocks=")), None)
    if data:  # the collator makes exactly the model's inputs (from image_count too), as the recipe
        args = dataclasses.replace(args, remove_unused_columns=False)
    dataset, collator = packed_blocks(folder, data) if data else (examples(model.config), collate)
    trainer = Trainer(model, args, train_dataset=dataset, data_collator=collator)
    initial = gathered(trainer.model)
    (output_dir.parent / f"{output_dir.name}.reads.{trainer.group.rank}.json").write_text(json.dumps(READS))
    resume = next((flag.removeprefix("from=") for flag in flags if flag.startswith("from=")), None)
    trainer.train(resume_from_checkpoint=resume)
    final = gathered(trainer.model)
    if trainer.group.is_main:
        torch.save(initial, output_dir / "initial.pt")
        torch.save(final, output_dir / "weights.pt")
        (output_dir / "layout.json").write_text(json.dumps(layout(trainer.model)))
    return trainer


if __name__ == "__main__":
    FolderWeights.read = recording_read
    for spec in sys.argv[2:]:
        out, run_choice, *run_flags = spec.split(",")
        run(sys.argv[1], out, run_choice, *run_flags)
