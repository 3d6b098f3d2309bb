"""The training methods of `hputrain train --model`, as the Hugging Face recipe asks them, and which
one a run takes.

A method's folder (methods/<name>/) subclasses `Method`, and hputrain/registry.py registers it
(`register_method`). The recipe asks the registered methods, in their order: which one claims the
data (from its columns and the flags), what each refuses of the data and of the others' flags
(one line), the defaults of the names two methods share (beta, loss_type), and then hands the run
to the one taken. `Method` itself is the causal LM's, which takes what no other method claims:
text cut into blocks, and the chat and instruction rows SFT reads (load_data tells them apart).
The recipe's options (`options_class`, HFOptions) are its own fields with every method's flags.
"""
from __future__ import annotations

import collections
import dataclasses

from ...config.fields import ConfigError, fields_given
from ...errors import InputError


class Method:
    """A training method as the recipe asks it; here, the causal LM's (see the module docstring)."""

    name = "lm"
    """--method's value."""
    label = "causal LM"
    """How a line names it ("DPO")."""
    data_words = "text"
    """What its data is, for a flag of its given with other data ("preference pairs")."""
    flags: type | None = None
    """The dataclass of its own settings, each a flag of `hputrain train --model` (HFOptions
    inherits them). A name in two methods' flags is both's: None unless given, then the method
    taken sets its own default (`resolve`)."""
    help_title: str | None = None
    """The title its flags go under in --help ("DPO: preference pairs")."""
    defaults: dict = {}
    """TrainingArguments defaults over the recipe's (TRL's config's, where they differ)."""
    loads_model = False
    """Whether it loads the model folder itself (a reward model's head); else the recipe loads
    the policy (and the reference `references` asks for) and calls `train`."""
    uses_reference = False
    """Whether --ref-model means something to it."""
    trains_blocks = True
    """Whether it trains through the causal LM's run (`train_blocks`: text blocks, packed rows)."""
    words = {"text": "causal LM on packed text"}
    """The row shapes whose rows it reads for the causal LM's run (load_data: text here, chat and
    instruction rows SFT's), and what the run header calls it on each."""

    def claims(self, columns: list[str], options) -> bool:
        """Whether data of these columns, with these flags, is this method's (--method auto)."""
        return False

    def check_data(self, options, columns: list[str], taken: str, found: str) -> None:
        """One line for data this method refuses, or for data it needs and is not given
        (`taken`: the method the data went to; `found`: its columns in words)."""

    def check_flags(self, options) -> None:
        """One line (ConfigError) for a flag of its own given a value it never takes."""

    def flags_given(self, options, taken: str) -> list[str]:
        """Its own flags (not the shared names) that `options` sets: refused for another's data."""
        if self.flags is None:
            return []
        return [name for name in fields_given(self.flags, options, none_is_unset=True)
                if name not in shared_names()]

    def flag_refusal(self, flag: str, options, taken: str) -> str:
        """The line for its flag `flag` given with data that `taken` trains."""
        return f"--{flag} is for {self.data_words} ({self.label}), and --dataset {options.dataset} holds none"

    def resolve(self, options):
        """`options` with the shared names its flags hold set to its defaults where not given
        (beta: DPO's 0.1, GRPO's 0.0), its settings checked (`check`)."""
        if self.flags is None:
            return options
        defaults, own = self.flags(), {f.name for f in dataclasses.fields(self.flags)}
        options = dataclasses.replace(options, **{
            name: getattr(defaults, name) for name in shared_names() & own
            if getattr(options, name) is None})
        self.check(options)
        return options

    def check(self, options) -> None:
        """Its settings valid (ConfigError, one line, otherwise), once `resolve` has set them."""

    def references(self, options) -> bool:
        """Whether the run needs a frozen reference model beside the policy."""
        return False

    def run(self, options, training_args, accelerator_config, folder) -> int:
        """The whole run, for a method that loads its own model (`loads_model`)."""
        raise NotImplementedError

    def train(self, options, training_args, accelerator_config, folder, policy) -> int:
        """Train `policy` (recipes/hf/__init__.py's Policy: the model, LoRA added, its tokenizer,
        the reference, the block size); returns the exit status."""
        from . import train_blocks

        return train_blocks(options, training_args, accelerator_config, folder, policy)

    def load_rows(self, path: str, fmt: str, tokenizer, block_size: int, options, *, cache_dir,
                  tokenizer_folder=None, split: str = "train"):
        """Rows of the shape `fmt` (one of `words`, not text) as the blocks or rows the
        causal LM's run trains on, with what the header says of them (describe_rows)."""
        raise NotImplementedError

    def describe_rows(self, data, options, block_size: int, source: str) -> str:
        """The header's lines on what `load_rows` made."""
        raise NotImplementedError

    def evaluate(self, options, *, batch_size: int, precision: str, split: str) -> dict | None:
        """`hputrain evaluate`'s numbers on this method's data, or None: the causal LM's loss
        over blocks (recipes/hf/evaluate.py)."""
        return None

    def plan_step(self, options, step, reference):
        """The step `hputrain plan` traces for this method, from the model's own step (`step`,
        rehearsal.plan's StepModel) and the reference's build (`reference`: a callable, or None);
        the causal LM's own (cli/planning.py packs it where its rows are packed)."""
        return step


