"""The CPU: always present. In lazy mode it runs on PyTorch's own lazy tensor backend
(torch._lazy with the TorchScript backend), a dry run of a Gaudi lazy-mode run.

Whether the CPU runs bfloat16 natively is told by its flags and confirmed by a probe that times a
few matrix products per dtype (once per process): without AVX512-BF16 or AMX (x86), or the BF16
extension (Arm), torch emulates bf16 and a matrix product can run ~100x slower than in float32.
The same probe gives the measured peak that the CPU's MFU is reported against.

A test switch, HPUTRAIN_CPU_NATIVE_BF16=1 or 0, overrules both, so that a test assuming one kind
of CPU fails on the developer's own machine, whatever its kind (docs/contributing.md).
"""
from __future__ import annotations

import functools
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass

import torch

from ..errors import InputError
from .base import GB, Accelerator, torch_grouped_mm


def _rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # Linux reports KiB, macOS bytes
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        current = peak
    return current, max(current, peak)  # the kernel updates its high-water mark lazily


def _keep_freed_memory() -> None:
    """Stop glibc's malloc from handing freed tensor memory back to the kernel after every step.

    With its default, self-adjusting thresholds, malloc trims the heap top or unmaps large blocks
    whenever a step's activations are freed, and the next step page-faults them in again: measured
    here, 2-3x the minor faults and up to 10% slower bf16 steps, depending only on the heap's
    layout. Fixed thresholds (what MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ would set) keep
    the memory mapped. A user who set those variables, or HPUTRAIN_CPU_MALLOC=default, keeps malloc's
    own behaviour; other C libraries are left alone.

    Not when this process is one of several ranks on the host (LOCAL_WORLD_SIZE > 1, as every
    launcher hputrain reads sets it): they share its memory, and what each keeps is kept N
    times. There a tensor of 1 MiB or more gets a mapping of its own, returned when it is freed
    (MALLOC_MMAP_THRESHOLD_=1048576): measured in docs/scale.md, each of 4 fsdp ranks of a 191M
    Llama peaks at 0.45x one process instead of 0.59x, for about 7% of the step's time.
    """
    if (sys.platform != "linux" or os.environ.get("HPUTRAIN_CPU_MALLOC") == "default"
            or "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ):
        return
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) > 1:
        mallopt(m_mmap_threshold, 1024**2)  # fixed: freed tensors go back to the system
        return
    mallopt(m_mmap_threshold, 32 * 1024**2)  # glibc's largest: blocks above this are still mmapped
    mallopt(m_trim_threshold, 256 * 1024**2)


_lazy_backend_started = False


def _start_lazy_backend() -> None:
    """PyTorch's TorchScript backend for lazy tensors; it can be started once per process."""
    global _lazy_backend_started
    if not _lazy_backend_started:
        from torch._lazy import ts_backend

        ts_backend.init()
        _lazy_backend_started = True


# CPU flags (/proc/cpuinfo) of hardware bfloat16 dot products: x86, then Arm.
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16", "svebf16")
# Shown beside them: the vector units the CPU has otherwise.
_VECTOR_FLAGS = ("avx2", "avx512f", "amx_tile", "asimd", "sve", "sve2")
# bf16 counts as native only where its measured matmul rate is at least this share of fp32's:
# emulated bf16 measures about 1/100 of it, native 1 to 10 times it; the margin absorbs the noise
# of a loaded machine.
_NATIVE_SHARE = 0.25
_PROBE_DTYPES = (torch.float32, torch.bfloat16)
# The test switch: 1 takes bf16 as native on this CPU (precision="auto" picks bf16), 0 as emulated
# (auto picks fp32, and bf16 asked for gets the slow line), whatever the flags and the probe say.
NATIVE_BF16_SWITCH = "HPUTRAIN_CPU_NATIVE_BF16"


def native_bf16_switch() -> bool | None:
    """What the test switch says: True (1), False (0), or None where it is unset or empty (then
    the CPU decides). Read at each decision, so that a test may set it and subprocesses inherit it."""
    value = os.environ.get(NATIVE_BF16_SWITCH, "").strip()
    if value not in ("", "0", "1"):
        raise InputError(f"{NATIVE_BF16_SWITCH}={value!r}: must be 1 (bf16 taken as native), "
                         f"0 (taken as emulated), or unset (the CPU decides)")
    return None if value == "" else value == "1"


