"""Image rows in TRL's vision formats: which format a data set has, its messages with their image
parts, and its images as picklable references that a worker process opens later.

Formats (`detect_image_format`, from the columns):

  messages            `messages` whose contents hold {"type": "image"} parts, and `images` (a list)
  prompt_completion   `prompt` and `completion` as message lists, and `images` (a list)
  image               a single `image` column beside `messages`, or `prompt` and `completion`

An image is a file path (relative to the data file, as TRL's data sets on disk are laid out), a
datasets Image value of a save_to_disk folder, a PIL image, or raw bytes. It becomes an
`ImageRef`, which pickles into DataLoader workers and opens with `open_image`: an absolute path;
a `SavedImage` (where the image lies in a save_to_disk folder: read, undecoded, from its
memory-mapped Arrow files when a block is made, so that no image is held in memory until then);
a `parquet.FileSpan` (an image of a Parquet file whose bytes lie in it as they are: read in
place, likewise); or the image's bytes (a PIL image without a file behind it is written as PNG,
losslessly).

Plain string contents are allowed beside parts, and every one becomes a text part (TRL's
prepare_multimodal_messages rule), so that a template that prints only parts of type "text"
(LLaVA-1.5's) renders it; where no message holds an image part, the images' placeholders go
before the text of the first user message whose content is a string (the same rule). Every
problem is one InputError line naming the row.

An image is read by `open_image` alone, for training and for `hputrain generate`: its EXIF
orientation applied (as transformers' load_image and datasets' Image do), then transparency
composited onto white (as the image processors' convert_to_rgb does); `image_size` gives the
size it has once turned, from its header, so that a bucket is chosen by the image as shown.
"""
from __future__ import annotations

import functools
import io
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from ....errors import InputError, did_you_mean
from ....data.sft import normalize_messages
from .parquet import FileSpan


@dataclass(frozen=True)
class SavedImage:
    """An image inside a data set written by save_to_disk."""

    folder: str
    split: str | None
    """The DatasetDict's split; None for a Dataset."""
    row: int
    column: str
    index: int | None
    """Its place in the row's list of images; None where the column holds one image."""


ImageRef = str | bytes | SavedImage | FileSpan
"""An image as the examples keep it: an absolute file path, an image of a save_to_disk folder,
an image's place in a Parquet file, or the encoded image's bytes."""

FORMATS = ("messages", "prompt_completion", "image")
"""TRL's vision row formats, as `detect_image_format` names them."""

ROLES = ("system", "user", "assistant", "tool")
"""Roles a message may have (as data/sft.py's)."""

PART_TYPES = ("image", "text")
"""The types of content parts a message may hold."""


def detect_image_format(columns: Iterable[str]) -> str | None:
    """"messages", "prompt_completion" or "image" for image data with these columns; None when
    the data has no image column (text data). An image column without conversation columns is
    one line."""
    columns = list(columns)
    conversation = "messages" in columns or ("prompt" in columns and "completion" in columns)
    if "images" in columns and "image" in columns:
        raise InputError("the data has both an 'images' and an 'image' column: give the images of a "
                         "row in one of them ('images', a list; or 'image', one per row)")
    if "images" not in columns and "image" not in columns:
        return None
    if not conversation:
        raise InputError(f"image data needs 'messages', or 'prompt' and 'completion', beside its "
                         f"images (it has: {', '.join(map(str, columns))})")
    if "image" in columns:
        return "image"
    return "messages" if "messages" in columns else "prompt_completion"


