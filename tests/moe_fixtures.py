"""Tiny mixture-of-experts folders, one per decoder family in transformers (8 experts, top-2, hidden
32), written with `save_pretrained` beside the byte-level tokenizer of hf_fixtures, so that nothing
is downloaded. Shared by the experts, router, expert-parallel, loading and method tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.hf_fixtures import tiny_tokenizer

_COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=2, pad_token_id=3)

FAMILIES: dict[str, tuple[str, dict]] = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=64, num_local_experts=8,
                                      num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=64, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, num_experts=8,
                                         num_experts_per_tok=2, decoder_sparse_step=1)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=64, moe_intermediate_size=32,
                                         num_experts=8, num_experts_per_tok=2, head_dim=8)),
    # DeepSeek-V2 (-Lite): a softmax router, here its group-limited greedy top-k (2 groups, the
    # best 1; V2-Lite's is plain "greedy"), multi-head latent attention; layer 0 stays dense
    "deepseek_v2": ("DeepseekV2Config", dict(
        num_hidden_layers=3, num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        topk_method="group_limited_greedy", first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # grouped top-k (2 groups, the best 1) with the bias-corrected routing; layer 0 stays dense
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_hidden_layers=3, num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=32, num_local_experts=8,
                                     num_experts_per_tok=2, head_dim=8, sliding_window=16,
                                     layer_types=["sliding_attention", "full_attention"])),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
    "llama4_text": ("Llama4TextConfig", dict(intermediate_size=32, intermediate_size_mlp=64,
                                             num_local_experts=8, num_experts_per_tok=1, head_dim=8,
                                             interleave_moe_layer_step=1)),
}
"""family (transformers' model_type) -> (its config class, the tiny sizes)."""


def tiny_moe_config(family: str, vocab_size: int = 300, **overrides):
    transformers = pytest.importorskip("transformers")
    class_name, fields = FAMILIES[family]
    config_class = getattr(transformers, class_name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    return config_class(**(_COMMON | {"vocab_size": vocab_size} | fields | overrides))


def tiny_moe_folder(folder: Path, family: str = "mixtral", seed: int = 0, **config_overrides) -> Path:
    """`folder` holding config.json, the weights and the tokenizer, as `save_pretrained` writes
    them (the experts in transformers' on-disk form for the family)."""
    import torch
    transformers = pytest.importorskip("transformers")

    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    config = tiny_moe_config(family, len(tokenizer), **config_overrides)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


@pytest.fixture(scope="session")
def mixtral_folder(tmp_path_factory) -> Path:
    """One tiny Mixtral folder for the whole session (read-only: copy it to change it), with the
    router's loss asked for, as MoE fine-tuning configures it."""
    return tiny_moe_folder(tmp_path_factory.mktemp("tiny-mixtral"), "mixtral",
                           output_router_logits=True, router_aux_loss_coef=0.02)


@pytest.fixture(scope="session")
def moe_folders(tmp_path_factory):
    """family -> a tiny folder of it, written on first use (read-only)."""
    written: dict[str, Path] = {}

    def folder(family: str, **config_overrides) -> Path:
        key = family + repr(sorted(config_overrides.items()))
        if key not in written:
            written[key] = tiny_moe_folder(tmp_path_factory.mktemp(f"tiny-{family}"), family,
                                           **config_overrides)
        return written[key]

    return folder


# -- MXFP4 folders (GPT-OSS as published) -----------------------------------------------------------

MXFP4_QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
"""The quantization_config of openai/gpt-oss-20b's config.json."""
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes of the 4-bit E2M1 codes 0-7 (codes 8-15: the same, negative)."""


def to_mxfp4(weight):
    """An experts parameter as the model holds it (experts × in × out) in MXFP4, as transformers
    writes it (integrations/mxfp4.py Mxfp4ReverseDeserialize): blocks, experts × out × in/32 × 16
    uint8 (two E2M1 codes a byte, the element of even index in the low nibble), and scales,
    experts × out × in/32 uint8 (the group's power of two plus 127). Each group of 32 takes the
    OCP MX shared exponent, floor(log2(max |x|)) − 2, and each value the nearest code (ties to
    the lower magnitude, a value above 6 to 6)."""
    import torch

    rows = weight.detach().transpose(1, 2).float()
    experts, out, inner = rows.shape
    groups = rows.reshape(experts, out, inner // 32, 32)
    largest = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = (torch.floor(torch.log2(largest)) - 2).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled.abs()[..., None] - torch.tensor(_E2M1)).abs().argmin(-1)
    codes = codes | ((scaled < 0).long() << 3)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def mxfp4_folder(folder: Path, seed: int = 0, **config_overrides) -> Path:
    """A tiny GPT-OSS folder in the form openai publishes it: each experts parameter as
    `{name}_blocks` and `{name}_scales` (to_mxfp4), every other tensor in bf16, and the
    quantization_config in config.json; width 64 (2 groups of 32 along gate_up's inputs)."""
    import json

    import torch
    from safetensors.torch import save_file

    transformers = pytest.importorskip("transformers")
    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    config = tiny_moe_config("gpt_oss", len(tokenizer), hidden_size=64, **config_overrides)
    model = transformers.AutoModelForCausalLM.from_config(config)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = to_mxfp4(tensor)
        else:
            tensors[name] = tensor.to(torch.bfloat16).contiguous()
    Path(folder).mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = [type(model).__name__]
    written = config.to_dict() | {"quantization_config": MXFP4_QUANTIZATION, "dtype": "bfloat16"}
    (Path(folder) / "config.json").write_text(json.dumps(written, indent=2))
    tokenizer.save_pretrained(folder)
    return Path(folder)
