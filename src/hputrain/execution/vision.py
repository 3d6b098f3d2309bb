"""The static image merge: a vision-language model's image features put in place of its image
tokens with nothing read back to the host, on a batch whose image slots are padded.

transformers' image-text-to-text models (LLaVA, Gemma 3, Qwen2.5-VL) embed the tokens, run the
vision tower on `pixel_values`, and write the features over the image tokens with
`inputs_embeds.masked_scatter(mask, features)`, the mask from `get_placeholder_mask`. That
method also checks that the batch holds as many image tokens as there are features
(`torch_compilable_check(n_image_tokens * D == features.numel())`): in eager and lazy mode a
value read back to the host every step, and false by design on hputrain's blocks, whose image
slots are padded to a fixed count with blank images (data/vision/: every batch the same shapes).
masked_scatter itself needs no equality: it fills the masked places, in row-major order, from the
first features in order, and the collator puts the real images' slots first, so the padding
slots' features are never read.

`static_image_merge` replaces `get_placeholder_mask` on the model instance (not the class) by the
same mask without the check; for LLaVA and Gemma 3 that is the only change, and Qwen2.5-VL's
tower gets two more (below). The parameters, their names and the weights saved stay
transformers' own, and so does every other method.

Host reads left in the forwards (transformers 5.24), on a static batch:
- LLaVA: none.
- Gemma 3: `llm_input_ids[special_image_mask] = 0` (boolean indexing) runs only when the image
  token id is outside the text vocabulary; it is inside it in every published Gemma 3 checkpoint
  (262144 < 262208) and in the tests' folders.
- Qwen2.5-VL: given `position_ids` (the blocks carry each example's own rope index), the forward
  skips `get_rope_index` (a Python loop over `.tolist()`). Its vision tower derives the patches'
  rotary positions, the window order and the attention splits from `image_grid_thw` by `.tolist()`
  and Python loops (transformers/vision_utils.py get_vision_position_ids, get_vision_window_index;
  Qwen2_5_VLVisionAttention splits by `cu_seqlens.tolist()`), and `get_image_features` splits the
  features by `image_grid_thw.prod(-1).tolist()`: four reads a step, and graphs that follow the
  grids (which bucket each slot holds). `_static_image_features` hands the tower what it would
  derive (the keyword inputs vision_utils pops for that purpose): the patches' positions computed
  on the device from `image_grid_thw` by elementwise ops, the split points (which follow from the
  shapes alone) made on the host; and `_static_attention` runs the tower's attention on all
  images at once, [images, heads, patches, head_dim], a window mask on the windowed layers,
  where transformers splits per image and per window. That needs what hputrain's blocks hold:
  images of one frame and one patch count (every bucket of a family has the same token count);
  the windows may be partial (a bucket side that is not a multiple of `window_size`). With flash
  attention requested the tower is left as it is (its split points stay on the device).
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import types

import torch

from ..models.vision import vision_family

_MARK = "_hputrain_static_merge"


def static_image_merge(model: torch.nn.Module) -> bool:
    """Swaps the count-free placeholder mask into the covered image-text-to-text model inside
    `model` (itself, or under PEFT's, DDP's or fsdp's wrappers: the module that has
    `get_placeholder_mask`), and for Qwen2.5-VL its image features and its tower's attention
    (`_static_image_features`, `_static_attention`). Returns whether it found one; a second call
    changes nothing."""
    inner = _inner_model(model)
    if inner is None:
        return False
    if not getattr(inner.get_placeholder_mask, _MARK, False):
        video = "video_features" in inspect.signature(inner.get_placeholder_mask).parameters
        inner.get_placeholder_mask = types.MethodType(_with_video if video else _image_only, inner)
    if vision_family(inner.config).positions == "3d" and not _flash(inner.visual):
        if not getattr(inner.get_image_features, _MARK, False):
            inner.get_image_features = types.MethodType(_static_image_features, inner)
        _window_attention(inner.visual)
    return True


def _inner_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module of `model` that merges image features (transformers' `*Model` inside the
    `*ForConditionalGeneration`), when `model` is a covered family; else None."""
    for module in model.modules():
        if hasattr(type(module), "get_placeholder_mask") and vision_family(getattr(module, "config", None)):
            return module
    return None