def conversation(row: Mapping, fmt: str, where: str) -> tuple[list[dict], list[int], list]:
    """(messages, the indices of the messages whose assistant turns are the completion (every
    index for conversations), the row's raw image values) of one row of format `fmt`; the
    messages hold exactly one image part per image (TRL's rule adds them to string contents)."""
    if fmt == "image":
        value = row.get("image")
        images = [] if value is None else [value]
        fmt = "messages" if "messages" in row else "prompt_completion"
    elif fmt in ("messages", "prompt_completion"):
        images = row.get("images")
        images = [] if images is None else images
        if isinstance(images, (str, bytes, Mapping)) or not isinstance(images, Iterable):
            raise InputError(f"{where}: 'images' is {type(images).__name__}, not a list of images")
        images = list(images)
    else:
        raise InputError(f"unknown image row format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt == "messages":
        messages = normalize(row.get("messages"), where, "messages")
        completion = list(range(len(messages)))
    else:
        prompt, answer = row.get("prompt"), row.get("completion")
        if isinstance(prompt, str) or isinstance(answer, str):
            raise InputError(f"{where}: image rows need 'prompt' and 'completion' as message lists "
                             "(TRL's conversational format), not text")
        before = normalize(prompt, where, "prompt")
        messages = before + normalize(answer, where, "completion")
        completion = list(range(len(before), len(messages)))
    return as_parts(messages, len(images), where), completion, images


def normalize(value, where: str, column: str) -> list[dict]:
    """A row's messages as [{"role", "content", ...}], content a string or a list of parts
    ({"type": "image"}, {"type": "text", "text": ...}); keys holding None are dropped (a
    save_to_disk struct fills missing keys with None, which a template would print): text SFT's
    reading (data/sft.py), each message by `_message`."""
    return normalize_messages(value, where, column, _message)


def _message(item, where: str, k: int, column: str) -> dict:
    if not isinstance(item, Mapping):
        raise InputError(f"{where}: message {k} in {column!r} is {type(item).__name__}, not a "
                         "{'role', 'content'} mapping")
    role = item.get("role")
    if role not in ROLES:
        raise InputError(f"{where}: message {k} in {column!r} has role {role!r}, which is not one of "
                         f"{', '.join(ROLES)}{did_you_mean(role, ROLES)}")
    content = item.get("content")
    if isinstance(content, str):
        pass
    elif isinstance(content, Iterable) and not isinstance(content, (bytes, Mapping)):
        content = [_part(part, where, k, column) for part in content]
    elif not (content is None and item.get("tool_calls")):
        raise InputError(f"{where}: message {k} in {column!r} has no content: its 'content' is "
                         f"{type(content).__name__}, not text or a list of parts")
    message = {key: v for key, v in item.items() if v is not None}
    if content is not None:
        message["content"] = content
    return message


def _part(part, where: str, k: int, column: str) -> dict:
    if not isinstance(part, Mapping) or part.get("type") not in PART_TYPES:
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        raise InputError(f"{where}: message {k} in {column!r} has a part of type {kind!r}: parts are "
                         "{'type': 'image'} or {'type': 'text', 'text': ...}")
    part = {key: v for key, v in part.items() if v is not None}
    if part["type"] == "text" and not isinstance(part.get("text"), str):
        raise InputError(f"{where}: message {k} in {column!r} has a text part without text")
    return part


def image_parts(messages: list[dict]) -> int:
    """How many {"type": "image"} parts the messages hold."""
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if part["type"] == "image")


def as_parts(messages: list[dict], images: int, where: str) -> list[dict]:
    """`messages` with every string content a list of parts (TRL's prepare_multimodal_messages:
    the string as one text part) and one image part per image. Where no message holds an image
    part, the images' parts go before the text of the first user message whose content is a
    string (TRL's rule; a conversation TRL takes becomes what TRL makes of it); parts already
    there are kept as they are. A different count of parts and images is one line."""
    place = image_parts(messages) == 0
    prepared = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if place and message["role"] == "user":
                parts, place = [{"type": "image"} for _ in range(images)] + parts, False
            message = {**message, "content": parts}
        prepared.append(message)
    parts = image_parts(prepared)
    if parts != images:
        raise InputError(f"{where}: the messages hold {parts} image placeholder(s) "
                         f"({{'type': 'image'}} parts) and the row has {images} image(s): give one "
                         "placeholder per image")
    return prepared


# -- the images ------------------------------------------------------------------------------------

