"""The combination table of issue 30: every choice a user makes in `hputrain train --model DIR
--dataset FILE` is a factor, and a covering array picks the cases so that every pair (or, under
the slow marker, every triple) of levels that a user can ask for runs together at least once.

A level "n/a" marks a factor that does not apply (packing for text and preference pairs: text is
always packed into blocks and pairs are padded to length buckets; a reference outside DPO). The
pairs refused by design are left out of the table and tested for their one line in
test_combinations.py (REFUSED).

Issue 40 made the model a factor: "dense" (the tiny Llama of every case before it) or "moe" (a
tiny Mixtral that trains its router's load-balancing loss). The dense cases are chosen first,
exactly as before, and the cases with the mixture of experts are added until every pair (triple)
with it is covered too: a new level costs its own cases, not a new table. "dense" is left out of
a case's name, so that the names of the dense cases stay those docs/reliability.md lists.

Issue 41 adds the level "vlm": a tiny LLaVA (tests/vlm_fixtures.py) trained on image
conversations (`messages` + `images`) or prompt-completion rows with images, read whole from a
file. Each model level's cases are added after the previous level's, so that a new level never
changes the cases (and names) of those before it.

Issue 47 adds the level "vlm_real" ("vlm x real template"): the same tiny LLaVA with the chat
template llava-hf/llava-1.5-7b-hf ships (tests/chat_templates/llava-1.5-7b-hf.jinja: it prints
only parts of type "text" and writes no end of turn), trained on rows as users' files hold them:
plain string contents, a system prompt, rows with two images, one or none (vlm_fixtures.
string_rows); on issue 46's main every such row was dropped.

Issue 47 also adds "moe × ep × accumulation": the processes level "ep2" (fsdp over 2 processes
with --expert-parallel-size 2: a mixture of experts only) and the factor "accumulation" ("acc1",
left out of a name, or "acc2": --gradient-accumulation-steps 2 with micro-batches of 1). LATER_LEVELS are new levels of
existing factors and new factors: every case chosen before them keeps its levels (acc1, never
ep2) and its name, and a last greedy pass, started from LATER_CASES, adds the cases until every
tuple with a later level is covered too."""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

NA = "n/a"

# factor -> levels; the order of the factors is the order of the parts of a case's name
FACTORS = {
    "method": ("text", "chat", "completion", "dpo", "grpo"),
    "adapters": ("full", "lora"),
    "packing": ("packed", "unpacked", NA),
    "processes": ("1proc", "ddp2", "fsdp2"),
    "mode": ("eager", "lazy"),
    "validation": ("noval", "val"),
    "reference": ("ref_adapters", "ref_frozen", "ref_model", "ref_precomputed", NA),
    "precision": ("fp32", "bf16"),
    # issue 31: the data set read whole and cached, or a folder of shards read as a stream;
    # issue 39: a folder of shards read whole (its validation/ subfolder the validation split)
    "source": ("file", "folder", "stream"),
    # issue 40: a mixture of experts (last, so that the dense cases are picked as before);
    # issue 41: a vision-language model on image data; issue 47: the same with a published
    # model's own chat template, on string contents
    "model": ("dense", "moe", "vlm", "vlm_real"),
    # issue 47: a step of two micro-batches (last, so that the names before it stay)
    "accumulation": ("acc1", "acc2"),
}
# issue 47's "moe × ep × accumulation": fsdp with --expert-parallel-size 2 ("ep2", last of the
# processes levels, so that the greedy choice ranks the levels before it as before)
FACTORS["processes"] = (*FACTORS["processes"], "ep2")
UNNAMED = {NA, "dense", "acc1"}  # levels a case's name leaves out
LATER_LEVELS = {("processes", "ep2"), ("accumulation", "acc2")}
"""Levels added after the model levels' passes (the module docstring)."""
EARLIER = {"accumulation": "acc1"}
"""What a case written before the accumulation factor (ISSUE_CASES, LEVEL_CASES) has of it."""
VLM_LEVELS = ("vlm", "vlm_real")  # the model levels of an image-text-to-text model

