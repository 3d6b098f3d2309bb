"""`hputrain train --model DIR --dataset PATH`: fine-tune a local Hugging Face causal language
model, all its weights or LoRA adapters (`--lora-r R`), without the network.

The model folder is what `save_pretrained` writes (config.json, weights, tokenizer files); the
data is local text (recipes/hf/data.py). The result is written the same way into output_dir/final: a
model folder, or a PEFT adapter folder, that transformers and peft load as they are.
"""
from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

from ...config.fields import ConfigError, check_choice
from ...methods.grpo.config import GRPO_DEFAULTS, GRPOOptions
from ...methods.reward.config import REWARD_DEFAULTS
from ...methods.dpo.config import DPO_DEFAULTS, PreferenceOptions
from ...errors import InputError, did_you_mean
from ...errors import first_line as _first_line
from ...kinds.vlm.family import describe as describe_vision, is_image_text_to_text
from ...checkpoint.model_folders import (CAUSAL_LM, SEQ_CLS, TASK_WORDS, adapter_base, check_task,
                                         check_weight_files, folder_task, head_labels,
                                         is_adapter_folder, load_classifier, tokenizer_folder)
from .adapters import (continued_rank, is_linear, moe_experts, tokenizer_source,
                       with_adapters, wrap_lora)
from .common import choose_block_size  # noqa: F401  (imported from here too)
from .common import model_line
# imported from here too
from .methods import data_kind, is_preference, is_prompts, method_options  # noqa: F401

METHOD_NAMES = ("auto", "lm", "sft", "dpo", "grpo", "reward")
"""--method's values."""
MISPLACED = "needs --model DIR (a Hugging Face model folder to fine-tune)"
"""What is said of one of these options given without --model (to the built-in GPT recipe)."""


@dataclasses.dataclass(kw_only=True)
class HFOptions(GRPOOptions, PreferenceOptions):
    """The Hugging Face recipe's own settings, beside TrainingArguments (and DPO's and GRPO's,
    inherited: `beta` and `loss_type` are both methods' names, resolved by `method_options`)."""

    beta: float | None = None
    """DPO: how far the policy may move from the reference (default 0.1); GRPO: the weight of
    the KL penalty to the reference (default 0.0: no reference)."""
    loss_type: str | None = None
    """DPO: sigmoid (default), ipo, hinge, robust; GRPO: dapo (default), grpo, bnpo, dr_grpo."""
    reward_funcs: list[str] | None = None
    """GRPO: the rewards, each FILE.py:NAME (a function f(prompts, completions, completion_ids,
    **columns) -> list of floats or None, TRL's signature) or a reward-model folder; a data set of
    prompts with --reward-funcs trains with GRPO."""

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
    train_vision_tower: bool = False
    """An image-text-to-text model: train the vision tower too (under LoRA, adapters on its
    linear layers); by default it is frozen."""
    train_projector: bool | None = None
    """An image-text-to-text model: train the projector (vision features into the text width);
    unset means yes for full fine-tuning, no under LoRA (where it is then trained whole)."""
    image_buckets: list[str] | None = None
    """Image sizes, WIDTHxHEIGHT, each image is resized into (the nearest in shape): each a fixed
    number of image tokens; unset means the processor's one size (LLaVA, Gemma 3), or three of
    equal token count, square, wide and tall (Qwen2.5-VL). Every bucket must give the same count."""
    image_slots: int | None = None
    """Images per packed block (the vision tower's fixed batch, padded with blank images); unset
    means the mean images per block of the packed data, at least the most of one example."""
    skip_bad_rows: bool = False
    """Image data: leave out the rows whose image is missing or cannot be decoded (a truncated
    file), counted in the header with the first one's reason; by default the first such row ends
    the run before its first step, in one line naming it (every image is decoded while the data
    set is encoded)."""
    center_rewards_coefficient: float | None = None
    """--method reward: add this times the squared sum of each pair's two rewards to the loss,
    which keeps rewards centred on 0 (TRL's name; 0.01 in the paper that proposed it)."""

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
        check_choice("method", self.method, METHOD_NAMES)
        if self.center_rewards_coefficient is not None and (
                self.method != "reward" or self.center_rewards_coefficient < 0):
            raise ConfigError("--center-rewards-coefficient is for --method reward and must not be "
                              f"negative, got {self.center_rewards_coefficient} with --method {self.method}")
        if self.lora_r is not None and self.lora_r < 1:
            raise ConfigError(f"lora_r must be at least 1, got {self.lora_r}")
        given = [n for n in ("lora_alpha", "lora_dropout", "lora_target_modules") if getattr(self, n) is not None]
        if given and self.lora_r is None:
            raise ConfigError(f"--{given[0].replace('_', '-')} needs --lora-r R (the adapters' rank)")
        if self.lora_alpha is not None and self.lora_alpha <= 0:
            raise ConfigError(f"lora_alpha must be positive, got {self.lora_alpha}")
        if self.lora_dropout is not None and not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.image_slots is not None and self.image_slots < 1:
            raise ConfigError(f"image_slots must be at least 1, got {self.image_slots}")
        if self.lora_target_modules is not None and not self.lora_target_modules:
            raise ConfigError("--lora-target-modules needs at least one module name (or leave it out)")


