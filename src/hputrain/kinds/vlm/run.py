"""`hputrain train --model VLMDIR --dataset IMAGEDATA` and `hputrain evaluate` on image data: an
image-text-to-text folder (kinds/vlm/recipe.py) fine-tuned on TRL's vision rows (kinds/vlm/data/), in blocks
of fixed shapes: S tokens and K image slots, packed without cross-talk (or one example a block
with --no-packing), through the same Trainer, strategies, checkpoints and resume as text.

What the run does not take yet is one line: DPO, GRPO and reward models, streaming, context and
expert parallelism, --method lm on image rows. Text data (no image column) with an
image-text-to-text folder: where AutoModelForCausalLM also loads its type (Gemma 3), the
causal-LM path as before (hf.py); else (LLaVA, Qwen2.5-VL) chat and prompt-completion rows train
its language model through these same blocks, as image rows with no image, and plain text is one
line.

final/ holds the model (or LoRA adapters) and the processor (processor.save_pretrained, or the
tokenizer and image processor side by side where the processor class cannot be built here).
"""
from __future__ import annotations

import dataclasses
import tempfile
import warnings
from pathlib import Path

from ...errors import InputError
from .recipe import learned_words, load_vision, prepare_parts, processor_words, saver

UNSUPPORTED = {"dpo": "DPO", "grpo": "GRPO", "reward": "a reward model"}
"""Methods that do not take an image-text-to-text model yet."""


def image_format(options) -> str:
    """The vision row format of --dataset (kinds/vlm/data/rows.FORMATS): its image column, else
    (text data) its chat or prompt-completion rows, taken as image rows without images; one line
    for what else an image-text-to-text model cannot train on here."""
    from ...data import sft
    from .data.rows import detect_image_format
    from ...recipes.hf.data import columns_of

    from ...recipes.hf.methods import is_preference, is_prompts

    columns = columns_of(options.dataset)
    method = options.method
    if method == "auto" and is_preference(columns or []):
        method = "dpo"
    elif method == "auto" and is_prompts(columns or []) and options.reward_funcs:
        method = "grpo"
    if method in UNSUPPORTED:
        raise InputError(f"{UNSUPPORTED[method]} (--method {method}) on an image-text-to-text model "
                         f"(--model {options.model}) is not supported yet: train it with SFT "
                         "(--method sft or auto) on image rows")
    fmt = detect_image_format(columns) if columns else None
    if fmt is not None and method == "lm":
        raise InputError(f"--method lm trains on plain text; --dataset {options.dataset} holds image "
                         f"rows ({fmt}): leave --method at auto (or sft)")
    if fmt is not None:
        return fmt
    try:
        found = sft.detect_format(columns or [])
    except InputError:
        found = None
    if found in ("messages", "prompt_completion") and method != "lm":
        return found  # rows without images: the language model learns them through the same path
    shown = ", ".join(map(str, columns or [])) or "plain text"
    raise InputError(f"--dataset {options.dataset} ({shown}) is not image data, and --model "
                     f"{options.model} is an image-text-to-text model, which trains here on chat "
                     "rows: 'messages' (with {\"type\": \"image\"} parts and an 'images' column, or "
                     "none), or 'prompt' and 'completion' (with 'images'), or an 'image' column")


def load_image_rows(options, processing, block_size: int, cache_dir, split: str = "train"):
    """The data set's ImageData (kinds/vlm/data/loading.py): its rows read as the text recipe reads
    them (hf_data.records), each image path relative to its data file; the encoded examples
    cached in `cache_dir` under a key of the split's data files and the tokenizer's (a rerun
    reads them back; an image file edited in place is not in the key). `split`: the split read as
    the training blocks (hputrain evaluate --split reads another)."""
    from .data.loading import load_image_data
    from .data.rows import split_rows
    from ...recipes.hf import data as hf_data
    from ...data.chat import use_chat_template

    use_chat_template(processing.tokenizer, options.chat_template)
    if options.chat_template and processing.processor is not None:  # saved with it in final/
        processing.processor.chat_template = processing.tokenizer.chat_template
    fmt = image_format(options)
    path = options.dataset

    def cache_key(split: str) -> str:  # the split's files and the tokenizer's, as text SFT keys them
        kind, files = hf_data.source_files(path, split)
        return hf_data.cache_key(kind, Path(path), files, processing.tokenizer,
                                 processing.tokenizer.name_or_path, 0, fmt,
                                 split if kind == "saved" else None, ["images"])

    return load_image_data(path, fmt, processing, block_size, options, cache_dir,
                           rows=lambda split: split_rows(path, split, image_records, hf_data.source_files),
                           splits=hf_data.saved_splits(path), cache_key=cache_key, train_split=split)


