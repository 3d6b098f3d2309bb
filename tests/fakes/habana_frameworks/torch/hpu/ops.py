"""Fake torch.ops.hpu.mixture_of_experts, registered (once per process: torch's op registry
outlives the fake package) when habana_frameworks.torch.hpu is imported, as the real runtime's
library load registers it. Computed on the CPU from the op's definition; each call is recorded
with its arguments. Only the fused-weights form (w12: [gate; up] per expert, w3: down) is here."""
import sys

import torch
import torch.nn.functional as F

_SCHEMA = ("mixture_of_experts.fused_weights(Tensor hidden_states, Tensor expert_routing_table, "
           "Tensor router_weights, Tensor[] w12, Tensor[] w3, bool permuted_weights, str activation, "
           "int experts_min, int experts_max) -> Tensor")
_ACTIVATIONS = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}


def mixture_of_experts(hidden_states, expert_routing_table, router_weights, w12, w3,
                       permuted_weights, activation, experts_min, experts_max):
    sys.modules["habana_frameworks.fake"].record("mixture_of_experts", {
        "routing_dtype": expert_routing_table.dtype, "weights_dtype": router_weights.dtype,
        "experts": len(w12), "permuted_weights": permuted_weights, "activation": activation,
        "experts_min": experts_min, "experts_max": experts_max})
    if router_weights.dtype != hidden_states.dtype:
        raise RuntimeError("fake mixture_of_experts: router_weights and hidden_states differ in dtype")
    out = torch.zeros_like(hidden_states)
    for t in range(hidden_states.size(0)):
        for slot in range(expert_routing_table.size(1)):
            expert = int(expert_routing_table[t, slot])
            if not experts_min <= expert <= experts_max:
                continue
            up, down = w12[expert - experts_min], w3[expert - experts_min]
            if permuted_weights:  # (out, in), as nn.Linear stores them
                up, down = up.t(), down.t()
            gate, value = (hidden_states[t] @ up).chunk(2)
            out[t] += router_weights[t, slot] * ((_ACTIVATIONS[activation](gate) * value) @ down)
    return out


def register() -> None:
    try:
        torch.ops.hpu.mixture_of_experts.fused_weights
        return
    except (AttributeError, RuntimeError):
        pass
    library = torch.library.Library("hpu", "FRAGMENT")
    library.define(_SCHEMA)
    library.impl("mixture_of_experts.fused_weights", mixture_of_experts, "CPU")
    _KEEP.append(library)


_KEEP: list = []  # a Library deregisters its ops when collected
register()