def _cpu_flags() -> frozenset[str] | None:
    """The first CPU's flags ("flags" on x86, "Features" on Arm), or None where /proc/cpuinfo
    does not list them (macOS, Windows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return None


def _operands(dtype: torch.dtype, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)  # the global RNG (training's) is left alone
    a, b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
    torch.mm(a, b)  # untimed: first-call set-up
    return a, b


def _seconds(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter_ns()
    torch.mm(a, b)
    return max(time.perf_counter_ns() - start, 1) / 1e9


@functools.cache
def measured_matmul_flops(threads: int, sizes=(256, 512), rounds: int = 5) -> dict:
    """dtype -> the best FLOP/s of square torch.mm on this CPU with `threads` threads (the cache
    key: a process measures once per thread count, in well under a second). The dtypes take turns,
    so that a burst of load on a shared machine hits both; a dtype whose product took over 20 ms
    (emulated bf16) is not tried at the next size."""
    rates = dict.fromkeys(_PROBE_DTYPES, 0.0)
    growing = list(_PROBE_DTYPES)
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        for size in sizes:
            operands = {dtype: _operands(dtype, size) for dtype in growing}
            best = dict.fromkeys(operands, float("inf"))
            for _ in range(rounds):
                for dtype, (a, b) in operands.items():
                    best[dtype] = min(best[dtype], _seconds(a, b))
            for dtype, seconds in best.items():
                rates[dtype] = max(rates[dtype], 2 * size**3 / seconds)
            growing = [dtype for dtype in growing if best[dtype] <= 0.02]
    return rates


@dataclass(frozen=True)
class BF16Support:
    """What decides whether this CPU runs bfloat16 natively."""

    flags: frozenset[str] | None
    """The CPU's flags; None where the system does not list them (then the probe alone decides)."""
    flops: dict
    """Measured matmul FLOP/s per dtype (float32, bfloat16)."""
    switch: bool | None = None
    """The test switch (HPUTRAIN_CPU_NATIVE_BF16) where set: it decides instead of the above."""

    @property
    def bf16_flags(self) -> list[str]:
        return [f for f in _BF16_FLAGS if self.flags and f in self.flags]

    @property
    def shown_flags(self) -> list[str] | None:
        """The bf16 and vector flags present (None: not readable)."""
        if self.flags is None:
            return None
        return [f for f in _BF16_FLAGS + _VECTOR_FLAGS if f in self.flags]

    @property
    def slowdown(self) -> float:
        """How many times longer a bf16 matrix product takes than a float32 one."""
        return self.flops[torch.float32] / self.flops[torch.bfloat16]

    @property
    def native(self) -> bool:
        if self.switch is not None:
            return self.switch
        fast = self.flops[torch.bfloat16] >= _NATIVE_SHARE * self.flops[torch.float32]
        return fast and (self.flags is None or bool(self.bf16_flags))

    @property
    def decided_by(self) -> str:
        """What decided `native`, for `hputrain env`."""
        if self.switch is not None:
            return f"{NATIVE_BF16_SWITCH}={int(self.switch)} (a test switch)"
        return "measured rates" if self.flags is None else "CPU flags and measured rates"

    def why_not(self) -> str:
        """Why bf16 is not native here, in a few words."""
        if self.switch is False:
            return f"{NATIVE_BF16_SWITCH}=0, a test switch"
        if self.flags is None:
            return "measured; the CPU's flags are not readable here"
        if self.bf16_flags:
            return f"although the CPU reports {', '.join(self.bf16_flags)}"
        arm = platform.machine().lower() in ("aarch64", "arm64")
        return "no BF16 extension" if arm else "no AVX512-BF16/AMX"


