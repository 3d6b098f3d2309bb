"""Intel Gaudi (HPU) through the habana_frameworks runtime.

The runtime reads PT_HPU_LAZY_MODE and PT_ENABLE_INT64_SUPPORT once, when it is first imported, so
this file imports habana_frameworks only inside its methods, after `_runtime()` has set them. If
something imported the runtime earlier with other values, that is an error, not a silent no-op.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import torch

from ..errors import InputError
from .base import GB, Accelerator

# Dense bf16 peak FLOP/s per device (matrix engines).
_PEAK_BF16_FLOPS = {"GAUDI3": 1835e12, "GAUDI2": 432e12}
GIB = 2**30
MEMORY_BYTES = {"gaudi2": 96 * GIB, "gaudi3": 128 * GIB}
"""Each Gaudi's HBM, as hl-smi reports it (98304 and 131072 MiB): the targets of `hputrain plan`."""
DIST_BACKEND = "hccl"
"""Gaudi's collectives (registered by the runtime; `hputrain plan` names it without importing)."""
DEVICE_TYPE = "hpu"
"""torch's name of the Gaudi device (and of its module, torch.hpu)."""
COMPILE_BACKEND = "hpu_backend"
"""torch.compile's backend for Gaudi (registered by the runtime)."""
# Gaudi's Transformer Engine: te.Linear layers, fp8_autocast, and the DelayedScaling recipe.
_TE = "habana_frameworks.torch.hpex.experimental.transformer_engine"
_FP8_DEVICES = ("GAUDI2", "GAUDI3")  # their MMEs multiply in fp8; first-generation Gaudi has no fp8
# FusedSDPA's recompute mode (attention recomputed in backward, not kept) by default from this
# many keys: where the (queries x keys) probabilities of every layer outgrow the memory they save.
_RECOMPUTE_FROM_KEYS = 8192


def has_fp8_units(name: str) -> bool:
    """Whether the Gaudi of this name ("GAUDI2", a plan target's "gaudi3") has fp8 matrix units."""
    return any(key in name.upper() for key in _FP8_DEVICES)


def _op_list_file(ops: list[str]) -> str:
    """A file of op names, one per line, named by its content: the same list gives the same path,
    so a second accelerator with the same lists agrees with the runtime's environment."""
    text = "\n".join(ops) + "\n"
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"hputrain-autocast-{digest}.txt"
    if not path.exists():
        path.write_text(text)
    return str(path)


class HPUEnvironmentError(InputError):
    """The Gaudi runtime was imported before its environment variables could be set."""


