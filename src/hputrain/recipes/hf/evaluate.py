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
    from . import choose_block_size, data_kind, kind_recipe, load_data
    from .folders import load_model, model_folder, tokenizer_source
    from .data import check_split
    from .methods import method_named

    check_split(options.dataset, split)  # one line, before any weight is read
    found = method_named(data_kind(options)).evaluate(options, batch_size=batch_size,
                                                      precision=precision, split=split)
    if found is not None:  # the method's own numbers (DPO's on pairs: methods/dpo/recipe.py)
        return found
    folder = model_folder(options.model, base_model=options.base_model)
    own = kind_recipe(folder, options)  # an image-text-to-text model's (kinds/vlm/run.py)
    if own is not None:
        return own.evaluate(options, folder, batch_size=batch_size, precision=precision, split=split)
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
