"""transformers' weight conversion (the tensors a folder holds on disk -> the model's parameters),
followed part by part, so that a rank reads only the bytes behind its own part of a parameter.

transformers 5 builds some parameters from several tensors of the folder as it loads them: a
mixture of experts stores each expert's projections apart (Mixtral's
`block_sparse_moe.experts.N.w1/w3.weight`, Qwen's `mlp.experts.N.gate_proj/up_proj.weight`), and
`from_pretrained` stacks them into one fused 3-D parameter per layer (`mlp.experts.gate_up_proj`,
experts × 2·intermediate × hidden), renaming keys on the way. The recipe for a model is its
conversion mapping (`conversion_mapping.get_model_conversion_mapping`: WeightRenaming and
WeightConverter objects, each converter a list of operations such as MergeModulelist(dim) and
Concatenate(dim)). Here that same mapping, with transformers' own key renaming
(`core_model_loading.rename_source_key`) and ordering (`dot_natural_key`), groups the folder's
tensors by the parameter they become; the converter's operations are then applied to *nodes*
(the recipe of a tensor, with its shape, never its values) instead of tensors. Asked for a part
of a parameter (a tuple of slices: a rank's FSDP shard, an expert-parallel rank's experts), a
node asks each of its inputs only for the part of it that lands inside, down to the files: a
rank whose shard is experts 0-3 of a layer reads experts 0-3's tensors and nothing of the others.

Operations followed: MergeModulelist, Concatenate, Transpose, Chunk (every MoE family of
transformers that stores experts apart uses the first two), and Mxfp4Dequantize, the
quantizer's conversion of an MXFP4 folder (GPT-OSS as published: each experts parameter stored
as 4-bit blocks and scales), read part by part and dequantized into the parameter's dtype with
transformers' own function, as from_pretrained dequantizes it. A mapping that uses another
operation on the folder's tensors is reported (a string saying which), and the caller loads the
whole model as before. Saving goes the other way through transformers' own
`revert_weight_conversion`, one parameter at a time (`disk_form`).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

Box = tuple[slice, ...]
Reader = Callable[[str, Box], torch.Tensor]
"""reader(file tensor name, box) -> that part of the tensor, reading only its bytes."""


class Node:
    """A tensor of the model built from the folder's tensors: its shape, and `read(box, reader)`,
    the part `box` of it (a slice per dimension, each with start and stop, none empty)."""

    shape: tuple[int, ...]

    def read(self, box: Box, reader: Reader) -> torch.Tensor:
        raise NotImplementedError

    def keys(self) -> list[str]:
        """The folder's tensors it is made of."""
        raise NotImplementedError


class Leaf(Node):
    """A tensor of the folder, as it is stored."""

    def __init__(self, key: str, shape: tuple[int, ...]) -> None:
        self.key, self.shape = key, tuple(shape)

    def read(self, box: Box, reader: Reader) -> torch.Tensor:
        return reader(self.key, box)

    def keys(self) -> list[str]:
        return [self.key]


class Stacked(Node):
    """torch.stack(parts, dim): the part of a box is read from the parts its range along `dim`
    covers (an expert range reads those experts only)."""

    def __init__(self, parts: list[Node], dim: int) -> None:
        shapes = {part.shape for part in parts}
        if len(shapes) != 1:
            raise _Unfollowed(f"stacks tensors of different shapes {sorted(shapes)}")
        inner = next(iter(shapes))
        self.parts, self.dim = parts, dim % (len(inner) + 1)
        self.shape = inner[:self.dim] + (len(parts),) + inner[self.dim:]

    def read(self, box: Box, reader: Reader) -> torch.Tensor:
        rest = box[:self.dim] + box[self.dim + 1:]
        picked = range(box[self.dim].start, box[self.dim].stop)
        return torch.stack([self.parts[i].read(rest, reader) for i in picked], dim=self.dim)

    def keys(self) -> list[str]:
        return [key for part in self.parts for key in part.keys()]


