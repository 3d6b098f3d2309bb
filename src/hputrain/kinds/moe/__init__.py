"""Mixtures of experts: the kind's hooks for the core (models/kind.py), and its parts.

- experts/: the static experts (dropless, shapes independent of the routing) and the
  expert-parallel forward, through transformers' ExpertsInterface;
- expert_parallel.py: the experts split over ranks (the strategy's layout and its agreement);
- router.py: the router's loss, its load metrics, DeepSeek-V3's bias update;
- plan.py and doctor.py: what `hputrain plan` and `hputrain doctor` say of the experts.
"""
from __future__ import annotations

from ...models.kind import ModelKind

# the config fields transformers' MoE families name their expert count and top-k with
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "top_k")


def experts_and_top_k(config) -> tuple[int, int] | None:
    """(experts per MoE layer, experts per token) of a mixture of experts' config (its text
    config for a multimodal model), or None for a dense model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = next((v for name in _EXPERT_COUNTS if isinstance(v := getattr(text, name, None), int)), None)
    top_k = next((v for name in _TOP_K if isinstance(v := getattr(text, name, None), int)), None)
    if not experts or experts < 2 or not top_k:
        return None
    return experts, top_k


class MixtureOfExperts(ModelKind):
    name = "moe"

    def matches(self, config) -> bool:
        return experts_and_top_k(config) is not None

    def describe(self, config, args=None) -> str | None:
        experts, top_k = experts_and_top_k(config)
        words = f"mixture of experts: {experts} experts, top-{top_k}"
        split = getattr(args, "expert_parallel_size", 1)
        if split > 1:
            from .experts.sizes import CAPACITY_FACTOR, holds_any_routing

            factor = getattr(args, "expert_capacity_factor", CAPACITY_FACTOR)
            buffers = ("all-to-all buffers for any routing" if holds_any_routing(top_k, experts, split, factor)
                       else f"all-to-all buffers {factor:g}x the average, an overflow runs the forward again")
            words += f", experts split over {split} ranks ({experts // split} a rank, {buffers})"
        return words

    def substitute_kernels(self, model, offered: dict, shared: dict) -> dict[str, int]:
        from .experts import use_static_experts

        if offered.get("experts") and (count := use_static_experts(model, shared)):
            return {f"experts: {offered['experts']}": count}
        return {}

    def prepare(self, model, args):
        if getattr(args, "expert_parallel_size", 1) > 1:  # the forward the strategy's split selects
            from .experts import parallel

            parallel.register()
        return None

    def extras(self, model, args, group, inputs, device):
        from .router import router_of

        return router_of(model, args, group, inputs, device)

    def parts(self, module, param) -> int:
        from .expert_parallel import SHARD_ATTRIBUTE

        shard = getattr(module, SHARD_ATTRIBUTE, None)
        split = shard is not None and param.dim() > 0 and param.shape[0] == shard.local_experts
        return shard.size if split else 1

    def check_layout(self, settings, world_size: int, config=None, model_name: str = "the model") -> None:
        if settings.expert_parallel_size == 1:
            return
        from ...errors import InputError
        from .expert_parallel import check_expert_parallel

        check_expert_parallel(settings.expert_parallel_size, world_size, config=config,
                              model_name=model_name, context_parallel_size=settings.context_parallel_size,
                              strategy=settings.strategy)
        if settings.fsdp_init_on_meta:  # each rank would draw the same values for its experts
            raise InputError(f"fsdp_init_on_meta draws the experts' weights whole, which "
                             f"expert_parallel_size={settings.expert_parallel_size} splits: build the "
                             "model eagerly or load it from a model folder")

    def parallel(self, strategy, settings, group):
        if settings.expert_parallel_size == 1:
            return strategy
        from .expert_parallel import ExpertParallel

        return ExpertParallel(strategy, group, settings.expert_parallel_size, settings.seed,
                              settings.expert_capacity_factor)

    def plan_layout(self, model, args):
        from .plan import moe_layout

        return moe_layout(model, args, tokens=0)

    def plan_tracing(self, args, fake: bool) -> list:
        from .plan import expert_parallel_stand_ins, grouped_mm_shapes

        tracing = [grouped_mm_shapes()] if fake else []  # torch's meta kernel takes bf16 only
        if int(getattr(args, "expert_parallel_size", 1) or 1) > 1:  # the split on the fake group
            tracing.append(expert_parallel_stand_ins())
        return tracing

    def counted_apart(self, model) -> list:
        from .plan import experts_modules

        return experts_modules(model)

    def doctor_watch(self, reads):
        from .doctor import ExpertsWatch

        return ExpertsWatch(reads)

    def doctor_findings(self, records: list[dict], warmup: int, seen: list) -> list[dict]:
        from .doctor import ExpertsSeen, routing_finding

        return routing_finding(records, warmup, [s for s in seen if isinstance(s, ExpertsSeen)])
