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

Sliding-window layers: given one 4-D mask, transformers uses it unchanged in every layer, so a
sliding layer would see past its window in a block longer than the window. A model whose layers
are typed (`layer_types`: Gemma 2 and 3, GPT-OSS, Cohere 2, OLMo 3, ...) with sliding ones among
them gets one mask per layer type, {"full_attention": ..., "sliding_attention": ...}, the dict its
forward takes as it is; the sliding one also drops the keys `sliding_window` or more tokens back
(transformers' sliding_window_overlay). A model whose every layer slides without types (Mistral)
gets the window in its one mask. A window at least the block's length changes nothing.

An image-text-to-text model's blocks (kinds/vlm/data/) get two things more, from the model's kind
(models/kind.py's `block_mask`: kinds/vlm/family.py says which family does what):
- Gemma 3 (bidirectional_images): the tokens of one image see each other both ways, as
  transformers' own mask for a training batch does (token_type_ids: a contiguous run of image
  tokens is one group, get_block_sequence_ids_for_mask in its modeling file), before the window
  is applied, as its create_masks_for_vision_model does. The runs are found on the device from
  `input_ids == image_token_id`, so the batch needs no token_type_ids.
- Qwen's 3-D positions come from the data as [batch, 3, length]; its forward takes them as
  [3, batch, length] (rows: temporal, height, width) and then builds no mask of its own from them.
"""
from __future__ import annotations

import torch

from ..data.batching import base_model
from ..data.packing import block_causal_mask
from ..errors import InputError
from ..models.kind import kinds_of, registered

SEQ_LENS = "seq_lens"
"""The batch key of a packed block's example lengths."""



def packing_keys() -> frozenset[str]:
    """Batch keys the model never takes but the Trainer keeps in samples: `seq_lens`, and the
    kinds' (an image block's image count, read by the image collator)."""
    return frozenset({SEQ_LENS}).union(*(kind.packing_keys() for kind in registered()))


class PackedInputs:
    """Turns a packed batch into the model's inputs (see the module docstring); other batches pass
    through unchanged."""

    def __init__(self, model: torch.nn.Module, precision, inputs: frozenset[str] | None) -> None:
        self.dtype = mask_dtype(model, precision)
        self.inputs = inputs
        self.mask = BlockMask.of(getattr(base_model(model), "config", None))

    def __call__(self, batch: dict) -> dict:
        if SEQ_LENS not in batch:
            return batch
        if self.inputs is not None and not {"attention_mask", "position_ids"} <= self.inputs:
            raise InputError("packed blocks need a model whose forward takes attention_mask and "
                             "position_ids (to keep attention inside each example): train with "
                             "--no-packing")
        batch = dict(batch)
        seq_lens = batch.pop(SEQ_LENS)
        return self.mask(batch, seq_lens, self.dtype)


class BlockMask:
    """The mask (and, for Qwen, the positions) of a model's packed blocks (see the module
    docstring)."""

    def __init__(self, image_token: int | None = None, sliding_window: int | None = None,
                 per_layer_type: bool = False, positions: str = "1d") -> None:
        self.image_token = image_token
        """The image token id whose runs attend both ways (None: causal, as text)."""
        self.sliding_window = sliding_window
        """The window of the model's sliding layers (None: none slides)."""
        self.per_layer_type = per_layer_type
        """Some layers slide and some do not: one mask per layer type."""
        self.positions = positions

    @classmethod
    def of(cls, config) -> BlockMask:
        """From a transformers config (None, or no sliding layer and no image family: the plain
        block-causal mask)."""
        if config is None:
            return cls()
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        window = getattr(text, "sliding_window", None)
        window = window if isinstance(window, int) and window > 0 else None
        types = set(getattr(text, "layer_types", None) or ())
        per_type = "sliding_attention" in types and types <= {"full_attention", "sliding_attention"}
        if types and not per_type and types != {"sliding_attention"}:
            window = None  # no layer slides (or a kind of layer this mask does not build)
        images = next(filter(None, (kind.block_mask(config) for kind in kinds_of(config))), None)
        if images is None:
            return cls(None, window, per_type and len(types) > 1)
        image_token, positions = images
        return cls(image_token, window, per_type and len(types) > 1, positions)

    def __call__(self, batch: dict, seq_lens: torch.Tensor, dtype: torch.dtype) -> dict:
        input_ids = batch["input_ids"]
        size = input_ids.shape[-1]
        position_ids = batch.get("position_ids")
        if self.positions == "3d" and position_ids is not None and position_ids.dim() == 3:
            batch["position_ids"] = position_ids.transpose(0, 1)  # [3, batch, length]
        sliding = self.sliding_window is not None and self.sliding_window < size
        if self.image_token is None and not sliding:
            batch["attention_mask"] = block_causal_mask(seq_lens, size, dtype)
            return batch
        allowed = block_causal_mask(seq_lens, size)
        if self.image_token is not None:
            allowed = allowed | image_runs(input_ids, self.image_token)[:, None]
        if not sliding:
            batch["attention_mask"] = additive(allowed, dtype)
            return batch
        at = torch.arange(size, device=input_ids.device)
        window = allowed & ((at[:, None] - at[None, :]) < self.sliding_window)  # kv > q - window
        batch["attention_mask"] = ({"full_attention": additive(allowed, dtype),
                                    "sliding_attention": additive(window, dtype)}
                                   if self.per_layer_type else additive(window, dtype))
        return batch


def image_runs(input_ids: torch.Tensor, image_token: int) -> torch.Tensor:
    """[batch, length, length] True where two tokens lie in one contiguous run of `image_token`
    (one image): transformers' get_block_sequence_ids_for_mask rule."""
    group = image_run_ids(input_ids, image_token)
    return (group[:, :, None] == group[:, None, :]) & (group[:, :, None] > 0)


def image_run_ids(input_ids: torch.Tensor, image_token: int) -> torch.Tensor:
    """[batch, length]: 1, 2, ... for each contiguous run of `image_token` (one image), 0 off the
    images (the training mask's runs, and hputrain generate's Gemma 3 prefill); in ops of static
    shape (no torch.where, no `~`: the CPU lazy backend runs those eagerly)."""
    image = (input_ids == image_token).long()
    before = torch.cat([torch.zeros_like(image[:, :1]), image[:, :-1]], dim=-1)
    starts = (image - before).clamp(min=0)
    return starts.cumsum(-1) * image


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
