"""The device interface: every fact about a device lives behind these methods.

One subclass per device (cpu.py, cuda.py, mps.py, hpu.py). Nothing outside this package compares
device strings or imports a vendor runtime; the trainer asks the accelerator instead.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch

GB = 1024**3


class Accelerator(ABC):
    """One kind of device. Construction is cheap and imports nothing; `setup` does the work."""

    name: str = ""
    #: torch.autocast's device_type for this device.
    autocast_device_type: str = "cpu"

    #: Whether the device's runtime applies Gaudi-style autocast op lists itself.
    applies_autocast_op_lists: bool = False

    def __init__(self, execution_mode: str = "auto", autocast_op_lists=None,
                 fp8_minimize_memory: bool = False) -> None:
        """`autocast_op_lists`: (bf16 ops, fp32 ops), and `fp8_minimize_memory`, for a runtime
        that takes them at start-up."""
        self.execution_mode = self.default_execution_mode() if execution_mode == "auto" else execution_mode
        self.autocast_op_lists = autocast_op_lists
        self.fp8_minimize_memory = fp8_minimize_memory

    def default_execution_mode(self) -> str:
        """What execution_mode="auto" means on this device."""
        return "eager"

    @property
    def lazy(self) -> bool:
        """Whether operations are deferred into graphs that run at `mark_step()`."""
        return self.execution_mode == "lazy"

    # -- presence ------------------------------------------------------------------------------
    @abstractmethod
    def is_available(self) -> bool: ...

    @abstractmethod
    def device_count(self) -> int: ...

    def device_name(self) -> str:
        """Human-readable name of the device (a GPU model, "Gaudi2", the CPU)."""
        return self.name

    # -- set-up --------------------------------------------------------------------------------
    @abstractmethod
    def setup(self, local_rank: int = 0) -> torch.device:
        """Prepare this process to use device `local_rank` and return it."""

    def host_device_after_training(self) -> torch.device | None:
        """Where the trainer hands the model back after train(), evaluate() and predict(): None
        (it stays on the device) unless the device's tensors are no use to host code."""
        return None

    @abstractmethod
    def dist_backend(self) -> str:
        """torch.distributed backend for this device by default (ddp_backend may choose another;
        what a backend can do is the process group's business, distributed/group.py)."""

    def compile_backend(self) -> str:
        return "inductor"

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Entered around every forward pass, for what the device needs there."""
        return contextlib.nullcontext()

    def mark_step(self) -> None:
        """Run what has been accumulated (lazy mode); a no-op on eager devices."""

    def synchronize(self) -> None:
        """Wait for queued device work, so that a host clock measures it."""

    def collectives_take_device_tensors(self) -> bool:
        """Whether the process group's collectives take this device's tensors, so that several
        processes can train together (not the CPU's lazy backend: Gloo takes CPU tensors only)."""
        return True

    def supports_fsdp(self) -> bool:
        """Whether FSDP2's sharding runs here: in eager and compile mode, never in lazy mode
        (Gaudi supports FSDP in eager mode and with torch.compile only)."""
        return not self.lazy

    # -- numbers -------------------------------------------------------------------------------
    @abstractmethod
    def memory_stats(self) -> dict[str, float]:
        """memory_allocated_gb, max_memory_allocated_gb and total_memory_available_gb."""

    def profiler_activities(self) -> list:
        """What torch.profiler records here (the host's activity; a device adds its own)."""
        return [torch.profiler.ProfilerActivity.CPU]

    def profiler_records_memory(self) -> bool:
        """Whether the profiler can keep a memory timeline of this device's allocations."""
        return False

    def is_out_of_memory(self, error: BaseException) -> bool:
        """Whether `error` says the device ran out of memory: torch's OutOfMemoryError, or the
        RuntimeError a runtime raises with "out of memory" in its message (Gaudi's does)."""
        if isinstance(error, torch.OutOfMemoryError):
            return True
        return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()

    def supports_bf16(self) -> bool:
        """Whether bfloat16 autocast runs here."""
        return True

    def native_bf16(self) -> bool:
        """Whether bfloat16 runs natively (not emulated) here: what precision="auto" picks bf16
        by. Unknown counts as not native."""
        return False

    def bf16_facts(self) -> dict:
        """What decided `native_bf16`, for `hputrain env` and the benchmarks' records."""
        return {"native_bf16": self.native_bf16()}

    def bf16_shortfall(self) -> str | None:
        """Where bf16 is known to be slow here, one phrase saying so and by how much; None
        otherwise (no warning without a device fact or a measurement)."""
        return None

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        """Dense peak FLOP/s of one device for `dtype`, or None when not known."""
        return None

    def measured_peak_flops(self, dtype: torch.dtype) -> float | None:
        """`dtype` matrix products' FLOP/s as measured on this device, where no published peak
        exists (the CPU's probe); None elsewhere."""
        return None

    # -- fp8 -----------------------------------------------------------------------------------
    def supports_fp8(self) -> bool:
        """Whether fp8 matrix products (E4M3 and E5M2) run here."""
        return False

    def native_fp8(self) -> bool:
        """Whether fp8 matrix products run on fp8 matrix units here (Hopper's and Ada's tensor
        cores, Gaudi 2's and 3's MME). Where `supports_fp8` alone holds, torch._scaled_mm is
        emulated in wider types, slower than bf16: a rehearsal of an fp8 run, not a speed-up."""
        return False

    def fp8_linear(self, recipe):
        """The device's own fp8 layer: a function making one from an nn.Linear (its weights
        copied), or None for hputrain's layer on torch._scaled_mm (execution/fp8.py), which
        decides which layers qualify either way."""
        return None

    def fp8_context(self, recipe) -> contextlib.AbstractContextManager:
        """Entered around the forward pass with fp8 (a runtime's fp8 autocast, where it has one)."""
        return contextlib.nullcontext()

    # -- optimizer and gradients ---------------------------------------------------------------
    def make_adamw(self, params, lr: float, betas=(0.9, 0.999), eps: float | None = None,
                   weight_decay: float = 0.0, fused: bool | None = None) -> torch.optim.Optimizer:
        """AdamW; `fused` None means the device's default (torch's fused kernel here).
        eps None means the optimizer's own default (1e-8 for torch's AdamW)."""
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=1e-8 if eps is None else eps,
                                 weight_decay=weight_decay, fused=False if fused is False else True)

    def clip_grad_norm(self, parameters: Iterable[torch.nn.Parameter], max_norm: float,
                       fused: bool | None = None) -> torch.Tensor:
        """Clip gradients in place to a total 2-norm of `max_norm`; return the norm before clipping
        as a device tensor (no host read-back)."""
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, foreach=True)

    def pins_memory(self) -> bool:
        """Whether batches in pinned host memory reach this device by an asynchronous copy (a
        CPU run has no copy to speed up)."""
        return False

    # -- graphs --------------------------------------------------------------------------------
    def graph_compiles(self) -> int | None:
        """Graphs compiled so far in lazy mode (None where the device does not count them)."""
        return None

    def wrap_graph_inference(self, module: torch.nn.Module) -> torch.nn.Module:
        """The device's captured-graph mechanism for inference (static shapes assumed)."""
        return torch.compile(module, backend=self.compile_backend(), dynamic=False)

    def wrap_graph_training(self, module: torch.nn.Module) -> torch.nn.Module:
        """Capture the training step's graphs and replay them (use_graphs_for_training)."""
        from ..errors import InputError

        raise InputError(f"use_graphs_for_training: the {self.name} has no graph capture for "
                         "training; use execution_mode='compile' instead")

    # -- kernels for Hugging Face models (kernels.py) -------------------------------------------
    def fused_kernels(self) -> dict[str, str | None]:
        """The kernel that runs each substitution here, by name (None: the device has none)."""
        return {"attention": "sdpa", "rms_norm": "rms_norm", "rotary": None, "experts": "static"}

    #: Whether an attention kernel with a recompute mode (Gaudi's FusedSDPA) uses it: True,
    #: False, or None for the device's default (TrainingArguments.attention_recompute).
    attention_recompute: bool | None = None

    def prefers_fused_kernels(self) -> bool:
        """What fused_kernels="auto" means here: on where the kernels are not slower. torch's
        own SDPA is already transformers' default, and F.rms_norm is one op where RMSNorm modules
        run five (bench/kernels.py, docs/benchmarks.md)."""
        return True

    def scaled_dot_product_attention(self, q, k, v, mask=None, causal=False, scale=None,
                                     dropout=0.0) -> torch.Tensor:
        """Attention of (batch, heads, seq, dim) tensors; k and v may have fewer heads
        (grouped-query). `mask`: boolean (True attends) or additive, broadcast to the scores."""
        groups = q.size(1) // k.size(1)
        if groups > 1 and mask is not None:  # torch's masked GQA takes the slow math path
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scale,
            enable_gqa=groups > 1 and mask is None)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`weight` times x normalised over its last dimension, in the numerics of transformers'
        RMSNorm: normalised in fp32, cast back to x's dtype, then scaled (so fp32 results equal
        Llama's, and bf16 ones round where Llama's do)."""
        normed = torch.nn.functional.rms_norm(x.float(), x.shape[-1:], eps=eps)
        return weight * normed.to(x.dtype)

    def grouped_mm_kernel(self, x: torch.Tensor, weight: torch.Tensor):
        """The device's grouped matrix product for these operands (one dtype), a function
        `(x (S, in), weight (E, in, out), offsets (E,) int32) -> (S, out)` that multiplies each
        expert's block of rows (ending at its offset) by its matrix, or None where the device has
        none that takes them exactly with fixed shapes: kinds/moe/experts/grouped.py's fixed-shape
        form runs then."""
        return None

    def fused_experts(self, hidden_states, top_k_index, top_k_weights, gate_up, down,
                      activation: str) -> torch.Tensor | None:
        """A whole experts layer in the device's fused MoE op, for inference (it has no backward):
        `gate_up` (E, 2·intermediate, hidden) [gate; up], `down` (E, hidden, intermediate), both
        as nn.Linear stores them, `activation` "silu" or "relu"; None where the device has no such
        op (the experts then run the grouped products)."""
        return None

    # -- randomness ----------------------------------------------------------------------------
    def rng_state(self) -> torch.Tensor | None:
        """This device's generator state (None where the device shares the CPU generator)."""
        return None

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        """Restore a state returned by `rng_state`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(execution_mode={self.execution_mode!r})"


def torch_grouped_mm(x: torch.Tensor, weight: torch.Tensor):
    """torch's grouped matrix product where this torch has one that takes the operands, else None:
    under torch.compile in bf16 only (its meta function's rule in torch 2.9 to 2.13)."""
    kernel = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if kernel is None or (torch.compiler.is_compiling() and x.dtype != torch.bfloat16):
        return None
    return lambda x, weight, offsets: kernel(x, weight, offs=offsets)