class Joined(Node):
    """torch.cat(parts, dim): each part read where the box's range along `dim` meets it."""

    def __init__(self, parts: list[Node], dim: int) -> None:
        rank = len(parts[0].shape)
        self.parts, self.dim = parts, dim % rank
        others = {part.shape[:self.dim] + part.shape[self.dim + 1:] for part in parts}
        if len(others) != 1 or any(len(part.shape) != rank for part in parts):
            raise _Unfollowed("concatenates tensors of mismatched shapes")
        first = parts[0].shape
        self.shape = first[:self.dim] + (sum(p.shape[self.dim] for p in parts),) + first[self.dim + 1:]

    def read(self, box: Box, reader: Reader) -> torch.Tensor:
        pieces, offset = [], 0
        want = box[self.dim]
        for part in self.parts:
            size = part.shape[self.dim]
            start, stop = max(want.start, offset), min(want.stop, offset + size)
            if start < stop:
                inner = box[:self.dim] + (slice(start - offset, stop - offset),) + box[self.dim + 1:]
                pieces.append(part.read(inner, reader))
            offset += size
        return torch.cat(pieces, dim=self.dim)

    def keys(self) -> list[str]:
        return [key for part in self.parts for key in part.keys()]


class Swapped(Node):
    """torch.transpose(part, dim0, dim1)."""

    def __init__(self, part: Node, dim0: int, dim1: int) -> None:
        rank = len(part.shape)
        self.part, self.dims = part, (dim0 % rank, dim1 % rank)
        shape = list(part.shape)
        shape[self.dims[0]], shape[self.dims[1]] = shape[self.dims[1]], shape[self.dims[0]]
        self.shape = tuple(shape)

    def read(self, box: Box, reader: Reader) -> torch.Tensor:
        inner = list(box)
        a, b = self.dims
        inner[a], inner[b] = box[b], box[a]
        return self.part.read(tuple(inner), reader).transpose(a, b)

    def keys(self) -> list[str]:
        return self.part.keys()


class Piece(Node):
    """`part` narrowed to [start, start + size) along `dim` (one of torch.chunk's chunks)."""

    def __init__(self, part: Node, dim: int, start: int, size: int) -> None:
        self.part, self.dim, self.start = part, dim % len(part.shape), start
        self.shape = part.shape[:self.dim] + (size,) + part.shape[self.dim + 1:]

    def read(self, box: Box, reader: Reader) -> torch.Tensor:
        shifted = slice(box[self.dim].start + self.start, box[self.dim].stop + self.start)
        return self.part.read(box[:self.dim] + (shifted,) + box[self.dim + 1:], reader)

    def keys(self) -> list[str]:
        return self.part.keys()


