"""A vision-language (image-text-to-text) model's family, from its config: what the data path,
the training forward, fsdp and LoRA need to know of it, in one table.

A family is covered when everything below holds for it: its images become a fixed number of
image tokens per pixel bucket, its image features replace those tokens in order (transformers'
`get_placeholder_mask` + `masked_scatter`), and its positions restart per example (1-D, or
Qwen's 3-D multimodal RoPE). transformers' other image-text-to-text model types are refused in one
line naming what is missing (`refusal`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionFamily:
    """What hputrain knows of one family of image-text-to-text models."""

    name: str
    """How the run header calls it: "LLaVA", "Gemma 3", "Qwen2.5-VL"."""
    model_types: tuple[str, ...]
    """transformers' model_type values of the family."""
    bidirectional_images: bool = False
    """The tokens of one image attend to each other both ways in training (Gemma 3's
    token_type_ids rule), not causally."""
    positions: str = "1d"
    """"1d": position ids 0, 1, ... per example; "3d": Qwen's multimodal RoPE ([3, length]:
    temporal, height, width; text tokens have three equal rows)."""
    tower: str = "vision_tower"
    """The vision tower's attribute on the model's inner `model` (frozen unless
    --train-vision-tower)."""
    projector: str = "multi_modal_projector"
    """The projector's dotted path on the inner `model` (vision features into the text width)."""
    fixed_size: bool = True
    """The processor resizes every image to one size (one bucket); False: dynamic resolution
    (Qwen: a few buckets of equal token count)."""


FAMILIES = (
    VisionFamily("LLaVA", ("llava",)),
    VisionFamily("Gemma 3", ("gemma3",), bidirectional_images=True),
    VisionFamily("Qwen2.5-VL", ("qwen2_5_vl",), positions="3d", tower="visual",
                 projector="visual.merger", fixed_size=False),
)


def vision_family(config) -> VisionFamily | None:
    """The covered family of `config` (a transformers config), or None (not a covered
    image-text-to-text model: see `is_image_text_to_text` and `refusal`)."""
    model_type = getattr(config, "model_type", None)
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def is_image_text_to_text(config) -> bool:
    """Whether transformers loads `config` with AutoModelForImageTextToText (covered or not)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    except ImportError:  # transformers too old to have the class
        return False
    return getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def image_token_id(config) -> int:
    """The id of the token an image's features replace (transformers' name, or the older one)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{getattr(config, 'model_type', 'the model')}'s config names no image token id")


def describe(config) -> str:
    """"image-text-to-text: LLaVA" for the run header."""
    family = vision_family(config)
    return f"image-text-to-text: {family.name if family else config.model_type}"


def refusal(model_type: str) -> str | None:
    """One line saying why `model_type` (an image-text-to-text type transformers has) is not
    covered, or None when it is."""
    if any(model_type in f.model_types for f in FAMILIES):
        return None
    return (f"{model_type} is an image-text-to-text model hputrain does not cover yet (covered: "
            f"{', '.join(t for f in FAMILIES for t in f.model_types)})")
