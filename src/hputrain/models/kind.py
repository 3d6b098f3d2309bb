"""A model kind as the core sees it: what a kind's folder (kinds/moe/, kinds/vlm/) gives the loop,
the kernels, the packing, the strategies and the header, without the core naming it.

A kind subclasses `ModelKind` and overrides the hooks it needs; every hook of the base does
nothing, so a dense decoder (no kind matches it) goes through the same calls. hputrain/registry.py
registers each kind once (`register`); the core asks `kinds_of(config)` for those that match a
model (a mixture of experts with images matches both) and `registered()` for every one (the
strategy's layout, which is chosen before any model is; the plan's and the doctor's hooks, which
they ask whatever the model).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable


class ModelKind:
    """The hooks a model kind implements (see the module docstring); here, a dense decoder's."""

    name = "dense"
    flags: type | None = None
    """The dataclass of its own settings, each a flag of `hputrain train --model` (the Hugging Face
    recipe's options inherit them), checked by `check_flags`; None: none."""
    help_title: str | None = None
    """The title its flags go under in --help."""

    def check_flags(self, options) -> None:
        """One line (ConfigError) for a flag of its own given a value it never takes."""

    def matches(self, config) -> bool:
        """Whether a model of this transformers config (None: not a Hugging Face model) is one."""
        return False

    def describe(self, config, args=None) -> str | None:
        """The run header's words on the model ("mixture of experts: 8 experts, top-2"), with
        what `args` (the TrainingArguments) make of it."""
        return None

    def substitute_kernels(self, model, offered: dict, shared: dict) -> dict[str, int]:
        """The device's kernels swapped into the model (execution/kernels.py's `offered` and
        `shared`): {"experts: static": 48, ...}."""
        return {}

    def prepare(self, model, args) -> Callable[[], contextlib.AbstractContextManager] | None:
        """Before the model is converted and placed: the forward's swaps. Returns what makes the
        context every forward of the run is called in (None: none)."""
        return None

    def extras(self, model, args, group, inputs, device):
        """The model's extra losses and metrics beside the method's (training/extras.py's
        interface: a mixture of experts' router), or None."""
        return None

    def parts(self, module, param) -> int:
        """Into how many ranks' parts this kind split `param` of `module` (1: whole here)."""
        return 1

    def adapted_where(self, config, names: list[str]) -> str | None:
        """Where LoRA's adapters (`names`: the adapted modules) sit, for the header ("in the
        language model and the vision tower"); None: nothing to say."""
        return None

    def recipe(self):
        """The kind's own recipe of `hputrain train / evaluate / export / plan --model`, for the
        folders it trains its own way (an image-text-to-text model: its processor, image rows),
        or None: the causal LM's recipe takes its models. The object answers `takes(folder,
        base_model, dataset)`, `merges(folder, base_model)`, `plans(config)` and
        `refusal(config)`, and does `check_run`, `run`, `evaluate`, `merged` and `step_model`
        (kinds/vlm/run.py's ImageTextRecipe)."""
        return None

    def packing_keys(self) -> frozenset[str]:
        """Keys of a packed batch the model never takes but the loop keeps (an image count)."""
        return frozenset()

    def block_mask(self, config) -> tuple[int | None, str] | None:
        """For a packed block's mask (training/packed.py): the token id whose runs attend both
        ways (None: causal as text) and the positions' form ("1d", "3d"); None: text's."""
        return None

    def check_layout(self, settings, world_size: int, config=None, model_name: str = "the model") -> None:
        """Refuse a parallel layout of this kind's in one line: before the processes join
        (`config` None), and again once the model's config is known."""

    def parallel(self, strategy, settings, group):
        """The strategy with this kind's parallel layout around it (expert parallelism), or the
        strategy as it is."""
        return strategy

    # -- what `hputrain plan` and `hputrain doctor` ask (rehearsal/); asked of every registered kind

    def plan_layout(self, model, args):
        """The plan's account of this kind's part of `model` (whole, on the meta device, before
        any split) in a run of `args`, or None: an object with `as_json()` (the plan's "moe"
        entry), `describe()` (its header line) and `with_tokens(n)` (the same for micro-batches
        of n tokens a rank)."""
        return None

    def plan_tracing(self, args, fake: bool) -> list[contextlib.AbstractContextManager]:
        """What the plan's trace of a step runs inside, whatever the model: stand-ins for what
        cannot run on fake tensors (`fake`) or in one process."""
        return []

    def counted_apart(self, model) -> list:
        """The modules of `model` whose allocations while they run the plan counts in a category
        of their own, out of the activations and temporaries (plan/tracking.py)."""
        return []

    def doctor_watch(self, reads):
        """A watch the doctor enters around the user's script (`reads`: its HostReads), or None.
        Its `seen()` lists what ran inside this kind's modules, each item with `reads` (site ->
        count), `fallbacks` (op -> count), `routing_dependent` (its shapes change from step to
        step), `read_fix` (the fix for a read inside it) and `as_dict()`; findings.diagnose
        takes them."""
        return None

    def doctor_findings(self, records: list[dict], warmup: int, seen: list) -> list[dict]:
        """The doctor's findings on what the watches saw (`seen`: the items, of every kind's
        watch, whose shapes change from step to step) in the steps `records`."""
        return []


_KINDS: list[ModelKind] = []


def register(kind: ModelKind) -> None:
    """Make `kind` known to the core (hputrain/registry.py, once per kind; idempotent)."""
    if all(type(known) is not type(kind) for known in _KINDS):
        _KINDS.append(kind)


def registered() -> list[ModelKind]:
    return list(_KINDS)


def own_recipes() -> list:
    """The recipes of the registered kinds that have one of their own (`ModelKind.recipe`)."""
    return [own for kind in _KINDS if (own := kind.recipe()) is not None]


def kinds_of(config) -> list[ModelKind]:
    """The registered kinds a model of this config is (none: a dense decoder)."""
    return [kind for kind in _KINDS if config is not None and kind.matches(config)]


def describe(config, args=None) -> str:
    """"image-text-to-text: LLaVA", "mixture of experts: 8 experts, top-2" or "dense": the first
    matching kind's words (an image model's before its experts')."""
    for kind in kinds_of(config):
        if (words := kind.describe(config, args)) is not None:
            return words
    return "dense"
