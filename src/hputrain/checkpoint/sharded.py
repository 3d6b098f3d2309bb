"""Sharded state IO: under a strategy that shards the model (fsdp), every rank writes its own
shards of the model and optimizer state with torch.distributed.checkpoint (DCP) into SHARDED_DIR
of the checkpoint's folder, inside the same atomic folder protocol as full checkpoints
(folder.py). DCP reshards on load, so a checkpoint of N processes resumes on M. A model with
frozen parameters (a LoRA) saves the shards of its trainable parameters only, as FullState does.

Reading is guarded, because DCP itself unpickles without limits in two places:
- `.metadata` is a pickle that FileSystemReader loads with plain `pickle.load`. `SafeReader`
  loads it with `_MetadataUnpickler`, which builds only DCP's own metadata classes, torch.Size and
  torch's dtypes, layouts and memory formats; any other global (os.system, builtins.eval, ...) is
  refused before anything runs.
- non-tensor values (the optimizer's hyper-parameters) are loaded by DefaultLoadPlanner with
  `torch.load(weights_only=False)`. `SafePlanner` loads them with `weights_only=True`.
Tensors themselves DCP already loads with `torch.load(weights_only=True)`. Before a load,
`read_metadata` checks that every shard file the metadata names is a file of this folder, large
enough for what is read from it, and `check_fits` that the model's tensors are all there with
their shapes, so an incomplete or foreign checkpoint is one line, not a collective's traceback.
"""
from __future__ import annotations

import io
import pickle
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from .checks import (check_param_group_kinds, has_frozen_parameters, load_failure_reason,
                     trainable_names, write_failure)
from .folder import CONFIG_FILE, MODEL_FILE, SHARDED_DIR, TRAINABLE_RECORD, CheckpointError
from .full import write_trainable_files
from .host import STATE_VIEWS, gathered_state
from .state import StateIO
from .streamed import each_once_by_identity, write_safetensors

METADATA_FILE = ".metadata"
MAX_METADATA_BYTES = 1 << 30  # far more than any model's metadata; a bigger file is refused
_MODEL, _OPTIMIZER = "model", "optimizer"  # the two top-level keys of the saved state


