"""A vision-language (image-text-to-text) model's family, from its config: what the data path,
the training forward, fsdp and LoRA need to know of it, in one table.

A family is covered when everything below holds for it: its images become a fixed number of
image tokens per pixel bucket, its image features replace those tokens in order (transformers'
`get_placeholder_mask` + `masked_scatter`), and its positions restart per example (1-D, or
Qwen's 3-D multimodal RoPE). transformers' other image-text-to-text model types are refused in one
line naming what is missing (`refusal`).
"""
from __future__ import annotations

import sys

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
    """Whether transformers loads `config` with AutoModelForImageTextToText (covered or not). A
    config made without transformers (the built-in GPT's) is not: transformers, seconds to import
    and a library of its own at exit, is never imported for it."""
    if "transformers" not in sys.modules:
        return False
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


_NOT_CHECKED = ("its processor's image-token expansion, image merge and positions have not been "
                "checked against hputrain's fixed image blocks")

REASONS = {
    "tiles each image into a variable number of crops, so its image-token count depends on the "
    "image, not on a fixed bucket": (
        "llava_next", "llava_next_video", "llava_onevision", "granite4_vision", "idefics2",
        "idefics3", "smolvlm", "granite_docling", "aria", "aya_vision", "cohere2_vision", "internvl",
        "qianfan_ocr", "got_ocr2", "pp_chart2table", "lfm2_vl", "lfm3_vl", "ovis2", "molmo2",
        "minicpm_ocr", "minicpmv4_6", "minicpmv4_7", "nemotron_h_omni", "perception_lm", "llama4",
        "deepseek_ocr2", "unlimited_ocr"),
    "takes images at their own resolution, like Qwen2.5-VL, through its own vision tower and "
    "position rule, which have not been checked against hputrain's fixed image blocks": (
        "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen4_exp", "glm4v",
        "glm4v_moe", "glm46v", "glmga", "glm_ocr", "glm5_next", "paddleocr_vl", "video_llama_3",
        "ernie4_5_vl_moe", "hyperclovax_vision_v2", "cosmos3_omni", "cosmos3_edge", "dots3_note",
        "hunyuan_vl", "hy_v4_vl", "kimi_k25", "mistral3", "mistral_large4", "lighton_ocr", "step3p7",
        "exaone4_5", "inkling2", "inkling2_loop", "inkling_mm_model", "muse_glimmer", "muse_spark",
        "minimax_m3_vl", "apertus1p5", "cohere_compass", "gemma4", "gemma4_unified",
        "diffusion_gemma"),
    "interleaves audio, video and image positions (an omni model's thinker)": (
        "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker", "gemma3n"),
    "attends to images through cross-attention layers, not image tokens in the sequence": (
        "mllama", "idefics"),
    "is an encoder-decoder, not a decoder with image tokens in its sequence": (
        "florence2", "pix2struct", "pp_formulanet", "udop", "vision-encoder-decoder", "t5gemma2",
        "blip", "kosmos-2.5"),
    "maps images through a query transformer (Q-Former) outside the text's placeholders": (
        "blip-2", "instructblip", "instructblipvideo"),
    "turns images into the discrete tokens of a VQ image tokenizer": ("chameleon", "emu3", "janus"),
    "places image features without image tokens (prepended, or as raw patches with row breaks)": (
        "git", "fuyu", "kosmos-2"),
    "trains with a prefix-LM mask (the whole prompt attends both ways), which hputrain's blocks do "
    "not build": ("paligemma",),
    "is not a generative chat model (a safety classifier, a robot action model, a protein model)": (
        "shieldgemma2", "pi0", "evolla"),
    "has a fixed-size vision tower like LLaVA's, but " + _NOT_CHECKED: (
        "deepseek_vl", "deepseek_vl_hybrid", "fast_vlm", "video_llava", "vipllava", "mistral4"),
}
"""Why each image-text-to-text type of transformers that hputrain does not cover is refused."""


def refusal(model_type: str) -> str | None:
    """One line saying why `model_type` (an image-text-to-text type transformers has) is not
    covered, or None when it is."""
    if any(model_type in f.model_types for f in FAMILIES):
        return None
    reason = next((r for r, types in REASONS.items() if model_type in types),
                  "is newer than hputrain's list of image-text-to-text models: " + _NOT_CHECKED)
    covered = ", ".join(f.name for f in FAMILIES)
    return (f"{model_type} {reason}; hputrain fine-tunes {covered} (docs/vlm.md lists every "
            "family and what each lacks)")