def image_ref(value, folder: Path | None, where: str) -> ImageRef:
    """The picklable reference of one image value of a row: a path (relative to `folder`, the
    data file's folder), {"bytes", "path"} (save_to_disk read undecoded), a PIL image (decoded:
    its file when it has one, else its pixels as PNG bytes) or bytes. A missing file is one line."""
    if isinstance(value, (SavedImage, FileSpan)):
        return value
    if isinstance(value, Mapping):
        data, path = value.get("bytes"), value.get("path")
        if data is not None:
            return bytes(data)
        value = path
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and value.split("://")[0].lower() in ("http", "https"):
        raise InputError(f"{where}: image {value} is a URL: images are read from files, so download "
                         "it and give its path relative to the data file")
    if isinstance(value, str):
        path = Path(value).expanduser()
        if not path.is_absolute() and folder is not None:
            path = folder / path
        if not path.is_file():
            relative = "" if Path(value).is_absolute() else f" (relative to {folder})"
            raise InputError(f"{where}: image {value}{relative} does not exist: give image paths "
                             "relative to the data file")
        return str(path.resolve())
    if hasattr(value, "save") and hasattr(value, "size"):  # a PIL image
        filename = getattr(value, "filename", "")
        if filename and Path(filename).is_file():
            return str(Path(filename).resolve())
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return buffer.getvalue()
    raise InputError(f"{where}: an image is {type(value).__name__}, not a file path, image bytes "
                     "or a datasets Image")


QUARTER_TURNS = (5, 6, 7, 8)
"""EXIF orientations that turn an image a quarter (its width and height swap when shown)."""


def image_size(ref: ImageRef, where: str) -> tuple[int, int]:
    """(width, height) of an image as shown, its EXIF orientation applied (a phone's portrait
    photo is stored wide), from its header; an unreadable image is one line."""
    from PIL import ExifTags, Image

    try:
        with Image.open(_source(ref)) as image:
            # the header's EXIF: Image.getexif itself (a PNG's override would decode the pixels)
            orientation = Image.Image.getexif(image).get(ExifTags.Base.Orientation, 1)
            width, height = image.size
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        raise InputError(f"{where}: image {describe(ref)} cannot be read: {_reason(error)}") from None
    return (height, width) if orientation in QUARTER_TURNS else (width, height)


def open_image(ref: ImageRef, where: str | None = None):
    """The image as an RGB PIL image, as training and `hputrain generate` both read it: turned
    by its EXIF orientation (transformers' load_image and datasets' Image do it), then any
    transparency composited onto white (as the image processors' convert_to_rgb does: an RGB
    conversion alone would show the colour hidden under it). An unreadable image is one line
    naming it."""
    from PIL import Image, ImageOps
    from transformers.image_transforms import convert_to_rgb

    try:
        with Image.open(_source(ref)) as image:
            image.load()
            ImageOps.exif_transpose(image, in_place=True)
            return Image.fromarray(convert_to_rgb(image, return_numpy=True))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        at = f"{where}: " if where else ""
        raise InputError(f"{at}image {describe(ref)} cannot be read: {_reason(error)}") from None


def describe(ref: ImageRef) -> str:
    """How an error names an image: its path, its place in a save_to_disk folder, or its size."""
    if isinstance(ref, SavedImage):
        at = "" if ref.index is None else f"[{ref.index}]"
        return f"{ref.column}{at} of row {ref.row}"
    if isinstance(ref, FileSpan):
        return ref.describe()
    return ref if isinstance(ref, str) else f"({len(ref)} bytes in the data set)"


def _source(ref: ImageRef):
    if isinstance(ref, SavedImage):
        return io.BytesIO(_saved_bytes(ref))
    if isinstance(ref, FileSpan):
        return io.BytesIO(ref.read())
    return io.BytesIO(ref) if isinstance(ref, bytes) else ref


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def split_rows(path: str, split: str, records, source_files) -> Iterator[tuple[str, dict, Path]]:
    """(where, row, folder) for each row of a data set's split, `folder` the one its image paths
    are relative to: each record file's own folder, or the save_to_disk folder. `records` and
    `source_files` are recipes/hf_data's (data/ may not import recipes/): the recipe passes
    them, as `split_rows(path, split, hf_data.records, hf_data.source_files)`."""
    kind, files = source_files(path, split)
    if kind == "saved":
        yield from _saved_rows(path, split, records)
        return
    for file in files:
        for where, row in records(str(file)):
            yield where, row, Path(file).parent


