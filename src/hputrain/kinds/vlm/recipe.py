"""An image-text-to-text (vision-language) model folder in the Hugging Face recipe: loaded with
AutoModelForImageTextToText in float32 and the folder's processor, its vision tower and projector
frozen or trained as the options say, LoRA on its language model.

The processing (kinds/vlm/data/encode.Processing) holds AutoProcessor's processor where the folder's
processor class can be built; where it cannot (Qwen2.5-VL's needs torchvision for its video
processor), the folder's tokenizer (with the chat template) and its image processor, which
final/ gets side by side as the processor would save them (TokenizerAndImages). The header says
which.

Freezing: the vision tower (the family's `tower`) is frozen unless --train-vision-tower; the
projector (its `projector`: vision features into the text width) is trained in full fine-tuning,
frozen under LoRA unless --train-projector, which then trains it whole (PEFT's modules_to_save).
LoRA's default targets are the language model's linear layers (+ the tower's with
--train-vision-tower, never the projector's): a regular expression over their names, which PEFT
matches whole; --lora-target-modules names layers inside those same parts.
"""
from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

from ...errors import InputError
from ...errors import first_line as _first_line
from .family import is_image_text_to_text, refusal, vision_family
from ...recipes.hf.folders import adapter_base, is_adapter_folder, tokenizer_folder, with_adapters


class TokenizerAndImages:
    """What a processor holds where its class cannot be built here: the tokenizer (its chat
    template inside) and the image processor, saved side by side as the processor saves them
    (tokenizer files, preprocessor_config.json), so that a folder written with it loads with
    AutoTokenizer + AutoImageProcessor (and with AutoProcessor where the class can be built)."""

    def __init__(self, tokenizer, image_processor) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor

    @property
    def chat_template(self):
        return getattr(self.tokenizer, "chat_template", None)

    @chat_template.setter
    def chat_template(self, value) -> None:
        self.tokenizer.chat_template = value

    def save_pretrained(self, folder) -> None:
        self.tokenizer.save_pretrained(str(folder))
        self.image_processor.save_pretrained(str(folder))

    def __len__(self) -> int:
        return len(self.tokenizer)


def vision_config(folder: Path, base_model: str | None = None, *, images: bool = True):
    """The config of `folder` (a model folder, or an adapter folder's base) when the image path
    takes it, else None: an image-text-to-text model's, unless `images` is False (text data, no
    image column) and AutoModelForCausalLM loads its type too (Gemma 3, Llama 4: trained on text
    as before, by the causal-LM path). An image-text-to-text type that is not covered is one line
    (models.vision.refusal)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    if is_adapter_folder(folder):
        folder = adapter_base(folder, base_model)
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return None  # the causal-LM path says why config.json cannot be read
    if not is_image_text_to_text(config) or (not images and loads_as_causal_lm(config)):
        return None
    if vision_family(config) is None:
        raise InputError(f"--model {folder}: {refusal(config.model_type)}")
    if int(transformers.__version__.split(".")[0]) < 5:
        raise InputError(f"--model {folder}: fine-tuning an image-text-to-text model needs "
                         f"transformers 5 or newer (this is {transformers.__version__}): "
                         "pip install -U transformers")
    return config


def loads_as_causal_lm(config) -> bool:
    """Whether AutoModelForCausalLM takes `config`'s type (some image-text-to-text types too)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(config, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def has_images(path: str | None) -> bool:
    """Whether the data set at `path` has an image column (what cannot be read: False, the
    recipe then says why)."""
    from .data.rows import detect_image_format
    from ...recipes.hf.data import columns_of

    try:
        columns = columns_of(path) if path else None
        return bool(columns) and detect_image_format(columns) is not None
    except (InputError, OSError):
        return False


def has_processor_files(folder: Path, base_model: str | None = None) -> bool:
    """Whether `folder` (or an adapter folder's base) holds an image or whole processor's config."""
    folders = [Path(folder)] + ([adapter_base(folder, base_model)] if is_adapter_folder(folder) else [])
    return any((f / name).is_file() for f in folders
               for name in ("processor_config.json", "preprocessor_config.json"))


