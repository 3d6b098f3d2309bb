"""The experts' grouped matrix product: rows sorted by expert, each expert's block of rows times
that expert's matrix, in shapes that never depend on how many rows each expert got.

`grouped_mm(x, weight, offsets, accelerator)` is the one entry point (the experts' forward, expert
parallelism and the benchmark call it). It runs the device's own kernel where the accelerator has
one that takes the operands (`Accelerator.grouped_mm_kernel`: torch's grouped_mm on CUDA and on the
CPU in eager mode), and otherwise the fixed-shape form here, which every backend traces into one
graph whatever the routing (the lazy backends: Gaudi's, the CPU's TorchScript one).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .sizes import tile_count, tile_rows


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
               accelerator=None, layouts: dict | None = None) -> torch.Tensor:
    """`x` (S, in) sorted by expert, `weight` (E, in, out), `offsets` (E,) integers: where each
    expert's rows end (the running sum of the rows per expert, a device tensor) -> (S, out), each
    row times its expert's matrix. Rows at or past `offsets[-1]` (padding) are unspecified: zero in
    the fixed-shape form, whatever the device's kernel leaves there; a caller with padding rows
    masks them. `layouts` keeps the fixed-shape form's tile layout between the products of one
    sorted buffer (the experts' up and down projections share their offsets)."""
    # one dtype for both operands: autocast's where it is on (as a linear layer's), else the
    # weight's (torch's grouped_mm takes no autocast, and the tiles' backward needs one dtype)
    dtype = torch.get_autocast_dtype(x.device.type) if autocast_on(x.device.type) else weight.dtype
    x, weight = x.to(dtype), weight.to(dtype)
    kernel = accelerator.grouped_mm_kernel(x, weight) if accelerator is not None else None
    if kernel is None:
        return fixed_shape_grouped_mm(x, weight, offsets, layouts=layouts)
    return kernel(x, weight, offsets.to(torch.int32))


def fixed_shape_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                           tile: int | None = None, layouts: dict | None = None) -> torch.Tensor:
    """The grouped product in shapes fixed by S and E alone: each expert's rows are laid out in
    tiles of `tile` rows (default sizes.tile_rows: at most 256), its last tile padded with zero
    rows; ⌊(S + E·(tile-1))/tile⌋ tiles hold any routing, so at most S + E·tile rows are
    multiplied, and kept for backward. Each tile is multiplied by its expert's matrix, the tiles'
    experts being data (no shape follows the routing), a few tiles at a time (`_TileProducts`).
    Everything is computed on the device from the offsets (comparisons, running sums, embedding
    lookups: no division, no host read), and a row's result is its own expert's product."""
    rows, experts = x.size(0), weight.size(0)
    if rows == 0:
        return x.new_zeros(0, weight.size(2))
    tile = tile or tile_rows(rows, experts)
    key = (rows, experts, tile)  # the layout of these offsets, made once (see grouped_mm)
    layout = layouts.get(key) if layouts is not None else None
    if layout is None:
        layout = _TileLayout(offsets, rows, experts, tile)
        if layouts is not None:
            layouts[key] = layout
    x_tiles = F.embedding(layout.source.reshape(-1), x) * layout.valid_as(x.dtype)
    y_tiles = _TileProducts.apply(x_tiles.view(layout.tiles, tile, -1), weight, layout.expert)
    return F.embedding(layout.destination, y_tiles.reshape(layout.tiles * tile, -1))