def image_records(path: str, split: str = "train"):
    """hf_data.records, but a Parquet file's images are references into it where their bytes lie
    in it as they are (kinds/vlm/data/parquet.py: a datasets Image column), not bytes in memory."""
    from .data.parquet import image_rows
    from ...recipes.hf import data as hf_data

    if path.lower().endswith(".parquet") and Path(path).is_file():
        return image_rows(Path(path))
    return hf_data.records(path, split)


def check_run(options, training_args) -> None:
    """What the image path does not take, in one line before any weight is read."""
    if options.streaming:
        raise InputError("--streaming reads text shards; an image-text-to-text model's data is read "
                         "whole: leave out --streaming")
    if training_args.context_parallel_size > 1:
        raise InputError("context parallelism on an image-text-to-text model is not supported: "
                         "set context_parallel_size=1")
    if training_args.expert_parallel_size > 1:
        raise InputError("expert parallelism on an image-text-to-text model is not supported: "
                         "set expert_parallel_size=1")
    image_format(options)


def run_vision(options, training_args, accelerator_config, folder: Path) -> int:
    """The training run on an image-text-to-text folder (recipes/hf/__init__.py's run sends it here)."""
    from ...recipes.hf.folders import is_adapter_folder
    from ...training.trainer import Trainer
    from ...recipes.finish import train_and_finish
    from ...recipes.hf.adapters import continued_rank
    from ...recipes.hf.common import choose_block_size
    from ...recipes.hf.sharded import loads_sharded

    check_run(options, training_args)
    if is_adapter_folder(folder):  # a LoRA run's final/: training continues on its adapters
        options = dataclasses.replace(options, lora_r=continued_rank(options, folder))
    # The model's output holds its vision tower's (image_outputs), views among them; FSDP2 warns
    # at every root forward that an in-place op on one would skip its hook. The run only takes
    # the loss from the output, so the warning says nothing to the user.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+ForConditionalGeneration\) "
                            "returned a view tensor")
    # A trained tower holds weights its features never reach (LLaVA's layers past its feature
    # layer and CLIP's post-norm, SigLIP's pooling head): DDP is told to expect them.
    training_args = dataclasses.replace(
        training_args,
        ddp_find_unused_parameters=training_args.ddp_find_unused_parameters or options.train_vision_tower)
    model, processing = load_vision(folder, from_scratch=options.from_scratch,
                                    sharded=loads_sharded(training_args), base_model=options.base_model,
                                    trainable=True, image_buckets=options.image_buckets)
    model = prepare_parts(model, options)
    block_size = choose_block_size(options.block_size, model.config.get_text_config(),
                                   processing.tokenizer)
    data = load_image_rows(options, processing, block_size,
                           options.cache_dir or Path(training_args.output_dir) / ".cache")
    trainer = Trainer(model, training_args, train_dataset=data.train, eval_dataset=data.validation,
                      data_collator=data.collator, accelerator_config=accelerator_config,
                      processing_class=saver(processing))
    return train_and_finish(
        trainer, lambda: header(trainer, model, options, data, processing, block_size),
        {"recipe": dataclasses.asdict(options), "block_size": block_size, "image_slots": data.slots},
        lambda final: load_line(model, final, options, processing))


def load_line(model, final: Path, options, processing) -> str:
    """How to load final/ in transformers (and PEFT)."""
    processor = ('AutoProcessor.from_pretrained("{f}")' if processing.processor is not None else
                 'AutoTokenizer.from_pretrained("{f}") and AutoImageProcessor.from_pretrained("{f}")'
                 ).format(f=final)
    if options.lora_r:
        base = model.get_base_model().name_or_path  # the absolute path adapter_config.json holds
        return (f'load it with PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained('
                f'"{base}"), "{final}") and {processor}, or merge it into one model folder with '
                f'hputrain export --merge {final} --output DIR')
    return f'load it with AutoModelForImageTextToText.from_pretrained("{final}") and {processor}'


# -- the run header --------------------------------------------------------------------------------

