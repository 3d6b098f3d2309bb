"""The Hugging Face recipe's options (HFOptions): its own fields, below, with every registered
method's flags (recipes/hf/methods.py), put together once the methods are registered."""
from __future__ import annotations

import dataclasses

from ...config.fields import ConfigError, check_choice, field_docs


def compose(methods, shared: frozenset[str], kinds=()) -> type:
    """HFOptions: `RecipeSettings`, each method's flags and each model kind's (models/kind.py's
    `ModelKind.flags`: an image model's); a name in `shared` (two methods') defaults to None, its
    help naming what it is to each."""
    flags = [owner.flags for owner in (*methods, *kinds) if owner.flags is not None]
    own, docs = [], {}
    for name in sorted(shared):
        takers = [(m, next(f for f in dataclasses.fields(m.flags) if f.name == name))
                  for m in methods if m.flags is not None and name in {f.name for f in dataclasses.fields(m.flags)}]
        own.append((name, f"{takers[0][1].type} | None", dataclasses.field(default=None)))
        docs[name] = "; ".join(f"{m.label}: {field_docs(m.flags).get(name, '').rstrip('.')} "
                               f"(default {f.default})" for m, f in takers)
    options = dataclasses.make_dataclass("HFOptions", own, bases=(RecipeSettings, *flags), kw_only=True)
    options.__module__, options.__qualname__ = "hputrain.recipes.hf", "HFOptions"  # pickled by name
    options.__doc__ = ("The Hugging Face recipe's settings, beside TrainingArguments: its own and "
                       "each method's (the names two share resolved by the method taken).")
    options.__field_docs__ = docs
    options.methods, options.kinds = tuple(methods), tuple(kinds)
    return options


@dataclasses.dataclass(kw_only=True)
class RecipeSettings:
    """The Hugging Face recipe's own settings (HFOptions adds the methods')."""

    methods = kinds = ()  # not fields: the methods and kinds whose flags HFOptions holds, which check them

    model: str | None = None
    """A local Hugging Face model folder (config.json, weights, tokenizer files) to fine-tune, or a
    PEFT adapter folder (a LoRA run's final/), whose adapters training continues on."""
    base_model: str | None = None
    """The base model folder of an adapter folder given as --model or --ref-model; unset means
    the one its adapter_config.json names (base_model_name_or_path)."""
    dataset: str | None = None
    """Local data: a UTF-8 file, a folder of them, a JSON Lines or Parquet file or a folder of them
    (its validation/ subfolder evaluated on), or a save_to_disk folder, with a text column (causal
    LM), chat / instruction columns (SFT: messages, conversations, prompt + completion), prompt +
    chosen + rejected (DPO) or prompts (GRPO, with --reward-funcs)."""
    method: str = "auto"
    """What to train: auto (from the data's columns), lm (causal LM on text), sft (chat and
    instruction rows), dpo (preference pairs: prompt, chosen, rejected), grpo (prompts, rewarded
    by --reward-funcs) or reward (a reward model, on preference pairs)."""
    ref_model: str | None = None
    """DPO: a local model folder (or adapter folder) as the reference; unset means the adapter-disabled base under
    LoRA, else a frozen copy of the starting weights."""
    from_scratch: bool = False
    """Start from random weights of the folder's architecture instead of its trained weights."""
    text_column: str = "text"
    """The field (JSON Lines) or column (save_to_disk) holding the text."""
    packing: bool = True
    """SFT data (messages, conversations, prompt + completion): pack whole examples into blocks of
    block_size tokens, attention kept inside each example; --no-packing pads one example a row
    to a few lengths instead."""
    assistant_only_loss: bool = True
    """SFT on conversations: learn the assistant turns only (each with its end of turn); false
    learns every token."""
    completion_only_loss: bool = True
    """SFT on prompt + completion: learn the completion only; false learns the prompt too."""
    chat_template: str | None = None
    """A Jinja chat template file that replaces the tokenizer's (and is saved with it in final/)."""
    block_size: int | None = None
    """Tokens per training sequence; unset means min(1024, the model's maximum length)."""
    validation_split_percentage: float = 5.0
    """Percent of the blocks held out for evaluation (at least one), unless the data set is a
    DatasetDict with a "validation" split, which is evaluated on instead; 0 means no evaluation."""
    cache_dir: str | None = None
    """Where the tokenized data set is cached; unset means output_dir/.cache."""
    dataset_num_proc: int | None = None
    """Processes that tokenize the data set the first time (TRL's name); unset means one per CPU
    core, at most 8. The first process of each node tokenizes, the others wait and share its cache."""
    streaming: bool = False
    """Read --dataset (a folder of JSON Lines or Parquet shards) as a stream, tokenized and packed
    on the fly, each rank its own shards (shard i on rank i % ranks); a checkpoint saves the
    stream's position. Needs --max-steps; evaluates on a validation/ subfolder of shards if any."""
    lora_r: int | None = None
    """Train LoRA adapters of this rank instead of every weight (needs peft)."""
    lora_alpha: float | None = None
    """LoRA scaling numerator; unset means 2 * lora_r."""
    lora_dropout: float | None = None
    """Dropout on the LoRA path; unset means 0.05 (0 where PEFT adapts a weight as a parameter:
    the experts)."""
    lora_target_modules: list[str] | None = None
    """Module names to adapt (q_proj v_proj ...); unset means peft's choice for the architecture, else
    all-linear; on a mixture of experts, every linear layer but the routers. There "experts" adapts
    the experts' fused weights (PEFT's target_parameters) and a router's name (gate) the router."""
    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model must name a local Hugging Face model folder")
        if not self.dataset:
            raise ConfigError(f"--model needs --dataset PATH: {_shapes()}")
        if self.block_size is not None and self.block_size < 2:
            raise ConfigError(f"block_size must be at least 2, got {self.block_size}")
        if not 0 <= self.validation_split_percentage < 100:
            raise ConfigError("validation_split_percentage must be in [0, 100), got "
                              f"{self.validation_split_percentage}")
        check_choice("method", self.method, ("auto", *(m.name for m in self.methods)))
        if self.lora_r is not None and self.lora_r < 1:
            raise ConfigError(f"lora_r must be at least 1, got {self.lora_r}")
        given = [n for n in ("lora_alpha", "lora_dropout", "lora_target_modules") if getattr(self, n) is not None]
        if given and self.lora_r is None:
            raise ConfigError(f"--{given[0].replace('_', '-')} needs --lora-r R (the adapters' rank)")
        if self.lora_alpha is not None and self.lora_alpha <= 0:
            raise ConfigError(f"lora_alpha must be positive, got {self.lora_alpha}")
        if self.lora_dropout is not None and not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_target_modules is not None and not self.lora_target_modules:
            raise ConfigError("--lora-target-modules needs at least one module name (or leave it out)")
        for owner in (*self.methods, *self.kinds):
            owner.check_flags(self)


def _shapes() -> str:
    from .data import SHAPES

    return SHAPES
