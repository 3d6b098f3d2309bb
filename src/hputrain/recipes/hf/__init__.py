"""`hputrain train --model DIR --dataset PATH`: fine-tune a local Hugging Face causal language
model, all its weights or LoRA adapters (`--lora-r R`), without the network.

The model folder is what `save_pretrained` writes (config.json, weights, tokenizer files); the
data is local text (recipes/hf/data.py). The method its columns ask for (recipes/hf/methods.py)
trains it, or the model's kind its own way (an image-text-to-text model: models/kind.py's
`recipe`). The result is written the same way into output_dir/final: a model folder, or a PEFT
adapter folder, that transformers and peft load as they are.
"""
from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

from ...config.fields import ConfigError  # noqa: F401  (a bad option's error, imported from here too)
from ...errors import InputError, did_you_mean
from ...errors import first_line as _first_line
from .adapters import continued_rank, is_linear, moe_experts, wrap_lora
# a model folder, read and loaded (imported from here too)
from .folders import (adapter_base, check_vocabulary, is_adapter_folder, load_model,  # noqa: F401
                      model_folder, tokenizer_source)
from .common import choose_block_size  # noqa: F401  (imported from here too)
from .common import model_line
# imported from here too
from .methods import data_kind, is_preference, is_prompts, method_named, options_class  # noqa: F401

MISPLACED = "needs --model DIR (a Hugging Face model folder to fine-tune)"
"""What is said of one of these options given without --model (to the built-in GPT recipe)."""


def __getattr__(name: str):
    if name == "HFOptions":  # the recipe's fields and the registered methods' (recipes/hf/options.py)
        return options_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def defaults(options) -> dict:
    """Fine-tuning defaults as the Hugging Face Trainer's examples use them; LoRA takes a larger
    learning rate, since it moves far fewer weights."""
    return {
        "output_dir": str(Path("runs") / (Path(options.model).resolve().name or "model")),
        "learning_rate": 1e-4 if options.lora_r else 5e-5,
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 8,
        "logging_steps": 10,
        "eval_steps": 0,  # evaluate once, at the end
        "save_steps": 500,
        "save_total_limit": 2,
        "precision": "auto",  # bf16 where the device runs it natively, else fp32
    } | method_defaults(options)


def method_defaults(options) -> dict:
    """The method's own defaults over those (TRL's config's: methods/dpo/config.py's ...): the
    method --method names, else the one the data's columns ask for. Data that cannot be read yet
    gets none: run() says what is wrong with it."""
    from .data import columns_of
    from .methods import registered_methods

    try:
        columns = columns_of(options.dataset) or []
    except (InputError, OSError):
        return {}
    if options.method != "auto":
        return dict(method_named(options.method).defaults)
    claimed = next((m for m in registered_methods() if m.claims(columns, options)), None)
    return dict(claimed.defaults) if claimed is not None else {}


def kind_recipe(folder: Path, options):
    """The recipe of the model's kind that trains `folder` on --dataset its own way (models/kind.py's
    `recipe`: an image-text-to-text model's), or None: the methods' (an uncovered family: one line)."""
    from ...models.kind import own_recipes

    return next((own for own in own_recipes()
                 if own.takes(folder, options.base_model, options.dataset)), None)


@dataclasses.dataclass
class Policy:
    """What the recipe loaded for a method's `train`: the model (LoRA added under --lora-r), its
    tokenizer, the block size, and the frozen reference in a one-item list the trainer empties
    (no frame of the recipe keeps it alive, so DPO frees it once its log-probs are precomputed),
    with the folder it came from (None: a copy of the starting weights, or none)."""

    model: object
    tokenizer: object
    block_size: int
    reference: list
    ref_folder: Path | None


