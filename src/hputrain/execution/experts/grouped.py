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


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
               accelerator=None) -> torch.Tensor:
    """`x` (S, in) sorted by expert, `weight` (E, in, out), `offsets` (E,) integers: where each
    expert's rows end (the running sum of the rows per expert, a device tensor) -> (S, out), each
    row times its expert's matrix. Rows at or past `offsets[-1]` (padding) are unspecified: zero in
    the fixed-shape form, whatever the device's kernel leaves there; a caller with padding rows
    masks them."""
    kernel = accelerator.grouped_mm_kernel(x, weight) if accelerator is not None else None
    if kernel is None:
        if not _autocast_on(x.device.type):
            x = x.to(weight.dtype)
        return fixed_shape_grouped_mm(x, weight, offsets)
    # torch's grouped_mm takes no autocast and one dtype: autocast's where it is on (as a linear
    # layer's operands), else the weight's
    dtype = torch.get_autocast_dtype(x.device.type) if _autocast_on(x.device.type) else weight.dtype
    return kernel(x.to(dtype), weight.to(dtype), offsets.to(torch.int32))


def fixed_shape_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The grouped product as one matrix product per expert over all S rows, each masked to that
    expert's block: every shape is (S, ·) whatever the offsets, nothing is read back to the host,
    and a row's result is its own expert's product plus exact zeros. It costs E times the
    arithmetic of a grouped kernel; it is what runs where the device has no such kernel (and what
    Optimum for Intel Gaudi trains Mixtral with)."""
    expert = expert_of_rows(offsets, x.size(0))
    out = None
    for e in range(weight.size(0)):
        product = x @ weight[e]
        part = product * (expert == e).to(product.dtype).unsqueeze(-1)
        out = part if out is None else out + part
    return out


def expert_of_rows(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows,) the expert whose block holds each row, from the blocks' ends (E for padding rows
    past the last end): a comparison of every row with every end, on the device."""
    index = torch.arange(rows, device=offsets.device)
    return (index.unsqueeze(-1) >= offsets.to(index.dtype).unsqueeze(0)).sum(-1)


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (the lazy backend's)
        return False