# Pairs refused by design (each is tested for its one-line error, exit 2): left out of the table.
REFUSED_PAIRS = {frozenset({("mode", "lazy"), ("processes", "fsdp2")}),
                 # the CPU's lazy backend, the rehearsal of Gaudi's, runs one process
                 frozenset({("mode", "lazy"), ("processes", "ddp2")}),
                 # preference pairs are encoded whole (a reference pass over them), never streamed
                 frozenset({("method", "dpo"), ("source", "stream")}),
                 # issue 32: prompts are read whole
                 frozenset({("method", "grpo"), ("source", "stream")}),
                 # issue 47: expert parallelism is fsdp's (eager or compile), on a model with
                 # experts, and not on an image-text-to-text model's
                 frozenset({("mode", "lazy"), ("processes", "ep2")}),
                 *(frozenset({("processes", "ep2"), ("model", level)})
                   for level in ("dense", "vlm", "vlm_real"))}

# The combinations issue 30 found broken, run first whatever the covering array picks.
ISSUE_CASES = (
    # item 1: LoRA SFT on conversations with the default packing exited 2
    dict(method="chat", adapters="lora", packing="packed", processes="1proc", mode="eager",
         validation="noval", reference=NA, precision="fp32", source="file", model="dense"),
    # item 2: full-weight DPO, precomputed reference, a validation split: a traceback at the end
    dict(method="dpo", adapters="full", packing=NA, processes="1proc", mode="eager",
         validation="val", reference="ref_precomputed", precision="fp32", source="file", model="dense"),
    # item 3: LoRA DPO on 2 processes, a validation split that leaves a rank without a batch: a hang
    dict(method="dpo", adapters="lora", packing=NA, processes="ddp2", mode="eager",
         validation="val", reference="ref_adapters", precision="fp32", source="file", model="dense"),
)

# issue 41: the first cases of the "vlm" level are the default image fine-tune (LoRA on the
# language model, the tower frozen, packed blocks) on one process and under fsdp (item 5: fsdp
# wraps the vision and decoder blocks), the greedy choice adds the others.
LEVEL_CASES = {"vlm": (
    dict(method="chat", adapters="lora", packing="packed", processes="1proc", mode="eager",
         validation="noval", reference=NA, precision="fp32", source="file", model="vlm"),
    dict(method="chat", adapters="lora", packing="packed", processes="fsdp2", mode="eager",
         validation="val", reference=NA, precision="fp32", source="file", model="vlm")),
    # issue 47: the default image fine-tune of a LLaVA-1.5 folder as published, on string rows
    "vlm_real": (
    dict(method="chat", adapters="lora", packing="packed", processes="1proc", mode="eager",
         validation="val", reference=NA, precision="fp32", source="file", model="vlm_real"),)}

# issue 47: the first case of the later levels is "moe × ep × accumulation" itself: SFT on a
# mixture of experts, its router's loss on, fsdp with the experts split over the 2 processes,
# two micro-batches a step, and a validation split that leaves rank 1 without a batch
LATER_CASES = (
    dict(method="chat", adapters="full", packing="packed", processes="ep2", mode="eager",
         validation="val", reference=NA, precision="fp32", source="file", model="moe",
         accumulation="acc2"),)


def allowed(case: dict) -> bool:
    """Whether a full assignment of levels is a run a user can ask for and hputrain takes."""
    packs = case["method"] in ("chat", "completion")
    if (case["packing"] == NA) == packs:
        return False  # packing is a choice for SFT data only
    dpo, grpo = case["method"] == "dpo", case["method"] == "grpo"
    if case["reference"] != NA and not (dpo or grpo):
        return False  # a reference is a choice for DPO and GRPO only
    if dpo and case["reference"] == NA:
        return False  # DPO always has one; GRPO has none at beta 0 (n/a), else one (beta 0.04)
    if grpo and case["reference"] == "ref_precomputed":
        return False  # GRPO's reference runs on each rollout (and each evaluation batch)
    if case["reference"] == "ref_adapters" and case["adapters"] != "lora":
        return False  # the adapter-disabled base needs adapters
    if case["reference"] == "ref_frozen" and case["adapters"] != "full":
        return False  # under LoRA without --ref-model the reference is the adapter-disabled base
    if case["model"] in VLM_LEVELS and not vlm_allowed(case):
        return False
    levels = set(case.items())
    return not any(pair <= levels for pair in REFUSED_PAIRS)


def vlm_allowed(case: dict) -> bool:
    """Whether the "vlm" level combines with the case's other levels."""
    if case["method"] not in ("chat", "completion"):
        return False  # image rows are SFT rows (messages, or prompt + completion); DPO and GRPO on
        # an image-text-to-text model are refused in one line (REFUSED), text has no image path
    if case["source"] != "file":
        return False  # image data sets are read whole, from a data file with its images beside it
        # (or a save_to_disk folder): --streaming is refused in one line (REFUSED), and a folder
        # of JSON Lines parts refuses the image files beside them
    return True