def defaults(options: HFOptions) -> dict:
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


def method_defaults(options: HFOptions) -> dict:
    """A method's own defaults over those: DPO's are TRL's DPOConfig's (methods/dpo/config.py).
    Data that cannot be read yet gets none: run() says what is wrong with it."""
    from .data import columns_of

    try:
        columns = columns_of(options.dataset) or []
    except (InputError, OSError):
        return {}
    if options.method == "reward":
        return dict(REWARD_DEFAULTS)
    if options.method == "grpo" or (options.method == "auto" and is_prompts(columns)
                                    and options.reward_funcs):
        return dict(GRPO_DEFAULTS)
    dpo = options.method == "dpo" or (options.method == "auto" and is_preference(columns))
    return dict(DPO_DEFAULTS) if dpo else {}


def run(options: HFOptions, training_args, accelerator_config) -> int:
    import torch

    from ...distributed.launch import needs_launch, relaunch_current_program
    from ...distributed.launchers import adopt_launcher_env
    from ...training.trainer import Trainer
    from ..finish import train_and_finish

    folder = model_folder(options.model, base_model=options.base_model,
                          weights=not options.from_scratch)
    from ...kinds.vlm.recipe import has_images, vision_config

    # an uncovered family: one line; text data on a type AutoModelForCausalLM takes: the text path
    vision = vision_config(folder, options.base_model, images=has_images(options.dataset)) is not None
    if vision:  # what the image path does not take, before any process starts (kinds/vlm/run.py)
        from ...kinds.vlm.run import check_run

        check_run(options, training_args)
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
    if vision:  # an image-text-to-text model (kinds/vlm/run.py)
        from ...kinds.vlm.run import run_vision

        return run_vision(options, training_args, accelerator_config, folder)
    if options.method == "reward":  # a sequence-classification model on pairs (methods/reward/recipe.py)
        from ...methods.reward.recipe import run_reward

        return run_reward(options, training_args, accelerator_config, folder)
    if is_adapter_folder(folder):  # a LoRA run's final/: training continues on its adapters
        options = dataclasses.replace(options, lora_r=continued_rank(options, folder))
    from .sharded import loads_sharded

    sharded = loads_sharded(training_args)  # fsdp or expert parallelism: no rank holds the model whole
    model, tokenizer = load_model(folder, options.from_scratch, base_model=options.base_model,
                                  trainable=True, sharded=sharded)
    check_vocabulary(model, tokenizer, folder)
    kind = data_kind(options)
    options = method_options(options, kind)  # beta and loss_type: the method's own defaults
    dpo = kind == "dpo"  # preference pairs: DPO needs a reference (methods/dpo/recipe.py)
    # GRPO needs one only with a KL penalty (beta > 0)
    referenced = dpo or (kind == "grpo" and options.beta > 0)
    ref_folder = (model_folder(options.ref_model, flag="--ref-model", base_model=options.base_model)
                  if referenced and options.ref_model else None)
    # The frozen reference in a one-item list that the trainer empties: no frame of the recipe
    # keeps it alive, so DPO frees it once its log-probs are precomputed.
    ref_model = [load_model(ref_folder, base_model=options.base_model, flag="--ref-model",
                            merge=True, sharded=sharded)[0] if ref_folder is not None else None]
    if referenced and ref_model[0] is None and not options.lora_r:  # the starting weights, frozen
        ref_model = [copy.deepcopy(model)]
    if options.lora_r and not is_adapter_folder(folder):
        model = add_lora(model, options)
    block_size = choose_block_size(options.block_size, model.config, tokenizer)
    if kind == "grpo":
        from ...methods.grpo.recipe import run_grpo

        return run_grpo(options, training_args, accelerator_config, folder, model, tokenizer,
                        ref_model.pop(), ref_folder)
    if dpo:
        from ...methods.dpo.recipe import run_dpo

        return run_dpo(options, training_args, accelerator_config, folder, model, tokenizer,
                       block_size, ref_model, ref_folder)
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


