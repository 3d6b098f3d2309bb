"""The Hugging Face recipe's training step of an image-text-to-text model, for `hputrain plan`
(recipes/hf/__init__.py step_model hands a VLM folder here; kinds/vlm/plan.py makes its image blocks
and names the vision tower's share): the model built from config.json alone
(AutoModelForImageTextToText.from_config, no weight read), its parts frozen or adapted as the run
sets them (hf_vision.prepare_parts: --lora-r, --train-vision-tower, --train-projector)."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

from ...errors import InputError
from .family import refusal, vision_family


def vision_step_model(folder: Path, config, options, block: int) -> dict:
    """StepModel's fields (rehearsal/plan/__init__.py) of the run `options` describe on the VLM `config`;
    `vision` carries what rehearsal.plan_vlm.vlm_step reads of the run."""
    import torch
    import transformers

    from .recipe import prepare_parts

    from .run import UNSUPPORTED

    family = vision_family(config)
    if family is None:
        raise InputError(f"--model {folder}: {refusal(config.model_type)}")
    if options.method in UNSUPPORTED:  # as the run refuses it
        raise InputError(f"{UNSUPPORTED[options.method]} (--method {options.method}) on an "
                         f"image-text-to-text model (--model {folder}) is not supported yet: plan "
                         "its SFT (--method sft or auto)")

    def build(lora: bool):
        model = transformers.AutoModelForImageTextToText.from_config(copy.deepcopy(config),
                                                                     dtype=torch.float32)
        asked = dataclasses.replace(options, lora_r=(options.lora_r or 16) if lora else None)
        return prepare_parts(model, asked)

    def batch(size: int) -> dict:  # replaced by the image blocks (rehearsal.plan_vlm.vlm_step)
        ids = torch.randint(0, config.get_text_config().vocab_size, (size, block))
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    vision = {"folder": Path(folder), "config": config, "block": block,
              "image_buckets": options.image_buckets, "image_slots": options.image_slots,
              "packing": options.packing, "train_vision_tower": options.train_vision_tower}
    return {"build": build, "batch": batch, "lora": bool(options.lora_r), "lora_possible": True,
            "vision": vision,
            "name": f"{config.model_type} ({family.name}) from {folder}, blocks of {block} tokens"}
