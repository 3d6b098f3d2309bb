"""LoRA adapters in the Hugging Face recipe: training that continues on an adapter folder's
adapters (`continued_rank`: what `hputrain train --lora-r` wrote into output_dir/final, given as
--model), and what new adapters go on (lora_settings): on a mixture of experts attention and the
dense layers by default, the experts' fused 3-D weights and the routers only when
--lora-target-modules names them. Reading adapter folders (their base, tokenizer, adapters) is
recipes/hf/folders.py's.
"""
from __future__ import annotations

from pathlib import Path

from .folders import adapter_config
from ...errors import InputError


def continued_rank(options, folder: Path) -> int:
    """The LoRA rank of the adapter folder `folder` given as --model, which training continues on
    as it is: LoRA adapters only (which the recipe trains, saves and disables for DPO's
    reference); --lora-* flags that ask for other adapters, and --from-scratch, are one line (a
    --lora-r equal to the rank is taken: the command that wrote the folder, run again)."""
    config = adapter_config(folder)
    rank, kind = config.get("r"), config.get("peft_type")
    if kind != "LORA" or not isinstance(rank, int):
        raise InputError(f"--model {options.model}: training continues only on LoRA adapters, and "
                         f"this folder holds {kind or 'other'} adapters")
    if options.lora_r is not None and options.lora_r != rank:
        raise InputError(f"--lora-r {options.lora_r}: --model {options.model} holds LoRA adapters of "
                         f"rank {rank}, which training continues on: leave out --lora-r")
    for name in ("lora_alpha", "lora_dropout", "lora_target_modules"):
        if getattr(options, name) is not None:
            raise InputError(f"--{name.replace('_', '-')}: --model {options.model} holds LoRA "
                             "adapters, which training continues on as they are: leave it out")
    if options.from_scratch:
        raise InputError(f"--from-scratch: --model {options.model} is an adapter folder, whose "
                         "base has trained weights: give the base model's folder instead")
    return rank


# -- what LoRA adapts -----------------------------------------------------------------------------

EXPERTS_NAME = "experts"
"""The name --lora-target-modules gives the experts (every family in transformers calls them so)."""


def lora_settings(peft, model, options) -> dict:
    """LoraConfig's target_modules, target_parameters and lora_dropout for `model` under the
    --lora-* options. A dense model: --lora-target-modules, else peft's names for the
    architecture, else all-linear. A mixture of experts (a module holding fused 3-D expert
    weights): every linear layer of the body (attention, dense MLPs, shared experts) but the
    routers, unless --lora-target-modules names what to adapt: the experts by their name
    ("experts", through PEFT's target_parameters on the fused weights), a router by its name."""
    dropout = 0.05 if options.lora_dropout is None else options.lora_dropout
    experts = moe_experts(model)
    if not experts:
        targets = options.lora_target_modules
        if not targets:  # peft knows the attention projections of the architectures it lists
            known = getattr(peft.utils, "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING", {})
            targets = None if getattr(model.config, "model_type", None) in known else "all-linear"
        return {"target_modules": targets, "lora_dropout": dropout}
    modules, parameters = _moe_targets(model, experts, options.lora_target_modules)
    modules, moved = _kept_by_peft(peft, model, modules)
    parameters = sorted(parameters | {f"{name}.weight" for name in moved})
    if parameters:  # PEFT's ParamWrapper cannot drop out the input of a weight it adapts
        if options.lora_dropout:
            raise InputError(f"--lora-dropout {options.lora_dropout:g}: LoRA on {parameters[0]} "
                             "(a weight PEFT adapts as a parameter, target_parameters) takes no "
                             "dropout: leave --lora-dropout out or give 0")
        dropout = 0.0
    settings = {"target_modules": sorted(modules), "lora_dropout": dropout}
    return settings | ({"target_parameters": parameters} if parameters else {})


