"""The static image merge: a vision-language model's image features put in place of its image
tokens with nothing read back to the host, on a batch whose image slots are padded.

transformers' image-text-to-text models (LLaVA, Gemma 3, Qwen2.5-VL) embed the tokens, run the
vision tower on `pixel_values`, and write the features over the image tokens with
`inputs_embeds.masked_scatter(mask, features)`, the mask from `get_placeholder_mask`. That
method also checks that the batch holds as many image tokens as there are features
(`torch_compilable_check(n_image_tokens * D == features.numel())`): in eager and lazy mode a
value read back to the host every step, and false by design on hputrain's blocks, whose image
slots are padded to a fixed count with blank images (kinds/vlm/data/: every batch the same shapes).
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
  derive (the keyword inputs vision_utils pops for that purpose), computed on the device from
  `image_grid_thw` by elementwise ops (`TowerLayout`): the patches' positions, and the split
  points (which follow from the shapes alone) made on the host; `_static_attention` runs the
  full-attention layers on all images at once, [images, heads, P, P], and the windowed layers
  window by window, [images x windows, heads, window, window] (each slot's patches gathered into
  a fixed number of window places, `buckets.most_windows`), where transformers splits per image
  and per window. That needs what hputrain's blocks hold: one frame an image and one patch count
  a slot, P, an image's own patches first (its bucket's, the windows maybe partial), blank ones
  after, which are no key of any attention and whose features come last. With flash attention
  requested the tower is left as it is (its split points stay on the device).

The Qwen tower is transformers 5.24's (WRITTEN_FOR): `check_tower` reads its layout when the
swap is made, and its first forward checks that each layer got the split points of its kind (the
windowed layers are told by fullatt_block_indexes, never by which tensor arrives) and that every
layer's attention ran through the module's forward; a transformers that lays it out otherwise is
one line naming what changed, not a silent fall back to full attention.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import types

import torch

from ...errors import InputError
from .family import vision_family

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
    """Qwen2.5-VL's get_image_features on hputrain's image slots (one patch count each, an
    image's own patches first), the tower's inputs precomputed without a host read (see the module
    docstring). The features come back real images' first, in order, then the slots' blank ones
    (what masked_scatter reads is the former), in chunks of one slot each. Outside
    `static_batches`, transformers' own."""
    if not getattr(self, _STATIC, False):
        return type(self).get_image_features(self, pixel_values, image_grid_thw,
                                             return_dict=return_dict, **kwargs)
    tower = self.visual
    images = image_grid_thw.shape[0]
    layout = TowerLayout(tower, pixel_values.shape[0], images, image_grid_thw)
    kwargs = {**layout.inputs(), **kwargs}
    outputs = tower(pixel_values.type(tower.dtype), grid_thw=image_grid_thw, **kwargs)
    if layout.layers_run < len(tower.blocks):
        raise changed(f"its vision tower ran {layout.layers_run} of its {len(tower.blocks)} attention "
                      "layers through the attention module's forward")
    features = outputs.pooler_output
    outputs.pooler_output = features[layout.real_first].split(features.shape[0] // images)
    return outputs if return_dict else outputs.to_tuple()


def _flash(tower) -> bool:
    """Whether the tower runs flash attention (its split points stay on the device, no read:
    the tower is left as it is)."""
    return "flash" in str(getattr(tower.config, "_attn_implementation", ""))


_LAYOUT = "hputrain_tower_layout"
"""The keyword input that hands each attention layer the batch's TowerLayout."""
_WINDOWED = "_hputrain_windowed"
"""An attention module's attribute: its layer attends within windows (from the tower's
fullatt_block_indexes, read when the module is swapped)."""


class TowerLayout:
    """Where each patch of a batch of image slots goes in Qwen2.5-VL's tower, computed on the
    device from the slots' grids by elementwise ops (no host read), for `images` slots of
    `patches // images` patches each, an image's own first (its grid's t * h * w, one frame),
    then blank ones:

    - `position_ids`: each patch's (row, column) in its image, in merge-block order (blank: 0);
    - `keys`: [images, 1, 1, P] True on an image's own patches (the keys the full-attention
      layers attend to);
    - windows: the windowed layers attend within each window of side window_size / patch_size
      patches (the last of a row or column may be partial), in static shapes: every slot has
      `windows` window places (`most_windows`, the most any bucket shape of the slot's tokens
      has) of `window` patches each; `gather` [images * windows * window] is the patch of each
      place (a place past the image's windows, or in a partial window's missing part, is not a
      key: `window_keys`), `scatter` [images * P] each patch's place;
    - `real_first`: the order of the tower's merged features that puts every image's own first,
      image by image, then every blank one;
    - `cu_seqlens`, `cu_window_seqlens`: host tensors the tower hands to its full and windowed
      layers, which each attention layer checks it got (`_static_attention`)."""

    def __init__(self, tower, patches: int, images: int, grid_thw: torch.Tensor) -> None:
        from .data.buckets import most_windows

        merge = tower.spatial_merge_size
        unit = merge * merge
        per_image = patches // images
        side = tower.window_size // merge // tower.patch_size  # a window's side, in merged tokens
        self.images, self.per_image, self.unit = images, per_image, unit
        self.window = side * side * unit
        self.windows = most_windows(per_image // unit, side)
        device = grid_thw.device
        height, width = grid_thw[:, 1:2], grid_thw[:, 2:3]  # [images, 1], in patches
        down, across = _div(height, merge), _div(width, merge)  # in merged tokens
        across_windows = _div(across + side - 1, side)
        local = torch.arange(per_image, device=device)[None]
        own = local < height * width
        block, inside = _div(local, unit), local % unit
        row, column = _div(block, across), block % across  # the merged token's
        rows = row * merge + _div(inside, merge)
        columns = column * merge + inside % merge
        self.position_ids = torch.stack([rows.where(own, 0), columns.where(own, 0)], dim=-1).reshape(patches, 2)
        self.keys = own[:, None, None, :]
        place = (_div(row, side) * across_windows + _div(column, side)) * self.window \
            + ((row % side) * side + column % side) * unit + inside
        places = self.windows * self.window
        self.scatter = (place.where(own, 0) + torch.arange(images, device=device)[:, None] * places).reshape(-1)
        at = torch.arange(places, device=device)[None]
        window, within = _div(at, self.window), at % self.window
        merged, inside = _div(within, unit), within % unit
        row = _div(window, across_windows) * side + _div(merged, side)
        column = window % across_windows * side + merged % side
        there = (row < down) & (column < across)
        patch = (row * across + column) * unit + inside
        self.gather = (patch.where(there, 0) + torch.arange(images, device=device)[:, None] * per_image).reshape(-1)
        self.window_keys = there.reshape(images * self.windows, 1, 1, self.window)
        features = per_image // unit
        merged_own = local[:, :features] < _div(height * width, unit)
        flat = torch.arange(images * features, device=device).reshape(images, features)
        self.real_first = torch.argsort(flat.where(merged_own, flat + images * features).reshape(-1))
        self.cu_seqlens, self.cu_window_seqlens = self.split_points_of(patches, per_image)
        self.layers_run = 0

    @staticmethod
    def split_points_of(patches: int, per_image: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The host tensors the tower hands its full and windowed layers (the images' split
        points, each layer checking it got its kind's by identity): made from the shapes alone."""
        points = torch.arange(0, patches + 1, per_image, dtype=torch.int32)
        return points, points.clone()

    def inputs(self) -> dict:
        """The tower's keyword inputs: what transformers/vision_utils pops precomputed
        ("position_ids"; "window_index", the identity: the patches stay in slot order; the two
        split points), and this layout, for the attention layers."""
        merged = self.position_ids.shape[0] // self.unit
        return {"position_ids": self.position_ids,
                "window_index": torch.arange(merged, device=self.position_ids.device),
                "cu_seqlens": self.cu_seqlens, "cu_window_seqlens": self.cu_window_seqlens,
                _LAYOUT: self}

    def split_points(self, windowed: bool) -> torch.Tensor:
        """What the tower hands a windowed (or full-attention) layer as its cu_seqlens."""
        return self.cu_window_seqlens if windowed else self.cu_seqlens


def _div(a: torch.Tensor, b) -> torch.Tensor:
    """a // b (non-negative integers) as torch.div: the CPU lazy backend runs floor_divide
    eagerly, not div."""
    return torch.div(a, b, rounding_mode="floor")


WRITTEN_FOR = "5.24"
"""The transformers whose Qwen2.5-VL tower `_static_attention` follows (read and tested)."""

_TOWER = ("blocks", "fullatt_block_indexes", "window_size", "patch_size", "spatial_merge_size")
_ATTENTION = ("qkv", "proj", "num_heads", "scaling", "config")
_MODELING = ("apply_rotary_pos_emb_vision", "ALL_ATTENTION_FUNCTIONS", "eager_attention_forward",
             "get_vision_position_ids", "get_vision_window_index", "get_vision_attention_seqlens")


def changed(what: str) -> InputError:
    """The one line that says Qwen2.5-VL's tower in this transformers is not the one
    `_static_attention` was written for, naming `what` differs."""
    import transformers

    return InputError(f"transformers {transformers.__version__}'s Qwen2.5-VL vision tower is not the one "
                      f"hputrain's static tower follows (transformers {WRITTEN_FOR}): {what}; install "
                      f"transformers {WRITTEN_FOR} (pip install 'transformers=={WRITTEN_FOR}.*')")


def check_tower(tower) -> None:
    """One line (`changed`) unless the tower is laid out as `_static_attention` reads it: its
    blocks' attention modules (block.attn, with qkv, proj, num_heads, scaling, config, and a
    forward of (hidden_states, cu_seqlens, position_embeddings, ...)), the layers that attend in
    full (fullatt_block_indexes; the others in windows), its window and patch sizes, and the
    functions of its modeling file that take its inputs precomputed. What this cannot see before
    a forward (the tower handing each layer the split points it was given, running every layer's
    attention through its forward) is checked in the first forward."""
    lacks = [name for name in _TOWER if not hasattr(tower, name)]
    if lacks:
        raise changed(f"its vision tower ({type(tower).__name__}) has no {', '.join(lacks)}")
    modeling = sys.modules[type(tower).__module__]
    lacks = [name for name in _MODELING if not hasattr(modeling, name)]
    if lacks:
        raise changed(f"{modeling.__name__} has no {', '.join(lacks)}")
    for index, block in enumerate(tower.blocks):
        attention = getattr(block, "attn", None)
        lacks = ["attn"] if attention is None else [name for name in _ATTENTION if not hasattr(attention, name)]
        if lacks:
            raise changed(f"block {index} of its vision tower ({type(block).__name__}) has no "
                          f"{', '.join(('attn.' if attention is not None else '') + n for n in lacks)}")
        names = list(inspect.signature(type(attention).forward).parameters)
        if names[1:4] != ["hidden_states", "cu_seqlens", "position_embeddings"]:
            raise changed(f"its vision attention's forward takes ({', '.join(names[1:])}), not "
                          "(hidden_states, cu_seqlens, position_embeddings, ...)")


def _window_attention(tower) -> None:
    """Swaps `_static_attention` into the attention module of each of the tower's blocks, once,
    each told whether its layer is windowed (not in fullatt_block_indexes); `check_tower` first."""
    check_tower(tower)
    full = {int(i) for i in tower.fullatt_block_indexes}
    for index, block in enumerate(tower.blocks):
        attention = block.attn
        setattr(attention, _WINDOWED, index not in full)
        if not getattr(attention.forward, _MARK, False):
            attention.forward = types.MethodType(_static_attention, attention)


def _same(given, expected: torch.Tensor) -> bool:
    """Whether `given` is the host tensor `expected` (itself, or a view of it such as a detached
    one); a copy is not (no value is read)."""
    return given is expected or (isinstance(given, torch.Tensor) and given.device == expected.device
                                 and given.shape == expected.shape and given.data_ptr() == expected.data_ptr())


def _static_attention(self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):
    """Qwen2.5-VL's vision attention over hputrain's image slots in static shapes (TowerLayout):
    a full-attention layer runs [images, heads, P, P], each image's own patches the keys; a
    windowed layer gathers each window's patches into its places, runs [images * windows, heads,
    window, window], and puts each patch's output back: the cost of the windows, not of P x P.
    transformers splits per image and per window by `cu_seqlens.tolist()`; the same attention,
    up to float rounding. Without a layout (outside hputrain's forwards), transformers' own. The
    split points the tower hands this layer must be those it was given for its kind of layer,
    and no precomputed input may be left unread: else one line (`changed`)."""
    layout = kwargs.pop(_LAYOUT, None)
    if layout is None:
        return type(self).forward(self, hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)
    windowed = getattr(self, _WINDOWED)
    if not _same(cu_seqlens, layout.split_points(windowed)):
        kind, points = ("windowed", "window") if windowed else ("full-attention", "image")
        raise changed(f"a {kind} layer of its tower was handed split points (cu_seqlens) other than "
                      f"the precomputed {points} ones, so which layers attend in windows is no "
                      "longer what fullatt_block_indexes says")
    unread = [name for name in ("position_ids", "window_index", "cu_seqlens", "cu_window_seqlens") if name in kwargs]
    if unread:
        raise changed(f"its vision tower no longer takes {', '.join(unread)} precomputed")
    layout.layers_run += 1
    modeling = sys.modules[type(self).__module__]
    length = hidden_states.shape[0]
    qkv = self.qkv(hidden_states).reshape(length, 3, self.num_heads, -1).permute(1, 0, 2, 3)
    query, key, value = qkv.unbind(0)
    cos, sin = position_embeddings
    query, key = modeling.apply_rotary_pos_emb_vision(query, key, cos, sin)
    if windowed:  # [images * windows, heads, window, head_dim]
        query, key, value = (t[layout.gather].reshape(-1, layout.window, self.num_heads, t.shape[-1]).transpose(1, 2)
                             for t in (query, key, value))
        keys = layout.window_keys
    else:  # [images, heads, P, head_dim]
        query, key, value = (t.reshape(layout.images, layout.per_image, self.num_heads, -1).transpose(1, 2)
                             for t in (query, key, value))
        keys = layout.keys
    mask = torch.zeros(keys.shape, dtype=query.dtype, device=query.device).masked_fill(
        keys.logical_not(), torch.finfo(query.dtype).min).expand(-1, -1, query.shape[-2], -1)
    attention = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, modeling.eager_attention_forward)
    output, _ = attention(self, query, key, value, attention_mask=mask, scaling=self.scaling,
                          dropout=0.0 if not self.training else self.attention_dropout, is_causal=False)
    output = output.reshape(-1, output.shape[-2] * output.shape[-1])
    if windowed:
        output = output[layout.scatter]
    return self.proj(output.contiguous())


for _swapped in (_image_only, _with_video, _static_image_features, _static_attention):
    setattr(_swapped, _MARK, True)
