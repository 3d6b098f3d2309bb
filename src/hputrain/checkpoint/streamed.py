"""A sharded model's weights written as safetensors by the main rank, one tensor at a time.

Under fsdp each rank holds a shard of every parameter. Gathering the whole state dict first and
then writing it (torch's full state dict, then a library's writer) holds the whole model on the
main rank at once: for a model that needs fsdp, often more than its host has. Here each tensor
is gathered (every rank takes part: it is a collective), written at its place in the file by
the main rank, and dropped before the next; the main rank holds its shards and one whole tensor,
and the other ranks copy none of it to their host.

The file is the safetensors format itself: an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range (all known before any tensor is gathered: the
names, dtypes and global shapes), then the bytes in that order. `safetensors.safe_open` and
`load_file` read it as any other.

A write that fails on the main rank (a full disk) does not stop the gathers, which the other
ranks are waiting in: the main rank goes on taking part, writes nothing more, and raises once
they are done, so every rank leaves the collectives together.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from .host import whole_views

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
           torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
           torch.float8_e5m2: "F8_E5M2"}


def each_once_by_identity(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors (parameters and persistent buffers, sharded or not) by state-dict
    name, a tensor registered under two names (a tied weight) under its first only; the layers'
    extra state (not tensors) left out."""
    seen, entries = set(), {}
    for name, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor) or id(value) in seen:
            continue
        seen.add(id(value))
        entries[name] = value
    return whole_views(model, entries)  # expert parallelism's split experts, whole


def header(entries: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors header of `entries` (their global shapes and dtypes), in their order,
    padded with spaces to 8 bytes as safetensors pads it, length prefix included."""
    table: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in entries.items():
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"{name} is {tensor.dtype}, which safetensors does not store")
        size = tensor.numel() * tensor.element_size()
        table[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def whole(tensor: torch.Tensor, keep: bool = True) -> torch.Tensor | None:
    """`tensor` whole and on the CPU: a DTensor (fsdp's shard) gathered from every rank (a
    collective: each rank calls it), from the device its mesh communicates on (a shard that
    fsdp_cpu_offload keeps in host memory goes there first). `keep` False, on a rank that
    writes nothing: it takes part in the gather and returns None, making no host copy, so that
    a node holds one host copy of the tensor, not one a rank (as torch's full state dict with
    cpu_offload copies to rank 0's host alone)."""
    if hasattr(tensor, "full_tensor"):
        from torch.distributed.tensor import DTensor

        mesh, local = tensor.device_mesh, tensor.to_local()
        if local.device.type != mesh.device_type:
            tensor = DTensor.from_local(local.to(mesh.device_type), mesh, tensor.placements,
                                        shape=tensor.shape, stride=tensor.stride())
        tensor = tensor.full_tensor()
    return tensor.detach().cpu() if keep else None


def placeholder(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of `tensor`'s global shape and dtype: what a header or a planner reads."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def write_safetensors(path: Path | None, entries: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None, convert=None) -> None:
    """Write `entries` to `path` as safetensors, gathering each in turn (every rank calls this;
    the main rank passes its path, the others None and write nothing). `convert(name, tensor)`,
    when given, turns each whole tensor into the tensors written in its place ({name: tensor}
    without it; the names and shapes it gives a meta placeholder are the header's): a fused
    experts parameter written as transformers' on-disk experts. See the module docstring for a
    failed write."""
    convert = convert or (lambda name, tensor: {name: tensor})
    written = {out: part for name, tensor in entries.items()
               for out, part in convert(name, placeholder(tensor)).items()}
    head = header(written, metadata)  # on every rank: a dtype it refuses stops all of them
    failure = handle = None
    if path is not None:
        try:
            handle = open(path, "wb")
            handle.write(head)
        except OSError as exc:
            failure, handle = exc, _close(handle)
    for name, tensor in entries.items():
        full = whole(tensor, keep=handle is not None)  # a rank that writes: the only host copy
        for part in convert(name, full).values() if full is not None else ():
            try:
                handle.write(part.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            except OSError as exc:
                failure, handle = exc, _close(handle)
                break
        del full  # one whole tensor at a time
    if handle is not None:
        try:
            handle.flush()
            handle.close()
        except OSError as exc:
            failure = exc
    if failure is not None:
        if not failure.filename and failure.strerror is not None:  # write() names no file
            failure.filename = str(path)
        raise failure


def _close(handle) -> None:
    if handle is not None:
        try:
            handle.close()
        except OSError:
            pass
    return None
