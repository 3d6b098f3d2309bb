"""Image-text-to-text models: the kind's hooks for the core (models/kind.py), and its parts.

- config.py: its flags (--train-vision-tower, --image-buckets, ...); family.py: the covered
  families and what differs between them;
- data/: TRL's vision rows read, images decoded and resized into buckets, packed into blocks of
  fixed shapes (S tokens, K image slots);
- execution.py: the static image merge swapped into the model;
- recipe.py, run.py, chat.py, step.py, plan.py: the folder loaded, trained, asked, planned;
  `ImageTextRecipe` below is what the Hugging Face recipe asks of them.
"""
from __future__ import annotations

from pathlib import Path

from ...models.kind import ModelKind
from .config import ImageFlags, check_image_flags
from .family import describe, image_token_id, is_image_text_to_text, vision_family


class ImageTextToText(ModelKind):
    name = "vlm"
    flags = ImageFlags
    help_title = "image-text-to-text models (a folder with an image processor)"

    def check_flags(self, options) -> None:
        check_image_flags(options)

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

    def recipe(self):
        return ImageTextRecipe()

    def packing_keys(self) -> frozenset[str]:
        from .data.blocks import IMAGE_COUNT

        return frozenset({IMAGE_COUNT})

    def block_mask(self, config):
        family = vision_family(config)
        if family is None:
            return None
        return image_token_id(config) if family.bidirectional_images else None, family.positions


# -- the kind's recipe, as the Hugging Face recipe asks it (ModelKind.recipe) --------------------

class ImageTextRecipe:
    """What `hputrain train / evaluate / export / plan --model` do with an image-text-to-text
    folder, in place of the causal LM's."""

    def takes(self, folder: Path, base_model: str | None, dataset: str | None) -> bool:
        """Whether this recipe trains (or evaluates) `folder` on `dataset`: an image-text-to-text
        model's, but text data on a type AutoModelForCausalLM also loads goes the causal-LM way;
        an uncovered family is one line (recipe.vision_config)."""
        from .recipe import has_images, vision_config

        return vision_config(folder, base_model, images=has_images(dataset)) is not None

    def merges(self, folder: Path, base_model: str | None) -> bool:
        """Whether `hputrain export --merge` writes `folder` with its processor (a folder without
        one: the causal-LM way)."""
        from .recipe import has_processor_files, vision_config

        return vision_config(folder, base_model, images=has_processor_files(folder, base_model)) is not None

    def check_run(self, options, training_args) -> None:
        from .run import check_run

        check_run(options, training_args)

    def run(self, options, training_args, accelerator_config, folder: Path) -> int:
        from .run import run_vision

        return run_vision(options, training_args, accelerator_config, folder)

    def evaluate(self, options, folder: Path, *, batch_size: int, precision: str, split: str) -> dict:
        from .run import evaluate_vision

        return evaluate_vision(options, folder, batch_size=batch_size, precision=precision, split=split)

    def merged(self, folder: Path, base_model: str | None):
        """(the adapters merged into the model, what saves its processor) for export."""
        from .recipe import load_vision, saver

        merged, processing = load_vision(folder, "--merge", base_model=base_model, merge=True)
        return merged, saver(processing)

    def plans(self, config) -> bool:
        """Whether `hputrain plan` plans a model of `config` with image blocks."""
        from .family import is_image_text_to_text

        return is_image_text_to_text(config)

    def step_model(self, folder: Path, config, options, block: int) -> dict:
        from .step import vision_step_model

        return vision_step_model(folder, config, options, block)

    def refusal(self, config) -> str | None:
        """What `config`'s model is, when a causal LM is asked for and AutoModelForCausalLM does
        not load it; None: it does."""
        from .family import describe, is_image_text_to_text
        from .recipe import loads_as_causal_lm

        if is_image_text_to_text(config) and not loads_as_causal_lm(config):
            return f"an image-text-to-text model ({describe(config)})"
        return None