def run(options, training_args, accelerator_config) -> int:
    import torch

    from ...distributed.launch import needs_launch, relaunch_current_program
    from ...distributed.launchers import adopt_launcher_env
    from .methods import resolved

    folder = model_folder(options.model, base_model=options.base_model,
                          weights=not options.from_scratch)
    own = kind_recipe(folder, options)
    if own is not None:  # what the kind's recipe does not take, before any process starts
        own.check_run(options, training_args)
    if options.streaming:  # a shard folder's refusals, before any weight is read (recipes/hf/stream.py)
        from .stream import check_stream

        data_kind(options)  # a method that never streams (GRPO) says so first
        check_stream(options, training_args)
    adopt_launcher_env(training_args.devices, training_args.num_nodes)  # mpirun's or srun's ranks
    if training_args.expert_parallel_size > 1:  # refused before any process starts
        _expert_parallel(folder, options, training_args)
    if needs_launch(training_args.devices, training_args.num_nodes):
        # One process per device, started before any weight is read: this one only waits for them
        # (it would otherwise hold a whole copy of the model for the length of the run).
        data_kind(options)  # the data's shape checked once, here, in one line
        return relaunch_current_program(training_args.devices, training_args.num_nodes)
    torch.manual_seed(training_args.seed)  # --from-scratch weights and LoRA's initial adapters
    if own is not None:
        return own.run(options, training_args, accelerator_config, folder)
    asked = method_named(options.method)
    if asked.loads_model:  # its own model (a reward model's head: methods/reward/recipe.py)
        return asked.run(options, training_args, accelerator_config, folder)
    if is_adapter_folder(folder):  # a LoRA run's final/: training continues on its adapters
        options = dataclasses.replace(options, lora_r=continued_rank(options, folder))
    from .sharded import loads_sharded

    sharded = loads_sharded(training_args)  # fsdp or expert parallelism: no rank holds the model whole
    model, tokenizer = load_model(folder, options.from_scratch, base_model=options.base_model,
                                  trainable=True, sharded=sharded)
    check_vocabulary(model, tokenizer, folder)
    method = method_named(data_kind(options))
    options = resolved(options, method)  # beta and loss_type: the method's own defaults
    referenced = method.references(options)
    ref_folder = (model_folder(options.ref_model, flag="--ref-model", base_model=options.base_model)
                  if referenced and options.ref_model else None)
    reference = [load_model(ref_folder, base_model=options.base_model, flag="--ref-model",
                            merge=True, sharded=sharded)[0] if ref_folder is not None else None]
    if referenced and reference[0] is None and not options.lora_r:  # the starting weights, frozen
        reference = [copy.deepcopy(model)]
    if options.lora_r and not is_adapter_folder(folder):
        model = add_lora(model, options)
    block_size = choose_block_size(options.block_size, model.config, tokenizer)
    policy = Policy(model, tokenizer, block_size, reference, ref_folder)
    del model, reference
    return method.train(options, training_args, accelerator_config, folder, policy)


def train_blocks(options, training_args, accelerator_config, folder: Path, policy: Policy) -> int:
    """The causal LM's run (Method.train): text blocks, or the chat and instruction rows of the
    method whose shape they have (SFT's), read whole or streamed, trained on the model's own loss."""
    from ...training.trainer import Trainer
    from ..finish import train_and_finish

    model, tokenizer, block_size = policy.model, policy.tokenizer, policy.block_size
    if options.streaming:  # shards read as a stream, each rank its own (recipes/hf/stream.py)
        from .stream import stream_data, stream_header

        data = stream_data(options, tokenizer, block_size)
    else:
        data = load_data(options, tokenizer, block_size, tokenizer_source(folder, options.base_model),
                         options.cache_dir or Path(training_args.output_dir) / ".cache")
    if data.method != "text" and options.packing and training_args.context_parallel_size > 1:
        raise InputError("packed SFT blocks under context parallelism are not supported (each rank "
                         "would hold a slice of several examples): use --no-packing")
    trainer = Trainer(model, training_args, train_dataset=data.train, eval_dataset=data.validation,
                      data_collator=getattr(data, "collator", None),
                      accelerator_config=accelerator_config, processing_class=tokenizer)

    def header() -> str:
        if options.streaming:
            return stream_header(model_line(trainer, model, options), trainer, options, data, block_size)
        return _header(trainer, model, options, data, block_size)

    def load_line(final: Path) -> str:
        if not options.lora_r:
            return f'load it with AutoModelForCausalLM.from_pretrained("{final}")'
        base = model.get_base_model().name_or_path  # the absolute path adapter_config.json holds
        return (f'load it with PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base}"), '
                f'"{final}"), or merge it into one model folder with hputrain export --merge {final} '
                '--output DIR')

    record = {"recipe": dataclasses.asdict(options), "block_size": block_size}
    return train_and_finish(trainer, header, record, load_line)


def _expert_parallel(folder: Path, options, training_args) -> None:
    """A parallel layout the model's kinds and the world allow (an expert-parallel one: one line
    otherwise, before any weight is read; models/kind.py's `check_layout`)."""
    import transformers

    from ...config.sections import Sections
    from ...models.kind import registered

    size = training_args.expert_parallel_size
    if options.lora_r and "experts" in (options.lora_target_modules or []):
        raise InputError(f"expert_parallel_size={size} with LoRA adapters on the experts "
                         "(--lora-target-modules experts) is not supported: adapt attention and the "
                         "dense layers, or set expert_parallel_size=1")
    world = int(os.environ.get("WORLD_SIZE") or training_args.devices * training_args.num_nodes)
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    for kind in registered():
        kind.check_layout(Sections.of(training_args).parallelism, world, config, options.model)


