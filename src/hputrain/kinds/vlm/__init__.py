"""Image-text-to-text models: the kind's hooks for the core (models/kind.py), and its parts.

- family.py: the covered families and what differs between them;
- data/: TRL's vision rows read, images decoded and resized into buckets, packed into blocks of
  fixed shapes (S tokens, K image slots);
- execution.py: the static image merge swapped into the model;
- recipe.py, run.py, chat.py, step.py, plan.py: the folder loaded, trained, asked, planned.
"""
from __future__ import annotations

from ...models.kind import ModelKind
from .family import describe, image_token_id, is_image_text_to_text, vision_family


class ImageTextToText(ModelKind):
    name = "vlm"

    def matches(self, config) -> bool:
        return is_image_text_to_text(config) or vision_family(config) is not None

    def describe(self, config, args=None) -> str | None:
        return describe(config) if is_image_text_to_text(config) else None

    def prepare(self, model, args):
        from .execution import image_model, static_batches, static_image_merge

        if vision_family(getattr(model, "config", None)) is None:
            return None
        static_image_merge(model)
        inner = image_model(model)
        return None if inner is None else (lambda: static_batches(inner))

    def adapted_where(self, config, names: list[str]) -> str | None:
        family = vision_family(config)
        if family is None:
            return None
        tower = f".{family.tower}." in "".join(f".{name}." for name in names)
        return f"in the language model{' and the vision tower' if tower else ''}"

    def packing_keys(self) -> frozenset[str]:
        from .data.blocks import IMAGE_COUNT

        return frozenset({IMAGE_COUNT})

    def block_mask(self, config):
        family = vision_family(config)
        if family is None:
            return None
        return image_token_id(config) if family.bidirectional_images else None, family.positions
