"""Tiny vision-language model folders and image data sets as a user would have them on disk:
LLaVA (CLIP tower + Llama), Gemma 3 (SigLIP tower without its attention-pooling head, as the
published Gemma 3 checkpoints have it, pooled to 4 image tokens, bidirectional attention over an
image) and Qwen2.5-VL (dynamic-resolution patches, 3-D multimodal RoPE), each
written by `save_pretrained` with a byte-level BPE tokenizer trained in the test (nothing is
downloaded).

LLaVA's and Gemma 3's folders hold their processor (AutoProcessor loads them, with PIL's image
processors: torchvision has no CPU build for torch 2.13 here). Qwen2.5-VL's processor class needs
torchvision (its video processor), so its folder holds what a processor would save without it:
the tokenizer (with the chat template) and the image processor's preprocessor_config.json.

Images are 28x28 for LLaVA and Gemma 3 (2x2 patches of 14: 4 image tokens; LLaVA drops the CLS
token), and Qwen2.5-VL's take 4 to 16 image tokens (28-pixel merged patches) by their size.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from .hf_fixtures import tiny_tokenizer

FAMILIES = ("llava", "gemma3", "qwen2_5_vl")
"""The families every vision test covers."""

SPECIAL = ["<|im_start|>", "<|im_end|>", "<image>", "<start_of_image>", "<end_of_image>",
           "<image_soft_token>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
"""Tokens the three families' templates and processors use (one token each)."""

PLACEHOLDER = {"llava": "<image>", "gemma3": "<start_of_image>",
               "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>"}
"""What each family's chat template writes for an image part (the processor expands it)."""


def chat_template(family: str, tagged: bool = False) -> str:
    """A ChatML template whose content may be a list of parts ({"type": "image"} and
    {"type": "text", "text": ...}); `tagged` marks the assistant's text with {% generation %}."""
    image = PLACEHOLDER[family]
    content = ("{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
               f"{{% if c['type'] == 'image' %}}{image}{{% else %}}{{{{ c['text'] }}}}{{% endif %}}"
               "{% endfor %}{% endif %}")
    if tagged:
        body = (f"{{% if m['role'] == 'assistant' %}}{{% generation %}}{content}<|im_end|>{{% endgeneration %}}"
                f"{{% else %}}{content}<|im_end|>{{% endif %}}")
    else:
        body = f"{content}<|im_end|>"
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n" + body + "\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


TEMPLATES = Path(__file__).parent / "chat_templates"

REAL_TEMPLATES = {"llava": "llava-1.5-7b-hf.jinja", "gemma3": "gemma-3-4b-it.jinja",
                  "qwen2_5_vl": "qwen2.5-vl-7b-instruct.jinja"}
"""The chat templates the published models ship, copied as they are into tests/chat_templates/
(issue 47 item 13):

- llava-1.5-7b-hf.jinja: llava-hf/llava-1.5-7b-hf's chat_template.json, as transformers' own
  tests/models/llava/test_processing_llava.py gives it (commit 043bb8dde14a, "tiny processor
  created ... from llava-hf/llava-1.5-7b-hf"); OpenVINO GenAI's table of chat templates lists
  the same text as "llava-1.5, llava-v1.6-vicuna (chat_template.json)". It prints only parts of
  type "text" (a string content renders empty), the system prompt without a role, and no
  end-of-turn marker ({% generation %} marks the assistant's text and the space after it).
- gemma-3-4b-it.jinja: google/gemma-3-4b-it's, the one template of the Gemma 3 instruction-tuned
  models, as the Hub's metadata of ggml-org/gemma-3-12b-it-GGUF (base_model google/gemma-3-12b-
  it) carries it (its gguf chat_template, the JSON string decoded); unsloth's chat_templates.py
  holds the same text "obtained via print(tokenizer.chat_template)". The system prompt goes
  before the first user message's text; roles must alternate.
- qwen2.5-vl-7b-instruct.jinja: Qwen/Qwen2.5-VL-7B-Instruct's chat_template.json, the Qwen2-VL
  Instruct template (OpenVINO GenAI's table lists it as Qwen2-VL-2B-Instruct's
  tokenizer_config.json; scripts that load Qwen2.5-VL set it as its official one). It writes a
  default system prompt when the conversation has none."""