class HPUAccelerator(Accelerator):
    name = "hpu"
    autocast_device_type = "hpu"
    applies_autocast_op_lists = True  # from the files named by PT_HPU_AUTOCAST_*_OPS_LIST

    def __init__(self, execution_mode: str = "auto", autocast_op_lists=None,
                 fp8_minimize_memory: bool = False) -> None:
        super().__init__(execution_mode, autocast_op_lists, fp8_minimize_memory)
        self._clip = None  # FusedClipNorm, built on first use
        #: FusedSDPA's recompute mode (Optimum's flash_attention_recompute): True, False, or None
        #: for on from _RECOMPUTE_FROM_KEYS keys.
        self.attention_recompute: bool | None = None

    def default_execution_mode(self) -> str:
        # Gaudi's native mode is lazy, unless the user has already switched the runtime to eager.
        return "eager" if os.environ.get("PT_HPU_LAZY_MODE") == "0" else "lazy"

    # -- the runtime ---------------------------------------------------------------------------
    def runtime_env(self) -> dict[str, str]:
        """The variables the runtime must see at import: the execution mode, the autocast op
        lists as files (one op name per line), and fp8's minimize_memory."""
        env = {"PT_HPU_LAZY_MODE": "1" if self.lazy else "0"}
        if not self.lazy:  # eager and torch.compile need 64-bit integers (token ids, indices)
            env["PT_ENABLE_INT64_SUPPORT"] = os.environ.get("PT_ENABLE_INT64_SUPPORT", "1")
        bf16_ops, fp32_ops = self.autocast_op_lists or (None, None)
        if bf16_ops:
            env["PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST"] = _op_list_file(bf16_ops)
        if fp32_ops:
            env["PT_HPU_AUTOCAST_FP32_OPS_LIST"] = _op_list_file(fp32_ops)
        if self.fp8_minimize_memory:  # keep fp8 weights, not bf16 copies, for backward
            env["PT_HPU_FP8_MINIMIZE_MEMORY"] = "true"
        return env

    def _runtime(self, module: str = "habana_frameworks.torch.hpu"):
        """Import a runtime module, setting the environment first on the first import."""
        wanted = self.runtime_env()
        if "habana_frameworks.torch" in sys.modules:
            for key, value in wanted.items():
                if os.environ.get(key) != value:
                    raise HPUEnvironmentError(
                        f"execution_mode={self.execution_mode!r} needs {key}={value}, but "
                        f"habana_frameworks was already imported with {key}="
                        f"{os.environ.get(key, '<unset>')}; set it before anything imports "
                        f"habana_frameworks (export {key}={value})")
        else:
            os.environ.update(wanted)
        return importlib.import_module(module)

    # -- presence ------------------------------------------------------------------------------
    def is_available(self) -> bool:
        if importlib.util.find_spec("habana_frameworks") is None:
            return False
        try:
            return bool(self._runtime().is_available())
        except ImportError:
            return False

    def device_count(self) -> int:
        return self._runtime().device_count() if self.is_available() else 0

    def device_name(self) -> str:
        return self._runtime().get_device_name()

    # -- set-up --------------------------------------------------------------------------------
    def setup(self, local_rank: int = 0) -> torch.device:
        self._runtime("habana_frameworks.torch.core")
        # One Gaudi is visible per process; the runtime maps it from the local rank.
        return torch.device(DEVICE_TYPE)

    def dist_backend(self) -> str:
        self._runtime("habana_frameworks.torch.distributed.hccl")  # registers "hccl"
        return DIST_BACKEND

    def compile_backend(self) -> str:
        return COMPILE_BACKEND

    def mark_step(self) -> None:
        if self.lazy:
            self._runtime("habana_frameworks.torch.core").mark_step()

    def synchronize(self) -> None:
        self._runtime().synchronize()

    def pins_memory(self) -> bool:
        return True

    # -- numbers -------------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, float]:
        stats = self._runtime().memory_stats()
        return {
            "memory_allocated_gb": stats["InUse"] / GB,
            "max_memory_allocated_gb": stats["MaxInUse"] / GB,
            "total_memory_available_gb": stats["Limit"] / GB,
        }

    def profiler_activities(self) -> list:
        """The host's, and Gaudi's where this build of torch has its activity (habana_frameworks
        adds ProfilerActivity.HPU)."""
        hpu = getattr(torch.profiler.ProfilerActivity, "HPU", None)
        return [torch.profiler.ProfilerActivity.CPU] + ([hpu] if hpu is not None else [])

    def native_bf16(self) -> bool:
        return True  # every Gaudi's matrix engines compute in bf16

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        if dtype != torch.bfloat16:
            return None
        name = self.device_name().upper()
        return next((flops for key, flops in _PEAK_BF16_FLOPS.items() if key in name), None)

    # -- fp8 through Gaudi's Transformer Engine ---------------------------------------------------
    def supports_fp8(self) -> bool:
        return self.native_fp8()  # the Transformer Engine runs on the MME's fp8 only

    def native_fp8(self) -> bool:
        return has_fp8_units(self.device_name())

    def fp8_linear(self, recipe):
        """te.Linear layers with the same weights as the eligible Linear layers."""
        if recipe.scaling != "delayed":
            raise InputError("fp8_scaling='dynamic': Gaudi's Transformer Engine scales from an amax "
                             "history only; use fp8_scaling='delayed'")
        te = self._runtime(_TE)

        def te_linear(layer):
            new = te.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
            with torch.no_grad():
                new.weight.copy_(layer.weight)
                if layer.bias is not None:
                    new.bias.copy_(layer.bias)
            return new

        return te_linear

    def fp8_context(self, recipe):
        # HYBRID: E4M3 forward, E5M2 gradients; the scale from the largest amax in the history.
        formats = self._runtime(f"{_TE}.recipe")
        scaling = formats.DelayedScaling(fp8_format=formats.Format.HYBRID, amax_compute_algo="max",
                                         amax_history_len=recipe.amax_history_len)
        return self._runtime(_TE).fp8_autocast(enabled=True, fp8_recipe=scaling)

    # -- optimizer and gradients ---------------------------------------------------------------
    def make_adamw(self, params, lr, betas=(0.9, 0.999), eps=None, weight_decay=0.0, fused=None):
        """Gaudi's FusedAdamW when asked (GaudiConfig use_fused_adam), with its own eps default of
        1e-6; otherwise torch's AdamW."""
        if not fused:  # torch's AdamW, unfused as on Gaudi it runs op by op anyway
            return super().make_adamw(params, lr, betas, eps, weight_decay, fused=False)
        optimizers = self._runtime("habana_frameworks.torch.hpex.optimizers")
        return optimizers.FusedAdamW(params, lr=lr, betas=betas, eps=1e-6 if eps is None else eps,
                                     weight_decay=weight_decay)

    def clip_grad_norm(self, parameters, max_norm, fused=None):
        parameters = list(parameters)
        if not fused:
            return super().clip_grad_norm(parameters, max_norm)
        if self._clip is None:
            normalization = self._runtime("habana_frameworks.torch.hpex.normalization")
            self._clip = normalization.FusedClipNorm(parameters, max_norm)
        return self._clip.clip_norm(parameters)

    # -- kernels for Hugging Face models -------------------------------------------------------
    def fused_kernels(self) -> dict[str, str | None]:
        return {"attention": "fused_sdpa", "rms_norm": "fused", "rotary": None, "experts": "static"}

    def scaled_dot_product_attention(self, q, k, v, mask=None, causal=False, scale=None, dropout=0.0):
        """FusedSDPA (hpex.kernels): its softmax in fp32 ("None" mode) unless the autocast op
        lists put softmax in bf16 ("fast" mode, as Optimum's flash_attention_fast_softmax)."""
        if k.size(1) != q.size(1):  # FusedSDPA wants as many key/value heads as query heads
            groups = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        bf16_ops = (self.autocast_op_lists or (None, None))[0] or ()
        softmax_mode = "fast" if "softmax" in bf16_ops else "None"
        recompute = self.attention_recompute
        if recompute is None:
            recompute = k.size(-2) >= _RECOMPUTE_FROM_KEYS
        kernels = self._runtime("habana_frameworks.torch.hpex.kernels")
        return kernels.FusedSDPA.apply(q, k, v, mask, dropout, causal, scale, softmax_mode, recompute)

    def rms_norm(self, x, weight, eps):
        """FusedRMSNorm (hpex.normalization), on inputs of the weight's dtype (it takes no mixed
        dtypes); the result is in the weight's dtype, as transformers' `weight * x` promotes."""
        normalization = self._runtime("habana_frameworks.torch.hpex.normalization")
        return normalization.FusedRMSNorm.apply(x.to(weight.dtype), weight, eps)

    def fused_experts(self, hidden_states, top_k_index, top_k_weights, gate_up, down, activation):
        """torch.ops.hpu.mixture_of_experts, its fused-weights form: per expert [gate; up] (w12)
        and down (w3) as nn.Linear stores them (permuted_weights=True), experts 0..E-1 here.
        Inference only, as Optimum for Intel Gaudi uses it: the op has no backward, so training
        runs the grouped products (the fixed-shape form) instead."""
        self._runtime()  # registers the hpu ops
        experts = gate_up.size(0)
        return torch.ops.hpu.mixture_of_experts(
            hidden_states=hidden_states, expert_routing_table=top_k_index.to(torch.int64),
            router_weights=top_k_weights.to(hidden_states.dtype),
            w12=[gate_up[e] for e in range(experts)], w3=[down[e] for e in range(experts)],
            permuted_weights=True, activation=activation, experts_min=0, experts_max=experts - 1)

    # -- graphs and randomness -----------------------------------------------------------------
    def wrap_graph_inference(self, module):
        return self._runtime().wrap_in_hpu_graph(module)

    def graph_compiles(self) -> int | None:
        if not self.lazy:
            return None
        metrics = self._runtime("habana_frameworks.torch.hpu.metrics")
        return int(dict(metrics.metric_global("graph_compilation").stats())["TotalNumber"])

    def wrap_graph_training(self, module):
        if not self.lazy:
            raise InputError("use_graphs_for_training: HPU graphs need lazy mode (execution_mode="
                             "'lazy', PT_HPU_LAZY_MODE=1)")
        # ModuleCacher records the module's forward and backward as HPU graphs, replayed per shape.
        return self._runtime().ModuleCacher(max_graphs=10)(model=module, inplace=True)

    def rng_state(self) -> torch.Tensor:
        return self._runtime().random.get_rng_state()

    def set_rng_state(self, state) -> None:
        if state is not None:
            self._runtime().random.set_rng_state(state)
