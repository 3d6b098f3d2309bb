"""`hputrain generate --model DIR --image FILE --chat QUESTION`: an image-text-to-text model's
answer about one or more images (a model folder, a LoRA run's final/ of one, or a merged
export), through the same static-shape generator as a text model's answer (recipes/hf_chat.py,
execution/generation.py).

The question is one user message whose content is an image part per --image, then the text,
rendered by the folder's chat template with the generation prompt. The images go through the
folder's processor (LLaVA, Gemma 3: the processor object expands each image's placeholder into
its image tokens); where the processor class cannot be built (Qwen2.5-VL without torchvision),
through its image processor and tokenizer, each `<|image_pad|>` repeated grid_t*grid_h*grid_w /
merge^2 times, as Qwen's processor does. The prefill carries the pixel values (execution.
generation.Prefill), Qwen's 3-D positions (the model's own get_rope_index) and, for Gemma 3, the
image blocks that attend both ways; the decode steps read the images through the cache only, so
they keep the fixed shapes of text generation.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..execution.generation import Prefill
from ..models.vision import image_token_id, vision_family
from .hf_chat import ChatAnswer, answer

MODEL_INPUTS_LEFT_OUT = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
"""What a processor returns that the prefill does not pass as it is: the tokens (the generator
pads them), the mask (it makes its own) and the token types (read here into positions and image
blocks)."""


@dataclass
class ImagePrompt:
    """A rendered question with its images, as the generator takes it."""

    ids: list[int]
    prefill: Prefill


def check_image_model(folder: Path, base_model: str | None = None) -> None:
    """One line unless `folder` (or an adapter folder's base) holds an image-text-to-text model
    hputrain covers (an uncovered one: models.vision.refusal); read before any weight is."""
    from .hf_vision import vision_config

    if vision_config(folder, base_model) is None:
        raise InputError(f"--image needs an image-text-to-text model folder, and --model {folder} "
                         "holds a text model (or none transformers reads as one): ask without "
                         "--image, or give a vision-language model's folder")


def open_images(paths: list[str]) -> list:
    """Each --image as an RGB PIL image; one line naming a missing or unreadable file."""
    from PIL import Image, UnidentifiedImageError

    images = []
    for name in paths:
        path = Path(name).expanduser()
        if not path.is_file():
            raise InputError(f"--image {name}: no such file")
        try:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        except (OSError, UnidentifiedImageError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise InputError(f"--image {name} cannot be read as an image: {first}") from None
    return images


def load_vision_for_chat(folder: Path, base_model: str | None = None):
    """(model in float32, processor or None, tokenizer, image processor) of a VLM folder or of a
    LoRA adapter folder of one (hf_vision.load_vision: its adapters on its base, the processor
    the folder's own where it holds one); the processor None where its class cannot be built."""
    from .hf_vision import load_vision

    model, processing = load_vision(Path(folder), base_model=base_model)
    # data.vision.encode.Processing (its processor object, or None), or a processor itself
    processor = getattr(processing, "processor", processing)
    if not hasattr(processor, "apply_chat_template"):  # the tokenizer and image processor only
        processor = None
    return model, processor, processing.tokenizer, processing.image_processor


def image_prompt(model, processor, tokenizer, image_processor, question: str,
                 images: list) -> ImagePrompt:
    """The question about `images` rendered and encoded as the model takes it (module
    docstring): the prompt's token ids and its Prefill."""
    import torch

    config = _inner_config(model)
    messages = [{"role": "user", "content": [{"type": "image"} for _ in images]
                 + [{"type": "text", "text": question}]}]
    renderer = processor if processor is not None and processor.chat_template else tokenizer
    if not isinstance(getattr(renderer, "chat_template", None), str):
        raise InputError("--model: neither its processor nor its tokenizer has a chat template, so "
                         "--chat cannot render the question")
    text = renderer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if processor is not None:
        encoded = dict(processor(text=[text], images=images, return_tensors="pt"))
    else:
        encoded = _qwen_encoding(config, tokenizer, image_processor, text, images)
    ids = encoded["input_ids"][0]
    family = vision_family(config)
    image_id = image_token_id(config)
    positions = groups = None
    if family.positions == "3d":
        types = (ids == image_id).int()[None]
        rope, _ = _inner(model).get_rope_index(ids[None], types,
                                               image_grid_thw=encoded.get("image_grid_thw"))
        positions = [rope[:, 0]]
    if family.bidirectional_images:
        groups = [image_groups(ids, image_id)]
    inputs = {k: v for k, v in encoded.items() if k not in MODEL_INPUTS_LEFT_OUT}
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(torch.float32)
    return ImagePrompt(ids.tolist(), Prefill(inputs, positions, groups))


def image_groups(ids, image_id: int):
    """(L,): the image each token belongs to (0, 1, ... by contiguous runs of `image_id`), -1 for
    the others: the blocks Gemma 3's tokens of one image attend within both ways."""
    import torch

    is_image = ids == image_id
    starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:-1]
    return torch.where(is_image, starts.long().cumsum(0) - 1, -1)


def _qwen_encoding(config, tokenizer, image_processor, text: str, images: list) -> dict:
    """What Qwen2.5-VL's processor returns for `text` and `images`, made by its parts: the image
    processor's pixel values and grids, and each image's `<|image_pad|>` repeated by its grid
    (t * h * w / merge^2)."""
    found = image_processor(images=images, return_tensors="pt")
    grids = found["image_grid_thw"]
    merge = getattr(image_processor, "merge_size", None) or config.vision_config.spatial_merge_size
    pad = tokenizer.convert_ids_to_tokens(image_token_id(config))
    pieces = text.split(pad)
    if len(pieces) - 1 != len(images):
        raise InputError(f"--model: the chat template wrote {len(pieces) - 1} image placeholders "
                         f"({pad}) for {len(images)} images")
    expanded = pieces[0]
    for grid, piece in zip(grids, pieces[1:]):
        expanded += pad * (int(grid.prod()) // merge**2) + piece
    ids = tokenizer(expanded, return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "pixel_values": found["pixel_values"], "image_grid_thw": grids}


def vision_answer(folder: Path, question: str, image_paths: list[str], accelerator, *,
                  max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                  base_model: str | None = None) -> ChatAnswer:
    """The model's answer to `question` about the images (see the module docstring and
    recipes/hf_chat.chat_answer, whose answer it is for text)."""
    check_image_model(folder, base_model)
    images = open_images(image_paths)
    model, processor, tokenizer, image_processor = load_vision_for_chat(folder, base_model)
    prompt = image_prompt(model, processor, tokenizer, image_processor, question, images)
    return answer(model, tokenizer, folder, accelerator, prompt.ids, max_new_tokens=max_new_tokens,
                  temperature=temperature, top_k=top_k, prefill=prompt.prefill)


def _inner(model):
    """The transformers model under PEFT's wrapper, then its inner `model` (tower, projector and
    language model: where get_rope_index lives)."""
    from ..data.batching import base_model

    top = base_model(model)
    return getattr(top, "model", top)


def _inner_config(model):
    from ..data.batching import base_model

    return base_model(model).config
