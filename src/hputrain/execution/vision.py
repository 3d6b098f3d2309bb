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
same mask without the check. It is the only change: the parameters, their names, the weights
saved and every other method stay transformers' own.

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
  grids. `_static_image_features` hands the tower all of them precomputed (the keyword inputs
  vision_utils pops for that purpose): positions and window order computed on the device from
  `image_grid_thw` by elementwise ops, the split points (which depend on the shapes alone) made on
  the host. That holds for hputrain's blocks, whose images all have the same number of patches
  (one token count for every bucket) and whose buckets are whole attention windows: each side a
  multiple of the tower's `window_size` pixels (112 for Qwen2.5-VL), so that every window is full.
"""
from __future__ import annotations

import inspect
import types

import torch

from ..models.vision import vision_family

_MARK = "_hputrain_static_merge"


def static_image_merge(model: torch.nn.Module) -> bool:
    """Swaps the count-free placeholder mask into the covered image-text-to-text model inside
    `model` (itself, or under PEFT's, DDP's or fsdp's wrappers: the module that has
    `get_placeholder_mask`), and for Qwen2.5-VL its image features (`_static_image_features`). Returns
    whether it found one; a second call changes nothing."""
    inner = _inner_model(model)
    if inner is None:
        return False
    if not getattr(inner.get_placeholder_mask, _MARK, False):
        video = "video_features" in inspect.signature(inner.get_placeholder_mask).parameters
        inner.get_placeholder_mask = types.MethodType(_with_video if video else _image_only, inner)
    if vision_family(inner.config).positions == "3d" and not getattr(inner.get_image_features, _MARK, False):
        inner.get_image_features = types.MethodType(_static_image_features, inner)
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


def _static_image_features(self, pixel_values, image_grid_thw=None, return_dict=True, **kwargs):
    """Qwen2.5-VL's get_image_features on images of equal patch counts and whole windows, the
    tower's grid inputs precomputed without a host read (see the module docstring); the features
    come back split per image, as transformers' own."""
    tower = self.visual
    images = image_grid_thw.shape[0]
    kwargs = {**_grid_inputs(tower, pixel_values.shape[0], images, image_grid_thw), **kwargs}
    outputs = tower(pixel_values.type(tower.dtype), grid_thw=image_grid_thw, **kwargs)
    features = outputs.pooler_output
    outputs.pooler_output = features.split(features.shape[0] // images)
    return outputs if return_dict else outputs.to_tuple()


def _grid_inputs(tower, patches: int, images: int, grid_thw: torch.Tensor) -> dict:
    """The keyword inputs Qwen2.5-VL's tower takes precomputed (transformers/vision_utils.py):
    each patch's (row, column) in its image, in merge-block order ("position_ids"); the merged
    tokens in window order ("window_index"); the images' and windows' split points
    ("cu_seqlens", "cu_window_seqlens"). `images` images of `patches // images` patches each, one
    frame each, their merged grids whole windows."""
    merge = tower.spatial_merge_size
    unit = merge * merge
    per_image = patches // images
    device = grid_thw.device

    def each(count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For `count` items per image: each item's index in its image, its image's grid
        height and width (in patches)."""
        grid = grid_thw[:, None, :].expand(images, count, 3).reshape(images * count, 3)
        return torch.arange(count, device=device).repeat(images), grid[:, 1], grid[:, 2]

    local, height, width = each(per_image)
    block, inside = local // unit, local % unit
    rows = (block // (width // merge)) * merge + inside // merge
    columns = (block % (width // merge)) * merge + inside % merge

    side = tower.window_size // merge // tower.patch_size  # a window's side, in merged tokens
    merged = per_image // unit
    local, height, width = each(merged)
    height, width = height // merge, width // merge
    window, inside = local // (side * side), local % (side * side)
    row = (window // (width // side)) * side + inside // side
    column = (window % (width // side)) * side + inside % side
    start = torch.arange(images * merged, device=device) // merged * merged

    flash = "flash" in str(getattr(tower.config, "_attn_implementation", ""))
    at = device if flash else "cpu"  # sdpa and eager split by them on the host: keep them there
    inputs = {"position_ids": torch.stack([rows, columns], dim=-1),
              "window_index": start + row * width + column,
              "cu_seqlens": torch.arange(0, patches + 1, per_image, dtype=torch.int32, device=at),
              "cu_window_seqlens": torch.arange(0, patches + 1, side * side * unit,
                                                dtype=torch.int32, device=at)}
    if flash:
        inputs |= {"max_seqlen": per_image, "max_window_seqlen": side * side * unit}
    return inputs


for _swapped in (_image_only, _with_video, _static_image_features):
    setattr(_swapped, _MARK, True)
