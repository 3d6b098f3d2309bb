"""A Hugging Face model folder under strategy="fsdp" across processes, or expert parallelism under
ddp, loaded so that no rank ever holds it whole: the model is built on the meta device (its
buffers real, computed as its constructor computes them), carries a weight source
(checkpoint/hf_weights.py) that the strategy calls once FSDP2 has sharded it (once the experts
are split, under ddp), and each rank reads its own rows of each tensor from the folder's
safetensors files. The weights equal `from_pretrained(dtype=float32)`'s bit for bit; a folder of
MXFP4 experts (GPT-OSS as published) is dequantized part by part as transformers dequantizes it.

LoRA adapters, small, are drawn on the CPU as PEFT draws them for an eagerly loaded model (see
`draw_adapters`). The folder's tensors map onto the parameters as from_pretrained maps them,
transformers' weight conversion included (a mixture of experts stored one expert at a time
fills its fused experts parameters, each rank reading its own experts). A folder whose tensors
do not map onto the model's parameters falls back to `from_pretrained` on every rank, with one
line saying why. One process, and every
other strategy, loads as before (recipes/hf/folders.py `_load_folder`). The reward recipe's sequence
classifier loads the same way, its score head drawn when the folder is a causal LM's (`meta_model`'s
new_heads).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch


def loads_sharded(training_args) -> bool:
    """Whether this run splits the model over several processes (WORLD_SIZE > 1, once mpirun's
    or srun's variables are read as torchrun's): fsdp, or expert parallelism under ddp too (each
    rank keeps only its experts). The model is then loaded shard by shard."""
    split = training_args.strategy == "fsdp" or getattr(training_args, "expert_parallel_size", 1) > 1
    return split and int(os.environ.get("WORLD_SIZE", "1")) > 1


@contextlib.contextmanager
def parameters_on_meta():
    """Build modules with their parameters on the meta device (no storage, nothing drawn) and
    their buffers real, as accelerate's init_empty_weights(include_buffers=False) does: a buffer
    such as rotary `inv_freq` is computed in __init__ and is often not in the checkpoint. Only
    while the model is built: torch's Module.register_parameter is restored on the way out."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def meta_model(folder: Path, config, flag: str, auto=None, *, new_heads: bool = False):
    """The model of `folder` (`auto`'s class of it: AutoModelForCausalLM unless given) on the
    meta device carrying its FolderWeights, made as from_pretrained makes it (float32, eval mode,
    its path as name_or_path, its generation config); None, after one line on the main rank,
    when the folder's tensors do not map onto its parameters (the caller then loads it whole).

    `new_heads` (a sequence classifier from a causal LM's folder): a top-level module none of
    whose weights the folder holds (the score head, width × labels: small) is drawn here, on the
    CPU, by the model's own initialisation, which is the one draw from_pretrained makes for it
    (the same values under the same seed); the folder fills the rest, and fsdp's materialise
    keeps a real tensor's values."""
    import transformers

    from ...checkpoint.hf_weights import FolderWeights, safetensors_files
    from ...distributed.fsdp import set_weight_source

    auto = auto or transformers.AutoModelForCausalLM
    # as from_pretrained, which draws nothing: a parameter made with torch.randn (CLIP's and
    # SigLIP's vision embeddings) would move the generator LoRA's adapters are drawn from next
    with parameters_on_meta(), torch.random.fork_rng(devices=[]):
        model = auto.from_config(config, dtype=torch.float32)
    files = safetensors_files(folder)
    heads = [name for name, child in model.named_children() if new_heads and not isinstance(files, str)
             and not any(f"{name}.{p}" in files for p, _ in child.named_parameters())]
    with _detached(model, heads):  # matched without the heads the folder lacks
        source = FolderWeights.match(folder, model)
    if isinstance(source, str):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"hputrain: {flag} {folder}: every rank loads the whole model, the folder's "
                  f"weights do not map onto {type(model).__name__}'s parameters ({source})")
        return None
    path = str(folder.resolve())
    if getattr(model.config, "quantization_config", None) is not None:  # MXFP4 experts, which the
        # source dequantizes (hf_conversion.py): a dense model from here on, as from_pretrained
        # leaves a model it dequantized, so that final/ is one too
        del model.config.quantization_config
    model.config.name_or_path = path  # what PEFT writes as the base model, as from_pretrained sets
    model.name_or_path = path
    if (folder / "generation_config.json").is_file():
        with contextlib.suppress(OSError, ValueError):
            model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    for name in heads:
        head = model.get_submodule(name)
        head.to_empty(device="cpu")
        model._init_weights(head)  # transformers' own initialisation of a weight it did not load
    return set_weight_source(model.eval(), source)


@contextlib.contextmanager
def _detached(model, names: list[str]):
    """The model's top-level modules `names` taken out for the block, then put back in order."""
    children = dict(model._modules)
    for name in names:
        del model._modules[name]
    try:
        yield
    finally:
        model._modules.clear()
        model._modules.update(children)


def draw_adapters(model, rng_state: torch.Tensor) -> None:
    """Give the LoRA adapters that get_peft_model added to a meta model real CPU tensors holding
    what it drew for them (lost when PEFT moved each adapter to its base layer's device, the meta
    device): its draws replayed from the generator state it started from, layer by layer in its
    order (nn.Linear's own init of A, then of B, then PEFT's reset_lora_parameters), so that they
    equal the adapters of an eagerly loaded model. The generator ends where PEFT left it."""
    from peft.tuners.lora import LoraLayer

    after = torch.random.get_rng_state()
    torch.random.set_rng_state(rng_state)
    try:
        with torch.no_grad():
            for layer in model.modules():
                if not isinstance(layer, LoraLayer):
                    continue
                for adapter in layer.lora_A:
                    for linear in (layer.lora_A[adapter], layer.lora_B[adapter]):
                        linear.to_empty(device="cpu")
                        linear.reset_parameters()
                    layer.reset_lora_parameters(adapter, model.peft_config[adapter].init_lora_weights)
    finally:
        torch.random.set_rng_state(after)
    _check_adapters(model)  # LoRA on an embedding (lora_embedding_A/B) is not drawn here


def load_adapter_values(model, folder: Path) -> None:
    """An adapter folder's LoRA adapters loaded onto a meta base (PEFT leaves them on their base
    layers' device, the meta device): given CPU tensors, then the folder's values by PEFT's own
    loader and key mapping."""
    import peft
    from peft.tuners.lora import LoraLayer

    for layer in model.modules():
        if isinstance(layer, LoraLayer):
            for adapters in (layer.lora_A, layer.lora_B):
                adapters.to_empty(device="cpu")
    peft.set_peft_model_state_dict(model, peft.utils.load_peft_weights(str(folder), device="cpu"))
    _check_adapters(model)


def _check_adapters(model) -> None:
    from ...errors import InputError

    left = [name for name, param in model.named_parameters() if param.is_meta and "lora_" in name]
    if left:
        raise InputError(f"{left[0]}: these adapters cannot be loaded with fsdp's sharded loading "
                         "(only LoRA on linear layers can)")

