"""What every Hugging Face recipe (fine-tuning, DPO, GRPO, reward models) shares: the block size
a run takes, and the run header's model line."""
from __future__ import annotations

from ...errors import InputError


def choose_block_size(asked: int | None, config, tokenizer) -> int:
    """`asked`, or min(1024, the longest sequence the model takes) — run_clm's default."""
    limits = [getattr(config, name) for name in ("max_position_embeddings", "n_positions",
                                                  "max_sequence_length", "seq_length")
              if isinstance(getattr(config, name, None), int)]
    if 0 < getattr(tokenizer, "model_max_length", 0) < 1_000_000:  # unset is a huge sentinel
        limits.append(tokenizer.model_max_length)
    longest = min(limits) if limits else None
    if asked is None:
        return min(1024, longest) if longest else 1024
    if longest is not None and asked > longest:
        raise InputError(f"--block-size {asked} is longer than the {longest} positions the model "
                         f"takes: give --block-size {longest} or less")
    return asked


def model_line(trainer, model, options) -> str:
    """The header's first line: the model (its own class, not FSDP2's wrapper class), LoRA's
    adapters, its kind (dense, or a mixture of experts, whose experts expert parallelism splits),
    the parameters trained (the whole model's), the device, the compute dtype and the kernels;
    for a mixture of experts, a second line on its router's balancing (kinds/moe/router.py)."""
    from ...models.kind import describe as describe_kind
    from ..finish import kernels_line

    trainable, total = _whole_counts(model)
    config = getattr(model, "config", None)
    kind = describe_kind(config, trainer.args)  # the kind's words: a MoE's split, its buffers
    router = getattr(getattr(trainer, "router", None), "line", "")
    name = f"{_class_name(model)} ({kind})"
    if options.lora_r:
        peft_config = next(iter(model.peft_config.values()))
        targets = peft_config.target_modules
        targets = ", ".join(sorted(targets)) if isinstance(targets, (set, list)) else _adapted(model)
        if getattr(peft_config, "target_parameters", None):  # the experts' fused weights
            targets = ", ".join(filter(None, [targets, *sorted(peft_config.target_parameters)]))
        name = f"{_class_name(model.get_base_model())} ({kind}) + LoRA r={options.lora_r} on {targets}"
    return (f"hputrain: {name}{' (random weights)' if options.from_scratch else ''}, "
            f"{_count(trainable)} of {_count(total)} parameters trainable, on "
            f"{trainer.accelerator.name} ({trainer.accelerator.device_name()}) in "
            f"{trainer.precision.describe()}{kernels_line(trainer)}"
            + (f"\nhputrain: {router}" if router else ""))


def _whole_counts(model) -> tuple[int, int]:
    """(trainable, all) parameters of the whole model: a parameter its kind split over ranks
    (models/kind.py's `parts`: an experts module under expert parallelism holds 1/size of its
    experts on this rank) counted whole."""
    from ...models.kind import registered

    counts, seen = [0, 0], set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:  # tied weights, counted once as model.parameters() does
                continue
            seen.add(id(param))
            n = param.numel() * max([kind.parts(module, param) for kind in registered()], default=1)
            counts[0] += n if param.requires_grad else 0
            counts[1] += n
    return counts[0], counts[1]


def _adapted(model) -> str:
    """The layers PEFT adapted, by name ("q_proj, v_proj"), and under which part of an
    image-text-to-text model ("in the language model and the vision tower"): what a target
    regular expression (an image-text-to-text model's, kinds/vlm/recipe.py) selected: the
    model kind's words (models/kind.py's `adapted_where`)."""
    from ...models.kind import kinds_of

    names = [name for name, module in model.named_modules() if hasattr(module, "lora_A")]
    layers = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in names}))
    config = getattr(model, "config", None)
    where = next(filter(None, (kind.adapted_where(config, names) for kind in kinds_of(config))), None)
    return layers if where is None else f"{layers} {where}"


def _class_name(model) -> str:
    """The model's class name, past the classes torch.distributed wraps it in (fully_shard makes
    an FSDP<Class> subclass)."""
    return next(cls.__name__ for cls in type(model).__mro__
                if not cls.__module__.startswith("torch.distributed"))


def _count(n: int) -> str:
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def held_out(total: int, percentage: float, path, what: str) -> int:
    """How many of a data set's `total` rows (the last ones) `--validation-split-percentage`
    holds out for validation: at least one, and never all (`what`: "prompt", "pair" in the line)."""
    count = max(1, int(total * percentage / 100))
    if count >= total:
        raise InputError(f"--dataset {path} has {total} {what}(s), too few to hold {percentage:g}% "
                         "out for validation: give more rows, or --validation-split-percentage 0")
    return count


def counted(n: int, noun: str) -> str:
    """"1 block", "0 blocks", "3 rows": a count and its noun, in the number it takes."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def split_sizes(train: int, held_out: int, noun: str) -> str:
    """"8 training and 2 validation blocks", or with a count of one, "8 training blocks and 1
    validation block"."""
    if train != 1 and held_out != 1:
        return f"{train} training and {held_out} validation {noun}s"
    return f"{counted(train, 'training ' + noun)} and {counted(held_out, 'validation ' + noun)}"