def _placeholders(inner, input_ids, inputs_embeds, token_id: int) -> torch.Tensor:
    """[batch, length, 1] True on the tokens `token_id` stands for, as transformers finds them:
    by id, or (inputs_embeds given alone) by the token's embedding."""
    if input_ids is None:
        token = torch.full((), token_id, dtype=torch.long, device=inputs_embeds.device)
        mask = (inputs_embeds == inner.get_input_embeddings()(token)).all(-1)
    else:
        mask = input_ids == token_id
    return mask.unsqueeze(-1).to(inputs_embeds.device)


def _image_only(self, input_ids, inputs_embeds, image_features=None):
    """LLaVA's and Gemma 3's get_placeholder_mask without the count check."""
    return _placeholders(self, input_ids, inputs_embeds, self.config.image_token_id)


def _with_video(self, input_ids, inputs_embeds, image_features=None, video_features=None):
    """Qwen-VL's get_placeholder_mask (image and video masks) without the count checks."""
    return (_placeholders(self, input_ids, inputs_embeds, self.config.image_token_id),
            _placeholders(self, input_ids, inputs_embeds, self.config.video_token_id))


_STATIC = "_hputrain_static_batches"
"""The attribute, on the model that merges image features, that says the forward running is
hputrain's, on its own blocks (equal patch counts per image): a model trained through the Python
API keeps the swaps, and its user's later forwards (generate on images of any size) get
transformers' own image features. An attribute, not a context variable: torch.compile guards on
it without a graph break."""


def image_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module of `model` that merges image features (under any wrapper), or None."""
    return _inner_model(model)


@contextlib.contextmanager
def static_batches(inner: torch.nn.Module | None):
    """Inside: `inner`'s (image_model's) swapped image features take the batch as hputrain's
    blocks make it (training/prepare.Prepared.forward opens it around every forward of a run);
    None: nothing to do."""
    if inner is None:
        yield
        return
    setattr(inner, _STATIC, True)
    try:
        yield
    finally:
        setattr(inner, _STATIC, False)


def _static_image_features(self, pixel_values, image_grid_thw=None, return_dict=True, **kwargs):
    """Qwen2.5-VL's get_image_features on images of equal patch counts, the tower's grid inputs
    precomputed without a host read (see the module docstring); the features come back split per
    image, as transformers' own. Outside `static_batches`, transformers' own."""
    if not getattr(self, _STATIC, False):
        return type(self).get_image_features(self, pixel_values, image_grid_thw,
                                             return_dict=return_dict, **kwargs)
    tower = self.visual
    images = image_grid_thw.shape[0]
    kwargs = {**_grid_inputs(tower, pixel_values.shape[0], images, image_grid_thw), **kwargs}
    outputs = tower(pixel_values.type(tower.dtype), grid_thw=image_grid_thw, **kwargs)
    features = outputs.pooler_output
    outputs.pooler_output = features.split(features.shape[0] // images)
    return outputs if return_dict else outputs.to_tuple()


def _flash(tower) -> bool:
    """Whether the tower runs flash attention (its split points stay on the device, no read:
    the tower is left as it is)."""
    return "flash" in str(getattr(tower.config, "_attn_implementation", ""))


_WINDOWS = "hputrain_window_ids"
_WINDOW_LAYERS = "hputrain_window_seqlens"


def _grid_inputs(tower, patches: int, images: int, grid_thw: torch.Tensor) -> dict:
    """The keyword inputs Qwen2.5-VL's tower takes precomputed (transformers/vision_utils.py), for
    `images` images of `patches // images` patches each (one frame each):
    - "position_ids": each patch's (row, column) in its image, in merge-block order, computed
      elementwise from each image's grid;
    - "window_index": the identity (the merged tokens stay in image order: `_window_attention`
      keeps each window to itself by a mask, wherever its tokens are);
    - "cu_seqlens": the images' split points, on the host (they follow from the shapes);
    - "cu_window_seqlens": a host tensor `_window_attention` tells the windowed layers by, with
      which patches share a window beside it ([images, 1, patches, patches], on the device)."""
    merge = tower.spatial_merge_size
    unit = merge * merge
    per_image = patches // images
    device = grid_thw.device
    grid = grid_thw[:, None, :].expand(images, per_image, 3).reshape(patches, 3)
    width = grid[:, 2]
    local = torch.arange(per_image, device=device).repeat(images)
    block, inside = _div(local, unit), local % unit
    rows = _div(block, _div(width, merge)) * merge + _div(inside, merge)
    columns = block % _div(width, merge) * merge + inside % merge
    side = tower.window_size // merge // tower.patch_size  # a window's side, in merged tokens
    across = _div(_div(width, merge) + side - 1, side)  # windows in a row (the last may be partial)
    windows = _div(rows, merge * side) * across + _div(columns, merge * side)
    windows = windows.reshape(images, per_image)
    cu_seqlens = torch.arange(0, patches + 1, per_image, dtype=torch.int32)
    window_layers = cu_seqlens.clone()
    return {"position_ids": torch.stack([rows, columns], dim=-1),
            "window_index": torch.arange(patches // unit, device=device),
            "cu_seqlens": cu_seqlens, "cu_window_seqlens": window_layers, _WINDOW_LAYERS: window_layers,
            _WINDOWS: (windows[:, :, None] == windows[:, None, :])[:, None]}


def _div(a: torch.Tensor, b) -> torch.Tensor:
    """a // b (non-negative integers) as torch.div: the CPU lazy backend runs floor_divide
    eagerly, not div."""
    return torch.div(a, b, rounding_mode="floor")


def _window_attention(tower) -> None:
    """Swaps `_static_attention` into the tower's attention modules, once."""
    for module in tower.modules():
        if hasattr(module, "qkv") and hasattr(module, "proj") and not getattr(module.forward, _MARK, False):
            module.forward = types.MethodType(_static_attention, module)


