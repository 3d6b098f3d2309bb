"""`hputrain generate --model DIR [--image FILE ...] --chat QUESTION`: an image-text-to-text
model's answer about one or more images, or to a text-only question (a model folder, a LoRA
run's final/ of one, or a merged export), through the same static-shape generator as a text
model's answer (recipes/hf/chat.py, execution/generation.py).

A question is encoded by the training path itself (kinds/vlm/data/), so that the two cannot drift:
the question is one user message, its string content made parts with an image part per --image
before the text (rows.as_parts, TRL's rule), rendered by the folder's chat template with the
generation prompt, each image's placeholder expanded for its pixel bucket as a training row's
is (encode.encode_prompt); each image read as training reads it (rows.open_image: its EXIF
orientation applied, transparency on white) and resized into its bucket as training resizes
it (Processing.pixels, buckets.py). The prefill carries the pixel values (execution.
generation.Prefill) stacked as a block's are, Qwen's 3-D positions (transformers'
get_rope_index, as a block's: blocks.RopeIndex) and, for Gemma 3, the image runs whose tokens
attend both ways (training/packed.image_run_ids, the training mask's rule); the decode steps
read the images through the cache only, so they keep the fixed shapes of text generation.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...errors import InputError
from ...execution.generation import Prefill
from ...recipes.hf.chat import ChatAnswer, answer


@dataclass
class ImagePrompt:
    """A rendered question with its images, as the generator takes it."""

    ids: list[int]
    prefill: Prefill


def check_image_model(folder: Path, base_model: str | None = None) -> None:
    """One line unless `folder` (or an adapter folder's base) holds an image-text-to-text model
    hputrain covers (an uncovered one: models.vision.refusal); read before any weight is."""
    from .recipe import vision_config

    if vision_config(folder, base_model) is None:
        raise InputError(f"--image needs an image-text-to-text model folder, and --model {folder} "
                         "holds a text model (or none transformers reads as one): ask without "
                         "--image, or give a vision-language model's folder")


def answers_as_vision_model(folder: Path, base_model: str | None = None) -> bool:
    """Whether a text-only --chat to `folder` goes through this path, as training on text rows
    would: an image-text-to-text folder whose type AutoModelForCausalLM does not also load
    (LLaVA, Qwen2.5-VL; Gemma 3's text model answers as a causal LM, as it trains on text)."""
    from .recipe import vision_config

    return vision_config(folder, base_model, images=False) is not None


def image_refs(paths: list[str]) -> list[str]:
    """Each --image as the training path's image reference (its absolute path), its header
    read; one line naming a missing or unreadable file, before any weight is read."""
    from .data.rows import image_size

    refs = []
    for name in paths:
        path = Path(name).expanduser()
        if not path.is_file():
            raise InputError(f"--image {name}: no such file")
        refs.append(str(path.resolve()))
        image_size(refs[-1], f"--image {name}")
    return refs


def load_vision_for_chat(folder: Path, base_model: str | None = None):
    """(model in float32, data.vision.encode.Processing) of a VLM folder or of a LoRA adapter
    folder of one (hf_vision.load_vision: its adapters on its base, the processor the folder's
    own where it holds one), the pixel buckets training uses by default."""
    from .recipe import load_vision

    return load_vision(Path(folder), base_model=base_model)


def image_prompt(processing, question: str, refs: list[str]) -> ImagePrompt:
    """The question about the images `refs` (none: a text-only question) encoded as the model
    takes it (module docstring): the prompt's token ids and its Prefill."""
    import torch

    from .data.blocks import RopeIndex, stack_images
    from .data.encode import encode_prompt
    from .data.rows import as_parts
    from ...training.packed import image_run_ids

    messages = as_parts([{"role": "user", "content": question}], len(refs), "--chat")
    ids, buckets = encode_prompt(messages, refs, processing, "--chat")
    inputs = stack_images([processing.pixels(ref, bucket, "--image")
                           for ref, bucket in zip(refs, buckets)]) if refs else {}
    tokens = torch.from_numpy(ids.astype("int64"))
    family, image_id = processing.family, processing.image_token_id
    positions = groups = None
    if family.positions == "3d":
        positions = [RopeIndex(processing.config)(tokens, inputs.get("image_grid_thw"), image_id)]
    if family.bidirectional_images:
        groups = [image_run_ids(tokens[None], image_id)[0] - 1]  # 0, 1, ... per image, -1 off
    return ImagePrompt(ids.tolist(), Prefill(inputs, positions, groups))


def vision_answer(folder: Path, question: str, image_paths: list[str], accelerator, *,
                  max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                  base_model: str | None = None) -> ChatAnswer:
    """The model's answer to `question` about the images (none: a text-only question; see the
    module docstring and recipes/hf_chat.chat_answer, whose answer it is for text)."""
    if image_paths:
        check_image_model(folder, base_model)
    refs = image_refs(image_paths)
    model, processing = load_vision_for_chat(folder, base_model)
    prompt = image_prompt(processing, question, refs)
    return answer(model, processing.tokenizer, folder, accelerator, prompt.ids,
                  max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                  prefill=prompt.prefill)
