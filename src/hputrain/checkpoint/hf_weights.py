"""A Hugging Face model folder's weights read straight into a model's own tensors: each process
reads, from the memory-mapped safetensors files, only the rows of each tensor that it holds (its
FSDP shards), so that no process ever holds a whole copy of the model, nor a whole parameter.

Each rank reads its own slices, rather than rank 0 reading every tensor and broadcasting or
scattering it shard by shard (Accelerate's cpu_ram_efficient_loading, FSDP2's
`set_model_state_dict(..., broadcast_from_rank0=True)`): it needs no communication at all, no
rank ever holds a whole tensor (rank 0 would hold each one in turn, the largest being the
embedding, vocabulary × width), and the ranks read in parallel. What it asks is that every rank
can read the folder, which a model folder given as `--model DIR` on each node already is; the
pages a rank reads come once from the disk into the page cache, shared by the ranks of a node.

The loader is a *weight source*, an object the recipe attaches to a model built on the meta
device (distributed/fsdp.py `set_weight_source`); the strategy calls its `fill(model)` once the
model is sharded and has storage. Names: the model's parameter names as `from_pretrained` would
load them (the folder's tensor names, a tied weight by either of its names); the name parts that
wrappers insert (PEFT's `base_model.model.` and `base_layer.`, torch's checkpoint and compile
wrappers) are ignored, so the same source fills the model once PEFT has wrapped it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PEFT_PREFIX = "base_model.model."
WRAPPER_PARTS = ("base_layer.", "_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
"""Name parts of wrappers around a module, which its weights' names in a folder never have."""


def safetensors_files(folder: Path) -> dict[str, Path] | str:
    """Tensor name → the file holding it: model.safetensors, or the files the sharded form's
    model.safetensors.index.json maps; a string saying why when the folder holds neither."""
    from safetensors import safe_open

    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            return {key: folder / name for key, name in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"{INDEX_FILE} cannot be read ({exc})"
    single = folder / WEIGHTS_FILE
    if not single.is_file():
        return f"no {WEIGHTS_FILE} or {INDEX_FILE} in the folder"
    try:
        with safe_open(str(single), framework="pt") as handle:
            return {key: single for key in handle.keys()}
    except Exception as exc:  # safetensors raises its own error types for a bad header
        return f"{WEIGHTS_FILE} cannot be read ({exc})"


class FolderWeights:
    """The weight source of a model whose every parameter is a tensor of a folder's safetensors
    files (`match` builds it, or says why not). `fill` is what the strategy calls."""

    def __init__(self, files: dict[str, Path], keys: dict[str, str]) -> None:
        self.files = files  # tensor name -> file
        self.keys = keys  # parameter name (every name of a tied one) -> tensor name

    @classmethod
    def match(cls, folder: Path, model: torch.nn.Module) -> FolderWeights | str:
        """The source for `model` (bare, as transformers builds it) from `folder`, or a string
        saying why its parameters do not map onto the folder's tensors one to one (transformers'
        key renames for some architectures, a missing weight that from_pretrained would draw,
        another shape), for which the caller loads the whole model instead."""
        files = safetensors_files(folder)
        if isinstance(files, str):
            return files
        try:
            shapes = _shapes(set(files.values()))
        except Exception as exc:  # safetensors raises its own error types for a bad header
            return f"the safetensors files cannot be read ({exc})"
        names: dict[int, list[str]] = {}
        params: dict[int, torch.nn.Parameter] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
            params[id(param)] = param
        keys = {}
        for ident, aliases in names.items():
            key = next((name for name in aliases if name in files), None)
            if key is None:
                return f"{aliases[0]} is not among the files' tensors"
            shape = shapes.get(key)
            if shape is None:
                return f"{key} is named in {INDEX_FILE} but is not in its file"
            if shape != tuple(params[ident].shape):
                return f"{key} has shape {list(shape)} in the files, {list(params[ident].shape)} in the model"
            keys.update(dict.fromkeys(aliases, key))
        return cls(files, keys)

    def key_of(self, name: str) -> str | None:
        """The tensor of the files behind the parameter `name` of the model, wrapped or not."""
        if name in self.keys:
            return self.keys[name]
        bare = name.removeprefix(PEFT_PREFIX)
        for part in WRAPPER_PARTS:
            bare = bare.replace(part, "")
        return self.keys.get(bare)

    def fill(self, model: torch.nn.Module) -> list[str]:
        """Copy into each parameter of `model` that the files hold the rows this rank holds of it
        (its local shard, or the whole tensor when unsharded), cast to the parameter's dtype as
        from_pretrained(dtype=...) casts; return the names of the parameters filled."""
        filled = []
        with torch.no_grad():
            for name, param in model.named_parameters():
                key = self.key_of(name)
                if key is None:
                    continue
                local = param.to_local() if hasattr(param, "to_local") else param
                index = local_index(param)
                if local.numel():
                    local.copy_(self.read(key, index))
                filled.append(name)
        return filled

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The part `index` of the tensor `key`, in the file's dtype: only those bytes are read
        from the memory-mapped file, which is closed again (its pages leave this process)."""
        from safetensors import safe_open

        with safe_open(str(self.files[key]), framework="pt") as handle:
            part = handle.get_slice(key)
            return part[index] if index else handle.get_tensor(key)

    def __deepcopy__(self, memo) -> FolderWeights:
        return self  # a copy of the model (DPO's reference) reads the same files


def _shapes(files: set[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the files' headers (each file opened once)."""
    from safetensors import safe_open

    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            shapes |= {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    return shapes


def local_index(param: torch.Tensor) -> tuple[slice, ...]:
    """The slices of the whole tensor that this rank holds of `param`: a DTensor's local shard
    as its placements cut it, else everything."""
    if not hasattr(param, "device_mesh"):
        return tuple(slice(0, size) for size in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(shape) != tuple(param.to_local().shape):  # not the cut torch's own checkpoints read
        raise RuntimeError(f"a shard of shape {tuple(param.to_local().shape)} is not the "
                           f"{tuple(shape)} its placements {param.placements} give")
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))