def _static_attention(self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):
    """Qwen2.5-VL's vision attention over images of equal patch counts in one call of static
    shape: [images, heads, patches, head_dim], each image attending to itself (full-attention
    layers) or each window to itself (windowed layers: a mask by the patches' window ids), where
    transformers splits the patches per image or per window by `cu_seqlens.tolist()`. The same
    attention, up to float rounding. Without the precomputed window ids, transformers' own."""
    windows = kwargs.pop(_WINDOWS, None)  # [images, 1, patches, patches]: True within a window
    window_layers = kwargs.pop(_WINDOW_LAYERS, None)
    if windows is None:
        return type(self).forward(self, hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)
    modeling = sys.modules[type(self).__module__]
    images, per_image = windows.shape[0], windows.shape[-1]
    length = hidden_states.shape[0]
    qkv = self.qkv(hidden_states).reshape(length, 3, self.num_heads, -1).permute(1, 0, 2, 3)
    query, key, value = qkv.unbind(0)
    cos, sin = position_embeddings
    query, key = modeling.apply_rotary_pos_emb_vision(query, key, cos, sin)
    query, key, value = (t.reshape(images, per_image, self.num_heads, -1).transpose(1, 2)
                         for t in (query, key, value))
    mask = None
    if cu_seqlens is window_layers:
        mask = torch.zeros(windows.shape, dtype=query.dtype, device=query.device).masked_fill(
            windows.eq(False), torch.finfo(query.dtype).min)
    attention = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, modeling.eager_attention_forward)
    output, _ = attention(self, query, key, value, attention_mask=mask, scaling=self.scaling,
                          dropout=0.0 if not self.training else self.attention_dropout, is_causal=False)
    return self.proj(output.reshape(length, -1).contiguous())


for _swapped in (_image_only, _with_video, _static_image_features, _static_attention):
    setattr(_swapped, _MARK, True)