class Mxfp4(Node):
    """An experts parameter stored in MXFP4 (GPT-OSS as published): `{name}_blocks`, experts ×
    rows × groups × 16 bytes (two 4-bit E2M1 values a byte, the low nibble first), and
    `{name}_scales`, experts × rows × groups (a power of two per group of 32 values, biased by
    127), dequantized by transformers' own function (integrations/mxfp4.py, as from_pretrained's
    Mxfp4Dequantize does where it has no MXFP4 kernels) into the parameter's `dtype`, the result
    transposed to experts × 32·groups × rows. A part reads, for its experts and rows only, the
    groups its columns fall in, one expert at a time (the dequantized copy of one expert's part
    is all it holds beside the result)."""

    def __init__(self, blocks: Node, scales: Node, dtype: torch.dtype) -> None:
        if len(blocks.shape) != 4 or blocks.shape[:3] != scales.shape:
            raise _Unfollowed(f"dequantizes MXFP4 blocks {list(blocks.shape)} with scales "
                              f"{list(scales.shape)}, which are not experts × rows × groups (× 16)")
        experts, rows, groups, width = blocks.shape
        self.blocks, self.scales, self.dtype, self.group = blocks, scales, dtype, 2 * width
        self.shape = (experts, groups * self.group, rows)

    def read(self, box: Box, reader: Reader) -> torch.Tensor:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        experts, columns, rows = box
        groups = slice(columns.start // self.group, -(-columns.stop // self.group))
        skip = columns.start - groups.start * self.group
        out = torch.empty(tuple(part.stop - part.start for part in box), dtype=self.dtype)
        for index, expert in enumerate(range(experts.start, experts.stop)):
            one = slice(expert, expert + 1)
            blocks = self.blocks.read((one, rows, groups, slice(0, self.blocks.shape[3])), reader)
            scales = self.scales.read((one, rows, groups), reader)
            values = convert_moe_packed_tensors(blocks, scales, dtype=self.dtype)  # 1 × columns × rows
            out[index] = values[0, skip:skip + out.shape[1]]
        return out

    def keys(self) -> list[str]:
        return self.blocks.keys() + self.scales.keys()


class _Unfollowed(Exception):
    """A conversion this module cannot follow part by part; its message says which."""


def whole_box(shape: tuple[int, ...]) -> Box:
    return tuple(slice(0, size) for size in shape)


# -- the plan: the model's parameters as nodes over the folder's tensors --------------------------

def folder_plan(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> dict[str, Node] | str:
    """Each state-dict name of `model` that the folder's tensors (`shapes`: name -> shape) give,
    as from_pretrained maps them, -> its node; or a string saying which conversion of
    transformers cannot be followed part by part. A model without a conversion mapping (not a
    transformers model, a transformers without conversions) maps names one to one. Quantized
    weights are followed where their dequantization is (DEQUANTIZED), else said: a part read as
    stored would be the quantized values without their scales."""
    method = quantization_method(model)
    if method is not None and method not in DEQUANTIZED:
        return f"its weights are quantized ({method}), which hputrain does not dequantize part by part"
    mapping = _conversion_mapping(model)
    if mapping is None:
        return {name: Leaf(name, shape) for name, shape in shapes.items()}
    from transformers.core_model_loading import (WeightConverter, WeightRenaming, dot_natural_key,
                                                 rename_source_key)

    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    plan: dict[str, Node] = {}
    groups: dict[str, tuple[object, dict[str, list[Node]]]] = {}
    for key in sorted(shapes, key=dot_natural_key):  # transformers' order: experts 0, 1, ..., 10
        name, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if name not in meta and key in meta:  # as from_pretrained: a name that needed no renaming
            name, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta)
        if name not in meta:
            continue  # a tensor the model does not use (from_pretrained: unexpected)
        if pattern is None:
            plan.setdefault(name, Leaf(key, shapes[key]))
        else:
            inputs = groups.setdefault(name, (by_pattern[pattern], {}))[1]
            inputs.setdefault(pattern, []).append(Leaf(key, shapes[key]))
    for name, (converter, inputs) in groups.items():
        try:
            plan |= _converted(converter, name, inputs, model)
        except _Unfollowed as exc:
            return f"transformers' conversion to {name} {exc}"
    return plan


DEQUANTIZED = ("mxfp4",)
"""The quantization methods of pre-quantized folders read part by part, dequantized (Mxfp4)."""


def quantization_method(model) -> str | None:
    """The quant_method of the folder's quantization_config that `model`'s config carries
    (from_config keeps it), or None for weights stored as they are."""
    quantization = getattr(getattr(model, "config", None), "quantization_config", None)
    if quantization is None:
        return None
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None))
    return str(getattr(method, "value", method))


def _conversion_mapping(model) -> list | None:
    """The WeightRenaming and WeightConverter objects from_pretrained would load `model` with;
    for an MXFP4 folder, with its quantizer's dequantizing converters, as from_pretrained loads
    it where it has no MXFP4 kernels (the CPU, Gaudi) or is told to dequantize."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # a transformers from before weight conversions
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    quantizer = None
    if quantization_method(model) in DEQUANTIZED:
        from transformers.quantizers.auto import AutoHfQuantizer

        quantizer = AutoHfQuantizer.from_config(model.config.quantization_config, pre_quantized=True)
        quantizer.quantization_config.dequantize = True
    return get_model_conversion_mapping(model, hf_quantizer=quantizer)


def _converted(converter, first_name: str, inputs: dict[str, list[Node]], model) -> dict[str, Node]:
    """The converter's operations applied to nodes, as WeightConverter.convert applies them to
    tensors, then named as it names its results (the first target's name's prefix and suffix)."""
    values: dict = dict(inputs)
    for op in converter.operations:
        values = _apply(op, values, converter, first_name, model)
    full = first_name.replace("*.", "0.") if "*." in first_name else first_name
    found = next((k for k in values if k in full), None)
    if found is None:
        raise _Unfollowed(f"names its results {sorted(values)}, which {first_name} does not contain")
    before, _, after = full.partition(found)
    return {before + target + after: _single(node) for target, node in values.items()}


def _single(value) -> Node:
    return value[0] if isinstance(value, list) else value


def _apply(op, values: dict, converter, first_name: str, model) -> dict:
    """One operation of transformers' core_model_loading applied to nodes."""
    from transformers import core_model_loading as ops

    sources, targets = converter.source_patterns, converter.target_patterns
    if isinstance(op, ops.MergeModulelist):
        count = len(values)
        return {op.get_target_pattern(count, pattern, targets):
                (Stacked(value, op.dim) if isinstance(value, list) else value)
                for pattern, value in values.items()}
    if isinstance(op, ops.Concatenate):
        parts = []
        for pattern in sources:
            value = values.get(pattern)
            parts.extend(value if isinstance(value, list) else [] if value is None else [value])
        return {op.get_target_pattern(targets): Joined(parts, op.dim)}
    if isinstance(op, ops.Transpose):
        target = op.get_target_pattern(values, sources, targets)
        node = _single(next(iter(values.values())))
        if op.check_dims and node.shape == tuple(model.get_parameter(first_name).shape):
            return {target: node}
        return {target: Swapped(node, op.dim0, op.dim1)}
    if isinstance(op, ops.Chunk):
        if len(values) != 1:
            raise _Unfollowed("chunks several tensors at once")
        node = _single(next(iter(values.values())))
        names = op.get_target_patterns(targets, config=getattr(model, "config", None))
        length = node.shape[op.dim]
        size = math.ceil(length / len(names))
        starts = range(0, length, size)
        return {name: Piece(node, op.dim, start, min(size, length - start)) for name, start in zip(names, starts)}
    if _dequantizes_mxfp4(op):
        parts = {pattern.rpartition("_")[2]: value for pattern, value in values.items()}
        if parts.keys() != {"blocks", "scales"} or any(isinstance(v, list) and len(v) != 1 for v in parts.values()):
            raise _Unfollowed(f"dequantizes MXFP4 from {sorted(values)}, not one blocks and one scales tensor")
        dtype = model.get_parameter(first_name).dtype  # as Mxfp4Dequantize: the parameter's
        return {targets[0]: Mxfp4(_single(parts["blocks"]), _single(parts["scales"]), dtype)}
    raise _Unfollowed(f"uses {type(op).__name__}, which hputrain does not follow part by part")