def load_vision(folder: Path, flag: str = "--model", *, from_scratch: bool = False,
                sharded: bool = False, base_model: str | None = None, trainable: bool = False,
                merge: bool = False, image_buckets: list[str] | None = None):
    """(model in float32, data.vision.encode.Processing) of an image-text-to-text folder, never
    from the network. The Processing holds the processor (AutoProcessor's), or where its class
    cannot be built the tokenizer and image processor (`saver` gives what final/ saves of either),
    and the pixel buckets (--image-buckets). An adapter folder (a LoRA run's final/) is its base
    with the adapters loaded by PEFT (trainable with `trainable`, merged with `merge`), its
    processor the folder's own when it has one. `sharded`: the parameters stay on the meta device
    for fsdp's shard-by-shard loading (hf_sharded.meta_model)."""
    folder = Path(folder)
    base = adapter_base(folder, base_model, flag) if is_adapter_folder(folder) else folder
    model = _load_weights(base, flag, from_scratch and base == folder, sharded and not merge)
    processing = load_processing(tokenizer_folder(folder, base) if base != folder else folder,
                                 model.config, flag, image_buckets)
    if base == folder:
        return model, processing
    return with_adapters(model, folder, trainable=trainable, merge=merge, flag=flag), processing


def _load_weights(folder: Path, flag: str, from_scratch: bool, sharded: bool):
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import transformers

    from ...recipes.hf.sharded import meta_model

    transformers.utils.logging.disable_progress_bar()  # the run prints its own progress
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"{flag} {folder}: config.json cannot be read: {_first_line(exc)}") from None
    if not is_image_text_to_text(config):
        raise InputError(f"{flag} {folder} holds {config.model_type}, not an image-text-to-text model")
    if vision_family(config) is None:
        raise InputError(f"{flag} {folder}: {refusal(config.model_type)}")
    auto = transformers.AutoModelForImageTextToText
    try:
        if sharded and not from_scratch and (model := meta_model(folder, config, flag, auto)) is not None:
            return model
        if from_scratch:
            return auto.from_config(config, dtype=torch.float32)
        return auto.from_pretrained(folder.resolve(), config=config, dtype=torch.float32,
                                    local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"{flag} {folder} cannot be loaded as an image-text-to-text model: "
                         f"{_first_line(exc)}") from None


def load_processing(folder: Path, config, flag: str = "--model", image_buckets=None):
    """data.vision.encode.Processing of `folder` (its processor, else its tokenizer and image
    processor), for the model of `config`; what cannot be read is one line."""
    from .data.encode import Processing

    try:
        return Processing.load(folder, config, image_buckets)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(f"{flag} {folder}: its processor (or tokenizer and image processor) cannot "
                         f"be loaded ({_first_line(exc)}): save the processor into the folder "
                         "(processor.save_pretrained)") from None


def saver(processing):
    """What final/ saves of the processing (its save_pretrained): the processor object, or the
    tokenizer and image processor side by side (TokenizerAndImages)."""
    if processing.processor is not None:
        return processing.processor
    return TokenizerAndImages(processing.tokenizer, processing.image_processor)


def processor_words(processing) -> str:
    """"LlavaProcessor", or "tokenizer + Qwen2VLImageProcessorPil (no processor class: ...)",
    for the header."""
    if processing.processor is not None:
        return type(processing.processor).__name__
    return (f"the tokenizer + {type(processing.image_processor).__name__} (the folder's processor "
            "class cannot be built here: Qwen2.5-VL's needs torchvision for its video processor)")


def learned_words(processing, options, fmt: str) -> str:
    """The header's words on what the loss counts: the completion, or the assistant turns, with
    the end-of-turn marker the chat template writes after an answer (what generation stops at);
    where it writes none (LLaVA-1.5's template: "ASSISTANT: answer USER: ..."), that nothing
    teaches the model where an answer ends, and what generation then stops at."""
    if fmt == "prompt_completion":
        if not options.completion_only_loss:
            return "every token but the image tokens (--no-completion-only-loss)"
        learned = "completion tokens (--completion-only-loss)"
    elif not options.assistant_only_loss:
        return "every token but the image tokens (--no-assistant-only-loss)"
    else:
        learned = "assistant turns (--assistant-only-loss)"
    marker = processing.template().end_of_turn()
    if marker:
        return f"{learned}, end of turn ({marker}) included"
    eos = getattr(processing.tokenizer, "eos_token", None)
    stop = f"eos ({eos}) if the model writes it" if eos else "nothing the tokenizer names"
    return (f"{learned}, with no end of turn: the chat template writes no marker after an answer, "
            f"so the model learns no stop (generation ends at {stop}, else at --max-new-tokens)")


