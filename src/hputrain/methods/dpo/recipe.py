"""`hputrain train --model DIR --dataset pairs.jsonl`: preference training (DPO) of a local Hugging
Face model on rows of prompt, chosen and rejected (methods/dpo/trainer.py, methods/dpo/data.py).

The reference, cheapest first: `--precompute-ref-log-probs` (one pass before training, cached),
the adapter-disabled base under `--lora-r`, `--ref-model DIR`, else a frozen copy of the starting
weights. Validation: the data set's own "validation" split, else the last
--validation-split-percentage of the pairs. The encoded pairs are made once per node (by
--dataset-num-proc processes) and cached as memory-mapped int32 arrays in output_dir/.cache (or
--cache-dir), as SFT's examples are. The output is what `hputrain train` writes for SFT:
final/ with the tokenizer, or the PEFT adapter.
"""
from __future__ import annotations

import dataclasses
import hashlib
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .config import DPO_DEFAULTS, DPOConfig, preference_values
from ...data import token_store
from .data import PAIR_KEYS, EncodedPairs, PairStats, encode_part, pair_shape
from ...data.token_store import Ragged
from ...errors import InputError
from ...recipes.hf import data as hf_data
from ...recipes.hf.common import choose_block_size, held_out, model_line

CACHE_VERSION = 1

SHAPES = {"prompt_chosen_rejected": "DPO on preference pairs ('prompt', 'chosen', 'rejected')",
          "implicit_prompt": "DPO on preference pairs ('chosen', 'rejected', the shared start as "
                             "the prompt)"}


def run_dpo(options, training_args, accelerator_config, folder: Path, model, tokenizer,
            block_size: int, ref_model: list, ref_folder: Path | None) -> int:
    """Train `model` (LoRA already added under --lora-r) against the reference `ref_model`
    holds: --ref-model's (loaded from `ref_folder`), a frozen copy of the starting weights, or
    None under LoRA (the adapter-disabled base). The one-item list is emptied into the trainer,
    the reference's only owner, which frees it after --precompute-ref-log-probs."""
    from .trainer import DPOTrainer
    from ...recipes.finish import train_and_finish
    from ...data.chat import use_chat_template

    use_chat_template(tokenizer, options.chat_template)
    train, validation, stats = load_pairs(
        options, tokenizer, block_size, tokenizer_folder=folder,
        cache_dir=options.cache_dir or Path(training_args.output_dir) / ".cache")
    if ref_folder is not None:
        reference, ref_key = f"--ref-model {ref_folder}", _identity(ref_folder)
    elif ref_model[0] is None:
        reference = "the base model with the LoRA adapters disabled"
        ref_key = f"{_identity(folder)}:adapters-disabled"
    else:
        reference = "a frozen copy of the starting weights"
        ref_key = f"{_identity(folder)}:start:{options.from_scratch and training_args.seed}"
    config = DPOConfig(**dataclasses.asdict(training_args), **preference_values(options),
                       max_length=block_size, ref_key=ref_key)
    trainer = DPOTrainer(model, config, ref_model=ref_model.pop(), train_dataset=train,
                         eval_dataset=validation, processing_class=tokenizer,
                         accelerator_config=accelerator_config)
    def header() -> str:
        shape = pair_shape(hf_data.columns_of(options.dataset) or [])
        return (_header(trainer, model, options, stats, len(train), len(validation or ()), block_size,
                        reference, shape) + _defaults_line(training_args))

    def forwards(final) -> str:
        ranks = trainer.group.world_size  # each rank runs its share: these are rank 0's
        return (f"reference forwards: {trainer.objective.reference_forwards} during training, "
                f"{trainer.precompute_forwards} to precompute" + (f" (on rank 0 of {ranks})"
                                                                  if ranks > 1 else ""))

    return train_and_finish(trainer, header, {"recipe": dataclasses.asdict(options), "block_size": block_size,
                                              "method": "dpo"}, forwards)