def wrap_lora(model, options, task_type: str):
    """`model` wrapped by PEFT with LoRA adapters of `task_type` (CAUSAL_LM; SEQ_CLS, whose score
    head PEFT also trains and saves), the adapters drawn from this process's generator as it is
    now: on the CPU for a model on the meta device (fsdp's sharded loading, sharded.py)."""
    import warnings

    import torch

    from ...distributed.fsdp import on_meta
    from ...errors import first_line
    from .sharded import draw_adapters

    try:
        import peft
    except ImportError:
        raise InputError("--lora-r needs peft, which is not installed: pip install peft") from None
    config = peft.LoraConfig(task_type=task_type, r=options.lora_r,
                             lora_alpha=options.lora_alpha or 2 * options.lora_r,
                             **lora_settings(peft, model, options))
    rng_state = torch.random.get_rng_state()  # what the adapters are drawn from
    try:
        with warnings.catch_warnings():  # PEFT reads a name transformers 5 deprecates: not the user's
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            wrapped = peft.get_peft_model(model, config)
    except ValueError as exc:
        raise InputError(f"LoRA cannot wrap {type(model).__name__}: {first_line(exc)} (name its "
                         "layers with --lora-target-modules)") from None
    if on_meta(model):
        draw_adapters(wrapped, rng_state)
    return wrapped


def moe_experts(model) -> dict[str, object]:
    """name -> each experts module of `model`: the modules holding fused 3-D expert weights of
    their own (transformers 5's form of every mixture-of-experts family); empty for a dense model."""
    return {name: module for name, module in model.named_modules()
            if any(param.dim() == 3 for param in module.parameters(recurse=False))}


def _moe_targets(model, experts: dict, asked: list[str] | None) -> tuple[set[str], set[str]]:
    """(target_modules, target_parameters) of a mixture of experts: by default each linear layer of
    the body that is neither in the experts nor a router (a leaf layer of an MoE block beside its
    experts: gate, router, shared_expert_gate), named by the shortest tail of its name that names
    no other layer; `asked`: those names, the experts' by their 3-D weights."""
    routers = {f"{parent}.{child}" for parent in {name.rpartition(".")[0] for name in experts}
               for child, module in model.get_submodule(parent).named_children()
               if f"{parent}.{child}" not in experts and not list(module.children())
               and list(module.parameters(recurse=False))}
    inside = tuple(f"{name}." for name in experts)
    layers = {name for name, module in model.named_modules()
              if "." in name and is_linear(module) and not name.startswith(inside)}
    if asked:
        return _asked_targets(model, experts, routers, layers, asked)
    chosen = layers - routers
    return {_shortest_tail(name, chosen, routers) for name in chosen}, set()


def _asked_targets(model, experts: dict, routers: set[str], layers: set[str],
                   asked: list[str]) -> tuple[set[str], set[str]]:
    """--lora-target-modules on a mixture of experts: a linear layer's name as peft matches it, the
    experts' (each fused 3-D weight, as a PEFT target parameter), a router's that is no Linear
    (its weight, as a target parameter)."""
    modules, parameters = set(), set()
    for target in asked:
        named = [name for name, _ in model.named_modules()
                 if name == target or name.endswith("." + target)]
        if not named:
            known = sorted({name.rsplit(".", 1)[-1] for name in layers | routers} | {EXPERTS_NAME})
            raise InputError(f"--lora-target-modules: {type(model).__name__} has no module named "
                             f"{target!r}; its layers are {', '.join(known)}")
        for name in named:
            if name in experts:
                parameters |= {f"{target}.{weight}" for weight, param in
                               experts[name].named_parameters(recurse=False) if param.dim() == 3}
            elif name in routers and not is_linear(model.get_submodule(name)):
                parameters.add(f"{target}.weight")
            else:
                modules.add(target)
    return modules, parameters


def _shortest_tail(name: str, chosen: set[str], others: set[str]) -> str:
    """The last parts of `name`, as few as name no layer of `others` (which peft would adapt too)."""
    parts = name.split(".")
    for count in range(1, len(parts) + 1):
        tail = ".".join(parts[-count:])
        if not any(other == tail or other.endswith("." + tail) for other in others):
            return tail
    return name


def _kept_by_peft(peft, model, modules: set[str]) -> tuple[set[str], set[str]]:
    """(the names PEFT adapts as modules, those it would move): PEFT rewrites the target_modules of
    the families whose experts transformers 5 fused (a name such as down_proj is taken for the v4
    experts' and becomes their fused weight), when it wraps a model and again when it loads the
    folder. The names it would move are kept on their own layers as target parameters instead."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a PEFT that converts nothing
        return modules, set()
    probe = peft.LoraConfig(r=1, target_modules=sorted(modules))
    convert_peft_config_for_transformers(probe, model=model, conversions=None)
    kept = set(probe.target_modules or ())
    return kept & modules, modules - kept


def is_linear(module) -> bool:
    import torch

    # GPT-2 style models hold their projections in transformers' Conv1D, a transposed Linear.
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


