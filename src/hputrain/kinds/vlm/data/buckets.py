"""Pixel buckets: the image sizes a run's images are resized into, each an image of at most the
slot's count of image tokens, so that the vision tower and the packed blocks keep one static shape.

Fixed-size families (LLaVA, Gemma 3): one bucket, the size the image processor makes of every
image (CLIP's centre crop, Gemma's resize). Images are handed to the image processor as they are,
so their pixel values are exactly what the processor makes at inference. --image-buckets with
them may name only that size; anything else is one line (their processor has one size).

Dynamic-resolution families (Qwen2.5-VL): sizes in multiples of the patch x merge (14 x 2 = 28)
within the image processor's min_pixels..max_pixels (there its own resize leaves an image be),
tokens = (width / 28) x (height / 28). By default (`default_sizes`), the aspect buckets of
diffusion training: the square of the largest square count up to 256 tokens the pixel limits
allow (448x448, 256 tokens, with Qwen's own settings), then wide and tall sizes of at most as
many tokens whose aspect ratios follow each other so closely that every image from 1:10 to 10:1
is resized by at most 10% in its aspect ratio (31 buckets at 256 tokens; 210 to 256 tokens each).
Each image goes into the bucket nearest its aspect ratio (`Buckets.choose`) and is resized there
with the processor's resampling filter; `resize_to_bucket` is that rule for one image, which
`hputrain generate` applies too, so that a question about an image sees it as training did.

Buckets of fewer tokens than the slot leave the rest of its patches blank: the vision tower runs
every slot at the slot's count (kinds/vlm/execution.py masks the blank patches out), so that all the
buckets of a run are one shape, one graph, whatever their number. An image whose aspect ratio is
more than MAX_DISTORTION from its bucket's (past 10:1, or a --image-buckets set with gaps) is
counted and named in a warning (`Buckets.distortion`).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from ....errors import InputError

DEFAULT_MAX_TOKENS = 256
"""The default buckets of a dynamic-resolution family give at most this many tokens an image."""

MAX_DISTORTION = 0.10
"""The most an image's aspect ratio is changed by the default buckets (from 1:DEFAULT_RATIO to
DEFAULT_RATIO:1); an image changed more is warned of."""

DEFAULT_RATIO = 10.0
"""The widest (and tallest) aspect ratio the default buckets keep within MAX_DISTORTION."""

RATIO_LIMIT = DEFAULT_RATIO * (1 + MAX_DISTORTION)
"""The widest aspect ratio of a bucket (11:1): Qwen2.5-VL's static tower plans its window slots
for no wider an image (kinds/vlm/execution.py, `most_windows`), so --image-buckets beyond it is one
line."""

MIN_FILL = 0.75
"""A default bucket gives at least this share of the slot's tokens (where the pixel limits allow)."""


