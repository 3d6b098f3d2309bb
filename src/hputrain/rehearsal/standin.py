"""A stand-in Gaudi runtime: `habana_frameworks` without a Gaudi, for `hputrain doctor`.

A script written for Gaudi imports `habana_frameworks`, names the `hpu` device and calls
`htcore.mark_step()`. While the doctor rehearses it, `StandIn` puts a small `habana_frameworks`
module tree into sys.modules (with real `__spec__`s, so `importlib.util.find_spec` finds it, as
transformers' `is_torch_hpu_available` asks) and maps the `hpu` device onto PyTorch's own lazy
tensor backend on the CPU, a dry run of Gaudi's lazy mode. Removing it puts everything back.

What it covers (docs/doctor.md keeps the same list for users):

- `habana_frameworks.torch.core`: `mark_step()`, the lazy step boundary (torch._lazy.mark_step,
  then every listener added with `on_mark_step`).
- `habana_frameworks.torch.hpu` (also `torch.hpu`, registered as the real runtime does):
  is_available (True), device_count (LOCAL_WORLD_SIZE / WORLD_SIZE of the original environment,
  else 1), current_device, set_device, get_device_name, synchronize, memory_allocated,
  max_memory_allocated, memory_stats, reset_peak_memory_stats (the process's resident memory
  against the machine's), wrap_in_hpu_graph (the module unchanged), and the random-seed
  functions (torch's CPU generator: manual_seed, manual_seed_all, seed, initial_seed,
  get_rng_state, set_rng_state).
- `habana_frameworks.torch.distributed.hccl`: importing it makes Gaudi's process-group backend
  (accelerators/hpu.py's DIST_BACKEND) usable; it is Gloo. A script started as one rank of several (WORLD_SIZE > 1) is
  rehearsed as that rank alone: the environment says one rank of one while it runs, and
  DistributedDataParallel is the bare module (no gradient all-reduce to rehearse on one rank).
- the device: `torch.device("hpu")` / "hpu:N" wherever the script passes it to torch (`.to(...)`,
  `device=` of factory functions, `Module.to`, `Tensor.hpu()`, `Module.hpu()`) lands on the lazy
  device, so `tensor.device.type` reads "lazy", not "hpu".
- `torch.compile` with Gaudi's compile backend (COMPILE_BACKEND) hands the function back unchanged: it runs lazily,
  which is how the doctor rehearses it.
- `habana_frameworks.torch.hpex`: `optimizers.FusedAdamW`, `normalization.FusedClipNorm` and
  `kernels.FusedSDPA`, CPU equivalents of what Gaudi's compute (standin_hpex.py).

Anything else under `habana_frameworks` raises an AttributeError (or ModuleNotFoundError) naming
it as not covered (`NOT_COVERED`), which the doctor turns into one line.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import socket
import sys
import types
from collections.abc import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from ..accelerators.hpu import COMPILE_BACKEND, DEVICE_TYPE, DIST_BACKEND
from .standin_hpex import hpex_members

NOT_COVERED = "hputrain's stand-in for habana_frameworks does not cover"
"""The start of every error raised for a part of habana_frameworks the stand-in lacks."""

LAZY = torch.device("lazy")
_DISTRIBUTED_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def real_gaudi_present() -> bool:
    """A real habana_frameworks is installed and sees an HPU (asked only when no stand-in is in)."""
    if "habana_frameworks" in sys.modules or importlib.util.find_spec("habana_frameworks") is None:
        return False
    try:
        import habana_frameworks.torch.hpu as hpu
        return bool(hpu.is_available())
    except Exception:  # a broken install is no Gaudi to rehearse on
        return False


def to_lazy(device):
    """`device` with the hpu device (a torch.device, "hpu", "hpu:0") replaced by the lazy one."""
    if isinstance(device, str) and device.split(":")[0] == DEVICE_TYPE:
        return LAZY
    if isinstance(device, torch.device) and device.type == DEVICE_TYPE:
        return LAZY
    return device


class HpuToLazy(TorchFunctionMode):
    """Maps the hpu device onto the lazy one in every torch call (positional arguments and the
    `device` keyword), and tells `on_transfer` of each host tensor the script moves there
    outside `Module.to` (the step's inputs, whose shapes the doctor records)."""

    def __init__(self, on_transfer: Callable[[torch.Tensor], None] | None = None) -> None:
        super().__init__()
        self.on_transfer = on_transfer
        self.moving_module = 0  # inside Module.to: parameters and buffers, not inputs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mapped = tuple(to_lazy(a) for a in args)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": to_lazy(kwargs["device"])}
        result = func(*mapped, **kwargs)
        if func is torch.Tensor.to and self.on_transfer is not None and not self.moving_module:
            source = args[0] if args else None
            if (isinstance(source, torch.Tensor) and isinstance(result, torch.Tensor)
                    and source.device.type != "lazy" and result.device.type == "lazy"):
                self.on_transfer(source)
        return result


class _Module(types.ModuleType):
    """A stand-in module: an attribute it lacks is named as not covered."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{NOT_COVERED} {self.__name__}.{name}")


class _Loader(importlib.abc.Loader):
    """Hands out the stand-in's module objects (already built) for their specs."""

    def __init__(self, modules: dict[str, types.ModuleType]) -> None:
        self.modules = modules

    def create_module(self, spec):
        return self.modules[spec.name]

    def exec_module(self, module) -> None:
        if module.__name__ == "habana_frameworks.torch":
            _register_torch_hpu(self.modules["habana_frameworks.torch.hpu"])


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the stand-in's modules (after a script deleted them from sys.modules, say)."""

    def __init__(self, loader: _Loader) -> None:
        self.loader = loader

    def find_spec(self, name, path=None, target=None):
        module = self.loader.modules.get(name)
        return None if module is None else module.__spec__


def _register_torch_hpu(hpu: types.ModuleType) -> None:
    """torch.hpu, as the real runtime registers it on import of habana_frameworks.torch."""
    if getattr(torch, DEVICE_TYPE, None) is not hpu:
        if hasattr(torch, DEVICE_TYPE):
            delattr(torch, DEVICE_TYPE)
        torch._register_device_module(DEVICE_TYPE, hpu)


class StandIn:
    """The stand-in runtime, installed by `with StandIn() as runtime:` (or install() / remove()).

    `runtime.on_mark_step(fn)` adds a listener called after each `htcore.mark_step()`;
    `runtime.mark_step()` is that call; `runtime.mark_steps` counts them; `runtime.device` is the
    lazy device hpu maps to; `runtime.ranks` is the WORLD_SIZE the script was started with (1
    when none); `runtime.on_transfer` is called with each host tensor moved to the device outside
    Module.to (settable before or after install)."""

    def __init__(self) -> None:
        self.device = LAZY
        self.mark_steps = 0
        self.ranks = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self._devices = int(os.environ.get("LOCAL_WORLD_SIZE", self.ranks) or 1)
        self._listeners: list[Callable[[], None]] = []
        self._mode = HpuToLazy(on_transfer=self._transfer)
        self.on_transfer: Callable[[torch.Tensor], None] | None = None
        self._undo: contextlib.ExitStack | None = None
        self._peak = 0

    # -- the API a rehearsal uses -------------------------------------------------------------------

    def on_mark_step(self, listener: Callable[[], None]) -> None:
        """Call `listener()` after every mark_step (the script's, or `mark_step()`)."""
        self._listeners.append(listener)

    def mark_step(self, device_str: str = "", sync: bool = False) -> None:
        """htcore.mark_step: run the lazy graph accumulated so far, then tell the listeners."""
        torch._lazy.mark_step()
        self.mark_steps += 1
        for listener in list(self._listeners):
            listener()

    def install(self) -> None:
        """Put the modules, the device mapping and the patches in place."""
        from torch._lazy import ts_backend  # noqa: F401  (the backend hputrain's CPU lazy mode runs on)

        from ..accelerators.cpu import _start_lazy_backend

        _start_lazy_backend()
        stack = contextlib.ExitStack()
        try:
            self._install_modules(stack)
            self._install_patches(stack)
            self._install_distributed(stack)
            stack.enter_context(self._mode)
        except BaseException:
            stack.close()
            raise
        self._undo = stack

    def remove(self) -> None:
        """Take everything out again, leaving sys.modules, torch and the environment as before."""
        if self._undo is not None:
            undo, self._undo = self._undo, None
            undo.close()

    def __enter__(self) -> StandIn:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _transfer(self, tensor: torch.Tensor) -> None:
        if self.on_transfer is not None:
            self.on_transfer(tensor)

    # -- the modules --------------------------------------------------------------------------------

    def _install_modules(self, stack: contextlib.ExitStack) -> None:
        modules = self._build_modules()
        loader = _Loader(modules)
        for name, module in modules.items():
            module.__spec__ = importlib.machinery.ModuleSpec(name, loader, is_package=True)
            module.__spec__.submodule_search_locations = []
            module.__loader__, module.__path__ = loader, []
            module.__file__ = __file__  # a real file: "a namespace package" to whoever checks
        saved = {name: sys.modules[name] for name in list(sys.modules)
                 if name == "habana_frameworks" or name.startswith("habana_frameworks.")}
        saved_hpu = torch.__dict__.get(DEVICE_TYPE), sys.modules.get(f"torch.{DEVICE_TYPE}")
        finder = _Finder(loader)

        def restore() -> None:
            sys.meta_path[:] = [f for f in sys.meta_path if f is not finder]
            for name in [n for n in sys.modules if n == "habana_frameworks" or n.startswith("habana_frameworks.")]:
                del sys.modules[name]
            sys.modules.update(saved)
            _put_back(torch, DEVICE_TYPE, saved_hpu[0])
            _put_back(sys.modules, f"torch.{DEVICE_TYPE}", saved_hpu[1])

        stack.callback(restore)
        for name in saved:
            del sys.modules[name]
        sys.meta_path.insert(0, finder)
        # imported in full, as a script's `import habana_frameworks.torch.core` would
        sys.modules.update(modules)
        _register_torch_hpu(modules["habana_frameworks.torch.hpu"])

    def _build_modules(self) -> dict[str, types.ModuleType]:
        hpex = hpex_members(self.mark_step, NOT_COVERED)
        names = ["habana_frameworks", "habana_frameworks.torch", "habana_frameworks.torch.core",
                 "habana_frameworks.torch.hpu", "habana_frameworks.torch.hpu.random",
                 "habana_frameworks.torch.distributed", "habana_frameworks.torch.distributed.hccl",
                 "habana_frameworks.torch.hpex", *hpex]
        modules = {name: _Module(name, "hputrain's stand-in (rehearsal/standin.py)") for name in names}
        for name, module in modules.items():
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(modules[parent], child, module)
        modules["habana_frameworks"].__version__ = "0.0+hputrain.standin"
        modules["habana_frameworks.torch"].__version__ = "0.0+hputrain.standin"
        modules["habana_frameworks.torch.core"].mark_step = self.mark_step
        _fill(modules["habana_frameworks.torch.hpu"], self._hpu_functions())
        _fill(modules["habana_frameworks.torch.hpu"], _random_functions())
        _fill(modules["habana_frameworks.torch.hpu.random"], _random_functions())
        for name, members in hpex.items():
            _fill(modules[name], members)
        return modules

    def _hpu_functions(self) -> dict[str, Callable]:
        current = [0]

        def set_device(device) -> None:
            current[0] = torch.device(device).index or 0 if not isinstance(device, int) else device

        return {
            "is_available": lambda: True, "is_initialized": lambda: True,
            "device_count": lambda: self._devices, "current_device": lambda: current[0],
            "set_device": set_device, "get_device_name": lambda device=None: "GAUDI (hputrain stand-in)",
            "synchronize": lambda device=None: torch._lazy.wait_device_ops(),
            "memory_allocated": lambda device=None: self._memory()[0],
            "max_memory_allocated": lambda device=None: self._memory()[1],
            "memory_stats": lambda device=None: self._memory_stats(),
            "reset_peak_memory_stats": self._reset_peak,
            "wrap_in_hpu_graph": lambda module, *args, **kwargs: module,
        }

    def _memory(self) -> tuple[int, int]:
        from ..accelerators.cpu import _rss_bytes

        current, _ = _rss_bytes()
        self._peak = max(self._peak, current)
        return current, self._peak

    def _memory_stats(self) -> dict[str, int]:
        current, peak = self._memory()
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        return {"InUse": current, "MaxInUse": peak, "Limit": limit, "NumAllocs": 0, "NumFrees": 0}

    def _reset_peak(self, device=None) -> None:
        self._peak = 0

    # -- torch: the device, compile, distributed ----------------------------------------------------

    def _install_patches(self, stack: contextlib.ExitStack) -> None:
        mode = self._mode
        original_module_to = torch.nn.Module.to

        def module_to(module, *args, **kwargs):
            mode.moving_module += 1
            try:
                return original_module_to(module, *args, **kwargs)
            finally:
                mode.moving_module -= 1

        original_compile = torch.compile

        def compile(model=None, *args, backend="inductor", **kwargs):
            if backend != COMPILE_BACKEND:
                return original_compile(model, *args, backend=backend, **kwargs)
            return model if model is not None else (lambda fn: fn)

        _patch(stack, torch.nn.Module, "to", module_to)
        _patch(stack, torch.nn.Module, DEVICE_TYPE, lambda module, device=None: module.to(LAZY))
        _patch(stack, torch.Tensor, DEVICE_TYPE, lambda tensor, device=None, non_blocking=False, **kw:
               tensor.to(LAZY, non_blocking=non_blocking))
        _patch(stack, torch, "compile", compile)

    def _install_distributed(self, stack: contextlib.ExitStack) -> None:
        """Gaudi's collectives as Gloo; a script started as one rank of several runs as that rank
        alone."""
        import torch.distributed as dist
        import torch.nn.parallel as parallel

        if not dist.is_available():
            return
        _register_hccl()
        saved = {name: os.environ.get(name) for name in _DISTRIBUTED_ENV}

        def restore() -> None:
            if dist.is_initialized():
                dist.destroy_process_group()
            for name, value in saved.items():
                _put_back(os.environ, name, value)

        stack.callback(restore)
        if self.ranks > 1:
            os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        _patch(stack, parallel, "DistributedDataParallel", _OneRank)
        _patch(stack, sys.modules["torch.nn.parallel.distributed"], "DistributedDataParallel", _OneRank)


class _OneRank(torch.nn.Module):
    """DistributedDataParallel on one rank: the module itself (as `.module`), which on one rank
    computes the same; Gloo could not take the lazy device's tensors anyway."""

    def __init__(self, module: torch.nn.Module, *args, **kwargs) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield


_hccl_registered = False


def _register_hccl() -> None:
    """Gaudi's process-group backend (DIST_BACKEND), created as Gloo (torch keeps backends for the
    process)."""
    global _hccl_registered
    import torch.distributed as dist

    if _hccl_registered or DIST_BACKEND in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(
        DIST_BACKEND, lambda store, rank, size, timeout: dist.ProcessGroupGloo(store, rank, size, timeout),
        devices=["cpu", "lazy"])
    _hccl_registered = True


def _random_functions() -> dict[str, Callable]:
    return {"manual_seed": torch.manual_seed, "manual_seed_all": torch.manual_seed,
            "seed": torch.seed, "initial_seed": torch.initial_seed,
            "get_rng_state": lambda device=None: torch.get_rng_state(),
            "set_rng_state": lambda state, device=None: torch.set_rng_state(state)}


def _fill(module: types.ModuleType, functions: dict[str, Callable]) -> None:
    for name, function in functions.items():
        setattr(module, name, function)


_MISSING = object()


def _patch(stack: contextlib.ExitStack, owner, name: str, value) -> None:
    """Set owner.name = value until the stack closes."""
    saved = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
    setattr(owner, name, value)
    stack.callback(lambda: setattr(owner, name, saved) if saved is not _MISSING else delattr(owner, name))


def _put_back(owner, name: str, value) -> None:
    """Restore `name` in a mapping or on an object to `value`, or remove it where it was None."""
    if isinstance(owner, (dict, os._Environ)):
        if value is None:
            owner.pop(name, None)
        else:
            owner[name] = value
    elif value is None:
        if name in vars(owner):
            delattr(owner, name)
    else:
        setattr(owner, name, value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