def _expert_parallel(folder: Path, options: HFOptions, training_args) -> None:
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


def load_data(options: HFOptions, tokenizer, block_size: int, folder: Path, cache_dir,
              split: str = "train"):
    """The data set as training and validation blocks (or rows): the method its columns ask for
    (hf_sft.data_method), with the --chat-template given put into the tokenizer first. `split`:
    the split read as the training blocks (hputrain evaluate --split reads another)."""
    from .data import load_blocks
    from ...data.chat import use_chat_template
    from ...methods.sft.recipe import data_method, load_sft

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
        data = load_sft(options.dataset, method, tokenizer, block_size, options, cache_dir=cache_dir,
                        tokenizer_folder=folder, split=split)
    data.method = method
    return data


# -- the model -----------------------------------------------------------------------------------

def step_model(options: HFOptions):
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
    if is_image_text_to_text(config):  # its image blocks: kinds/vlm/plan.py
        from ...kinds.vlm.step import vision_step_model

        return vision_step_model(folder, config, options, block)

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

def model_folder(name: str, *, flag: str = "--model", base_model: str | None = None,
                 weights: bool = True) -> Path:
    """`name` as a model folder on this machine, or a PEFT adapter folder whose base model is one
    (`base_model`, --base-model, else the one its adapter_config.json names); else one line
    saying why it is neither. `weights`: its safetensors files are whole too (not for
    --from-scratch), checked before any process starts."""
    folder = Path(name).expanduser()
    if not folder.is_dir():
        if folder.exists():
            raise InputError(f"{flag} {name} is a file: give the folder holding config.json, the "
                             "weights and the tokenizer files")
        raise InputError(f"{flag} {name} is not a folder on this machine: hputrain train works "
                         f"offline; download it first (huggingface-cli download {name} --local-dir DIR)")
    if is_adapter_folder(folder):
        adapter_base(folder, base_model, flag)  # one line now when the base is not found
    elif not (folder / "config.json").is_file():
        raise InputError(f"{flag} {name} has no config.json: give a folder written by save_pretrained "
                         "(config.json, weights, tokenizer files), or a PEFT adapter folder "
                         "(adapter_config.json)")
    if weights:
        check_weight_files(folder, flag, base_model)
    return folder


def load_model(folder: Path, from_scratch: bool = False, *, base_model: str | None = None,
               trainable: bool = False, merge: bool = False, flag: str = "--model",
               sharded: bool = False, task: str | None = CAUSAL_LM):
    """(model in float32, tokenizer) from `folder`, never from the network. Float32 weights: the
    precision plugin casts per op, and the optimizer keeps full-precision weights. `sharded`
    (fsdp or expert parallelism across processes): the model's parameters stay on the meta
    device, and each rank reads its own shards once fsdp has cut them or its experts once they
    are split (recipes/hf/sharded.py); not for a base whose adapters
    are merged into it, nor for --from-scratch (drawn as before). `task`: the model asked for,
    a causal LM unless said (checkpoint/model_folders.py); a folder of the other task's model
    or adapters is one line; None takes the folder's own (a sequence classifier's adapters load
    onto a sequence classifier of their head's labels, which `merge` keeps).

    An adapter folder (recipes/hf/adapters.py) is its base model with its adapters loaded by PEFT:
    trainable ones with `trainable` (training continues on them), merged into the weights with
    `merge` (a frozen reference needs no adapters), else frozen; the tokenizer is the folder's
    own when it has one."""
    task = check_task(folder, task, flag) if task is not None else folder_task(folder, flag)
    if not is_adapter_folder(folder):
        return _load_folder(folder, from_scratch, flag, sharded, task=task)
    base = adapter_base(folder, base_model, flag)
    labels = head_labels(folder) if task == SEQ_CLS else None
    model, tokenizer = _load_folder(base, False, flag, sharded and not merge, task=task,
                                    labels=labels)
    if tokenizer_folder(folder, base) == folder:
        tokenizer = _load_tokenizer(folder, flag)
    return with_adapters(model, folder, trainable=trainable, merge=merge, flag=flag), tokenizer