def real_template(family: str) -> str:
    """The published model's chat template of `family` (REAL_TEMPLATES)."""
    return (TEMPLATES / REAL_TEMPLATES[family]).read_text()


def vlm_tokenizer(image_token: str = "<image_soft_token>"):
    """tiny_tokenizer with the families' special tokens, Gemma 3's named ones as attributes
    (`image_token`: the one a processor expands, LLaVA's "<image>"). transformers 5 takes no
    additional_special_tokens argument: the unnamed ones are added as special tokens after."""
    transformers = pytest.importorskip("transformers")
    base = tiny_tokenizer()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": image_token})
    tokenizer.add_tokens([t for t in SPECIAL if t not in tokenizer.get_vocab()], special_tokens=True)
    return tokenizer


def _text(vocab_size: int) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                bos_token_id=1, eos_token_id=2, pad_token_id=3)


def _vision() -> dict:
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                image_size=28, patch_size=14)


def tiny_vlm_config(family: str, tokenizer, **overrides):
    """The config of a tiny model of `family` whose ids match `tokenizer`'s special tokens."""
    transformers = pytest.importorskip("transformers")
    ids = tokenizer.convert_tokens_to_ids
    text = _text(len(tokenizer))
    if family == "llava":
        config = transformers.LlavaConfig(
            vision_config=transformers.CLIPVisionConfig(**_vision(), projection_dim=32),
            text_config=transformers.LlamaConfig(**text), image_token_id=ids("<image>"),
            vision_feature_layer=-1, image_seq_length=4)
    elif family == "gemma3":
        config = transformers.Gemma3Config(
            text_config=transformers.Gemma3TextConfig(**text, head_dim=8, sliding_window=512),
            vision_config=transformers.SiglipVisionConfig(**_vision(), vision_use_head=False),
            mm_tokens_per_image=4,
            image_token_id=ids("<image_soft_token>"), boi_token_id=ids("<start_of_image>"),
            eoi_token_id=ids("<end_of_image>"))
    elif family == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(
            text_config=text | {"rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}},
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4,
                               out_hidden_size=32, patch_size=14, spatial_merge_size=2,
                               temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
            image_token_id=ids("<|image_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"))
    else:
        raise ValueError(f"no tiny config for {family!r}: one of {FAMILIES}")
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def image_processor(family: str):
    """The family's image processor (PIL backends)."""
    transformers = pytest.importorskip("transformers")
    if family == "llava":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        return CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    if family == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        return Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    assert transformers
    return Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=56 * 56 * 4)


def tiny_vlm_folder(folder: Path, family: str = "llava", seed: int = 0, tagged: bool = False,
                    template: str | None = None, **config_overrides) -> Path:
    """`folder` holding config.json, the weights, the tokenizer with its chat template (a ChatML
    one, or `template`: e.g. real_template(family)) and the image processor (and, for LLaVA and
    Gemma 3, processor_config.json), as save_pretrained writes them."""
    import torch
    transformers = pytest.importorskip("transformers")

    tokenizer = vlm_tokenizer("<image>" if family == "llava" else "<image_soft_token>")
    template = template or chat_template(family, tagged)
    torch.manual_seed(seed)
    config = tiny_vlm_config(family, tokenizer, **config_overrides)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    if family == "gemma3":  # transformers draws its projection as zeros: no image would matter
        weight = model.model.multi_modal_projector.mm_input_projection_weight
        torch.nn.init.normal_(weight.data, std=weight.shape[0] ** -0.5)
    model.save_pretrained(folder)
    images = image_processor(family)
    if family == "llava":
        transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                                    vision_feature_select_strategy="default", chat_template=template,
                                    image_token="<image>", num_additional_image_tokens=1
                                    ).save_pretrained(folder)
    elif family == "gemma3":
        transformers.Gemma3Processor(image_processor=images, tokenizer=tokenizer,
                                     chat_template=template, image_seq_length=4).save_pretrained(folder)
    else:
        tokenizer.chat_template = template
        tokenizer.save_pretrained(folder)
        images.save_pretrained(folder)
    return Path(folder)


QUESTIONS = ["what is in the picture", "describe the image", "which colour is it",
             "how many shapes are there", "is it bright or dark"]
