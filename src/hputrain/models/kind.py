"""A Hugging Face model's kind, from its config, for the run header: an image-text-to-text model
(its family: models/vision.py), a mixture of experts (how many experts, how many per token) or
dense."""
from __future__ import annotations

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


def describe(config) -> str:
    """"image-text-to-text: LLaVA", "mixture of experts: 8 experts, top-2" or "dense"."""
    from .vision import describe as describe_vision, is_image_text_to_text

    if is_image_text_to_text(config):
        return describe_vision(config)
    moe = experts_and_top_k(config)
    return f"mixture of experts: {moe[0]} experts, top-{moe[1]}" if moe else "dense"