def header(trainer, model, options, data, processing, block_size: int) -> str:
    """The model line (its family), the processor, what is learned, the images, the blocks and
    the validation set."""
    from ...recipes.hf import data as hf_data
    from ...recipes.hf.common import model_line
    from ...recipes.hf.common import counted, split_sizes

    stats, rows = data.stats, data.rows
    held_out = len(data.validation) if data.validation is not None else 0
    learned = learned_words(processing, options, data.fmt)
    if options.packing:
        shape = (f"{split_sizes(len(data.train), held_out, 'block')} of {block_size} tokens and "
                 f"{counted(data.slots, 'image slot')}, packed with attention kept inside each "
                 f"example ({stats.padding_fraction:.1%} padding)")
    else:
        shape = (f"{split_sizes(len(data.train), held_out, 'row')} of at most {block_size} tokens "
                 f"and {counted(data.slots, 'image slot')}, unpacked (--no-packing), padded to "
                 "length buckets")
    unit = "block" if options.packing else "row"
    if data.own_validation:
        validation = f"the data set's own validation split, {counted(held_out, unit)}"
    elif held_out:
        validation = (f"the last {options.validation_split_percentage:g}% of the examples held out "
                      f"(--validation-split-percentage), {counted(held_out, unit)}")
    else:
        validation = "none (--validation-split-percentage 0)"
    return (f"{model_line(trainer, model, options)}\n"
            f"hputrain: processor: {processor_words(processing)}; {_parts(model, options)}\n"
            f"hputrain: method: SFT on image rows ({data.fmt!r}), loss on {learned}; image tokens "
            "never learned\n"
            f"hputrain: images: {processing.buckets.describe()}, {counted(data.slots, 'slot')} a "
            f"block, {counted(stats.images, 'image')}, {stats.padding_slot_fraction:.1%} of the "
            "slots padding (blank images)\n"
            + "".join(f"hputrain: warning: {said}\n" for said in stats.warnings(options.packing))
            + f"hputrain: {counted(rows.rows, 'row')}, {rows.nothing_to_learn} skipped with nothing "
            f"to learn, {_bad_rows(rows, options)}{stats.truncated} cut to {block_size} tokens "
            f"(--block-size), {stats.labels_cut} learned tokens cut\n"
            f"hputrain: {shape}, from {options.dataset}{_cached(data)}\n"
            + hf_data.splits_line(options.dataset, options.validation_split_percentage > 0)
            + f"hputrain: validation: {validation}")


def _bad_rows(rows, options) -> str:
    """"N skipped with an image that cannot be read (--skip-bad-rows; the first: LINE), " under
    --skip-bad-rows, else nothing (such a row ends the run before its first step)."""
    if not options.skip_bad_rows:
        return ""
    first = f"; the first: {rows.bad_reason}" if rows.bad_rows else ""
    return f"{rows.bad_rows} skipped with an image that cannot be read (--skip-bad-rows{first}), "


def _cached(data) -> str:
    """" (cached in DIR)" or " (from the cache DIR)": where the encoded examples are."""
    if data.cache_file is None:
        return ""
    return f" ({'from the cache' if data.from_cache else 'cached in'} {data.cache_file})"


def _parts(model, options) -> str:
    """"vision tower frozen (...), projector trained": read from what requires grad."""
    from .recipe import part_prefixes

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parts = part_prefixes(base)
    prefix = "base_model.model." if base is not model else ""

    def trains(part: str, but: str | None = None) -> bool:
        inside = (f"{prefix}{parts[part]}.",)
        outside = (f"{prefix}{parts[but]}.",) if but else ()
        return any(p.requires_grad for n, p in model.named_parameters()
                   if n.startswith(inside) and not (outside and n.startswith(outside)))

    tower = "trained" if trains("tower", "projector") else "frozen (--train-vision-tower trains it)"
    if trains("projector"):
        projector = "trained whole (--train-projector)" if options.lora_r else "trained"
    else:
        projector = ("frozen (--train-projector trains it)" if options.lora_r
                     else "frozen (--no-train-projector)")
    return f"vision tower {tower}, projector {projector}"


# -- evaluate --------------------------------------------------------------------------------------

def evaluate_vision(options, folder: Path, *, batch_size: int = 8, precision: str = "fp32",
                    split: str = "train") -> dict:
    """`hputrain evaluate --model VLMDIR` on image data: eval_loss (the summed cross-entropy of
    every learned token over their number, as transformers' loss on each example, token-weighted),
    eval_perplexity, eval_tokens, and the examples the block size cut (examples_cut, tokens_cut)."""
    from ...config.arguments import TrainingArguments
    from ...training.trainer import Trainer
    from ...recipes.hf.common import choose_block_size

    model, processing = load_vision(folder, base_model=options.base_model,
                                    image_buckets=options.image_buckets)
    block_size = choose_block_size(options.block_size, model.config.get_text_config(),
                                   processing.tokenizer)
    options.validation_split_percentage = 0  # the whole data set is evaluated
    with tempfile.TemporaryDirectory(prefix="hputrain-evaluate-") as scratch:
        data = load_image_rows(options, processing, block_size, options.cache_dir or scratch, split)
        args = TrainingArguments(output_dir=scratch, per_device_eval_batch_size=batch_size,
                                 precision=precision, report_to="none", disable_tqdm=True)
        trainer = Trainer(model, args, data_collator=data.collator)
        metrics = trainer.evaluate(data.train)
        tokens = sum(trainer.count_tokens({"labels": block["labels"][None]}) for block in data.train)
    return {"eval_loss": metrics["eval_loss"], "eval_perplexity": metrics["eval_perplexity"],
            "eval_tokens": tokens, "method": f"sft on image rows ({data.fmt})",
            "block_size": block_size, "packing": bool(options.packing), "image_slots": data.slots,
            "images": data.stats.images, "examples_cut": data.stats.truncated,
            "tokens_cut": data.stats.labels_cut, "examples": data.stats.examples}