@dataclass(frozen=True)
class Buckets:
    """The pixel buckets of a run."""

    sizes: tuple[tuple[int, int], ...]
    """(width, height) of each bucket."""
    tokens: int
    """Image tokens of an image slot: the most of any bucket (every bucket's, for fixed-size
    families and equal counts)."""
    resizes: bool
    """True: images are resized to their bucket here (dynamic resolution); False: the image
    processor resizes every image to its one size itself."""
    resample: int = 3
    """PIL's resampling filter for the resize (the image processor's; 3 is bicubic)."""
    counts: tuple[int, ...] = ()
    """Image tokens of each bucket (empty: `tokens` each)."""

    def __post_init__(self) -> None:
        if not self.counts:
            object.__setattr__(self, "counts", (self.tokens,) * len(self.sizes))

    def choose(self, width: int, height: int) -> int:
        """The index of the bucket nearest in aspect ratio to a width x height image (the first
        of equally near ones)."""
        shape = math.log(width / height)
        return min(range(len(self.sizes)),
                   key=lambda i: abs(shape - math.log(self.sizes[i][0] / self.sizes[i][1])))

    def distortion(self, width: int, height: int, index: int | None = None) -> float:
        """How much a width x height image's aspect ratio changes in bucket `index` (its own,
        `choose`, by default): 0.1 when one side is stretched 10% against the other. Zero where the
        image processor resizes every image itself (its own rule, not a bucket's)."""
        if not self.resizes:
            return 0.0
        bucket = self.sizes[self.choose(width, height) if index is None else index]
        return math.exp(abs(math.log(width / height) - math.log(bucket[0] / bucket[1]))) - 1

    def resize(self, image, index: int):
        """`image` (PIL) as the image processor should get it for bucket `index`: resized to the
        bucket's size, or as it is where the processor resizes it itself."""
        if not self.resizes or image.size == self.sizes[index]:
            return image
        return image.resize(self.sizes[index], resample=self.resample)

    def describe(self) -> str:
        """"3 pixel buckets (336x336, 448x252, 252x448) of 144 image tokens each", or for many,
        their span, their token counts, how closely they keep aspect ratios, and the one image
        slot (one shape, one graph) they all run in."""
        low, high = min(self.counts), max(self.counts)
        if len(self.sizes) <= 3:
            names = ", ".join(f"{w}x{h}" for w, h in self.sizes)
            count = f"{len(self.sizes)} pixel buckets" if len(self.sizes) > 1 else "1 pixel bucket"
        else:
            tall, wide = (min(self.sizes, key=lambda s: s[0] / s[1]), max(self.sizes, key=lambda s: s[0] / s[1]))
            names = (f"{self.sizes[0][0]}x{self.sizes[0][1]}, ... from {tall[0]}x{tall[1]} to "
                     f"{wide[0]}x{wide[1]}")
            count = f"{len(self.sizes)} pixel buckets"
        if low == high:
            words = f"{count} ({names}) of {high} image tokens each"
        else:
            words = f"{count} ({names}) of {low} to {high} image tokens"
        kept = self.kept_within()
        if kept is not None:
            words += f", aspect ratios kept within {kept[1]:.0%} from 1:{kept[0]:g} to {kept[0]:g}:1"
        if len(self.sizes) > 1:  # (kinds/vlm/data/blocks.py pads each image's patches to the slot)
            words += f"; each in an image slot of {self.tokens} tokens, so the buckets add no graph"
        return words

    def kept_within(self) -> tuple[float, float] | None:
        """(R, the most an image's aspect ratio is changed from 1:R to R:1), for buckets that resize
        and have more than one shape; R is DEFAULT_RATIO, or the widest bucket's ratio if less."""
        if not self.resizes or len(self.sizes) < 2:
            return None
        ratios = [w / h for w, h in self.sizes]
        reach = min(DEFAULT_RATIO, max(max(ratios), 1 / min(ratios)))
        points = [math.exp(math.log(reach) * (2 * i / 400 - 1)) for i in range(401)]
        points += [r for r in ratios if 1 / reach <= r <= reach]
        edges = sorted(ratios)
        points += [math.sqrt(a * b) for a, b in zip(edges, edges[1:])]  # the worst places
        worst = max(min(abs(math.log(p / r)) for r in ratios) for p in points if 1 / reach <= p <= reach)
        return round(reach, 1), math.exp(worst) - 1


def resize_to_bucket(image, buckets: Buckets):
    """`image` (an RGB PIL image, oriented and flattened as the run's image reader gives it) as
    training hands it to the image processor: resized into the bucket nearest its aspect ratio
    (`Buckets.choose`, with the processor's resampling filter), or as it is for a fixed-size
    family, whose processor resizes every image itself. The one rule of training's blocks
    (encode.Processing.pixels) and of `hputrain generate`'s questions, so that a model is asked
    about an image as it learned from it. `buckets`: the run's (encode.Processing.buckets,
    from --image-buckets or the defaults)."""
    return buckets.resize(image, buckets.choose(*image.size))