ANSWERS = ["a red square on a dark field", "two stripes", "mostly blue", "three small dots",
           "it is bright and warm, with a yellow corner and a grey border around it"]


def write_images(folder: Path, count: int, seed: int = 0) -> list[str]:
    """`count` PNG files of varied sizes (20 to 90 pixels a side) in `folder`/images; their
    paths relative to `folder`."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(count):
        height, width = (int(v) for v in rng.integers(20, 90, size=2))
        pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        name = f"images/{i:03d}.png"
        Image.fromarray(pixels).save(folder / name)
        names.append(name)
    return names


def image_rows(count: int, images: list[str], fmt: str = "messages") -> list[dict]:
    """TRL's vision rows: `messages` with image parts and an `images` list (some rows with two
    images, some with none), `prompt_completion` (prompt and completion as messages, `images`),
    or `image` (one image a row, in an `image` column, with `messages`)."""
    rows = []
    for i in range(count):
        question, answer = QUESTIONS[i % len(QUESTIONS)], " ".join([ANSWERS[i % len(ANSWERS)]] * (1 + i % 3))
        if fmt == "image":
            used = [images[i % len(images)]]
        else:
            used = [images[(i + k) % len(images)] for k in range(i % 3 if i % 5 else 1)]
        parts = [{"type": "image"} for _ in used] + [{"type": "text", "text": question}]
        if fmt == "prompt_completion":
            rows.append({"prompt": [{"role": "user", "content": parts}],
                         "completion": [{"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                         "images": used})
            continue
        messages = [{"role": "user", "content": parts},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        if i % 4 == 3:  # a second exchange, text only
            messages += [{"role": "user", "content": [{"type": "text", "text": "and then"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "nothing more"}]}]
        rows.append({"image": used[0], "messages": messages} if fmt == "image"
                    else {"messages": messages, "images": used})
    return rows


def write_image_dataset(folder: Path, fmt: str = "messages", rows: int = 24, seed: int = 0) -> Path:
    """`folder`/data.jsonl of `image_rows` with its images beside it (paths relative to the data
    file); returns the data file."""
    folder.mkdir(parents=True, exist_ok=True)
    images = write_images(folder, max(4, rows // 2), seed)
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in image_rows(rows, images, fmt)))
    return path


SYSTEM = "You are a careful assistant: answer in a few words."
"""The system prompt of `string_rows`."""


def string_rows(count: int, images: list[str], fmt: str = "messages") -> list[dict]:
    """TRL's vision rows as users' files hold them: every content a plain string (TRL's
    prepare_multimodal_messages adds the image parts), a system prompt, rows with two images,
    one or none (text-only rows, as a mixed data set has them), some with a second exchange;
    `messages`, or `prompt_completion` (prompt: the system and user messages, completion: the
    assistant's)."""
    rows = []
    for i in range(count):
        question, answer = QUESTIONS[i % len(QUESTIONS)], ANSWERS[(i + 2) % len(ANSWERS)]
        used = [images[(i + k) % len(images)] for k in range(i % 3)]
        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        reply = [{"role": "assistant", "content": answer}]
        if fmt == "prompt_completion":
            rows.append({"prompt": prompt, "completion": reply, "images": used})
            continue
        more = ([{"role": "user", "content": "and then"}, {"role": "assistant", "content": "nothing more"}]
                if i % 4 == 3 else [])
        rows.append({"messages": prompt + reply + more, "images": used})
    return rows


def write_string_dataset(folder: Path, fmt: str = "messages", rows: int = 16, seed: int = 0) -> Path:
    """`folder`/data.jsonl of `string_rows` with its images beside it; returns the data file."""
    folder.mkdir(parents=True, exist_ok=True)
    images = write_images(folder, max(4, rows // 2), seed)
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in string_rows(rows, images, fmt)))
    return path


def write_phone_photo(path: Path, size: tuple[int, int] = (64, 48), orientation: int = 6) -> Path:
    """A JPEG as a phone writes a portrait photo: its pixels stored `size` (landscape, as the
    sensor reads them), EXIF saying how to turn them to show it (Orientation 6: a quarter turn
    clockwise, shown 48x64), beside the camera's make, model and time. The pixels differ from
    corner to corner, so that a turn shows in them."""
    import numpy as np
    from PIL import ExifTags, Image

    width, height = size
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1),
                       (x * y) % 256], axis=-1).astype(np.uint8)
    exif = Image.Exif()
    exif[ExifTags.Base.Make], exif[ExifTags.Base.Model] = "Apple", "iPhone 13"
    exif[ExifTags.Base.Orientation] = orientation
    exif[ExifTags.Base.DateTime] = "2026:05:01 10:15:00"
    exif[ExifTags.Base.Software] = "17.4.1"
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, "JPEG", quality=92, exif=exif.tobytes())
    return path


