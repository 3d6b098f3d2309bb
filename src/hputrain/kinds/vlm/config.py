"""The image-text-to-text kind's settings, each a flag of `hputrain train --model` (HFOptions
holds them: models/kind.py's `ModelKind.flags`)."""
from __future__ import annotations

from dataclasses import dataclass

from ...config.fields import check


@dataclass(kw_only=True)
class ImageFlags:
    """What an image-text-to-text run trains and how its images are read and packed."""

    train_vision_tower: bool = False
    """An image-text-to-text model: train the vision tower too (under LoRA, adapters on its
    linear layers); by default it is frozen."""
    train_projector: bool | None = None
    """An image-text-to-text model: train the projector (vision features into the text width);
    unset means yes for full fine-tuning, no under LoRA (where it is then trained whole)."""
    image_buckets: list[str] | None = None
    """Image sizes, WIDTHxHEIGHT, each image is resized into (the nearest in shape): each a fixed
    number of image tokens; unset means the processor's one size (LLaVA, Gemma 3), or three of
    equal token count, square, wide and tall (Qwen2.5-VL). Every bucket must give the same count."""
    image_slots: int | None = None
    """Images per packed block (the vision tower's fixed batch, padded with blank images); unset
    means the mean images per block of the packed data, at least the most of one example."""
    skip_bad_rows: bool = False
    """Image data: leave out the rows whose image is missing or cannot be decoded (a truncated
    file), counted in the header with the first one's reason; by default the first such row ends
    the run before its first step, in one line naming it (every image is decoded while the data
    set is encoded)."""



def check_image_flags(options) -> None:
    """Each image setting valid (one line, ConfigError, otherwise)."""
    check(options.image_slots is None or options.image_slots >= 1,
          f"image_slots must be at least 1, got {options.image_slots}")