def _tuples(case: dict, strength: int, factors=FACTORS) -> set:
    return {tuple((name, case[name]) for name in names)
            for names in itertools.combinations(factors, strength)}


def _cost(case: dict) -> int:
    """A rough price of a case, to prefer the cheaper of two that cover as much."""
    return ((case["processes"] != "1proc") * 4 + (case["mode"] == "lazy") * 2
            + (case["precision"] == "bf16") + (case["validation"] == "val") + (case["source"] == "stream"))


def covering_cases(strength: int = 2, required=ISSUE_CASES) -> list[dict]:
    """Cases (dicts factor -> level) in which every `strength`-tuple of levels that occurs in some
    allowed case occurs at least once: the dense model's cases first (the table before issue 40),
    then those the mixture of experts adds. Deterministic."""
    table = _table(strength) if required is ISSUE_CASES else _cover(strength, tuple(required))
    return [dict(case) for case in table]


def _cover(strength: int, required: tuple) -> tuple:
    candidates = [dict(zip(FACTORS, levels)) for levels in itertools.product(*FACTORS.values())]
    candidates = [case for case in candidates if allowed(case)]
    earlier = [case for case in candidates if not LATER_LEVELS & set(case.items())]
    before = [name for name in FACTORS if name not in EARLIER]  # the factors before issue 47's
    chosen = _greedy([case for case in earlier if case["model"] == "dense"], strength,
                     [EARLIER | case for case in required], [name for name in before if name != "model"])
    # the dense cases hold every tuple with "dense" (each tuple of the other factors is in them);
    # each further model level adds its own cases after those of the levels before it
    for level in FACTORS["model"][1:]:
        chosen = _greedy([case for case in earlier if case["model"] == level], strength,
                         [*chosen, *(EARLIER | case for case in LEVEL_CASES.get(level, ()))], before)
    # issue 47's levels: their own cases, after all of those
    return tuple(_greedy(candidates, strength, [*chosen, *LATER_CASES], list(FACTORS)))


@functools.cache
def _table(strength: int) -> tuple:
    """The table of ISSUE_CASES and `strength`, made once (the test module asks for it thrice)."""
    return _cover(strength, ISSUE_CASES)


def _greedy(candidates: list[dict], strength: int, required, factors: list[str]) -> list[dict]:
    """The required cases, then greedily the candidate that covers the most `strength`-tuples
    (of `factors`) not yet covered, the cheaper on a tie, until every tuple of a candidate is."""
    covers = [_tuples(case, strength, factors) for case in candidates]
    uncovered = set().union(*covers)
    chosen = []
    for case in required:
        if not allowed(case):
            raise ValueError(f"required case {case_id(case)} is not allowed")
        chosen.append(dict(case))
        uncovered -= _tuples(case, strength, factors)
    while uncovered:
        best = max(range(len(candidates)),
                   key=lambda i: (len(covers[i] & uncovered), -_cost(candidates[i])))
        chosen.append(candidates[best])
        uncovered -= covers[best]
    return chosen


def case_id(case: dict) -> str:
    """The case's name: its levels in factor order, n/a and dense left out."""
    return "-".join(case[name] for name in FACTORS if case[name] not in UNNAMED)


@dataclass(frozen=True)
class Inputs:
    """The fixture files a case's flags name."""
    model: str
    ref_model: str
    datasets: dict  # method -> data file
    streams: dict  # (method, validation level) -> a folder of shards (with validation/ under "val")
    folders: dict  # (method, validation level) -> a folder of JSON Lines files read whole, likewise
    reward_funcs: str = ""  # GRPO's FILE.py:NAME
    moe_model: str = ""  # issue 40: the model and the reference of the "moe" level
    moe_ref_model: str = ""
    vlm_model: str = ""  # issue 41: the "vlm" level's tiny LLaVA folder
    vlm_datasets: dict = field(default_factory=dict)  # method (chat, completion) -> image data file
    vlm_real_model: str = ""  # issue 47: the "vlm_real" level's LLaVA with llava-1.5's own template
    vlm_real_datasets: dict = field(default_factory=dict)  # method -> string rows with images

    def models(self, case: dict) -> tuple[str, str]:
        """(--model, --ref-model) of a case."""
        if case.get("model") == "moe":
            return self.moe_model, self.moe_ref_model
        if case.get("model") == "vlm":
            return self.vlm_model, ""
        if case.get("model") == "vlm_real":
            return self.vlm_real_model, ""
        return self.model, self.ref_model


