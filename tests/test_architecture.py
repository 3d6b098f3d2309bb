"""The house's rules, checked on every test run: one folder per concern, layered top to bottom,
no import circle at any depth (import-linter's contracts in pyproject.toml), and a small top."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "hputrain"


def test_import_contracts_are_kept():
    """Layers (cli on top; accelerators, models and config at the bottom) and acyclic siblings."""
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_the_top_of_the_package_stays_small():
    """At the top: the public entry points and the shared leaves; everything else in a folder."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "errors.py", "files.py", "inference.py", "metrics.py", "registry.py"], top
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert folders == ["accelerators", "callbacks", "checkpoint", "cli", "config", "data",
                       "distributed", "execution", "kinds", "methods", "models", "recipes", "rehearsal",
                       "training"]


def test_no_three_files_of_a_folder_share_a_name_prefix():
    """Issue 48: a prefix shared by three files (kinds/vlm/recipe.py, kinds/vlm/run.py, kinds/vlm/chat.py;
    methods/dpo/plan.py, methods/grpo/plan.py, kinds/moe/plan.py) is a folder waiting to exist."""
    crowded = {}
    for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        groups: dict[str, list[str]] = {}
        for stem in sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__"):
            groups.setdefault(stem.split("_")[0], []).append(stem)
        crowded.update({f"{folder.relative_to(PACKAGE)}/{prefix}": stems
                        for prefix, stems in groups.items() if len(stems) >= 3})
    assert crowded == {}, crowded


def test_every_method_and_kind_folder_is_registered_once():
    """Issue 48: a method or a model kind is a folder plus its line in hputrain/registry.py; the
    kinds the core asks (models/kind.py) are exactly those, and the independence contract lists
    every folder."""
    import tomllib

    from hputrain import registry
    from hputrain.models.kind import registered
    from hputrain.recipes.hf.methods import Method, registered_methods

    methods = sorted(p.name for p in (PACKAGE / "methods").iterdir() if (p / "__init__.py").is_file())
    kinds = sorted(p.name for p in (PACKAGE / "kinds").iterdir() if (p / "__init__.py").is_file())
    assert sorted(method.name for method in registry.METHODS) == methods
    assert [type(m) for m in registered_methods()] == [Method] + [type(m) for m in registry.METHODS]
    assert sorted(kind.name for kind in registry.KINDS) == kinds
    assert [type(kind) for kind in registered()] == [type(kind) for kind in registry.KINDS]
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    [independence] = [c for c in contracts if c["type"] == "independence"]
    assert sorted(independence["modules"]) == sorted(
        [f"hputrain.methods.{m}" for m in methods] + [f"hputrain.kinds.{k}" for k in kinds])


def test_documented_import_paths_keep_working():
    from hputrain import Callback, EarlyStopping, Trainer, TrainingArguments  # noqa: F401
    from hputrain.callbacks import added_to_every_trainer  # noqa: F401
    from hputrain.inference import wrap_for_inference  # noqa: F401
    from hputrain.metrics import accuracy, token_accuracy  # noqa: F401
    from hputrain.models.gpt import GPT  # noqa: F401


def test_the_design_and_every_page_the_docs_name_are_in_the_repository():
    """Issue 46, item 17: the README named ../shared/DESIGN.md, outside the project. The design is
    docs/design.md, the README links it, and every page README.md and docs/ name is a file here."""
    import re

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {(page.name, ref) for page in pages
             for ref in re.findall(r"(?:\.\./|docs/)[\w./-]+\.md", page.read_text(encoding="utf-8"))}
    missing = sorted((page, ref) for page, ref in named
                     if ref.startswith("../") or not (ROOT / ref).is_file())
    assert not missing, missing
    assert ("README.md", "docs/design.md") in named


def test_a_new_method_is_a_class_the_recipe_asks(monkeypatch, tmp_path):
    """Issue 48: the Hugging Face recipe names no method. A method it has never seen (a KTO-like
    one, on rows with a 'label') joins by being registered: its flags become the recipe's options
    (one it shares with DPO and GRPO defaults to None, its help naming each meaning), its data is
    routed to it, its flags given with other data are one line, and --method takes its name."""
    import dataclasses
    import json

    import pytest

    from hputrain.config.fields import field_docs
    from hputrain.errors import InputError
    from hputrain.recipes.hf import methods
    from hputrain.recipes.hf.options import compose

    @dataclasses.dataclass(kw_only=True)
    class UnpairedFlags:
        beta: float = 0.1
        """How far the policy may move."""
        desirable_weight: float = 1.0
        """The weight of the desirable rows' loss."""

    class Unpaired(methods.Method):
        name, label, data_words, flags = "unpaired", "KTO", "rows labelled good or bad", UnpairedFlags

        def claims(self, columns, options) -> bool:
            return {"prompt", "completion", "label"} <= set(columns)

    monkeypatch.setattr(methods, "_METHODS", [*methods._METHODS, Unpaired()])
    options_class = compose(methods._METHODS, methods.shared_names())
    assert {"beta", "loss_type"} <= methods.shared_names()
    fields = {f.name: f for f in dataclasses.fields(options_class)}
    assert fields["desirable_weight"].default == 1.0 and fields["beta"].default is None
    beta = field_docs(options_class)["beta"]  # each method's meaning, in the registry's order
    assert beta.startswith("DPO: ") and beta.index("; GRPO: ") < beta.index("; KTO: How far the policy may move (default 0.1)")

    def data(name: str, rows: list[dict]) -> str:
        path = tmp_path / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(path)

    labelled = data("labelled.jsonl", [{"prompt": "q", "completion": "a", "label": True}] * 3)
    text = data("text.jsonl", [{"text": "plain"}] * 3)
    assert methods.data_kind(options_class(model="m", dataset=labelled)) == "unpaired"
    assert methods.data_kind(options_class(model="m", dataset=labelled, method="unpaired")) == "unpaired"
    with pytest.raises(InputError, match=r"^--desirable-weight is for rows labelled good or bad \(KTO\)"):
        methods.data_kind(options_class(model="m", dataset=text, desirable_weight=2.0))
    assert methods.data_kind(options_class(model="m", dataset=text)) == "lm_or_sft"
