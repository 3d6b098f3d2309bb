"""`hputrain train`: the built-in recipe, a GPT on a text corpus (by default the Python standard
library's own source, found at run time, no download), on the best device present.

Every TrainingArguments field is a flag; `--config FILE` (JSON or TOML) may hold the same fields and
the recipe's own (model_size, seq_len, corpus, max_corpus_bytes). Precedence, lowest first: the
recipe's defaults, what `hputrain config` saved, the file, the flags typed. `--devices N` starts N
processes (torchrun underneath).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .config import AcceleratorConfig, ConfigError, TrainingArguments, checked_values, read_mapping
from .defaults import load_defaults, training_defaults
from .flags import add_dataclass_flags


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


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train the built-in GPT recipe",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="JSON or TOML file of settings")
    p.add_argument("--accelerator-config", "--accelerator_config", "--gaudi-config",
                   dest="accelerator_config", help="a GaudiConfig JSON file")
    p.add_argument("--cpu", action="store_true", help="force the CPU")
    add_dataclass_flags(p, RecipeOptions, "recipe")
    add_dataclass_flags(p, TrainingArguments, "training arguments")
    p.set_defaults(func=cmd_train)


def resolve_settings(flags: dict) -> tuple[RecipeOptions, TrainingArguments]:
    """Merge the recipe's defaults, the --config file and the flags typed."""
    recipe_names = {f.name for f in dataclasses.fields(RecipeOptions)}
    file_values = read_mapping(flags["config"]) if flags.get("config") else {}
    where = f"config file {flags.get('config')}"
    recipe = checked_values(RecipeOptions, {k: v for k, v in file_values.items() if k in recipe_names}, where)
    training = checked_values(TrainingArguments,
                              {k: v for k, v in file_values.items() if k not in recipe_names}, where)
    typed = {k: v for k, v in flags.items() if k not in ("config", "accelerator_config", "cpu", "func", "command")}
    recipe |= {k: v for k, v in typed.items() if k in recipe_names}
    saved = load_defaults()  # what `hputrain config` wrote
    chosen = ((training_defaults(saved) if saved else {}) | training
              | {k: v for k, v in typed.items() if k not in recipe_names})
    # A choice made anywhere (saved, file, flag) outranks the recipe's default for the same thing.
    outranked = {"bf16": "precision", "warmup_ratio": "warmup_steps"}
    defaults = {k: v for k, v in RECIPE_DEFAULTS.items()
                if not any(choice in chosen and k == default for choice, default in outranked.items())}
    return RecipeOptions(**recipe), TrainingArguments(**(defaults | chosen))


def cmd_train(args) -> int:
    import torch

    from .checkpoint import latest_checkpoint
    from .data import load_corpus
    from .models.gpt import GPT, GPTConfig
    from .report import write_report
    from .trainer import Trainer

    options, training_args = resolve_settings(vars(args))
    config = AcceleratorConfig.from_file(args.accelerator_config) if args.accelerator_config else None
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
                      accelerator_config=config)
    if trainer.group.is_main:
        print(f"hputrain: {options.model_size} GPT ({model.num_parameters() / 1e6:.2f}M parameters) on "
              f"{trainer.accelerator.name} ({trainer.accelerator.device_name()}) in "
              f"{str(trainer.precision.compute_dtype).removeprefix('torch.')}, "
              f"{len(train_set)} training sequences of {options.seq_len} bytes from "
              f"{options.corpus or 'the Python standard library'}")
    output = trainer.train()
    device = next(model.parameters()).device  # the host after lazy mode
    # a sharded model's forward is a collective: every rank samples (the same tokens, seeded)
    sharded = trainer.strategy.shards_state and output.interrupted_by is None
    sample = _sample(model, device) if sharded else None
    if not trainer.group.is_main:
        return 0
    _write_recipe(training_args.output_dir, options, model_config)
    out = Path(training_args.output_dir)
    print(f"checkpoint: {latest_checkpoint(out)}")
    print(f"metrics:    {out / 'metrics.jsonl'}")
    try:
        for path in write_report(out):
            print(f"plot:       {path}")
    except ValueError as exc:  # matplotlib missing: the run itself is fine
        print(f"no plots: {exc}")
    if output.interrupted_by is not None:
        print(f"stopped by signal {output.interrupted_by}; resume with --resume-from-checkpoint latest")
        return 128 + output.interrupted_by
    print(f"sample:     {sample if sample is not None else _sample(model, device)!r}")
    return 0


def _write_recipe(output_dir: str, options: RecipeOptions, model_config) -> None:
    """The recipe and model shape beside the checkpoints, so a run can be rebuilt from them;
    written once the run has ended (train() holds output_dir's lock while it runs)."""
    out = Path(output_dir)
    try:
        (out / "recipe.json").write_text(json.dumps(
            {"recipe": dataclasses.asdict(options), "model": dataclasses.asdict(model_config)}, indent=2))
    except OSError as exc:
        raise ConfigError(f"output_dir {out} cannot be written: {exc.strerror} ({exc.filename})") from None


def _sample(model, device, prompt: bytes = b"def ", length: int = 120) -> str:
    """A few bytes of sampled text from the trained model, to see what it learned."""
    import torch

    ids = torch.tensor([list(prompt)], device=device)
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=length, temperature=0.8, top_k=20)
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")