def _times(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


class CPUAccelerator(Accelerator):
    name = "cpu"
    autocast_device_type = "cpu"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def device_name(self) -> str:
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return platform.processor() or platform.machine() or "cpu"

    def setup(self, local_rank: int = 0) -> torch.device:
        if self.lazy:
            _start_lazy_backend()
            return torch.device("lazy")
        _keep_freed_memory()
        return torch.device("cpu")

    def host_device_after_training(self) -> torch.device | None:
        # Lazy tensors of the TorchScript backend cannot be saved, printed or read by host code
        # (save_pretrained, a sampling loop): hand the model back on the CPU.
        return torch.device("cpu") if self.lazy else None

    def dist_backend(self) -> str:
        return "gloo"

    def collectives_take_device_tensors(self) -> bool:
        return not self.lazy

    def forward_context(self):
        if not self.lazy:
            return super().forward_context()
        from .cpu_lazy import lazy_forward

        return lazy_forward()

    def mark_step(self) -> None:
        if self.lazy:
            from torch import _lazy

            _lazy.mark_step()

    def memory_stats(self) -> dict[str, float]:
        current, peak = _rss_bytes()
        return {
            "memory_allocated_gb": current / GB,
            "max_memory_allocated_gb": peak / GB,
            "total_memory_available_gb": _ram_bytes() / GB,
        }

    def bf16_support(self) -> BF16Support:
        """The CPU's flags and the probe's rates (measured once per process and thread count)."""
        return BF16Support(_cpu_flags(), measured_matmul_flops(torch.get_num_threads()),
                           native_bf16_switch())

    def native_bf16(self) -> bool:
        return self.bf16_support().native

    def bf16_facts(self) -> dict:
        support = self.bf16_support()
        return {"native_bf16": support.native, "bf16_decided_by": support.decided_by,
                "cpu_flags": support.shown_flags,
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "matmul_gflops": {str(dtype).removeprefix("torch."): round(rate / 1e9, 1)
                                  for dtype, rate in support.flops.items()}}

    def bf16_shortfall(self) -> str | None:
        support = self.bf16_support()
        if support.native:
            return None
        if support.switch is False:  # the measured rates may well say native: no figure
            return f"bf16 on this CPU is taken as emulated ({support.why_not()})"
        ratio = support.slowdown
        speed = (f"runs {_times(ratio)} slower than fp32" if ratio >= 1
                 else f"is emulated ({_times(1 / ratio)} fp32's matmul rate)")
        return f"bf16 on this CPU {speed} ({support.why_not()})"

    def measured_peak_flops(self, dtype: torch.dtype) -> float | None:
        if self.lazy:  # the lazy backend is a dry run of Gaudi's: its speed is not the point
            return None
        return measured_matmul_flops(torch.get_num_threads()).get(dtype)

    def supports_fp8(self) -> bool:
        # torch._scaled_mm has a CPU kernel in recent builds; ask it rather than a version number.
        if self.lazy:  # the lazy backend has no fp8 types
            return False
        try:
            one, probe = torch.ones(()), torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
            torch._scaled_mm(probe, probe.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        except (AttributeError, RuntimeError, NotImplementedError):
            return False
        return True

    def native_fp8(self) -> bool:
        # torch's CPU kernel for _scaled_mm computes in wider types, on no fp8 unit: an fp8 step of
        # the built-in GPT took 3.6x a bf16 one on a 2-core EPYC, ~90x on a Xeon with AMX
        # (issue 46; docs/devices.md)
        return False

    def wrap_graph_inference(self, module):
        # The CPU has no graph replay; compiled code stands in for it. For small inference steps
        # the Python wrapper around the generated kernels is most of the time, so inductor writes
        # the wrapper in C++ too (measured: a tiny GPT's decode step 2.2x faster than without).
        return torch.compile(module, dynamic=False, options={"cpp_wrapper": True})

    def graph_compiles(self) -> int | None:
        if not self.lazy:
            return None
        from torch._lazy import metrics

        return metrics.counter_value("UncachedCompile") or 0

    def make_adamw(self, params, lr, betas=(0.9, 0.999), eps=None, weight_decay=0.0, fused=None):
        if not self.lazy:
            return super().make_adamw(params, lr, betas, eps, weight_decay, fused)
        from .cpu_lazy import AdamW  # the lazy backend has neither the fused kernel nor lerp

        return AdamW(params, lr=lr, betas=betas, eps=1e-8 if eps is None else eps,
                     weight_decay=weight_decay)

    def clip_grad_norm(self, parameters, max_norm, fused=None):
        if not self.lazy:
            return super().clip_grad_norm(parameters, max_norm, fused)
        from .cpu_lazy import clip_grad_norm

        return clip_grad_norm(list(parameters), max_norm)

    def grouped_mm_kernel(self, x, weight):
        # torch's CPU kernel: exact, and as fast as one matrix product over all the rows
        # (measured, 8 experts, 8192 rows); the lazy backend has none
        return None if self.lazy else torch_grouped_mm(x, weight)

    def rng_state(self) -> None:
        return None  # the CPU generator is saved by the checkpoint with the Python and numpy ones
