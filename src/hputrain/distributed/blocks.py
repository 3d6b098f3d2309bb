"""Which modules of a model are its transformer blocks.

One answer, shared by activation checkpointing (each block's activations are recomputed in
backward) and by sharding (one `fully_shard` per block). The blocks are, in this order of choice:

- the modules whose class is named in `fsdp_block_classes` (TrainingArguments), when given;
- a Hugging Face model's `_no_split_modules` classes (the layers it never splits across devices),
  those of them that are items of a layer list (an `nn.ModuleList`) where any is: a
  vision-language model also names its vision tower's embeddings and pooling head there
  (CLIPVisionEmbeddings, SiglipMultiheadAttentionPoolingHead), which are no repeated block and
  stay with the root, beside the projector and the norms, while the tower's encoder layers and
  the decoder layers are blocks;
- the built-in GPT's `Block`s.

Blocks come in module order, outermost only: a block inside another block is part of it.

Around the blocks, `end_modules` names the input embedding and the output head (what sharding
wraps as units of their own), as the model itself reports them.
"""
from __future__ import annotations

from torch import nn

from ..errors import InputError, did_you_mean


def block_modules(model: nn.Module, class_names: list[str] | None = None) -> list[nn.Module]:
    """The transformer blocks of `model`, in module order. `class_names` (fsdp_block_classes)
    wins over what the model says; a name that is no class of the model's modules is one line."""
    if class_names is not None:
        _check_class_names(model, class_names)
        return _outermost(model, set(class_names))
    split = no_split_modules(model)
    if split:
        listed = {id(item) for module in model.modules() if isinstance(module, nn.ModuleList)
                  for item in module}
        return _outermost(model, split, listed) or _outermost(model, split)
    from ..models.gpt import Block

    return [module for module in model.modules() if isinstance(module, Block)]


def end_modules(model: nn.Module, blocks: list[nn.Module]) -> tuple[nn.Module | None, nn.Module | None]:
    """(input embedding, output head) of `model` as it reports them (transformers'
    `get_input_embeddings` / `get_output_embeddings`, forwarded by a PEFT wrapper), each None when
    the model has none, does not say, it lies inside one of `blocks`, or a weight of it is also
    another module's. So a head that shares its weight with the embedding (tie_word_embeddings;
    the built-in GPT, which reports neither) gives (None, None): one matrix used first and last
    in every step stays in one unit, the root's."""
    inside = {id(m) for block in blocks for m in block.modules()}
    found = []
    for method in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, method, lambda: None)()
        except (NotImplementedError, AttributeError):  # transformers' base raises for some models
            module = None
        fits = (isinstance(module, nn.Module) and id(module) not in inside
                and any(True for _ in module.parameters()) and not _shares_weights(model, module))
        found.append(module if fits else None)
    return found[0], found[1]


def _shares_weights(model: nn.Module, part: nn.Module) -> bool:
    """Whether a parameter of `part` is also registered in a module of `model` outside `part`."""
    own = {id(m) for m in part.modules()}
    mine = {id(p) for p in part.parameters()}
    return any(id(p) in mine for m in model.modules() if id(m) not in own
               for p in m.parameters(recurse=False))


def no_split_modules(model: nn.Module) -> set[str]:
    """The class names in the `_no_split_modules` of `model` and of its sub-models (a Hugging
    Face model inside a PEFT wrapper, or a vision tower inside a multimodal model)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def every(blocks: list[nn.Module], k: int) -> list[nn.Module]:
    """Every k-th block, starting with the first (blocks 0, k, 2k, ...)."""
    return blocks[::k]


def _outermost(model: nn.Module, class_names: set[str], among: set[int] | None = None) -> list[nn.Module]:
    """The outermost modules of `model` whose class is in `class_names` (and whose id is in
    `among`, when given), in module order."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()  # ids of modules within a block already taken
    for module in model.modules():  # parents come before their children
        if id(module) in inside or type(module).__name__ not in class_names:
            continue
        if among is not None and id(module) not in among:
            continue
        blocks.append(module)
        inside.update(id(m) for m in module.modules())
    return blocks


def _check_class_names(model: nn.Module, class_names: list[str]) -> None:
    present = {type(module).__name__ for module in model.modules()}
    for name in class_names:
        if name not in present:
            raise InputError(f"fsdp_block_classes names {name!r}, which is no module class of "
                             f"{type(model).__name__}{did_you_mean(name, present)}")
