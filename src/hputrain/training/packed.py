"""Packed batches on their way into the model: attention kept inside each example.

A packed block (data/packing.py) carries `seq_lens`, the lengths of the examples it holds. Just
before the model is called, on the device, they become the additive block-causal mask passed as
`attention_mask` (the block's `position_ids`, restarting at each example, go in as they are), and
`seq_lens` itself never reaches the model.

Why here and not in a collator: the mask must be in the dtype the attention computes in (eager
attention adds it to the scores; a float32 mask added to bfloat16 scores under autocast promotes
them to float32, and a bfloat16 minimum built on the host would be wrong for a float32 model).
That dtype is known only to the Trainer (its precision plugin and the model), not to the data
workers; and a [batch, 1, S, S] float mask is S times larger than the lengths it comes from, so
building it on the device also saves the host-to-device copy. Everything here is device ops on
tensors of static shape (cumsum, scatter, comparisons): nothing is read back to the host, so in
lazy mode the step's graph is the same every step.

An image-text-to-text model's blocks (data/vision/) get two things more, from the model's family
(models/vision.py):
- Gemma 3 (bidirectional_images): the tokens of one image see each other both ways, as
  transformers' own mask for a training batch does (token_type_ids: a contiguous run of image
  tokens is one group, get_block_sequence_ids_for_mask in its modeling file). The runs are found
  on the device from `input_ids == image_token_id`, so the batch needs no token_type_ids.
- a family whose text model has sliding-window layers (Gemma 3) gets one mask per layer type,
  {"full_attention": ..., "sliding_attention": ...}, the dict its forward takes as it is: given one
  4-D mask, transformers uses it unchanged in every layer, so a sliding layer would see past its
  window in a block longer than the window. The sliding one also drops the keys `sliding_window`
  or more tokens back (transformers' sliding_window_overlay), after the image rule, as its
  create_masks_for_vision_model does.
- Qwen's 3-D positions come from the data as [batch, 3, length]; its forward takes them as
  [3, batch, length] (rows: temporal, height, width) and then builds no mask of its own from them.
"""
from __future__ import annotations

import torch

from ..data.batching import base_model
from ..data.packing import block_causal_mask
from ..errors import InputError
from ..models.vision import image_token_id, vision_family

SEQ_LENS = "seq_lens"
"""The batch key of a packed block's example lengths."""

PACKING_KEYS = frozenset({SEQ_LENS})
"""Batch keys the model never takes but the Trainer keeps in batches (see `model_inputs`)."""


class PackedInputs:
    """Turns a packed batch into the model's inputs (see the module docstring); other batches pass
    through unchanged."""

    def __init__(self, model: torch.nn.Module, precision, inputs: frozenset[str] | None) -> None:
        self.dtype = mask_dtype(model, precision)
        self.inputs = inputs
        self.images = ImageAttention.of(getattr(base_model(model), "config", None))

    def __call__(self, batch: dict) -> dict:
        if SEQ_LENS not in batch:
            return batch
        if self.inputs is not None and not {"attention_mask", "position_ids"} <= self.inputs:
            raise InputError("packed blocks need a model whose forward takes attention_mask and "
                             "position_ids (to keep attention inside each example): train with "
                             "--no-packing")
        batch = dict(batch)
        seq_lens = batch.pop(SEQ_LENS)
        if self.images is None:
            batch["attention_mask"] = block_causal_mask(seq_lens, batch["input_ids"].shape[-1], self.dtype)
            return batch
        return self.images(batch, seq_lens, self.dtype)


class ImageAttention:
    """The mask and positions of an image-text-to-text family's packed blocks (see the module
    docstring)."""

    def __init__(self, image_token: int | None, sliding_window: int | None, positions: str) -> None:
        self.image_token = image_token
        """The image token id whose runs attend both ways (None: causal, as text)."""
        self.sliding_window = sliding_window
        """The text model's sliding window, when some of its layers have one."""
        self.positions = positions

    @classmethod
    def of(cls, config) -> ImageAttention | None:
        """For a covered family's config, else None (text models keep the plain mask)."""
        family = vision_family(config)
        if family is None:
            return None
        text = config.get_text_config()
        sliding = ("sliding_attention" in (getattr(text, "layer_types", None) or ())
                   and getattr(text, "sliding_window", None) or None)
        return cls(image_token_id(config) if family.bidirectional_images else None, sliding,
                   family.positions)

    def __call__(self, batch: dict, seq_lens: torch.Tensor, dtype: torch.dtype) -> dict:
        input_ids = batch["input_ids"]
        size = input_ids.shape[-1]
        allowed = block_causal_mask(seq_lens, size)
        if self.image_token is not None:
            allowed = allowed | image_runs(input_ids, self.image_token)[:, None]
        position_ids = batch.get("position_ids")
        if self.positions == "3d" and position_ids is not None and position_ids.dim() == 3:
            batch["position_ids"] = position_ids.transpose(0, 1)  # [3, batch, length]
        if self.sliding_window is None or self.sliding_window >= size:
            batch["attention_mask"] = additive(allowed, dtype)
            return batch
        at = torch.arange(size, device=input_ids.device)
        window = (at[:, None] - at[None, :]) < self.sliding_window  # kv > q - window
        batch["attention_mask"] = {"full_attention": additive(allowed, dtype),
                                   "sliding_attention": additive(allowed & window, dtype)}
        return batch


def image_runs(input_ids: torch.Tensor, image_token: int) -> torch.Tensor:
    """[batch, length, length] True where two tokens lie in one contiguous run of `image_token`
    (one image): transformers' get_block_sequence_ids_for_mask rule, in ops of static shape
    (no torch.where, no `~`: the CPU lazy backend runs those eagerly)."""
    image = (input_ids == image_token).long()
    before = torch.cat([torch.zeros_like(image[:, :1]), image[:, :-1]], dim=-1)
    starts = (image - before).clamp(min=0)
    group = starts.cumsum(-1) * image  # 1, 2, ... per run; 0 off the images
    return (group[:, :, None] == group[:, None, :]) & (group[:, :, None] > 0)


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as block_causal_mask gives it in `dtype`."""
    if dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        allowed.eq(False), torch.finfo(dtype).min)


def mask_dtype(model: torch.nn.Module, precision) -> torch.dtype:
    """The dtype attention scores are computed in: the autocast dtype under bf16 (or fp16)
    autocast, else the model's floating-point parameter dtype."""
    if precision.compute_dtype in (torch.bfloat16, torch.float16):
        return precision.compute_dtype
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32