class _TileLayout:
    """Where each expert's sorted rows go in the tiles, and back."""

    def __init__(self, offsets: torch.Tensor, rows: int, experts: int, tile: int) -> None:
        device = offsets.device
        most = -(-rows // tile)  # the tiles one expert can need
        self.tiles = tile_count(rows, experts, tile)
        ends = offsets.long()
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        counts = ends - starts
        per_expert = (counts.unsqueeze(1) > torch.arange(most, device=device).unsqueeze(0) * tile).sum(1)
        tile_ends = torch.cumsum(per_expert, 0)
        tile_starts = tile_ends - per_expert
        index = torch.arange(self.tiles, device=device)
        owner = (index.unsqueeze(1) >= tile_ends.unsqueeze(0)).sum(1)  # E: a tile past the last
        self.expert = owner.clamp(max=experts - 1)
        # tile j's slot i holds expert e's row (j - tile_starts[e])·tile + i, if it has one
        within = ((index - _pick(tile_starts, self.expert)).unsqueeze(1) * tile
                  + torch.arange(tile, device=device).unsqueeze(0))
        self.valid = (within < _pick(counts, self.expert).unsqueeze(1)) & (owner < experts).unsqueeze(1)
        self.source = (_pick(starts, self.expert).unsqueeze(1) + within).clamp(max=rows - 1)
        row_expert = expert_of_rows(offsets, rows).clamp(max=experts - 1)
        self.destination = ((_pick(tile_starts * tile - starts, row_expert)
                             + torch.arange(rows, device=device)).clamp(max=self.tiles * tile - 1))
        self._valid: torch.Tensor | None = None

    def valid_as(self, dtype: torch.dtype) -> torch.Tensor:
        """(tiles·tile, 1) 1 for a slot that holds a row, else 0: one tensor for both products."""
        if self._valid is None or self._valid.dtype != dtype:
            self._valid = self.valid.reshape(-1, 1).to(dtype)
        return self._valid


def _pick(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values[index] for integer tensors, as an embedding lookup (the lazy backends' indexing)."""
    return F.embedding(index, values.unsqueeze(1)).squeeze(1)


#: Tiles multiplied at a time: each reads its expert's matrix through a gather of at most this
#: many matrices (about one layer's local experts' worth under expert parallelism), freed before
#: the next; none is kept for backward.
CHUNK_TILES = 16


def _chunks(count: int) -> list[slice]:
    return [slice(first, min(first + CHUNK_TILES, count)) for first in range(0, count, CHUNK_TILES)]


class _TileProducts(torch.autograd.Function):
    """Each tile of rows times its expert's matrix: (tiles, tile, in) and (E, in, out), the
    tiles' experts (tiles,) as data -> (tiles, tile, out). Torch has no product that reads a
    matrix through an index without a kernel of its own (the grouped kernel), so the matrices
    are gathered CHUNK_TILES tiles at a time, not for every tile at once, and not kept: backward
    gathers them again, and adds each tile's weight gradient to its expert's (scatter_add) chunk
    by chunk."""

    @staticmethod
    def forward(ctx, x_tiles, weight, tile_expert):
        ctx.save_for_backward(x_tiles, weight, tile_expert)
        return torch.cat([torch.bmm(x_tiles[part], weight.index_select(0, tile_expert[part]))
                          for part in _chunks(x_tiles.size(0))])

    @staticmethod
    def backward(ctx, grad):
        x_tiles, weight, tile_expert = ctx.saved_tensors
        parts = _chunks(x_tiles.size(0))
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.cat([torch.bmm(grad[part], weight.index_select(0, tile_expert[part]).transpose(1, 2))
                                for part in parts])
        if ctx.needs_input_grad[1]:
            flat = weight[0].numel()
            grad_weight = grad.new_zeros(weight.size(0), flat)
            for part in parts:
                per_tile = torch.bmm(x_tiles[part].transpose(1, 2), grad[part]).reshape(-1, flat)
                owner = tile_expert[part].unsqueeze(1).expand(-1, flat)
                # out of place: the lazy backend compiled an in-place one again at a later step
                grad_weight = grad_weight.scatter_add(0, owner, per_tile)
            grad_weight = grad_weight.view(weight.shape)
        return grad_x, grad_weight, None


def expert_of_rows(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows,) the expert whose block holds each row, from the blocks' ends (E for padding rows
    past the last end): a comparison of every row with every end, on the device."""
    index = torch.arange(rows, device=offsets.device)
    return (index.unsqueeze(-1) >= offsets.to(index.dtype).unsqueeze(0)).sum(-1)


def autocast_on(device_type: str) -> bool:
    """Whether autocast is on for `device_type` (False for a type it does not know)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (the lazy backend's)
        return False