@dataclasses.dataclass(frozen=True)
class PairForm:
    """A method's preference pairs as `load_pairs` makes them (DPO's here, a reward model's in
    methods/reward/recipe.py): `encode(context, rows) -> (part, stats)`, the work of one tokenizing process;
    `join` of the parts; its cache's `write(folder, (pairs, stats))` and `read(folder)` ((pairs,
    stats), None when missing or damaged); `stats`, a dataclass of counts summed over the parts
    and the splits; `extra`, what else decides the tokens (part of the cache's key); `empty`, why
    no pair can be left (the end of an error line). Pairs have len and take(start, stop)."""
    name: str
    encode: Callable
    context: tuple
    join: Callable
    read: Callable
    write: Callable
    stats: type
    extra: list
    empty: str


def dpo_form(options, tokenizer, block_size: int) -> PairForm:
    """DPO's pairs: EncodedPairs, memory-mapped from the cache."""
    return PairForm("dpo", encode_part, (tokenizer, block_size, options.max_prompt_length),
                    EncodedPairs.join, _read_pairs, _write_pairs, PairStats,
                    [options.max_prompt_length], f"every prompt fills --block-size {block_size}")


def load_pairs(options, tokenizer, block_size: int, *, cache_dir: str | Path | None = None,
               tokenizer_folder: str | Path | None = None, form: PairForm | None = None,
               split: str = hf_data.TRAIN_SPLIT):
    """(training pairs, validation pairs or None, stats of every split) of `form` (DPO's unless
    given), from a cache in `cache_dir` made once per node (token_store.made_once), or held in
    memory when there is no cache_dir. `split`: the split read as the training pairs (hputrain
    evaluate --split reads another)."""
    form = form or dpo_form(options, tokenizer, block_size)
    path, percentage = options.dataset, options.validation_split_percentage
    read = (options, tokenizer, block_size, cache_dir, tokenizer_folder, form)
    pairs, stats = _encoded_pairs(*read, split)
    if percentage > 0 and hf_data.VALIDATION_SPLIT in hf_data.saved_splits(path):
        held, more = _encoded_pairs(*read, hf_data.VALIDATION_SPLIT)
        stats = _summed(form.stats, [stats, more])
    elif percentage > 0:
        count = held_out(len(pairs), percentage, path, "pair")
        pairs, held = pairs.take(0, len(pairs) - count), pairs.take(len(pairs) - count, len(pairs))
    else:
        held = None
    if not len(pairs):
        raise InputError(f"--dataset {path}: no pair is left to train on ({form.empty})")
    return pairs, held if held is not None and len(held) else None, stats


PAIR_ARRAYS = tuple(name for key in PAIR_KEYS for name in (key, f"{key}.offsets")) + ("stats",)


def _summed(kind: type, parts: list):
    return kind(*(sum(getattr(s, f.name) for s in parts) for f in dataclasses.fields(kind)))


def _encoded_pairs(options, tokenizer, block_size: int, cache_dir, tokenizer_folder,
                   form: PairForm, split: str):
    """(pairs, stats) of one split, encoded by --dataset-num-proc processes."""
    path = options.dataset
    workers = token_store.check_workers(getattr(options, "dataset_num_proc", None))

    def make():
        parts = list(token_store.ordered_map(
            form.encode, form.context, token_store.chunks(hf_data.records(path, split), 256), workers))
        return form.join([p for p, _ in parts]), _summed(form.stats, [s for _, s in parts])

    if cache_dir is None:
        return make()
    kind, files = hf_data.source_files(path, split)
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else repr(template)
    extra = [CACHE_VERSION, form.name, *form.extra, hashlib.sha256(template.encode()).hexdigest()]
    key = hf_data.cache_key(kind, Path(path), files, tokenizer, tokenizer_folder, block_size,
                            form.name, split if kind == "saved" else None, extra)
    made, _ = token_store.made_once(Path(cache_dir) / f"{form.name}-{key[:24]}", form.read, make,
                                    form.write)
    return made


def _read_pairs(folder: Path):
    arrays = token_store.read_arrays(folder, PAIR_ARRAYS)
    if arrays is None or arrays["stats"].shape != (len(dataclasses.fields(PairStats)),):
        return None
    columns = {key: Ragged.read(arrays, key) for key in PAIR_KEYS}
    if len({len(c) for c in columns.values()}) != 1 or any(
            c.offsets[-1] != len(c.values) for c in columns.values()):
        return None
    return EncodedPairs(columns), PairStats(*map(int, arrays["stats"]))