# -- the guarded reader ----------------------------------------------------------------------------
_DCP = "torch.distributed.checkpoint"
_ALLOWED = {
    (f"{_DCP}.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {(f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
     ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """pickle, building only the classes a DCP .metadata holds; anything else is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)  # torch.float32 and its kind pickle as globals
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a DCP .metadata never holds")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a persistent id, which a DCP .metadata never holds")


def _storage_reader_classes():
    """SafeReader and SafePlanner, made on first use (no torch.distributed import at import)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._nested_dict import set_element

    class SafeReader(FileSystemReader):
        """FileSystemReader whose .metadata goes through `_MetadataUnpickler`."""

        def read_metadata(self, *args, **kwargs):
            metadata = load_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is not None:
                metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner loading non-tensor values with torch.load(weights_only=True)."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeReader, SafePlanner


def load_metadata(folder: Path):
    """The Metadata in `folder`/.metadata, through `_MetadataUnpickler`; ValueError when it is
    missing, too large, or not DCP metadata."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = folder / METADATA_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing: the sharded checkpoint is incomplete")
    if path.stat().st_size > MAX_METADATA_BYTES:
        raise ValueError(f"{path} is {path.stat().st_size:,} bytes, more than DCP metadata holds")
    with open(path, "rb") as handle:
        try:
            metadata = _MetadataUnpickler(handle).load()
        except Exception as exc:  # a refused global, a truncated or foreign file
            raise ValueError(f"{path} is not DCP metadata: {exc}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise ValueError(f"{path} is not DCP metadata: it holds a {type(metadata).__name__}")
    return metadata


def _check_storage(folder: Path, metadata) -> None:
    """Every shard file the metadata names is a plain file of `folder` holding what is read."""
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        name = str(getattr(info, "relative_path", ""))
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not name or Path(name).name != name or name in (".", ".."):
            raise ValueError(f"its .metadata names a shard file {name[:60]!r} outside {folder}")
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            raise ValueError(f"its .metadata gives {name} a bad offset or length")
        ends[name] = max(ends.get(name, 0), offset + length)
    for name, end in sorted(ends.items()):
        path = folder / name
        if not path.is_file():
            raise ValueError(f"shard file {path} is missing")
        if path.stat().st_size < end:
            raise ValueError(f"shard file {path} is truncated ({path.stat().st_size:,} bytes, "
                             f"{end:,} expected)")


def read_metadata(folder: Path):
    """The checked Metadata of a sharded checkpoint folder (SHARDED_DIR); ValueError if unfit."""
    metadata = load_metadata(folder)
    _check_storage(folder, metadata)
    return metadata


def check_fits(metadata, model_state: dict) -> None:
    """Raise ValueError unless the checkpoint holds every tensor of `model_state` (keyed by name,
    as get_model_state_dict gives it) with its global shape, and no model tensor the model lacks."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = {key[len(_MODEL) + 1:]: entry for key, entry in metadata.state_dict_metadata.items()
             if key.startswith(_MODEL + ".") and isinstance(entry, TensorStorageMetadata)}
    mine = _tensors_by_key(model_state)
    missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or unexpected:
        raise ValueError(f"it does not fit the model (missing: {', '.join(missing[:5]) or 'none'}; "
                         f"unexpected: {', '.join(unexpected[:5]) or 'none'})")
    for name, value in mine.items():
        if tuple(saved[name].size) != tuple(value.shape):
            raise ValueError(f"it does not fit the model: {name} has shape "
                             f"{tuple(saved[name].size)}, the model's {tuple(value.shape)}")


def _tensors_by_key(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a state dict under the keys DCP stores them by: a layer's extra state that
    is a dict of tensors (fp8 scaling: amax_history, scale) as NAME._extra_state.KEY."""
    found = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            found[prefix + name] = value
        elif isinstance(value, dict):
            found |= _tensors_by_key(value, f"{prefix}{name}.")
    return found


def _failure_reason(exc: BaseException) -> str:
    """One line from DCP's CheckpointException (a failure per rank; the first is told) or any
    other error; torch's weights_only advice is left out (checks.load_failure_reason)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = min(failures.items(), key=lambda item: item[0])
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped  # (exception, traceback)
        return f"rank {rank}: {load_failure_reason(inner)}"
    return load_failure_reason(exc)


class SharedWriteError(OSError):
    """A failed write that every rank learned of alike: dcp.save gives each rank every rank's
    failure (save_checkpoint has rank 0 alone say it)."""


def _write_error(exc: BaseException, sharded: Path) -> OSError | None:
    """The SharedWriteError of a failed dcp.save (the first rank's failure, which every rank
    has: a full disk under torch.save's RuntimeError, checks.write_failure) naming the file:
    the rank's shard file (FileSystemWriter's __RANK_0.distcp, one a rank) where the error
    names none; None when it is no failed write."""
    failures = getattr(exc, "failures", None)
    rank, inner = 0, exc
    if isinstance(failures, dict) and failures:
        rank, wrapped = min(failures.items(), key=lambda item: item[0])
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped  # (exception, traceback)
    error = write_failure(inner) if isinstance(inner, BaseException) else None
    if error is None:
        return None
    return SharedWriteError(error.errno, error.strerror,
                            error.filename or str(sharded / f"__{rank}_0.distcp"))


def _dcp_errors() -> tuple[type[BaseException], ...]:
    """What a failed DCP call raises: CheckpointException is a BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


# -- the state IO ----------------------------------------------------------------------------------
class ShardedState(StateIO):
    """Model and optimizer state as DCP shards, written by every rank (see the module docstring)."""

    shards = True

    @staticmethod
    def found_in(folder: Path) -> bool:
        return (folder / SHARDED_DIR / METADATA_FILE).is_file()

    def write(self, folder: Path, *, model, optimizer, rank: int) -> None:
        """Every rank calls this: DCP gathers the plans, each rank writes its shards, rank 0 the
        .metadata. `model` is the module that owns the weights (fully_shard'ed or plain)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = {_MODEL: _dcp_model_state(model)}
        if optimizer is not None:
            state[_OPTIMIZER] = get_optimizer_state_dict(model, optimizer)
        state = _viewed(model, state, "whole")
        writer = dcp.FileSystemWriter(folder / SHARDED_DIR, single_file_per_rank=True, sync_files=True)
        try:
            with _single_process_quiet():
                dcp.save(state, storage_writer=writer, no_dist=not _distributed())
        except _dcp_errors() as exc:  # every rank: DCP shares each rank's failure with all
            error = _write_error(exc, folder / SHARDED_DIR)
            if error is None:
                raise
            raise error from exc
        if has_frozen_parameters(model):  # the record, and a PEFT model's adapter files
            tensors = gathered_state(model, trainable_only=True)  # gathered onto rank 0
            if rank == 0:
                write_trainable_files(folder, model, {name: tensors[name] for name in state[_MODEL]})

    def load(self, folder: Path, *, model, optimizer, rank: int) -> None:
        """Every rank calls this; DCP reshards to the current layout. Raises CheckpointError."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_optimizer_state_dict,
                                                             set_model_state_dict,
                                                             set_optimizer_state_dict)

        sharded = folder / SHARDED_DIR
        state = {_MODEL: _dcp_model_state(model)}
        if optimizer is not None:
            state[_OPTIMIZER] = get_optimizer_state_dict(model, optimizer)  # fills an empty state
        state = _viewed(model, state, "whole")  # loaded in place, through the views
        try:
            check_fits(read_metadata(sharded), state[_MODEL])
            reader_class, planner_class = _storage_reader_classes()
            with _single_process_quiet():
                dcp.load(state, storage_reader=reader_class(sharded), planner=planner_class(),
                         no_dist=not _distributed())
            if optimizer is not None:
                _check_param_groups(state[_OPTIMIZER], optimizer)
        except _dcp_errors() as exc:
            raise CheckpointError(f"Sharded checkpoint {sharded} cannot be loaded: "
                                  f"{_one_line(_failure_reason(exc))}.") from exc
        state = _viewed(model, state, "local")
        # a frozen base is not in the checkpoint: it stays as the model was built
        options = StateDictOptions(strict=not has_frozen_parameters(model))
        set_model_state_dict(model, state[_MODEL], options=options)
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, state[_OPTIMIZER])

    def consolidate(self, path: Path, *, model, rank: int) -> None:
        """Write the whole model to `path` (safetensors) from rank 0: every rank takes part in
        gathering it, one tensor at a time, which rank 0 writes and drops before the next
        (streamed.py). Not for a model with frozen parameters: its base is on disk already, and
        export.save_model writes what loads (a PEFT adapter folder)."""
        if has_frozen_parameters(model):
            return
        write_safetensors(path if rank == 0 else None, each_once_by_identity(model),
                          metadata={"format": "pt"})


def _dcp_model_state(model) -> dict:
    """The model's state dict as DCP saves it (this rank's shards); for a model with frozen
    parameters, the trainable parameters only (checks.trainable_names)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model)
    if has_frozen_parameters(model):
        state = {name: state[name] for name in trainable_names(model)}
    return state


def _viewed(model, state: dict, way: str) -> dict:
    """`state` ({model: ..., optimizer: ...} as DCP takes it) with the tensors of the parameters
    the model's STATE_VIEWS name, and their optimizer state, seen `way` ("whole" or "local")."""
    views = getattr(model, STATE_VIEWS, None)
    if views is None:
        return state
    convert = getattr(views, way)
    model_state = {name: convert(value) if name in views.names else value
                   for name, value in state[_MODEL].items()}
    out = {**state, _MODEL: model_state}
    optimizer = state.get(_OPTIMIZER)
    if isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict):
        per_param = {name: ({key: convert(value) if torch.is_tensor(value) and value.dim() else value
                             for key, value in entry.items()} if name in views.names else entry)
                     for name, entry in optimizer["state"].items()}
        out[_OPTIMIZER] = {**optimizer, "state": per_param}
    return out