# Small enough for two steps in a few seconds, and a validation split of a few rows (3 pairs, 3
# examples or 1 text block) under an evaluation batch of 4: under 2 processes one rank has no batch.
COMMON = ["--max-steps", "2", "--save-steps", "1", "--logging-steps", "1", "--block-size", "128",
          "--per-device-train-batch-size", "2", "--per-device-eval-batch-size", "4",
          "--learning-rate", "1e-3", "--seed", "0", "--disable-tqdm", "--cpu"]


def case_flags(case: dict, inputs: Inputs) -> list[str]:
    """The `hputrain train` arguments of a case (output and resume flags aside)."""
    if case["source"] == "stream":
        data = [inputs.streams[case["method"], case["validation"]], "--streaming"]
    elif case["source"] == "folder":
        data = [inputs.folders[case["method"], case["validation"]]]
    elif case["model"] == "vlm":
        data = [inputs.vlm_datasets[case["method"]]]
    elif case["model"] == "vlm_real":
        data = [inputs.vlm_real_datasets[case["method"]]]
    else:
        data = [inputs.datasets[case["method"]]]
    model, ref_model = inputs.models(case)
    flags = ["--model", model, "--dataset", *data, *COMMON]
    # the router's loss asked by its flag (the folder's config leaves output_router_logits off)
    flags += ["--router-aux-loss-coef", "0.02"] if case["model"] == "moe" else []
    flags += ["--lora-r", "4"] if case["adapters"] == "lora" else []
    flags += ["--no-packing"] if case["packing"] == "unpacked" else []
    if case["processes"] == "ep2":  # fsdp over 2 processes, the experts split over both
        flags += ["--devices", "2", "--strategy", "fsdp", "--expert-parallel-size", "2"]
    elif case["processes"] != "1proc":
        flags += ["--devices", "2", "--strategy", case["processes"].removesuffix("2")]
    if case["accumulation"] == "acc2":  # two micro-batches of 1: the global batch of acc1's one of 2
        flags += ["--gradient-accumulation-steps", "2", "--per-device-train-batch-size", "1"]
    flags += ["--execution-mode", case["mode"]]
    flags += ["--validation-split-percentage", "8" if case["validation"] == "val" else "0"]
    flags += {"ref_model": ["--ref-model", ref_model],
              "ref_precomputed": ["--precompute-ref-log-probs"]}.get(case["reference"], [])
    flags += ["--precision", "bf16-mixed" if case["precision"] == "bf16" else "fp32"]
    if case["method"] == "grpo":  # two completions of 8 tokens per prompt, rewarded by a function
        flags += ["--reward-funcs", inputs.reward_funcs, "--num-generations", "2",
                  "--max-completion-length", "8"]
        flags += ["--beta", "0.04"] if case["reference"] != NA else []
    return flags


@dataclass(frozen=True)
class Refusal:
    """A pair refused by design: its levels, the flags that ask for it (beside --model, --dataset
    of `method`, COMMON) and the one line `hputrain train` answers with (exit 2)."""
    name: str
    method: str
    flags: tuple
    line: str
    processes: bool  # whether the refusal comes from the ranks (needs real processes)
    model: str = "dense"  # the model level whose folder (and data, for "vlm") it runs on


