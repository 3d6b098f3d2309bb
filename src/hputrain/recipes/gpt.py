"""The built-in recipe: a GPT on a text corpus (by default the Python standard library's own
source, found at run time, no download), on the best device present.
"""
from __future__ import annotations

import dataclasses

from ..config.fields import ConfigError

MISPLACED = "is for the built-in GPT recipe; with --model the model folder decides the model"
"""What is said of one of these options given with --model (to the Hugging Face recipe)."""


@dataclasses.dataclass(kw_only=True)
class RecipeOptions:
    """The recipe's own settings, beside TrainingArguments."""

    model_size: str = "tiny"
    """GPT size: tiny, small or base."""
    seq_len: int = 256
    """Tokens (bytes) per training sequence."""
    corpus: str | None = None
    """A folder (or file) of text to train on; unset means the Python standard library's source."""
    max_corpus_bytes: int = 8_000_000
    """Read at most this many bytes of the corpus."""
    eval_batches: int = 20
    """Evaluate on at most this many validation batches."""

    def __post_init__(self) -> None:
        for name, least in (("seq_len", 2), ("max_corpus_bytes", 1), ("eval_batches", 1)):
            if getattr(self, name) < least:  # 0 batches would report a perfect eval_loss of 0.0
                raise ConfigError(f"{name} must be at least {least}, got {getattr(self, name)}")


# Chosen so that the no-argument run takes about 5 minutes on a 2-core CPU and visibly learns.
RECIPE_DEFAULTS = {
    "output_dir": "runs/gpt",
    "max_steps": 2500,
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 32,
    "learning_rate": 2e-3,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 100,
    "weight_decay": 0.1,
    "adam_beta2": 0.99,
    "logging_steps": 50,
    "eval_steps": 500,
    "save_steps": 1000,
    "save_total_limit": 2,
    "throughput_warmup_steps": 10,
    "precision": "auto",  # bf16 where the device runs it natively, else fp32
}


def defaults(options: RecipeOptions) -> dict:
    return RECIPE_DEFAULTS


def run(options: RecipeOptions, training_args, accelerator_config) -> int:
    import torch

    from ..data.batching import load_corpus
    from ..models.gpt import GPT, GPTConfig
    from ..training.trainer import Trainer
    from .finish import kernels_line, report_outputs, save_final, write_recipe

    train_set, val_set = load_corpus(options.corpus, options.seq_len, max_bytes=options.max_corpus_bytes)
    val_set = torch.utils.data.Subset(
        val_set, range(min(len(val_set), options.eval_batches * training_args.per_device_eval_batch_size)))
    try:
        model_config = GPTConfig.from_size(options.model_size, block_size=options.seq_len)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    torch.manual_seed(training_args.seed)
    model = GPT(model_config)
    trainer = Trainer(model, training_args, train_dataset=train_set, eval_dataset=val_set,
                      accelerator_config=accelerator_config)
    if trainer.group.is_main:
        print(f"hputrain: {options.model_size} GPT ({model.num_parameters() / 1e6:.2f}M parameters) on "
              f"{trainer.accelerator.name} ({trainer.accelerator.device_name()}) in "
              f"{trainer.precision.describe()}, "
              f"{len(train_set)} training sequences of {options.seq_len} bytes from "
              f"{options.corpus or 'the Python standard library'}"
              f"{kernels_line(trainer)}")
    output = trainer.train()
    if output.already_done:  # a finished run, run again: said by the trainer, nothing written
        return 0
    device = next(model.parameters()).device  # the host after lazy mode
    # a sharded model's forward is a collective: every rank samples (the same tokens, seeded)
    sharded = trainer.strategy.shards_state and output.interrupted_by is None
    sample = _sample(model, device) if sharded else None
    final = save_final(trainer, output)  # every rank: a sharded model is gathered first
    if not trainer.group.is_main:
        return 0
    write_recipe(training_args.output_dir, {"recipe": dataclasses.asdict(options),
                                            "model": dataclasses.asdict(model_config)})
    status = report_outputs(trainer, output)
    if status is not None:
        return status
    if final is not None and hasattr(GPT, "from_pretrained"):  # checkpoint/export.py gives GPT one
        print(f"load it with hputrain.models.gpt.GPT.from_pretrained({str(final)!r})")
    print(f"sample:     {sample if sample is not None else _sample(model, device)!r}")
    return 0


def _sample(model, device, prompt: bytes = b"def ", length: int = 120) -> str:
    """A few bytes of sampled text from the trained model, to see what it learned."""
    import torch

    ids = torch.tensor([list(prompt)], device=device)
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=length, temperature=0.8, top_k=20)
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def step_model(options: RecipeOptions):
    """One training step of this recipe, for `hputrain plan`: the fields of rehearsal.plan's
    StepModel (the GPT of --model-size, windows of --seq-len bytes)."""
    import torch

    from ..models.gpt import GPT, GPTConfig

    try:
        config = GPTConfig.from_size(options.model_size, block_size=options.seq_len)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None

    def batch(size: int) -> dict:
        ids = torch.randint(0, config.vocab_size, (size, options.seq_len))
        return {"input_ids": ids, "labels": ids}

    return {"build": lambda lora: GPT(config), "batch": batch,
            "name": f"the {options.model_size} GPT, {options.seq_len}-byte sequences"}
