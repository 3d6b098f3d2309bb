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
load them (the folder's tensor names mapped by transformers' own conversion mapping, a tied
weight by either of its names); the name parts that wrappers insert (PEFT's `base_model.model.`
and `base_layer.`, torch's checkpoint and compile wrappers) are ignored, so the same source fills
the model once PEFT has wrapped it.

A parameter that transformers builds from several of the folder's tensors (a mixture of
experts' fused `experts.gate_up_proj` from each expert's projections) is read part by part
through that conversion (hf_conversion.py): a rank whose shard holds experts 0-3 reads those
experts' tensors and no other. `read_experts` reads a given range of experts, for expert
parallelism.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from .hf_conversion import Node, folder_plan, whole_box
from .host import STATE_VIEWS

WEIGHTS_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
"""A model folder's weights as save_pretrained writes them: one file, or shards and their index."""
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
    """The weight source of a model whose every parameter is made of a folder's safetensors
    tensors (`match` builds it, or says why not): one tensor as stored, or, where transformers
    converts the folder's tensors on loading (a mixture of experts' fused experts), several
    (checkpoint/hf_conversion.py). `fill` is what the strategy calls; `read_part` and
    `read_experts` read any part of one parameter (expert parallelism's experts of a rank)."""

    def __init__(self, files: dict[str, Path], nodes: dict[str, Node]) -> None:
        self.files = files  # tensor name -> file
        self.nodes = nodes  # parameter name (every name of a tied one) -> what the files make it of
        self._handles: dict[Path, object] | None = None  # the files held open while `opened`
        self._files = contextlib.ExitStack()

    @classmethod
    def match(cls, folder: Path, model: torch.nn.Module) -> FolderWeights | str:
        """The source for `model` (bare, as transformers builds it) from `folder`, or a string
        saying why its parameters do not map onto the folder's tensors (a missing weight that
        from_pretrained would draw, another shape, a conversion of transformers not followed
        part by part), for which the caller loads the whole model instead. The folder's names
        map onto the model's as from_pretrained maps them (its conversion mapping)."""
        files = safetensors_files(folder)
        if isinstance(files, str):
            return files
        try:
            shapes = _shapes(set(files.values()))
        except Exception as exc:  # safetensors raises its own error types for a bad header
            return f"the safetensors files cannot be read ({exc})"
        if missing := sorted(set(files) - set(shapes)):
            return f"{missing[0]} is named in {INDEX_FILE} but is not in its file"
        plan = folder_plan(model, shapes)
        if isinstance(plan, str):
            return plan
        names: dict[int, list[str]] = {}
        params: dict[int, torch.nn.Parameter] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
            params[id(param)] = param
        nodes = {}
        for ident, aliases in names.items():
            node = next((plan[name] for name in aliases if name in plan), None)
            if node is None:
                return f"{aliases[0]} is not among the files' tensors"
            if node.shape != tuple(params[ident].shape):
                keys = node.keys()
                made = keys[0] if len(keys) == 1 else f"{aliases[0]} (from {keys[0]} and {len(keys) - 1} more)"
                return f"{made} has shape {list(node.shape)} in the files, {list(params[ident].shape)} in the model"
            nodes.update(dict.fromkeys(aliases, node))
        for name, buffer in _persistent_buffers(model):  # DeepSeek-V3's e_score_correction_bias
            if name in plan and plan[name].shape == tuple(buffer.shape):
                nodes[name] = plan[name]
        return cls(files, nodes)

    def node_of(self, name: str) -> Node | None:
        """What the files make the parameter `name` of the model of, wrapped or not."""
        if name in self.nodes:
            return self.nodes[name]
        bare = name.removeprefix(PEFT_PREFIX)
        for part in WRAPPER_PARTS:
            bare = bare.replace(part, "")
        return self.nodes.get(bare)

    def fill(self, model: torch.nn.Module) -> list[str]:
        """Copy into each parameter of `model` that the files hold the part this rank holds of it
        (its local shard, or the whole tensor when unsharded), cast to the parameter's dtype as
        from_pretrained(dtype=...) casts, and the persistent buffers the files hold (whole, as
        from_pretrained loads them over what the constructor computed); return the names filled."""
        filled = []
        views = getattr(model, STATE_VIEWS, None)
        with torch.no_grad(), self.opened():
            for name, param in [*model.named_parameters(), *model.named_buffers()]:
                node = self.node_of(name)
                if node is None:
                    continue
                local = param.to_local() if hasattr(param, "to_local") else param
                if local.numel():
                    local.copy_(node.read(index_in_whole(param, node.shape, name, views), self.read))
                filled.append(name)
        return filled

    def read_part(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The part `index` (a slice with start and stop per dimension, none empty) of the
        model's parameter `name` as from_pretrained would load it, in the files' dtype, reading
        only the bytes of the folder's tensors that land in it."""
        node = self.node_of(name)
        if node is None:
            raise KeyError(f"{name} is not among the parameters the folder fills")
        with self.opened():
            return node.read(tuple(index), self.read)

    def read_experts(self, name: str, experts: range) -> torch.Tensor:
        """Experts `experts` (a range with step 1) of the fused experts parameter `name`
        (experts along dimension 0, as transformers fuses them: `...mlp.experts.gate_up_proj`,
        `...down_proj`, their biases), whole in the other dimensions: the rows an expert-parallel
        rank holds. Reads only those experts' tensors (stored apart) or rows (stored fused)."""
        node = self.node_of(name)
        if node is None:
            raise KeyError(f"{name} is not among the parameters the folder fills")
        if experts.step != 1 or not 0 <= experts.start < experts.stop <= node.shape[0]:
            raise ValueError(f"experts {experts} are not a range within {name}'s {node.shape[0]}")
        return self.read_part(name, (slice(experts.start, experts.stop),) + whole_box(node.shape[1:]))

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """The part `index` of the folder's tensor `key`, in the file's dtype: only those bytes
        are read from the memory-mapped file (held open while `opened`, else opened for this
        read and closed again)."""
        with self.opened():
            handle = self._handle(self.files[key])
            return handle.get_slice(key)[index] if index else handle.get_tensor(key)

    @contextlib.contextmanager
    def opened(self):
        """The files stay open for the block (outermost wins) and are closed after it, so their
        pages leave this process: a fused experts parameter is read from hundreds of tensors,
        and opening a file parses its whole header again (milliseconds, for each tensor)."""
        if self._handles is not None:
            yield
            return
        with contextlib.ExitStack() as self._files:
            self._handles = {}
            try:
                yield
            finally:
                self._handles = None

    def _handle(self, file: Path):
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = self._files.enter_context(safe_open(str(file), framework="pt"))
        return self._handles[file]

    def __deepcopy__(self, memo) -> FolderWeights:
        return self  # a copy of the model (DPO's reference) reads the same files


def read_experts(folder: Path, model: torch.nn.Module, name: str, experts: range) -> torch.Tensor:
    """Experts `experts` of the fused experts parameter `name` of `model` (bare, as transformers
    builds it; on the meta device is enough) from the model folder `folder`, reading only their
    bytes (FolderWeights.read_experts); an InputError when the folder's tensors do not map onto
    the model's parameters."""
    from ..errors import InputError

    source = FolderWeights.match(Path(folder), model)
    if isinstance(source, str):
        raise InputError(f"{folder}: its weights do not map onto {type(model).__name__}'s parameters ({source})")
    return source.read_experts(name, experts)


def _persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers of `model` that its state dict holds, by state-dict name."""
    return [(f"{owner}.{leaf}" if owner else leaf, buffer) for owner, module in model.named_modules()
            for leaf, buffer in module._buffers.items()
            if buffer is not None and leaf not in module._non_persistent_buffers_set]


def _shapes(files: set[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the files' headers (each file opened once)."""
    from safetensors import safe_open

    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            shapes |= {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    return shapes


def index_in_whole(param: torch.Tensor, whole: tuple[int, ...], name: str, views=None) -> tuple[slice, ...]:
    """The slices of the whole tensor (shape `whole`, as the folder makes it) that this rank
    holds of `param`: its local shard (local_index); for a parameter that holds only this rank's
    experts (expert parallelism: the model's STATE_VIEWS name it), the shard its views place in
    the whole (the rank's experts, and fsdp's cut of them). A part that does not place within
    `whole` is an error, never a silent read of other rows."""
    split = views is not None and name in views.names and tuple(param.shape) != tuple(whole)
    index = local_index(views.whole(param.detach()) if split else param)
    if len(index) != len(whole) or any(part.stop > size for part, size in zip(index, whole)) or (
            not split and tuple(param.shape) != tuple(whole)):
        raise RuntimeError(f"{name}: this rank's part {[(s.start, s.stop) for s in index]} does not "
                           f"place within the folder's {list(whole)}")
    return index


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