REFUSED = (
    Refusal("lazy+fsdp2", "chat", ("--devices", "2", "--strategy", "fsdp", "--execution-mode", "lazy"),
            "hputrain: error: strategy='fsdp' runs in eager or compile mode, not lazy: set "
            "execution_mode='eager' or 'compile'", processes=True),
    Refusal("lazy+ddp2", "chat", ("--devices", "2", "--strategy", "ddp", "--execution-mode", "lazy"),
            "hputrain: error: execution_mode='lazy' on cpu runs one process, not 2: the collectives "
            "between processes take no lazy tensors; rehearse one rank (devices=1) or set "
            "execution_mode='eager'", processes=True),
    Refusal("fsdp2+context_parallel", "chat",
            ("--devices", "2", "--strategy", "fsdp", "--context-parallel-size", "2", "--no-packing"),
            "hputrain: error: strategy='fsdp' with context_parallel_size > 1 is not supported yet: "
            "use ddp or fast_ddp with context parallelism", processes=True),
    Refusal("dpo+context_parallel", "dpo", ("--devices", "2", "--context-parallel-size", "2",
                                            "--lora-r", "4"),
            "hputrain: error: DPO under context parallelism is not supported: set "
            "context_parallel_size=1", processes=True),
    Refusal("packed_sft+context_parallel", "chat", ("--devices", "2", "--context-parallel-size", "2"),
            "hputrain: error: packed SFT blocks under context parallelism are not supported (each "
            "rank would hold a slice of several examples): use --no-packing", processes=True),
    Refusal("dpo+streaming", "dpo", ("--streaming",),
            "hputrain: error: --streaming trains causal LM and SFT rows; DPO (preference pairs) "
            "reads its data set whole: leave out --streaming", processes=False),
    Refusal("grpo+streaming", "grpo", ("--streaming", "--reward-funcs", "{reward_funcs}"),
            "hputrain: error: --streaming trains causal LM and SFT rows; GRPO reads its prompts "
            "whole: leave out --streaming", processes=False),
    Refusal("ref_model+text", "text", ("--ref-model", "{ref_model}"),
            "hputrain: error: --ref-model is for preference pairs (DPO), and --dataset {dataset} "
            "holds none", processes=False),
    Refusal("ref_precomputed+chat", "chat", ("--precompute-ref-log-probs",),
            "hputrain: error: --precompute-ref-log-probs is for preference pairs (DPO), and "
            "--dataset {dataset} holds none", processes=False),
    # issue 41: the "vlm" level beside the methods and the source it does not combine with
    Refusal("dpo+vlm", "dpo", (),
            "hputrain: error: DPO (--method dpo) on an image-text-to-text model (--model {model}) is "
            "not supported yet: train it with SFT (--method sft or auto) on image rows",
            processes=False, model="vlm"),
    Refusal("grpo+vlm", "grpo", ("--reward-funcs", "{reward_funcs}"),
            "hputrain: error: GRPO (--method grpo) on an image-text-to-text model (--model {model}) "
            "is not supported yet: train it with SFT (--method sft or auto) on image rows",
            processes=False, model="vlm"),
    Refusal("stream+vlm", "chat", ("--streaming",),
            "hputrain: error: --streaming reads text shards; an image-text-to-text model's data is "
            "read whole: leave out --streaming", processes=False, model="vlm"),
    # issue 47: the "ep2" level beside the models without experts and lazy mode
    Refusal("ep2+dense", "chat", ("--devices", "2", "--strategy", "fsdp", "--expert-parallel-size", "2"),
            "hputrain: error: expert_parallel_size=2 splits a mixture-of-experts model's experts, "
            "and {model} (llama) has none: set expert_parallel_size=1", processes=False),
    Refusal("ep2+vlm", "chat", ("--devices", "2", "--strategy", "fsdp", "--expert-parallel-size", "2"),
            "hputrain: error: expert parallelism on an image-text-to-text model is not supported: "
            "set expert_parallel_size=1", processes=False, model="vlm"),
    Refusal("lazy+ep2", "chat", ("--devices", "2", "--strategy", "fsdp", "--expert-parallel-size", "2",
                                 "--execution-mode", "lazy"),
            "hputrain: error: strategy='fsdp' runs in eager or compile mode, not lazy: set "
            "execution_mode='eager' or 'compile'", processes=True, model="moe"),
)


def refusal_flags(refusal: Refusal, inputs: Inputs) -> tuple[list[str], str]:
    """(the `hputrain train` arguments of a refused pair, the line expected on stderr)."""
    vlm = refusal.model == "vlm"  # its own image data where it has some (SFT rows)
    dataset = (inputs.vlm_datasets if vlm and refusal.method in inputs.vlm_datasets
               else inputs.datasets)[refusal.method]
    model = {"vlm": inputs.vlm_model, "moe": inputs.moe_model}.get(refusal.model, inputs.model)
    flags = [f.format(ref_model=inputs.ref_model, reward_funcs=inputs.reward_funcs)
             for f in refusal.flags]
    argv = ["--model", model, "--dataset", dataset, *COMMON, "--validation-split-percentage",
            "0", *flags]
    return argv, refusal.line.format(dataset=dataset, model=model)