def load_data(options, tokenizer, block_size: int, folder: Path, cache_dir,
              split: str = "train"):
    """The data set as training and validation blocks (or rows): text, or the rows of the method
    whose shape its columns have (data_method; SFT's), with the --chat-template given put into
    the tokenizer first. `split`: the split read as the training blocks (hputrain evaluate
    --split reads another)."""
    from .data import data_method, load_blocks
    from .methods import rows_method
    from ...data.chat import use_chat_template

    use_chat_template(tokenizer, options.chat_template)
    method = data_method(options.dataset, options.text_column)
    if (options.method == "lm") != (method == "text") and options.method != "auto":
        found = "text" if method == "text" else f"{method} rows"
        raise InputError(f"--method {options.method}: --dataset {options.dataset} holds {found}: "
                         "leave --method at auto, or give data of that shape")
    if method == "text":
        data = load_blocks(options.dataset, tokenizer, block_size, text_column=options.text_column,
                           validation_percentage=options.validation_split_percentage,
                           cache_dir=cache_dir, tokenizer_folder=folder,
                           workers=options.dataset_num_proc, split=split)
    else:
        data = rows_method(method).load_rows(options.dataset, method, tokenizer, block_size, options,
                                             cache_dir=cache_dir, tokenizer_folder=folder, split=split)
    data.method = method
    return data


# -- the model -----------------------------------------------------------------------------------

def step_model(options):
    """One training step of this recipe, for `hputrain plan`: the fields of rehearsal.plan's
    StepModel (the folder's architecture from its config.json alone, no weight read; LoRA as
    --lora-r asks, r 16 when the plan tries it; blocks of --block-size tokens)."""
    import torch

    folder = model_folder(options.model, base_model=options.base_model)
    if is_adapter_folder(folder):  # the base model's architecture, with LoRA of the folder's rank
        options = dataclasses.replace(options, lora_r=continued_rank(options, folder))
        folder = adapter_base(folder, options.base_model)
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"--model {folder}: config.json cannot be read: {_first_line(exc)}") from None
    longest = getattr(config.get_text_config(), "max_position_embeddings", None) or 1024
    block = options.block_size or min(1024, longest)
    from ...models.kind import own_recipes

    for own in own_recipes():  # a kind that plans its own step (image blocks: kinds/vlm/plan.py)
        if own.plans(config):
            return own.step_model(folder, config, options, block)

    def build(lora: bool):
        # a copy each time: the kernels set the attention implementation on the config they see
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
        if lora:
            model = add_lora(model, dataclasses.replace(options, lora_r=options.lora_r or 16))
        return model

    def batch(size: int) -> dict:
        ids = torch.randint(0, config.vocab_size, (size, block))
        return {"input_ids": ids, "labels": ids, "use_cache": False}  # as training calls it

    return {"build": build, "batch": batch, "lora": bool(options.lora_r), "lora_possible": True,
            "name": f"{config.model_type} from {folder}, blocks of {block} tokens"}

def add_lora(model, options):
    """`model` wrapped by peft with LoRA adapters: only the adapters will require grad."""
    if options.lora_target_modules and not moe_experts(model):
        _check_targets(model, options.lora_target_modules)
    return wrap_lora(model, options, "CAUSAL_LM")


def _check_targets(model, targets: list[str]) -> None:
    """Each target names a module (by its last name part, or a dotted tail), as peft matches."""
    names = [name for name, _ in model.named_modules() if name]
    layers = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if is_linear(module)})
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in names):
            raise InputError(f"--lora-target-modules: {type(model).__name__} has no module named "
                             f"{target!r}{did_you_mean(target, layers)}; its linear layers are "
                             f"{', '.join(layers)}")


# -- the run header ------------------------------------------------------------------------------

def _header(trainer, model, options, data, block_size: int) -> str:
    from .data import splits_line
    from .common import counted, split_sizes
    from .methods import rows_method

    method = rows_method(data.method)  # SFT's, for its rows

    held_out = len(data.validation) if data.validation is not None else 0
    cached = f"from the cache {data.cache_file}" if data.from_cache else f"cached in {data.cache_file}"
    unit = "block" if options.packing or data.method == "text" else "row"
    if data.own_validation:
        validation = f"the data set's own validation split, {counted(held_out, unit)}"
    elif held_out:
        held = "blocks" if data.method == "text" else "examples"
        validation = (f"the last {options.validation_split_percentage:g}% of the {held} held out "
                      f"(--validation-split-percentage), {counted(held_out, unit)}")
    else:
        validation = "none (--validation-split-percentage 0)"
    return (f"{model_line(trainer, model, options)}\n"
            f"hputrain: method: {method.words[data.method]}\n"
            + (f"hputrain: {split_sizes(len(data.train), held_out, 'block')} of {block_size} "
               f"tokens from {options.dataset} ({cached})\n" if data.method == "text" else
               method.describe_rows(data, options, block_size, f"from {options.dataset} ({cached})"))
            + splits_line(options.dataset, options.validation_split_percentage > 0)
            + f"hputrain: validation: {validation}")