def _check_param_groups(loaded: dict, optimizer) -> None:
    """The loaded hyper-parameters are of the kinds of the optimizer's own (load_state_dict takes
    them from the file)."""
    groups = loaded.get("param_groups") if isinstance(loaded, dict) else None
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        raise ValueError("its optimizer parameter groups do not fit the optimizer")
    for index, (theirs, mine) in enumerate(zip(groups, optimizer.param_groups)):
        check_param_group_kinds(index, theirs, mine)


def _one_line(text: str) -> str:
    text = " ".join(str(text).split()).rstrip(".")
    return text if len(text) <= 300 else text[:294] + " (...)"


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextmanager
def _single_process_quiet():
    """DCP warns that it "assumes the intent" of one process when there is no process group:
    here one process is what was meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# -- export ------------------------------------------------------------------------------------
def export_model(checkpoint: Path, output: Path | None = None) -> Path:
    """Write the model of a sharded checkpoint folder as one safetensors file (default: the
    folder's model.safetensors), in this process, with no process group: the tensors are read
    from the shards through the guarded reader. The folder's config.json goes along when the
    output's folder has none, so `hputrain generate` can read the result."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    sharded, output = checkpoint / SHARDED_DIR, output or checkpoint / MODEL_FILE
    if not checkpoint.is_dir():
        raise CheckpointError(f"Checkpoint folder {checkpoint} does not exist.")
    if not sharded.is_dir():
        raise CheckpointError(f"{checkpoint} is not a sharded checkpoint ({SHARDED_DIR}/ is "
                              f"missing): its {MODEL_FILE} already holds the whole model.")
    if (checkpoint / TRAINABLE_RECORD).is_file():  # a LoRA's: its shards are the adapter's
        raise CheckpointError(f"{checkpoint} holds only the trainable parameters of a model "
                              "with frozen ones (a LoRA), not a whole model: a PEFT model's "
                              "adapter_model.safetensors there loads with PeftModel.")
    try:
        metadata = read_metadata(sharded)
        template = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
                    for key, entry in metadata.state_dict_metadata.items()
                    if key.startswith(_MODEL + ".") and isinstance(entry, TensorStorageMetadata)}
        if not template:
            raise ValueError("it holds no model tensors")
        reader_class, planner_class = _storage_reader_classes()
        with _single_process_quiet():
            dcp.load(template, storage_reader=reader_class(sharded), planner=planner_class(),
                     no_dist=True)
    except _dcp_errors() as exc:
        raise CheckpointError(f"Sharded checkpoint {sharded} cannot be exported: "
                              f"{_one_line(_failure_reason(exc))}.") from exc
    tensors = {key[len(_MODEL) + 1:]: value for key, value in template.items()}
    partial = output.with_name(f".{output.name}.partial")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(partial), metadata={"format": "pt"})
        partial.replace(output)  # never a half-written file under the output's name
        config = checkpoint / CONFIG_FILE
        if config.is_file() and not (output.parent / CONFIG_FILE).exists():
            shutil.copyfile(config, output.parent / CONFIG_FILE)
    except Exception as exc:
        partial.unlink(missing_ok=True)
        failed = write_failure(exc)  # a full disk: the system's words, not safetensors'
        reason = failed.strerror if failed is not None and failed.strerror else _one_line(exc)
        raise CheckpointError(f"Cannot write {output}: {reason}.") from exc
    return output
