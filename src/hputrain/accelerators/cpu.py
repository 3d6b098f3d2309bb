"""The CPU: always present. In lazy mode it runs on PyTorch's own lazy tensor backend
(torch._lazy with the TorchScript backend), a dry run of a Gaudi lazy-mode run."""
from __future__ import annotations

import os
import platform
import resource
import sys

import torch

from .base import GB, Accelerator


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

    def dist_backend(self) -> str:
        return "gloo"

    def forward_context(self):
        if not self.lazy:
            return super().forward_context()
        from .cpu_lazy import LazyBackendGaps

        return LazyBackendGaps()

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

    def rng_state(self) -> None:
        return None  # the CPU generator is saved by the checkpoint with the Python and numpy ones