def write_logo(path: Path, hidden: tuple[int, int, int] = (20, 40, 60)) -> Path:
    """A PNG logo with transparency: an opaque red square on a transparent field whose hidden
    colour is `hidden` (what an RGB conversion shows; the processors composite it onto white)."""
    import numpy as np
    from PIL import Image

    rgba = np.zeros((40, 40, 4), dtype=np.uint8)
    rgba[..., :3] = hidden
    rgba[10:30, 10:30] = (200, 10, 10, 255)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rgba, "RGBA").save(path)
    return path


def save_image_dataset(folder: Path, rows: int = 24, seed: int = 0) -> Path:
    """The `messages` rows written by datasets' save_to_disk, `images` a list of datasets.Image
    (the images' bytes inside the Arrow files)."""
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    source = folder.parent / f"{folder.name}-images"
    names = write_images(source, max(4, rows // 2), seed)
    records = image_rows(rows, names)
    features = datasets.Features({"messages": [{"role": datasets.Value("string"),
                                                "content": [{"type": datasets.Value("string"),
                                                             "text": datasets.Value("string")}]}],
                                  "images": datasets.Sequence(datasets.Image())})
    table = {"messages": [r["messages"] for r in records],
             "images": [[Image.open(source / name).convert("RGB") for name in r["images"]] for r in records]}
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(folder))
    return folder


@pytest.fixture(scope="session")
def vlm_folders(tmp_path_factory):
    """folder(family, tagged=False, real=False): one tiny folder per family and template for the
    session (read-only: copy it to change it); `real`: the published model's chat template
    (real_template) in place of the ChatML one."""
    made: dict[tuple, Path] = {}

    def folder(family: str = "llava", tagged: bool = False, real: bool = False) -> Path:
        key = (family, tagged, real)
        if key not in made:
            made[key] = tiny_vlm_folder(tmp_path_factory.mktemp(f"tiny-{family}"), family, tagged=tagged,
                                        template=real_template(family) if real else None)
        return made[key]

    return folder


@pytest.fixture(scope="session")
def image_data(tmp_path_factory):
    """data(fmt="messages"): one image data set per format for the session (read-only)."""
    made: dict[str, Path] = {}

    def data(fmt: str = "messages") -> Path:
        if fmt not in made:
            made[fmt] = write_image_dataset(tmp_path_factory.mktemp(f"images-{fmt}"), fmt)
        return made[fmt]

    return data


def write_jpeg_parquet(path: Path, megabytes: float, seed: int = 0) -> tuple[int, int]:
    """A Parquet file as datasets' `Dataset.to_parquet` writes it: a `messages` column and an
    `images` column of datasets.Image holding JPEG bytes (600x600 noise at quality 95, about 425
    KB each, one or two a row), until it holds `megabytes` MiB of images; (rows, image bytes)."""
    import io

    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    target, total, rows = megabytes * (1 << 20), 0, []
    while total < target:
        images = []
        for _ in range(1 + len(rows) % 2):
            pixels = rng.integers(0, 256, size=(600, 600, 3), dtype=np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
            images.append({"bytes": buffer.getvalue(), "path": None})
            total += len(images[-1]["bytes"])
        parts = [{"type": "image", "text": None} for _ in images]
        rows.append({"messages": [
            {"role": "user", "content": parts + [{"type": "text", "text": f"what is picture {len(rows)}"}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"noise number {len(rows)}"}]}],
            "images": images})
    features = datasets.Features({
        "messages": [{"role": datasets.Value("string"),
                      "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
        "images": datasets.Sequence(datasets.Image())})
    data = datasets.Dataset.from_list(rows, features=features)
    data.to_parquet(str(path))
    return len(rows), total