_METHODS: list[Method] = [Method()]
_OPTIONS: list[type] = []


def register_method(method: Method) -> None:
    """Make `method` known to the recipe (hputrain/registry.py, once per method; idempotent)."""
    if _OPTIONS:
        raise RuntimeError(f"method {method.name!r} registered after the recipe's options were made")
    if all(type(known) is not type(method) for known in _METHODS):
        _METHODS.append(method)


def registered_methods() -> list[Method]:
    return list(_METHODS)


def method_named(name: str) -> Method:
    """The registered method `name` ("lm_or_sft", what no method claims: the causal LM's)."""
    return next((m for m in _METHODS if m.name == name), _METHODS[0])


def rows_method(fmt: str) -> Method:
    """The method whose rows have the shape `fmt` ("text": the causal LM's)."""
    return next(m for m in _METHODS if fmt in m.words)


def shared_names() -> frozenset[str]:
    """The flags two or more methods take (beta, loss_type), each defaulted by the method taken."""
    counts = collections.Counter(f.name for m in _METHODS if m.flags is not None
                                 for f in dataclasses.fields(m.flags))
    return frozenset(name for name, count in counts.items() if count > 1)


def options_class() -> type:
    """HFOptions: the recipe's own fields (recipes/hf/options.py) with every registered method's
    and model kind's flags; a name two methods share defaults to None, its help saying each one's
    meaning."""
    if not _OPTIONS:
        from ...models.kind import registered
        from .options import compose

        _OPTIONS.append(compose(_METHODS, shared_names(), registered()))
    return _OPTIONS[0]


def data_kind(options) -> str:
    """The name of the method whose data --dataset holds ("lm_or_sft" where no method claims it:
    load_data tells text and SFT rows apart), checked against --method and the flags each method
    alone takes (one line)."""
    from .data import columns_of

    columns = columns_of(options.dataset)
    check_not_empty(options.dataset, columns)
    columns = columns or []
    taken = next((m.name for m in _METHODS if m.claims(columns, options)), "lm_or_sft")
    found = ", ".join(map(str, columns)) or "no columns (plain text)"
    asked = [m for m in _METHODS if m.name == options.method]  # its refusal first
    for method in asked + [m for m in _METHODS if m not in asked]:
        method.check_data(options, columns, taken, found)
    _refuse_other_methods_flags(options, taken)
    return taken


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


def _refuse_other_methods_flags(options, taken: str) -> None:
    """A flag of one method's given for data another trains: one line."""
    for method in _METHODS:
        given = method.flags_given(options, taken)
        if method.name != taken and given:
            raise InputError(method.flag_refusal(given[0].replace("_", "-"), options, taken))
    shared = [name for name in sorted(shared_names()) if getattr(options, name) is not None]
    if taken == "lm_or_sft" and shared:
        takers = [m for m in _METHODS if m.flags is not None and shared[0] in
                  {f.name for f in dataclasses.fields(m.flags)}]
        raise InputError(f"--{shared[0].replace('_', '-')} is for "
                         + " or ".join(f"{m.label} ({m.data_words})" for m in takers)
                         + f", and --dataset {options.dataset} holds "
                         + ("neither" if len(takers) == 2 else "none of those"))


def resolved(options, method: Method):
    """`method.resolve(options)`, a setting it refuses said in one line (InputError)."""
    try:
        return method.resolve(options)
    except ConfigError as error:
        raise InputError(str(error)) from None
