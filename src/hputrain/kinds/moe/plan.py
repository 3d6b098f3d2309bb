"""What `hputrain plan` says of a mixture-of-experts model (rehearsal/plan/__init__.py traces its step like
any other's), and what its trace needs to run one on fake tensors.

The layout (`moe_layout`), read from the prepared model's experts modules (transformers' fused
3-D experts: `gate_up_proj` or `up_proj`, and `down_proj`, of E experts each) and its config:

- parameters: every expert is stored (and trained: its gradients and AdamW's moments are those
  of all E), but a token runs through only its top-k: the active parameters per token are the
  dense ones and k/E of the experts'.
- activations: per MoE layer, the T*k (token, expert) pairs of a micro-batch of T tokens, each
  with its (2I) gate-and-up intermediate (I the expert's intermediate size) and its (I) gated
  one, kept for backward; the trace counts them as the experts implementation allocates them.
- expert parallelism (--expert-parallel-size N): E/N experts a rank, and per MoE layer the
  all-to-all's buffers, whose shapes do not depend on the routing: to each of the N peers
  C = min(ceil(1.25*T*k/N), T*min(k, E/N)) rows of the hidden size, 1.25 times the pairs a rank
  receives on average (kinds/moe/experts/sizes.py; a rarer second exchange carries what does not
  fit), and what the experts keep for backward on those rows (the fixed-shape form's tiles).

The trace itself: `torch._grouped_mm`'s shape function (its meta kernel) accepts only the
bfloat16 inputs CUDA's kernel takes, where the CPU's kernel runs fp32 too (what transformers'
"grouped_mm" experts call on the CPU); `grouped_mm_shapes` gives it the output the real kernel
allocates, of any dtype, for the time of the trace.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class MoELayout:
    layers: int
    """MoE layers (layers whose MLP is a set of experts)."""
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    parameters: int
    """All parameters of the model (every expert's)."""
    expert_parameters: int
    expert_parallel: int = 1
    tokens: int = 0
    """Tokens of a micro-batch on one rank (T)."""
    element_bytes: int = 4
    """Of the residual stream (the weights' dtype)."""
    compute_bytes: int = 4
    """Of the experts' products: the compute dtype (bf16 under bf16-mixed's autocast)."""
    capacity_factor: float = 1.25
    """The all-to-all's rows per peer over the average (expert_capacity_factor)."""

    def with_tokens(self, tokens: int) -> MoELayout:
        """This layout for micro-batches of `tokens` tokens a rank (the plan's, once its batch is
        made)."""
        return dataclasses.replace(self, tokens=tokens)

    @property
    def active_parameters(self) -> int:
        """The parameters one token runs through: the dense ones and its top-k experts."""
        return self.parameters - self.expert_parameters + (
            self.expert_parameters * self.top_k // self.experts)

    @property
    def experts_per_rank(self) -> int:
        return self.experts // self.expert_parallel

    @property
    def sizes(self):
        """The layer's rows (kinds/moe/experts/sizes.py): buffers, received rows, tiles."""
        from .experts.sizes import expert_sizes

        return expert_sizes(self.tokens, self.top_k, self.experts, self.expert_parallel, self.capacity_factor)

    @property
    def rows_per_peer(self) -> int:
        """Rows of the hidden size sent to (and received from) each peer, per MoE layer."""
        return self.sizes.capacity if self.expert_parallel > 1 else 0

    @property
    def all_to_all_bytes(self) -> int:
        """One MoE layer's send buffer (its receive buffer is as large), over all peers: in the
        compute dtype, which the pairs travel in (kinds/moe/experts/parallel.py)."""
        return self.sizes.exchange_rows * self.hidden * self.compute_bytes

    @property
    def expert_rows(self) -> int:
        """Rows a rank's experts run on, per MoE layer: the T·k pairs, or under expert
        parallelism every peer's block of rows (N·C)."""
        return self.sizes.expert_rows

    @property
    def intermediate_bytes(self) -> int:
        """One MoE layer's (rows, 2I) gate-and-up intermediate, in the compute dtype."""
        return self.expert_rows * 2 * self.intermediate * self.compute_bytes

    @property
    def saved_bytes(self) -> int:
        """What one MoE layer's experts keep for backward, in the fixed-shape form (Gaudi's: its
        tiles' rows; a grouped kernel keeps the rows alone)."""
        return self.sizes.saved(self.hidden, self.intermediate) * self.compute_bytes

    def as_json(self) -> dict:
        sizes = self.sizes
        return {"layers": self.layers, "experts": self.experts, "top_k": self.top_k,
                "parameters": self.parameters, "expert_parameters": self.expert_parameters,
                "active_parameters": self.active_parameters,
                "expert_parallel_size": self.expert_parallel,
                "experts_per_rank": self.experts_per_rank,
                "all_to_all_rows_per_peer": self.rows_per_peer,
                "all_to_all_send_bytes_per_layer": self.all_to_all_bytes,
                "all_to_all_receive_bytes_per_layer": self.all_to_all_bytes,
                "expert_rows_per_layer": self.expert_rows,
                "intermediate_bytes_per_layer": self.intermediate_bytes,
                "tile_rows": sizes.tile, "tiles_per_layer": sizes.tiles,
                "saved_bytes_per_layer": self.saved_bytes,
                "minimum_saved_bytes_per_layer": sizes.minimum_saved(self.hidden, self.intermediate)
                * self.compute_bytes}

    def describe(self) -> str:
        """One line for the plan's header."""
        def millions(n: int) -> str:
            return f"{n / 1e6:,.1f}M" if n >= 1e6 else f"{n:,}"

        sizes = self.sizes
        line = (f"experts: {self.layers} MoE layer{'s' if self.layers > 1 else ''} of "
                f"{self.experts} experts, top-{self.top_k}; {millions(self.parameters)} "
                f"parameters stored ({millions(self.expert_parameters)} in experts), "
                f"{millions(self.active_parameters)} active per token; the experts run "
                f"{self.expert_rows:,} rows a layer ({_size(self.intermediate_bytes)} of (rows, "
                f"{2 * self.intermediate}) intermediates)")
        if self.expert_parallel > 1:
            size = self.all_to_all_bytes
            line += (f"; expert-parallel {self.expert_parallel}: {self.experts_per_rank} experts "
                     f"a rank, all-to-all {self.rows_per_peer:,} rows of {self.hidden} to each "
                     f"peer ({_size(size)} sent and {_size(size)} received a layer, "
                     f"{sizes.exchange_rows / max(1, sizes.pairs):.2f}x the {sizes.pairs:,} pairs a rank "
                     f"receives on average)")
        if self.tokens:
            line += (f"; kept for backward {_size(self.saved_bytes)} a layer ({sizes.tiles} tiles of "
                     f"{sizes.tile} rows; {_size(sizes.minimum_saved(self.hidden, self.intermediate) * self.compute_bytes)}"
                     " for the T·k pairs alone)")
        return line


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's experts modules: transformers' fused 3-D experts (E experts of `down_proj`
    each, with `gate_up_proj`, or `up_proj`, beside it)."""
    found = []
    for module in model.modules():
        down = getattr(module, "down_proj", None)
        up = getattr(module, "gate_up_proj", getattr(module, "up_proj", None))
        if (isinstance(down, torch.nn.Parameter) and down.dim() == 3
                and isinstance(up, torch.nn.Parameter) and up.dim() == 3):
            found.append(module)
    return found


def moe_layout(model: torch.nn.Module, args, tokens: int) -> MoELayout | None:
    """The MoE layout of `model` (None for a dense one) for a run of `args` on micro-batches of
    `tokens` tokens per rank. Counted on the whole model, before any sharding."""
    experts = experts_modules(model)
    if not experts:
        return None
    first = experts[0]
    count = first.down_proj.shape[0]
    config = getattr(model, "config", None)
    top_k = _config_value(config, "num_experts_per_tok", "moe_topk", "top_k") or 1
    up = getattr(first, "gate_up_proj", None)
    gated = up is not None
    up = first.gate_up_proj if gated else first.up_proj
    # (E, out, in) or transposed (E, in, out): the hidden size is the config's, the other the
    # intermediate's (Llama 4's experts are transposed without saying so)
    width = _config_value(config, "hidden_size") or up.shape[2]
    inner = up.shape[2] if up.shape[1] == width else up.shape[1]
    return MoELayout(
        layers=len(experts), experts=count, top_k=int(top_k), hidden=int(width),
        intermediate=int(inner // 2 if gated else inner),
        parameters=sum(p.numel() for p in _unique(model.parameters())),
        expert_parameters=sum(p.numel() for m in experts for p in m.parameters(recurse=False)),
        expert_parallel=max(1, int(getattr(args, "expert_parallel_size", 1) or 1)),
        capacity_factor=float(getattr(args, "expert_capacity_factor", 1.25) or 1.25),
        tokens=tokens, element_bytes=up.element_size(),
        compute_bytes=2 if str(getattr(args, "precision", "")).startswith("bf16") else up.element_size())


def _config_value(config, *names):
    for source in (config, getattr(config, "text_config", None)):
        for name in names:
            value = getattr(source, name, None) if source is not None else None
            if value:
                return value
    return None


def _unique(params):
    seen = set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


# -- torch._grouped_mm on fake tensors -------------------------------------------------------------

class _GroupedMMShapes(TorchDispatchMode):
    """`aten._grouped_mm` as the output its kernel allocates (any dtype; torch's meta kernel
    takes only CUDA's bfloat16)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.ops.aten._grouped_mm.default:
            return func(*args, **kwargs)
        a, b = args[0], args[1]
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        dtype = kwargs.get("out_dtype") or (args[4] if len(args) > 4 else None) or a.dtype
        return a.new_empty(grouped_mm_shape(a.shape, b.shape, offs), dtype=dtype)


def grouped_mm_shape(a: torch.Size, b: torch.Size, offs) -> list[int]:
    """The output shape of torch._grouped_mm(a, b, offs) (2-D or 3-D operands)."""
    if len(a) == 2 and len(b) == 2:
        return [offs.shape[0], a[0], b[1]]
    if len(a) == 2:
        return [a[0], b[-1]]
    if len(b) == 2:
        return [a[1], b[1]]
    return [a[0], a[1], b[-1]]


@contextlib.contextmanager
def grouped_mm_shapes():
    """For the time of a trace on fake tensors: torch._grouped_mm of any dtype."""
    with _GroupedMMShapes():
        yield


# -- expert parallelism in a trace of one process --------------------------------------------------

@contextlib.contextmanager
def expert_parallel_stand_ins():
    """For the time of a trace on the fake process group (rehearsal/plan/__init__.py): distributed/
    expert_parallel.py's layout built by its own code on that group (its mesh made outside the
    fake mode, which cannot read the mesh's rank tensor; its Gloo groups made on the fake
    backend, as no Gloo group can join a fake world), and kinds/moe/experts/parallel.py's
    agreement on the exchange's sizes answered by the plan's assumption: every rank's micro-batch
    as large as this one's, its routing balanced. The all-to-all's buffers are then the forward's
    own, allocated as in the run (the fake backend moves nothing)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from . import expert_parallel
    from .experts import parallel

    layout, new_group = expert_parallel.ExpertLayout.build, dist.new_group
    answers = [(parallel, "_agree"), (parallel, "_largest"), (expert_parallel, "_any_rank")]
    answers = [(module, name, getattr(module, name)) for module, name in answers]

    def build(cls, size: int, device_type: str):
        with unset_fake_temporarily():
            dist.new_group = lambda *args, backend=None, **kwargs: new_group(*args, **kwargs)
            try:
                return layout.__func__(cls, size, device_type)
            finally:
                dist.new_group = new_group

    expert_parallel.ExpertLayout.build = classmethod(build)
    # every rank's micro-batch as large as this one's, and no rank past its block's rows: the
    # first exchange alone (its second is the rare case of an unbalanced routing)
    parallel._agree = lambda tokens, most, group: (tokens, 0)
    parallel._largest = lambda tokens, group: tokens
    expert_parallel._any_rank = lambda flag: False
    try:
        yield
    finally:
        expert_parallel.ExpertLayout.build = layout
        for module, name, answer in answers:
            setattr(module, name, answer)
