"""The encoded image examples of a split, cached on disk as text SFT caches its examples
(data/token_store.py): made once per node under a lock, memory-mapped by every rank, so the
ranks of a node share one copy of the token ids. The images are kept as references: a file's
path, an image's place in a save_to_disk folder (rows.SavedImage) or in a Parquet file
(parquet.FileSpan), each read when a block is made; only an image that lies nowhere as it is (a
PIL image, a compressed Parquet column's) is kept as its bytes.

The folder's name is a hash of the split's data files (the caller's key: recipes/hf_data's
cache_key of them, with the tokenizer's files) and of what decides the examples here: the row
format, the loss flags, the chat template, the pixel buckets and each bucket's image-token
expansion, the image token. Pixel values are not cached: a block makes them when it is read.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ....data.token_store import Ragged, made_once, read_arrays, write_arrays
from .encode import SKIP_HINT, ImageExample, ImageStats, UnreadableImage
from .parquet import FileSpan
from .rows import SavedImage

CACHE_VERSION = 4
ARRAYS = ("input_ids", "input_ids.offsets", "labels", "labels.offsets", "buckets", "buckets.offsets",
          "images_end", "where", "where.offsets", "refs", "refs.offsets", "ref_kinds", "stats",
          "distortion", "bad_reason")
PATH, BYTES, SAVED, SPAN = 0, 1, 2, 3
"""How an image reference is stored (ref_kinds): a path (UTF-8), the image's bytes, a
rows.SavedImage or a parquet.FileSpan (its fields as JSON)."""
COUNTS = ("rows", "examples", "nothing_to_learn", "images", "bad_rows")
"""The ImageStats counts, in the order the stats array holds them."""


class CachedExamples(Sequence):
    """A split's ImageExamples, each made when it is read from the memory-mapped arrays."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.ids, self.labels = Ragged.read(arrays, "input_ids"), Ragged.read(arrays, "labels")
        self.buckets = Ragged.read(arrays, "buckets")
        """Each example's images' buckets (offsets: where each example's images start)."""
        self.refs, self.ref_kinds = Ragged.read(arrays, "refs"), arrays["ref_kinds"]
        self.where, self.images_end = Ragged.read(arrays, "where"), arrays["images_end"]
        self.distortion = arrays["distortion"]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> ImageExample:
        if not -len(self) <= i < len(self):
            raise IndexError(f"example {i} of {len(self)}")
        i %= len(self)
        first, last = int(self.buckets.offsets[i]), int(self.buckets.offsets[i + 1])
        refs = [_ref(self.refs[k].tobytes(), int(self.ref_kinds[k])) for k in range(first, last)]
        return ImageExample(self.ids[i], self.labels[i], refs, self.buckets[i].tolist(),
                            int(self.images_end[i]), self.where[i].tobytes().decode(),
                            float(self.distortion[i]))


def cached_split(cache_dir: str | Path, source_key: str, fmt: str, processing, options,
                 make: Callable[[], tuple[list[ImageExample], ImageStats]]):
    """(examples, ImageStats, the cache folder, whether read from it) of one split: `make()`d by
    the first process of the node to get here, memory-mapped by all."""
    folder = Path(cache_dir) / f"images-{key(source_key, fmt, processing, options)[:24]}"
    (examples, stats), cached = made_once(folder, _read, make, _write)
    if stats.bad_rows and not getattr(options, "skip_bad_rows", False):  # cached by a run with it
        raise UnreadableImage(f"{stats.bad_reason}; {SKIP_HINT}")
    return examples, stats, folder, cached


def key(source_key: str, fmt: str, processing, options) -> str:
    """A hash of what decides a split's examples (see the module docstring)."""
    template = getattr(processing.tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else repr(template)
    buckets = processing.buckets
    decided = [CACHE_VERSION, source_key, fmt, bool(options.assistant_only_loss),
               bool(options.completion_only_loss), hashlib.sha256(template.encode()).hexdigest(),
               [list(size) for size in buckets.sizes], buckets.tokens, list(processing.expansions),
               processing.image_token_id, len(processing.tokenizer)]
    return hashlib.sha256(json.dumps(decided).encode()).hexdigest()


def _bytes(items: list[bytes]) -> Ragged:
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum([len(item) for item in items], out=offsets[1:])
    return Ragged(np.frombuffer(b"".join(items), dtype=np.uint8), offsets)


def _stored(ref) -> tuple[bytes, int]:
    """(the bytes stored, the kind) of an image reference."""
    if isinstance(ref, str):
        return ref.encode(), PATH
    if isinstance(ref, SavedImage):
        return json.dumps(dataclasses.asdict(ref)).encode(), SAVED
    if isinstance(ref, FileSpan):
        return json.dumps(dataclasses.asdict(ref)).encode(), SPAN
    return bytes(ref), BYTES


def _ref(stored: bytes, kind: int):
    if kind == PATH:
        return stored.decode()
    if kind == SAVED:
        return SavedImage(**json.loads(stored))
    if kind == SPAN:
        return FileSpan(**json.loads(stored))
    return stored


def _write(folder: Path, made) -> None:
    examples, stats = made
    refs = [_stored(ref) for e in examples for ref in e.images]
    write_arrays(folder, {
        **Ragged.of([e.input_ids for e in examples]).arrays("input_ids"),
        **Ragged.of([e.labels for e in examples]).arrays("labels"),
        **Ragged.of([e.buckets for e in examples]).arrays("buckets"),
        "images_end": np.asarray([e.images_end for e in examples], dtype=np.int64),
        **_bytes([e.where.encode() for e in examples]).arrays("where"),
        **_bytes([stored for stored, _ in refs]).arrays("refs"),
        "ref_kinds": np.asarray([kind for _, kind in refs], dtype=np.int8),
        "distortion": np.asarray([e.distortion for e in examples], dtype=np.float32),
        "stats": np.asarray([getattr(stats, name) for name in COUNTS], dtype=np.int64),
        "bad_reason": np.frombuffer(stats.bad_reason.encode(), dtype=np.uint8)})


def _read(folder: Path):
    """(CachedExamples, ImageStats), or None when the cache is missing or damaged."""
    arrays = read_arrays(folder, ARRAYS)
    if arrays is None:
        return None
    examples = CachedExamples(arrays)
    count = len(examples)
    whole = (len(examples.labels) == len(examples.buckets) == len(examples.where)
             == len(examples.images_end) == len(examples.distortion) == count
             and arrays["stats"].shape == (len(COUNTS),)
             and np.array_equal(examples.ids.offsets, examples.labels.offsets)
             and len(examples.refs) == len(examples.ref_kinds) == examples.buckets.offsets[-1]
             and examples.ids.offsets[-1] == len(examples.ids.values)
             and examples.refs.offsets[-1] == len(examples.refs.values))
    if not whole:
        return None
    counts = dict(zip(COUNTS, map(int, arrays["stats"])))
    return examples, ImageStats(**counts, bad_reason=arrays["bad_reason"].tobytes().decode())