# -- what trains -----------------------------------------------------------------------------------

def part_prefixes(model) -> dict[str, str]:
    """{"tower", "projector", "language_model"} -> the dotted name prefix of each part in
    `model.named_parameters()` (a bare transformers model, not a PEFT wrapper)."""
    family = vision_family(model.config)
    inner = "model." if getattr(model, "model", None) is not None else ""
    return {"tower": f"{inner}{family.tower}", "projector": f"{inner}{family.projector}",
            "language_model": f"{inner}language_model"}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def freeze_parts(model, options) -> None:
    """Full fine-tuning: the vision tower frozen unless options.train_vision_tower; the projector
    trained unless options.train_projector is False (Qwen's projector sits inside its tower)."""
    parts = part_prefixes(model)
    tower, projector = options.train_vision_tower, options.train_projector is not False
    for name, param in model.named_parameters():
        if _under(name, parts["projector"]):
            param.requires_grad_(projector)
        elif _under(name, parts["tower"]):
            param.requires_grad_(tower)


def lora_targets(model, options) -> str:
    """LoRA's target_modules for PEFT: a regular expression matching whole names of linear layers
    under the language model (and the tower with --train-vision-tower, never the projector),
    their last name part among --lora-target-modules when given."""
    from ...recipes.hf.adapters import is_linear

    parts = part_prefixes(model)
    scopes = [parts["language_model"]] + ([parts["tower"]] if options.train_vision_tower else [])
    chosen = [name for name, module in model.named_modules()
              if is_linear(module) and any(_under(name, s) for s in scopes)
              and not _under(name, parts["projector"])]
    asked = options.lora_target_modules
    if asked:
        chosen = [n for n in chosen if any(n == t or n.endswith("." + t) for t in asked)]
        if not chosen:
            where = " and ".join(scopes)
            layers = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                             if is_linear(m) and any(_under(n, s) for s in scopes)})
            raise InputError(f"--lora-target-modules {' '.join(asked)}: no linear layer of that name "
                             f"under {where} of {type(model).__name__}; its linear layers there are "
                             f"{', '.join(layers)}")
    ends = sorted({name.rsplit(".", 1)[-1] for name in chosen})
    return (f"(?:{'|'.join(re.escape(s) for s in scopes)})\\..*\\.(?:{'|'.join(map(re.escape, ends))})")


def add_vision_lora(model, options):
    """`model` wrapped by PEFT with LoRA on `lora_targets`; with --train-projector the projector
    trained whole (modules_to_save); everything else frozen."""
    import torch

    from ...distributed.fsdp import on_meta
    from ...recipes.hf.sharded import draw_adapters

    try:
        import peft
    except ImportError:
        raise InputError("--lora-r needs peft, which is not installed: pip install peft") from None
    saved = [vision_family(model.config).projector] if options.train_projector else None
    config = peft.LoraConfig(task_type="CAUSAL_LM", r=options.lora_r,
                             lora_alpha=options.lora_alpha or 2 * options.lora_r,
                             lora_dropout=0.05 if options.lora_dropout is None else options.lora_dropout,
                             target_modules=lora_targets(model, options), modules_to_save=saved)
    rng_state = torch.random.get_rng_state()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            wrapped = peft.get_peft_model(model, config)
    except ValueError as exc:
        raise InputError(f"LoRA cannot wrap {type(model).__name__}: {_first_line(exc)}") from None
    if on_meta(model):
        draw_adapters(wrapped, rng_state)
    return wrapped


def prepare_parts(model, options):
    """The model as the run trains it: LoRA (add_vision_lora) or full fine-tuning with the parts
    frozen as asked (freeze_parts). An adapter folder's model (training continues on its
    adapters) is kept as loaded."""
    if hasattr(model, "peft_config"):
        return model
    if options.lora_r:
        return add_vision_lora(model, options)
    freeze_parts(model, options)
    return model
