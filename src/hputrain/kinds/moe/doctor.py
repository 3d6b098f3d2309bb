"""The doctor's watch over the experts of mixture-of-experts models, whatever trains them.

In an MoE layer the router picks each token's experts, and how many tokens each expert gets
changes every step. Experts that size their work by those counts (transformers' "eager" loop over
the experts hit, with nonzero / where over the routing; its "grouped_mm", whose fallback reads the
tokens per expert back to the host and cuts one matmul per expert) build a graph of new shapes at
every step: in lazy mode on Gaudi each step compiles again, whatever the batch shapes. From the
counters alone that looks like "something other than the shapes changes the graph", so the doctor
watches the experts' own forward: for every module that is a transformers experts module (it
dispatches through transformers' ExpertsInterface, or its class is named `*Experts`), the ops that
ran eagerly inside it (the lazy backend's fallback counters) and the values read back to the host
inside it (HostReads), in the steps watched only. Experts whose shapes do not depend on the
routing (hputrain's static experts, transformers' "batched_mm", Llama 4's dense experts) show
neither, and nothing is said of them.

`ExpertsWatch` is entered around the script (hooks on every module's forward, process-wide, while
the doctor runs); `seen()` is what `findings.diagnose` turns into one finding with the fix.
"""
from __future__ import annotations

import dataclasses

import torch

from ...accelerators.cpu_lazy import BACKEND_FALLBACKS, HostReads, lazy_counters
from .experts import NAME

_READ_COUNTER = "aten::_local_scalar_dense"  # a value read back, counted by HostReads instead

FIX = (f"experts with static shapes, in which every token still goes to its top-k experts and "
       f"no shape depends on the routing: hputrain's, registered with transformers' "
       f"ExpertsInterface as experts_implementation=\"{NAME}\". hputrain's Trainer selects them "
       "itself (`experts: static` in the run's header) with fused_kernels on (the default, "
       "\"auto\"; --fused-kernels) for a model that keeps transformers' default experts_implementation "
       "(\"grouped_mm\"): leave experts_implementation unset and fused_kernels on. Elsewhere (a "
       "Hugging Face Trainer, a plain loop) call hputrain.kinds.moe.experts.register() and "
       f"model.set_experts_implementation(\"{NAME}\").")
EXPERTS_READ = ("a read of the routing inside the experts' forward (the tokens each expert got): "
                "see the recompilation finding for the experts; static-shape experts read nothing back.")


@dataclasses.dataclass
class ExpertsSeen:
    """What the steps watched ran inside one class of experts modules."""

    name: str
    """The experts module's class: MixtralExperts."""
    implementation: str
    """transformers' experts_implementation it ran ("eager", "grouped_mm", ...), or "its own
    forward" for experts that do not go through transformers' ExpertsInterface."""
    fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)
    """aten op -> times it ran eagerly inside the experts' forward (the backend's own gaps left out)."""
    reads: dict = dataclasses.field(default_factory=dict)
    """SyncSite -> values read back to the host inside the experts' forward."""
    read_fix = EXPERTS_READ
    """The fix findings.diagnose gives a read inside the experts of shapes that follow the routing."""

    @property
    def routing_dependent(self) -> bool:
        return bool(self.fallbacks or self.reads)

    def as_dict(self) -> dict:
        return {"name": self.name, "implementation": self.implementation, "fallbacks": self.fallbacks,
                "host_reads": {_where(site): n for site, n in self.reads.items()}}

    def evidence(self) -> str:
        """"ran eagerly: nonzero (12x), ...; read back: 8x, at transformers/...:83 (forward)"."""
        parts = []
        if self.fallbacks:
            parts.append("ran eagerly, outside the graph: " + ", ".join(
                f"{op} ({n}x)" for op, n in sorted(self.fallbacks.items())))
        if self.reads:
            parts.append(f"read back to the host {sum(self.reads.values())}x, at "
                         + ", ".join(sorted({_where(site) for site in self.reads})))
        return "; ".join(parts)


def _where(site) -> str:
    """A host read's place: the library's line and function where the read is in one."""
    library = getattr(site, "library", None)
    return f"{library} ({site.function})" if library else str(getattr(site, "user", site))


def is_experts(module: torch.nn.Module) -> bool:
    """A transformers experts module: one made by `use_experts_implementation` (it dispatches
    through the ExpertsInterface), or any module whose class is named `*Experts`."""
    return hasattr(module, "_is_expert_parallel") or type(module).__name__.endswith("Experts")


def implementation(module: torch.nn.Module) -> str:
    if not hasattr(module, "_is_expert_parallel"):
        return "its own forward"
    return str(getattr(getattr(module, "config", None), "_experts_implementation", None) or "eager")


class ExpertsWatch:
    """While entered: what ran inside each experts module's forward during a watched step
    (`reads.in_step`); see the module's docstring."""

    def __init__(self, reads: HostReads) -> None:
        self.reads = reads
        self._seen: dict[tuple[str, str], ExpertsSeen] = {}
        self._open: list[tuple[dict[str, int], dict]] = []
        self._handles: list = []

    def __enter__(self) -> ExpertsWatch:
        from torch.nn.modules import module as modules

        self._handles = [modules.register_module_forward_pre_hook(self._before),
                         modules.register_module_forward_hook(self._after)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before(self, module, args) -> None:
        if self.reads.in_step and is_experts(module):
            self._open.append((lazy_counters(), dict(self.reads.where)))

    def _after(self, module, args, output) -> None:
        if not (self.reads.in_step and is_experts(module) and self._open):
            return
        counters, where = self._open.pop()
        now = lazy_counters()
        kind = type(module).__name__, implementation(module)
        seen = self._seen.setdefault(kind, ExpertsSeen(*kind))
        for name, value in now.items():
            op = name[6:]
            if name.startswith("aten::") and name != _READ_COUNTER and op not in BACKEND_FALLBACKS:
                if value > counters.get(name, 0):
                    seen.fallbacks[op] = seen.fallbacks.get(op, 0) + value - counters.get(name, 0)
        for site, count in self.reads.where.items():
            if count > where.get(site, 0):
                seen.reads[site] = seen.reads.get(site, 0) + count - where.get(site, 0)

    def seen(self) -> list[ExpertsSeen]:
        """The experts met in the steps watched, those whose shapes follow the routing first."""
        return sorted(self._seen.values(), key=lambda s: not s.routing_dependent)


def routing_finding(records: list[dict], warmup: int, routed: list[ExpertsSeen]) -> list[dict]:
    """One finding for the experts whose shapes follow the routing (`routed`): what in them does,
    the graphs compiled after warm-up that it explains, and the fix."""
    if not routed:
        return []
    late = [r for r in records[warmup:] if r["compiles"]]
    who = "; ".join(f"{e.name} (experts_implementation=\"{e.implementation}\": {e.evidence()})"
                    if e.implementation != "its own forward" else f"{e.name} ({e.evidence()})"
                    for e in routed)
    compiled = (f"step(s) {[r['step'] for r in late]} compiled {[r['compiles'] for r in late]} new "
                f"graphs after the {warmup} warm-up step(s), for batch shapes compiled before"
                if late else f"no step after the {warmup} warm-up step(s) compiled here by luck of "
                "the routing, but the next that routes otherwise will")
    return [{"kind": "recompilation", "message": (
        f"the experts' shapes follow the routing: {who}. They size their work by how many tokens "
        "the router sent to each expert, which changes every step, so each step's routing makes "
        f"graphs of new shapes: {compiled}. On a Gaudi every step compiles again, and each read "
        f"waits for the device. Fix: {FIX}")}]