def _load_folder(folder: Path, from_scratch: bool, flag: str, sharded: bool = False, *,
                 task: str | None = CAUSAL_LM, labels: int | None = None):
    """(model, tokenizer) of a model folder (see load_model). Loaded from its absolute path, the
    model's name_or_path, which PEFT writes into adapter_config.json as the base, holds from any
    working directory. `task` SEQ_CLS: a sequence classifier of `labels` (load_classifier)."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is first imported
    import torch
    import transformers

    from .sharded import meta_model

    transformers.utils.logging.disable_progress_bar()  # the run prints its own progress
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"{flag} {folder}: config.json cannot be read: {_first_line(exc)}") from None
    from ...kinds.vlm.recipe import loads_as_causal_lm  # (it builds on this module: imported here)

    if task == CAUSAL_LM and is_image_text_to_text(config) and not loads_as_causal_lm(config):
        raise InputError(f"{flag} {folder} holds an image-text-to-text model ({describe_vision(config)}), "
                         f"not a causal language model: {flag} does not take one here")
    tokenizer = _load_tokenizer(folder, flag)
    auto = transformers.AutoModelForCausalLM
    try:
        if task == SEQ_CLS:
            return load_classifier(folder, labels, config), tokenizer
        if sharded and not from_scratch and (model := meta_model(folder, config, flag)) is not None:
            return model, tokenizer
        if from_scratch:
            model = auto.from_config(config, dtype=torch.float32)
        else:
            model = auto.from_pretrained(folder.resolve(), config=config, dtype=torch.float32,
                                         local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"{flag} {folder} cannot be loaded as {TASK_WORDS[task or CAUSAL_LM]}: "
                         f"{_first_line(exc)}") from None
    return model, tokenizer


def check_vocabulary(model, tokenizer, folder: Path, flag: str = "--model") -> None:
    """A tokenizer that gives ids the model has no embedding row for (tokens added and the
    embeddings not resized) is one line here, not an IndexError in the first forward."""
    embeddings = model.get_input_embeddings()
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is not None and len(tokenizer) > rows:
        raise InputError(f"{flag} {folder}: its tokenizer has {len(tokenizer)} tokens and the model "
                         f"embeds {rows}: resize the embeddings to the tokenizer "
                         "(model.resize_token_embeddings(len(tokenizer))) and save the folder again")


def _load_tokenizer(folder: Path, flag: str):
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{flag} {folder}: no tokenizer could be loaded ({_first_line(exc)}): save "
                         "the tokenizer into the folder (tokenizer.save_pretrained)") from None


def add_lora(model, options: HFOptions):
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

def _header(trainer, model, options: HFOptions, data, block_size: int) -> str:
    from .data import splits_line
    from ...methods.sft.recipe import METHODS, describe
    from .common import counted, split_sizes

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
            f"hputrain: method: {METHODS[data.method]}\n"
            + (f"hputrain: {split_sizes(len(data.train), held_out, 'block')} of {block_size} "
               f"tokens from {options.dataset} ({cached})\n" if data.method == "text" else
               describe(data, options, block_size, f"from {options.dataset} ({cached})"))
            + splits_line(options.dataset, options.validation_split_percentage > 0)
            + f"hputrain: validation: {validation}")


def _shapes() -> str:
    from .data import SHAPES

    return SHAPES