def _dequantizes_mxfp4(op) -> bool:
    try:
        from transformers.integrations.mxfp4 import Mxfp4Dequantize
    except ImportError:  # a transformers without MXFP4
        return False
    return isinstance(op, Mxfp4Dequantize)


# -- saving: the model's parameters in the folder's form ------------------------------------------

def disk_form(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors that `save_pretrained` writes for the model's tensor `name` (`tensor`, whole, or
    a meta placeholder of its shape): transformers' own revert_weight_conversion of it alone
    (a fused experts parameter -> each expert's projections under their on-disk names);
    {name: tensor} for a model that transformers does not convert."""
    return _reverted(model, {name: tensor})


def _reverted(model, state: dict) -> dict:
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without weight conversions renames nothing
        return dict(state)
    if not isinstance(model, PreTrainedModel):
        return dict(state)
    return revert_weight_conversion(model, dict(state))


class DiskForm:
    """`convert(name, tensor)` for the streamed writer (streamed.write_safetensors): the tensors
    save_pretrained writes for each of the model's tensors, one at a time. Built once from all
    of them (`of`): transformers' reverse conversion of the whole state gives the names on disk;
    a tensor it leaves as it is (most: every dense weight) is written as it is, and each other
    one goes through the reverse conversion alone (a call costs milliseconds: it rebuilds the
    model's mapping)."""

    def __init__(self, model, names: dict[str, list[str]]) -> None:
        self.model = model
        self.names = names  # the model's tensor -> the names it is written under

    @classmethod
    def of(cls, model, placeholders: dict[str, torch.Tensor]) -> DiskForm | None:
        """From the model's tensors as meta placeholders; None where reverting one tensor at a
        time does not give what reverting them all at once gives (a reverse conversion that
        joins several of the model's tensors), or changes the bytes."""
        try:
            together = _reverted(model, placeholders)
            parts, names = {}, {}
            for name, tensor in placeholders.items():
                kept = name in together and _alike(together[name], tensor)
                outs = {name: tensor} if kept else disk_form(model, name, tensor)
                parts |= outs
                names[name] = list(outs)
        except Exception:  # noqa: BLE001 - whatever it cannot do on placeholders: not streamed
            return None
        if parts.keys() != together.keys() or not all(_alike(parts[k], together[k]) for k in parts) or (
                sum(p.numel() for p in parts.values()) != sum(t.numel() for t in placeholders.values())):
            return None
        return cls(model, names)

    def __call__(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.names.get(name) == [name]:
            return {name: tensor}
        return disk_form(self.model, name, tensor)


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype
