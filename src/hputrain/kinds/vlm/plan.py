"""What `hputrain plan` traces for an image-text-to-text model (rehearsal/plan/__init__.py traces its step
like any other's): the batch the run feeds it, and the vision tower's share of the peak.

The batch is the run's (kinds/vlm/data/: the block format of issue 41, stacked by its
ImageCollator): blocks of S tokens, each holding K whole examples of one image each (K the image
slots, --image-slots, else as many as fill half the block with image tokens, at most 8), every
slot a real image (the peak), the image tokens expanded, labels on the text only, positions
restarting per example (Qwen's as 3 rows), seq_lens; pixel_values [B*K, C, H, W] (Qwen: the
[B*K*P, D] patches with image_grid_thw [B*K, 3]). One image's tokens and pixel shape are the
folder's own processing of its first pixel bucket (data.vision.encode.Processing, --image-buckets
honoured), or, where the folder holds no processor (a folder of config.json alone), the
config's: the tower's image size (LLaVA's image_seq_length tokens, Gemma 3's mm_tokens_per_image)
or, for Qwen2.5-VL, a 448x448 bucket (256 tokens, whole 112-pixel windows). --no-packing: one
example (of one image) a block.

What trains is the recipe's (recipes/hf/__init__.py step_model: hf_vision.prepare_parts): the tower frozen
unless --train-vision-tower, the projector trained in full fine-tuning and under LoRA only with
--train-projector, LoRA on the language model (and the tower with --train-vision-tower).

The vision tower's share (`VisionShare`, in the plan's header and JSON): its parameters (frozen
or trained, with the gradients and AdamW moments of the trained ones), the image tokens of a
micro-batch, and the activations its forward leaves alive for backward, read from the trace
(MemTracker's snapshots before and after the tower's forward): nearly nothing when it is frozen.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import InputError
from .family import image_token_id, vision_family
from ...training.loss import IGNORE_INDEX

DEFAULT_SLOTS_CAP = 8
"""The most image slots a block gets by default (without --image-slots)."""

QWEN_TOKENS = 256
"""A config-only Qwen2.5-VL plan's image tokens (a 448x448 bucket: the default cap's square)."""


@dataclass(frozen=True)
class ImageShape:
    """One image of the run, as the model gets it."""

    tokens: int
    """Image tokens it becomes."""
    pixels: tuple[int, ...]
    """Its pixel_values' shape: (C, H, W), or Qwen's (P, D) patches."""
    grid: tuple[int, int, int] | None = None
    """Qwen's (t, h, w) patch grid."""
    source: str = ""
    """Where the shape comes from, for the plan's header."""


@dataclass
class VisionShare:
    """The vision tower's part of the planned step."""

    family: str
    tower_parameters: int
    """Parameters of the tower (the projector not included, even where it sits inside the
    tower: Qwen's merger)."""
    tower_trained: bool
    tower_bytes: int
    """Its weights, and for a trained tower their gradients and AdamW's two moments."""
    image_tokens: int
    """Image tokens of one micro-batch (B * K * tokens per image)."""
    tokens: int
    """All tokens of one micro-batch."""
    images: int
    """Images of one micro-batch (B * K)."""
    activations: int | None = None
    """What the tower's forward leaves alive for backward (its output included); None where the
    trace did not follow the tower alone (fsdp)."""
    shape: ImageShape | None = None
    slots: int = 0

    def as_json(self) -> dict:
        return {"family": self.family, "tower_parameters": self.tower_parameters,
                "tower_trained": self.tower_trained, "tower_bytes": self.tower_bytes,
                "tower_activation_bytes": self.activations, "images": self.images,
                "image_slots": self.slots, "image_tokens": self.image_tokens, "tokens": self.tokens,
                "tokens_per_image": self.shape.tokens if self.shape else 0}

    def describe(self) -> str:
        """One line for the plan's header."""
        state = (f"trained: {_size(self.tower_bytes)} with its gradients and AdamW moments"
                 if self.tower_trained else f"frozen: {_size(self.tower_bytes)} of weights")
        return (f"vision: {self.family}, tower of {_millions(self.tower_parameters)} parameters "
                f"({state}); "
                f"{self.images} images a micro-batch ({self.slots} slot"
                f"{'s' if self.slots > 1 else ''} a block, {self.shape.tokens} tokens each from "
                f"{self.shape.source}): {self.image_tokens:,} of its {self.tokens:,} tokens; the "
                "tower's activations "
                + (_size(self.activations) if self.activations is not None else "not traced alone"))


def vlm_step(step):
    """`step` (rehearsal.plan.StepModel of an image-text-to-text model, its `vision` the recipe's
    settings: kinds/vlm/step.py) with the run's image blocks as its batch and a
    VisionStep as its `vision`."""
    settings = step.vision
    config, block = settings["config"], settings["block"]
    shape = image_shape(settings["folder"], config, settings["image_buckets"])
    fill = block // 2 // max(1, shape.tokens)  # half the block's tokens images
    slots = settings["image_slots"] or max(1, min(DEFAULT_SLOTS_CAP, fill))
    if not settings["packing"]:
        slots = 1
    if slots * (shape.tokens + 2) > block:
        raise InputError(f"--block-size {block} holds no {slots} images of {shape.tokens} tokens "
                         f"each: give a larger --block-size, or fewer --image-slots")
    blocks = ImageBlocksOfShape(config, shape, slots, block, packed=settings["packing"])
    vision = VisionStep(blocks, settings["train_vision_tower"])
    name = (f"{step.name}; {slots} image slot{'s' if slots > 1 else ''} a block of "
            f"{shape.tokens} tokens each")
    return dataclasses.replace(step, batch=blocks.batch, vision=vision, name=name)


def image_shape(folder: Path, config, image_buckets: list[str] | None = None) -> ImageShape:
    """One image's tokens and pixel shape: the folder's processing of its first bucket, else the
    config's (module docstring)."""
    from .data.encode import Processing

    try:
        processing = Processing.load(folder, config, image_buckets)
    except InputError:
        raise
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        return _config_shape(config)
    blank = processing.blank(0)
    grid = blank.get("image_grid_thw")
    width, height = processing.buckets.sizes[0]
    return ImageShape(processing.buckets.tokens, tuple(blank["pixel_values"].shape),
                      tuple(int(v) for v in grid) if grid is not None else None,
                      f"the folder's image processor ({width}x{height})")


def _config_shape(config) -> ImageShape:
    vision = config.vision_config
    family = vision_family(config)
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None) or 3
    if family.positions == "3d":
        patch, merge = vision.patch_size, vision.spatial_merge_size
        side = int(QWEN_TOKENS ** 0.5) * merge  # in patches
        temporal = getattr(vision, "temporal_patch_size", 2)
        return ImageShape(QWEN_TOKENS, (side * side, channels * temporal * patch * patch),
                          (1, side, side), f"config.json ({side * patch}x{side * patch})")
    size = vision.image_size
    tokens = (getattr(config, "image_seq_length", None)
              or getattr(config, "mm_tokens_per_image", None) or (size // vision.patch_size) ** 2)
    return ImageShape(int(tokens), (channels, size, size), None, f"config.json ({size}x{size})")


class ImageBlocksOfShape:
    """Blocks of the run's format (kinds/vlm/data/blocks.py) full of examples of one image each, and
    their batch by the run's collator (data.vision.blocks.ImageCollator)."""

    def __init__(self, config, shape: ImageShape, slots: int, block: int,
                 packed: bool = True) -> None:
        self.config, self.shape, self.slots, self.block = config, shape, slots, block
        self.packed = packed
        self.image_token = image_token_id(config)
        self.vocab = config.get_text_config().vocab_size
        self.three_d = vision_family(config).positions == "3d"

    def blocks(self, size: int) -> list[dict]:
        """`size` blocks (random text, every image slot real)."""
        return [self._block() for _ in range(size)]

    def batch(self, size: int) -> dict:
        from .data.blocks import ImageCollator

        return ImageCollator(0)(self.blocks(size))

    def _block(self) -> dict:
        examples = self.slots
        lengths = [self.block // examples] * examples
        lengths[-1] += self.block - sum(lengths)
        ids = torch.randint(0, self.vocab, (self.block,))
        ids[ids == self.image_token] = 0
        labels = ids.clone()
        start = 0
        for length in lengths:
            first_image = start + 1  # one text token, then the image, then text
            ids[first_image:first_image + self.shape.tokens] = self.image_token
            labels[first_image - 1:first_image + self.shape.tokens] = IGNORE_INDEX
            start += length
        positions = torch.cat([torch.arange(n) for n in lengths])
        if self.three_d:  # text-like rows: the same shape and dtype as Qwen's rope index
            positions = positions.expand(3, -1).clone()
        seq_lens = torch.zeros(self.block, dtype=torch.long)
        seq_lens[:examples] = torch.tensor(lengths)
        found = {"input_ids": ids, "labels": labels, "position_ids": positions,
                 "seq_lens": seq_lens, "image_count": torch.tensor(self.slots)}
        pixels = torch.randn(self.slots, *self.shape.pixels)
        if self.shape.grid is None:
            return found | {"pixel_values": pixels}
        return found | {"pixel_values": pixels.flatten(0, 1),
                        "image_grid_thw": torch.tensor([self.shape.grid] * self.slots)}


class VisionStep:
    """StepModel's `vision` after vlm_step: the blocks (for a measured run: the blocks and the
    collator) and the tower's share of a traced step."""

    def __init__(self, blocks: ImageBlocksOfShape, train_tower: bool) -> None:
        self.blocks, self.train_tower = blocks, train_tower

    def collator(self):
        from .data.blocks import ImageCollator

        return ImageCollator(0)

    def tracing(self):
        """What a trace on fake tensors needs of an image step (host_split_points)."""
        return host_split_points()

    def share(self, model: torch.nn.Module, counting, batch: dict, ranks: int = 1) -> VisionShare:
        """The tower's share of the step `counting` (the plan's tracker) saw on `batch`."""
        config = _config(model)
        family = vision_family(config)
        tower = find_tower(model, family.tower)
        inside = family.projector.removeprefix(family.tower + ".")  # Qwen's merger is in its tower
        params = [p for name, p in (tower.named_parameters() if tower is not None else ())
                  if inside == family.projector or not (name + ".").startswith(inside + ".")]
        count = sum(_numel(p) for p in params)
        trained = [p for p in params if p.requires_grad]
        weights = sum(_numel(p) * p.element_size() for p in params)
        # a trained weight: its gradient and AdamW's two float32 moments
        extra = sum(_numel(p) * (p.element_size() + 8) for p in trained)
        images = int(batch["input_ids"].shape[0]) * self.blocks.slots
        return VisionShare(family.name, count, bool(trained), (weights + extra) // ranks,
                           images * self.blocks.shape.tokens, int(batch["input_ids"].numel()),
                           images, tower_activations(counting, tower), self.blocks.shape,
                           self.blocks.slots)


@contextlib.contextmanager
def host_split_points():
    """For the time of a trace on fake tensors: Qwen2.5-VL's static tower (kinds/vlm/execution.py
    `TowerLayout`) with the split points it hands its layers (`cu_seqlens`, `cu_window_seqlens`,
    which depend on the shapes alone) as real host tensors, as in the run."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from . import execution as vision

    original = vision.TowerLayout.split_points_of

    def split_points_of(patches: int, per_image: int):
        with unset_fake_temporarily():
            return original(patches, per_image)

    vision.TowerLayout.split_points_of = staticmethod(split_points_of)
    try:
        yield
    finally:
        vision.TowerLayout.split_points_of = staticmethod(original)


def find_tower(model: torch.nn.Module, attribute: str) -> torch.nn.Module | None:
    """The vision tower inside `model` (under PEFT's and fsdp's wrappers): the module of the
    shortest name whose last part is the family's tower attribute."""
    found = [(name, module) for name, module in model.named_modules()
             if name.rsplit(".", 1)[-1] == attribute]
    return min(found, key=lambda item: len(item[0]))[1] if found else None


def tower_activations(counting, tower) -> int | None:
    """The activation bytes alive after the tower's first forward less those before it
    (MemTracker's per-module snapshots of the traced step; a later call is activation
    checkpointing's recompute in backward); None where the tracker kept no snapshot of the
    tower (fsdp's tracker follows its own units)."""
    stats = getattr(counting, "memory_tracking", {}).get(tower) if tower is not None else None
    if stats is None:
        return None
    from torch.distributed._tools.mem_tracker import _ModState

    before = stats.snapshots.get(_ModState.PRE_FW, [])
    after = stats.snapshots.get(_ModState.POST_FW, [])
    if not before or not after:
        return None
    return max(0, _activations(after[0]) - _activations(before[0]))


def _activations(snapshot: dict) -> int:
    return sum(int(value) for per_device in snapshot.values() for kind, value in per_device.items()
               if getattr(kind, "name", str(kind)) == "ACT")


def _config(model):
    from ...data.batching import base_model

    return base_model(model).config


def _numel(p: torch.Tensor) -> int:
    return int(p.numel())  # an fsdp-sharded parameter (DTensor): the whole one's


def _millions(n: int) -> str:
    return f"{n / 1e6:,.1f}M" if n >= 1e6 else f"{n:,}"


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
