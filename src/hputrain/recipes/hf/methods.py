"""Which training method a Hugging Face run takes, from its data's columns and its flags: causal
LM or SFT (told apart by load_data), DPO (preference pairs) or GRPO (prompts with --reward-funcs);
the flags one method alone takes refused for another's data, and the two names both DPO and GRPO
use (beta, loss_type) given their method's defaults."""
from __future__ import annotations

import dataclasses

from ...config.fields import ConfigError
from ...methods.grpo.config import GRPOOptions, check_grpo, grpo_flags_given
from ...methods.dpo.config import PreferenceOptions, check_preference, preference_flags_given
from ...errors import InputError


def data_kind(options) -> str:
    """"dpo" for preference pairs, "grpo" for prompts to reward, else "lm_or_sft" (load_data
    tells those apart): from the data's columns, checked against --method and the flags each
    method alone takes."""
    from .data import columns_of

    columns = columns_of(options.dataset)
    check_not_empty(options.dataset, columns)
    columns = columns or []
    kind = ("dpo" if is_preference(columns) else
            "grpo" if is_prompts(columns) and (options.reward_funcs or options.method == "grpo")
            else "lm_or_sft")
    found = ", ".join(map(str, columns)) or "no columns (plain text)"
    if options.method == "dpo" and kind != "dpo":
        raise InputError(f"--method dpo needs preference rows ('chosen' and 'rejected', and "
                         f"'prompt'); --dataset {options.dataset} has: {found}")
    if options.method == "grpo" and kind != "grpo":
        raise InputError(f"--method grpo needs rows with a 'prompt' and no completion (the model "
                         f"writes it); --dataset {options.dataset} has: {found}")
    if kind == "grpo" and options.streaming:
        raise InputError("--streaming trains causal LM and SFT rows; GRPO reads its prompts whole: "
                         "leave out --streaming")
    if kind == "grpo" and not options.reward_funcs:
        raise InputError("GRPO needs --reward-funcs FILE.py:NAME [...] (functions with TRL's "
                         "signature) or a reward-model folder")
    if (options.method == "auto" and is_prompts(columns) and not options.reward_funcs
            and options.text_column not in columns):  # prompts alone: GRPO's, without its rewards
        raise InputError(f"--dataset {options.dataset} holds prompts without completions ({found}): "
                         "GRPO trains on them with --reward-funcs FILE.py:NAME [...] or a "
                         "reward-model folder; SFT needs a 'completion' beside each 'prompt'")
    if kind == "lm_or_sft" and options.reward_funcs:  # not "is for prompts rewarded by" itself
        raise InputError(f"--reward-funcs trains with GRPO on rows with a 'prompt' and no "
                         f"completion; --dataset {options.dataset} has: {found}")
    if options.method in ("lm", "sft") and kind == "dpo":
        raise InputError(f"--method {options.method}: --dataset {options.dataset} holds preference "
                         "pairs (chosen, rejected): train them with --method dpo (or auto)")
    _refuse_other_methods_flags(options, kind)
    return kind


def check_not_empty(path, columns) -> None:
    """One line for a file of records, or a folder of them, that holds no row (`columns` []),
    rather than a line about the fields its missing first row lacks."""
    from .data import records

    if columns == [] and next(records(path), None) is None:
        raise InputError(f"--dataset {path} holds no rows: it is empty")


def is_preference(columns) -> bool:
    """Whether a data set with these columns holds preference pairs (DPO's, a reward model's)."""
    return {"chosen", "rejected"} <= set(map(str, columns))


def is_prompts(columns) -> bool:
    """Rows of prompts alone (GRPO's): a 'prompt' and no completion, pair or conversation."""
    columns = set(map(str, columns))
    return "prompt" in columns and not columns & {"completion", "chosen", "rejected", "messages",
                                                   "conversations"}


def _refuse_other_methods_flags(options, kind: str) -> None:
    """A flag of DPO's or GRPO's given for data another method trains: one line."""
    dpo_only = [n for n in preference_flags_given(options) if n not in ("beta", "loss_type")]
    dpo_only += ["ref_model"] if options.ref_model and kind != "grpo" else []
    grpo_only = [n for n in grpo_flags_given(options) if n not in ("beta", "loss_type")]
    grpo_only += ["reward_funcs"] if options.reward_funcs else []
    shared = [n for n in ("beta", "loss_type") if getattr(options, n) is not None]
    if kind != "dpo" and dpo_only:
        raise InputError(f"--{dpo_only[0].replace('_', '-')} is for preference pairs (DPO), and "
                         f"--dataset {options.dataset} holds none")
    if kind != "grpo" and grpo_only:
        raise InputError(f"--{grpo_only[0].replace('_', '-')} is for prompts rewarded by "
                         f"--reward-funcs (GRPO), and --dataset {options.dataset} holds "
                         + ("preference pairs" if kind == "dpo" else "no prompt-only rows"))
    if kind == "lm_or_sft" and shared:
        raise InputError(f"--{shared[0].replace('_', '-')} is for DPO (preference pairs) or GRPO "
                         f"(prompts with --reward-funcs), and --dataset {options.dataset} holds "
                         "neither")


def method_options(options, kind: str) -> object:
    """`options` with beta and loss_type set to the method's defaults where not given (TRL's:
    DPO 0.1 and sigmoid, GRPO 0.0 and dapo), and the method's settings checked (one line)."""
    dpo, grpo = PreferenceOptions(), GRPOOptions()
    defaults = grpo if kind == "grpo" else dpo
    resolved = dataclasses.replace(
        options, beta=defaults.beta if options.beta is None else options.beta,
        loss_type=defaults.loss_type if options.loss_type is None else options.loss_type)
    try:
        (check_grpo if kind == "grpo" else check_preference)(resolved)
    except ConfigError as error:
        raise InputError(str(error)) from None
    return resolved