@functools.lru_cache(maxsize=64)
def most_windows(tokens: int, side: int) -> int:
    """The most attention windows of `side` x `side` merged tokens (the last of a row or column
    partial) an image of a bucket shape of at most `tokens` tokens has: every shape a x b with
    a * b <= tokens and an aspect ratio up to RATIO_LIMIT, as make_buckets allows them. Qwen2.5-VL's
    static tower gives each image slot this many window places (kinds/vlm/execution.py)."""
    most = 1
    for b in range(1, math.isqrt(tokens) + 1):
        for a in range(b, tokens // b + 1):
            if a / b <= RATIO_LIMIT:
                most = max(most, -(-a // side) * -(-b // side))
    return most


def parse_size(text: str) -> tuple[int, int]:
    """"336x252" as (336, 252); anything else is one line."""
    width, sep, height = str(text).lower().partition("x")
    if not sep or not width.strip().isdigit() or not height.strip().isdigit() \
            or int(width) < 1 or int(height) < 1:
        raise InputError(f"--image-buckets {text!r} is not a size: give WIDTHxHEIGHT in pixels, "
                         "e.g. 336x336")
    return int(width), int(height)


def make_buckets(family, image_processor, image_buckets: list[str] | None = None,
                 tokens_of: Callable[[int, int], int] | None = None) -> Buckets:
    """The buckets of `family` (models.vision.VisionFamily) with its image processor, from
    --image-buckets (["WxH", ...]) or the defaults. `tokens_of(width, height)`: the image tokens
    of an image of that size as the processor expands it (the family's grid rule by default,
    for dynamic resolution; needed for fixed-size families)."""
    resample = int(getattr(image_processor, "resample", None) or 3)
    if family.fixed_size:
        size = fixed_size(image_processor)
        if image_buckets:
            asked = [parse_size(text) for text in image_buckets]
            if any(s != size for s in asked):
                raise InputError(f"--image-buckets {','.join(image_buckets)}: {family.name}'s image "
                                 f"processor makes every image {size[0]}x{size[1]}, its only size: "
                                 "leave --image-buckets out")
        if tokens_of is None:
            raise ValueError("a fixed-size family's buckets need tokens_of (the processor's count)")
        return Buckets((size,), tokens_of(*size), resizes=False, resample=resample)
    factor, low, high = pixel_limits(image_processor)
    tokens_of = tokens_of or (lambda w, h: (w // factor) * (h // factor))
    if image_buckets:
        sizes = tuple(dict.fromkeys(parse_size(text) for text in image_buckets))
        for width, height in sizes:
            _check_size(width, height, factor, low, high, family.name)
    else:
        sizes = default_sizes(factor, low, high)
    counts = tuple(tokens_of(w, h) for w, h in sizes)
    return Buckets(sizes, max(counts), resizes=True, resample=resample, counts=counts)


def fixed_size(image_processor) -> tuple[int, int]:
    """(width, height) of what a fixed-size image processor makes of any image: read from its
    output on a blank image (whatever its settings: crop size, size, padding)."""
    from PIL import Image

    out = image_processor(images=[Image.new("RGB", (64, 48))], return_tensors="np")
    shape = out["pixel_values"].shape
    return int(shape[-1]), int(shape[-2])


def pixel_limits(image_processor) -> tuple[int, int, int]:
    """(patch x merge, min_pixels, max_pixels) of a dynamic-resolution image processor."""
    factor = int(image_processor.patch_size) * int(getattr(image_processor, "merge_size", 1) or 1)
    size = getattr(image_processor, "size", None) or {}
    get = size.get if isinstance(size, dict) else (lambda key: getattr(size, key, None))
    low = getattr(image_processor, "min_pixels", None) or get("shortest_edge") or get("min_pixels")
    high = getattr(image_processor, "max_pixels", None) or get("longest_edge") or get("max_pixels")
    return factor, int(low or factor * factor), int(high or factor * factor * DEFAULT_MAX_TOKENS)


def _check_size(width: int, height: int, factor: int, low: int, high: int, name: str) -> None:
    if width % factor or height % factor:
        raise InputError(f"--image-buckets {width}x{height}: {name}'s bucket sides must be multiples "
                         f"of {factor} (patch x merge): e.g. {_round(width, factor)}x"
                         f"{_round(height, factor)}")
    if max(width / height, height / width) > RATIO_LIMIT:
        raise InputError(f"--image-buckets {width}x{height}: an aspect ratio of "
                         f"{max(width / height, height / width):.1f}:1, past the {RATIO_LIMIT:g}:1 "
                         f"{name}'s vision tower is planned for: choose a squarer size")
    if not low <= width * height <= high:
        raise InputError(f"--image-buckets {width}x{height}: {width * height} pixels, outside the image "
                         f"processor's min_pixels..max_pixels ({low}..{high}), where it would resize "
                         "the image again: choose a size within them")


def _round(value: int, factor: int) -> int:
    return max(factor, round(value / factor) * factor)


def default_sizes(factor: int, low: int, high: int) -> tuple[tuple[int, int], ...]:
    """The default buckets (see the module docstring): the square of the largest square count
    k * k up to DEFAULT_MAX_TOKENS within the pixel limits, then wide shapes a x b (each with its
    tall twin b x a) of at most k * k tokens and at least MIN_FILL of them, chosen from the
    squarest on (`_wider`) so that every aspect ratio up to DEFAULT_RATIO is within
    MAX_DISTORTION of one; where the token count is too small for that (a few tokens a side),
    the nearest shapes there are, leaving gaps (`Buckets.kept_within` says how wide)."""
    cell = factor * factor
    counts = [k for k in range(int(math.isqrt(DEFAULT_MAX_TOKENS)), 0, -1)
              if low <= k * k * cell <= high]
    if not counts:
        raise InputError(f"the image processor's pixel limits ({low}..{high}) hold no square of "
                         f"{factor}-pixel cells: give --image-buckets")
    k = counts[0]
    most = k * k
    shapes = [(a, b) for b in range(1, k + 1) for a in range(b + 1, most // b + 1)
              if a * b >= max(MIN_FILL * most, low / cell) and a / b <= RATIO_LIMIT]
    wide, reach = [], 1 + MAX_DISTORTION  # aspect ratios up to reach are kept within the limit
    while reach < DEFAULT_RATIO:
        shape = _wider(shapes, wide[-1] if wide else (k, k), reach)
        if shape is None:
            break
        wide.append(shape)
        reach = shape[0] / shape[1] * (1 + MAX_DISTORTION)
    sizes = [(k * factor, k * factor)]
    for a, b in wide:
        sizes += [(a * factor, b * factor), (b * factor, a * factor)]
    return tuple(sizes)


def _wider(shapes: list[tuple[int, int]], last: tuple[int, int], reach: float) -> tuple[int, int] | None:
    """The next wide shape after `last`, where the ratios up to `reach` are kept: of the shapes
    that keep the ratio `reach` within the limit, the widest among those of nearly the most tokens
    (within MAX_DISTORTION of it); where none does (a gap), the squarest wider than that."""
    limit = reach * (1 + MAX_DISTORTION)
    keeping = [s for s in shapes if last[0] / last[1] < s[0] / s[1] <= limit]
    if keeping:
        most = max(a * b for a, b in keeping)
        near = [s for s in keeping if s[0] * s[1] >= most * (1 - MAX_DISTORTION)]
        return max(near, key=lambda s: (s[0] / s[1], s[0] * s[1]))
    beyond = [s for s in shapes if s[0] / s[1] > limit]
    if not beyond:
        return None
    return min(beyond, key=lambda s: (s[0] / s[1], -s[0] * s[1]))
