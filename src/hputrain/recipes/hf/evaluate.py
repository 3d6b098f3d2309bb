"""`hputrain evaluate --model DIR --dataset PATH`: the loss of a local Hugging Face causal language
model (a downloaded one, or a run's output_dir/final: a model folder, or the adapter folder of a
LoRA run, loaded onto its base) over a whole data set.

The data is read as `hputrain train` reads it (hf.load_data: text, or SFT rows by their columns),
every example or block of one split of it (`split`: train, the whole data set where it names no
splits, as before; validation or test, a folder's files named for them or a DatasetDict's split,
hf_data), none held out, and evaluated by the Trainer's own evaluation loop
(training/evaluation.py), so the numbers are those a training run reports: `eval_loss` is the
summed cross-entropy over every counted token (labels other than -100, after the shift) divided
by their number, `eval_perplexity` its exponential, `eval_tokens` that number; on chat and
instruction rows, `examples_cut` examples were longer than the block size and cut to it, which
left `tokens_cut` counted tokens out of the loss. Packed blocks are evaluated with attention
kept inside each example (training/packed.py), so packed and unpacked data give the same loss.
"""
from __future__ import annotations

import tempfile

from ...config.arguments import TrainingArguments


def evaluate(options, *, batch_size: int = 8, precision: str = "fp32", split: str = "train") -> dict:
    """{"eval_loss", "eval_perplexity", "eval_tokens"} of the model `options.model` on the split
    `split` of `options.dataset` (options: the recipe's HFOptions, whose validation split is
    ignored)."""
    import torch

    from ...training.trainer import Trainer
    from . import choose_block_size, data_kind, load_data, load_model, method_options, model_folder
    from .adapters import tokenizer_source
    from .data import check_split

    check_split(options.dataset, split)  # one line, before any weight is read
    if data_kind(options) == "dpo":  # DPO's beta and loss_type where not given
        return evaluate_pairs(method_options(options, "dpo"), batch_size=batch_size,
                              precision=precision, split=split)
    folder = model_folder(options.model, base_model=options.base_model)
    from ...kinds.vlm.recipe import has_images, vision_config

    # image-text-to-text (kinds/vlm/run.py), but text data on a type AutoModelForCausalLM takes
    if vision_config(folder, options.base_model, images=has_images(options.dataset)) is not None:
        from ...kinds.vlm.run import evaluate_vision

        return evaluate_vision(options, folder, batch_size=batch_size, precision=precision,
                               split=split)
    model, tokenizer = load_model(folder, base_model=options.base_model)
    block_size = choose_block_size(options.block_size, model.config, tokenizer)
    options.validation_split_percentage = 0  # the whole data set is evaluated
    with tempfile.TemporaryDirectory(prefix="hputrain-evaluate-") as scratch:
        # The token cache goes where --cache-dir says, else nowhere lasting: evaluate writes no run.
        data = load_data(options, tokenizer, block_size, tokenizer_source(folder, options.base_model),
                         options.cache_dir or scratch, split)
        args = TrainingArguments(output_dir=scratch, per_device_eval_batch_size=batch_size,
                                 precision=precision, report_to="none", disable_tqdm=True)
        trainer = Trainer(model, args, data_collator=getattr(data, "collator", None))
        metrics = trainer.evaluate(data.train)
        tokens = sum(trainer.count_tokens({"labels": torch.as_tensor(row["labels"])[None]})
                     for row in data.train)
    result = {"eval_loss": metrics["eval_loss"], "eval_perplexity": metrics["eval_perplexity"],
              "eval_tokens": tokens, "method": data.method, "block_size": block_size,
              "packing": bool(options.packing) or data.method == "text"}
    if "eval_aux_loss" in metrics:  # a mixture of experts' router loss (kinds/moe/router.py)
        result["eval_aux_loss"] = metrics["eval_aux_loss"]
    if data.method != "text":  # examples longer than a block are cut to it (text is one stream)
        result |= {"examples_cut": data.packed.truncated, "tokens_cut": data.packed.labels_cut}
    return result


def evaluate_pairs(options, *, batch_size: int = 8, precision: str = "fp32",
                   split: str = "train") -> dict:
    """DPO's numbers of the model `options.model` against the reference `options.ref_model` on
    every pair of `options.dataset`: eval_loss (the mean over pairs), eval_rewards/* and
    eval_logps/* with TRL's names (methods/dpo/trainer.py), eval_pairs, and the pairs cut to the block
    size (examples_cut) or left out (their prompt fills it)."""
    from ...methods.dpo.config import DPOConfig, preference_values
    from ...errors import InputError
    from ...methods.dpo.trainer import DPOTrainer
    from . import choose_block_size, load_model, model_folder
    from ...methods.dpo.recipe import load_pairs
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