def _saved_rows(path: str, split: str, records) -> Iterator[tuple[str, dict, Path]]:
    """The rows of a save_to_disk folder, their datasets Image values as SavedImage references
    (the Arrow column read for the list lengths only: nothing is decoded or kept); a data set
    without Image columns as `records` reads it."""
    data, name, key = _saved(path, split)
    kinds = {column: _images_in(feature) for column, feature in data.features.items()}
    kinds = {column: kind for column, kind in kinds.items() if kind is not None}
    if not kinds:
        for where, row in records(path, split):
            yield where, row, Path(path)
        return
    import pyarrow.compute as pc

    folder = str(Path(path).resolve())
    others = data.select_columns([c for c in data.column_names if c not in kinds])
    images = data.select_columns(list(kinds)).with_format("arrow")
    for start in range(0, len(data), SAVED_BATCH):
        batch, table = others[start:start + SAVED_BATCH], images[start:start + SAVED_BATCH]
        counts = {c: (pc.list_value_length(table.column(c)) if kind == "list" else table.column(c).is_valid()
                      ).to_pylist() for c, kind in kinds.items()}
        for offset in range(table.num_rows):
            number = start + offset
            row = {column: values[offset] for column, values in batch.items()}
            for column, kind in kinds.items():
                count = counts[column][offset]
                row[column] = (None if not count else SavedImage(folder, key, number, column, None)
                               if kind == "one" else [SavedImage(folder, key, number, column, k)
                                                      for k in range(count)])
            yield f"{name} row {number}", row, Path(path)


SAVED_BATCH = 256
"""Rows of a save_to_disk folder read at a time."""


def _saved(path: str, split: str):
    """(the split's Dataset, how errors name it, its DatasetDict key or None)."""
    import datasets

    data = _load(str(Path(path).resolve()))
    if not isinstance(data, datasets.DatasetDict):
        return data, path, None
    if split not in data:
        raise InputError(f"--dataset {path} has no {split!r} split (it has: {', '.join(data)})")
    return data[split], (path if split == "train" else f"{path} (its {split} split)"), split


@functools.lru_cache(maxsize=4)
def _load(folder: str):
    """A save_to_disk folder, memory-mapped; loaded once per process (and per DataLoader worker)."""
    import datasets

    try:
        return datasets.load_from_disk(folder)
    except (OSError, ValueError, KeyError) as error:
        raise InputError(f"--dataset {folder} cannot be loaded with datasets.load_from_disk: "
                         f"{_reason(error)}") from None


@functools.lru_cache(maxsize=16)
def _saved_column(folder: str, split: str | None, column: str):
    """One column of a save_to_disk folder's split in Arrow form (its images undecoded)."""
    data = _load(folder)
    data = data if split is None else data[split]
    return data.select_columns([column]).with_format("arrow")


def _saved_bytes(ref: SavedImage) -> bytes:
    value = _saved_column(ref.folder, ref.split, ref.column)[ref.row].column(0)[0].as_py()
    value = value if ref.index is None else value[ref.index]
    if value.get("bytes") is not None:
        return value["bytes"]
    path = Path(value.get("path") or "")
    return (path if path.is_absolute() else Path(ref.folder) / path).read_bytes()


def _images_in(feature) -> str | None:
    """"one" for a datasets Image feature, "list" for a list of them, else None."""
    import datasets

    if isinstance(feature, datasets.Image):
        return "one"
    inner = feature[0] if isinstance(feature, list) and feature else getattr(feature, "feature", None)
    return "list" if isinstance(inner, datasets.Image) else None