def _write_pairs(folder: Path, made) -> None:
    pairs, stats = made
    arrays = {name: array for key in PAIR_KEYS for name, array in pairs.columns[key].arrays(key).items()}
    stats = [getattr(stats, f.name) for f in dataclasses.fields(PairStats)]
    token_store.write_arrays(folder, {**arrays, "stats": np.asarray(stats, dtype=np.int64)})


def _identity(folder: Path) -> str:
    """A model folder's identity for the reference cache: its path and its weight files' sizes
    and modification times (a changed file is a new reference)."""
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
    return repr([str(folder.resolve())] + [(p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                           for p in files])


def _defaults_line(training_args) -> str:
    """The line naming DPO's own defaults in use (a value the user set to the same number is
    named too: harmless, and the flag to change it is the same)."""
    kept = [f"{name} {value:g}" for name, value in DPO_DEFAULTS.items()
            if getattr(training_args, name) == value]
    if not kept:
        return ""
    flags = ", ".join(f"--{name.replace('_', '-')}" for name in DPO_DEFAULTS)
    return f"hputrain: defaults for DPO: {', '.join(kept)} (TRL's DPOConfig); set {flags} to change\n"


def _header(trainer, model, options, stats: PairStats, train: int, held: int, block_size: int,
            reference: str, shape: str) -> str:
    smoothing = f", label_smoothing {options.label_smoothing:g}" if options.label_smoothing else ""
    precomputed = (" (log-probs precomputed once, cached in output_dir/.cache)"
                   if options.precompute_ref_log_probs else "")
    return pairs_header(trainer, model, options, SHAPES[shape],
                        f"loss {options.loss_type}, beta {options.beta:g}{smoothing}; reference: "
                        f"{reference}{precomputed}",
                        f"{stats.rows} rows, {train} training and {held} validation pairs, "
                        f"{stats.prompt_fills_block} left out (prompt fills --block-size "
                        f"{block_size}), {stats.truncated} cut to {block_size} tokens")


def pairs_header(trainer, model, options, method: str, loss: str, pairs: str) -> str:
    """The header of a run on preference pairs (DPO, a reward model): the model, then the method,
    its loss and the pairs, a line each."""
    return (f"{model_line(trainer, model, options)}\nhputrain: method: {method}\n"
            f"hputrain: {loss}\nhputrain: {pairs}\n"
            + hf_data.splits_line(options.dataset, options.validation_split_percentage > 0))


# -- hputrain evaluate on pairs -------------------------------------------------------------------

def evaluate_pairs(options, *, batch_size: int = 8, precision: str = "fp32",
                   split: str = "train") -> dict:
    """DPO's numbers of the model `options.model` against the reference `options.ref_model` on
    every pair of `options.dataset`: eval_loss (the mean over pairs), eval_rewards/* and
    eval_logps/* with TRL's names (methods/dpo/trainer.py), eval_pairs, and the pairs cut to the block
    size (examples_cut) or left out (their prompt fills it)."""
    from .trainer import DPOTrainer
    from ...recipes.hf.folders import load_model, model_folder
    from ...data.chat import use_chat_template

    if not options.ref_model:
        raise InputError(f"--dataset {options.dataset} holds preference pairs: evaluating them "
                         "needs --ref-model DIR, the reference the rewards are measured against")
    base = options.base_model
    model, tokenizer = load_model(model_folder(options.model, base_model=base), base_model=base)
    reference = load_model(model_folder(options.ref_model, flag="--ref-model", base_model=base),
                           base_model=base, flag="--ref-model", merge=True)[0]
    use_chat_template(tokenizer, options.chat_template)
    block_size = choose_block_size(options.block_size, model.config, tokenizer)
    options.validation_split_percentage = 0  # every pair is evaluated
    pairs, _, stats = load_pairs(options, tokenizer, block_size, split=split)
    with tempfile.TemporaryDirectory(prefix="hputrain-evaluate-") as scratch:
        args = DPOConfig(output_dir=scratch, per_device_eval_batch_size=batch_size,
                         precision=precision, report_to="none", disable_tqdm=True,
                         max_length=block_size, **preference_values(options))
        trainer = DPOTrainer(model, args, ref_model=reference, processing_class=tokenizer)
        metrics = trainer.evaluate(pairs)
    return {**metrics, "eval_pairs": len(pairs), "left_out": stats.prompt_fills_block,
            "examples_cut": stats.truncated, "method": "dpo", "block_size": block_size}
