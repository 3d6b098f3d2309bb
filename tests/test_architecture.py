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

    methods = sorted(p.name for p in (PACKAGE / "methods").iterdir() if (p / "__init__.py").is_file())
    kinds = sorted(p.name for p in (PACKAGE / "kinds").iterdir() if (p / "__init__.py").is_file())
    assert sorted(name for name in registry.METHODS if name != "lm") == methods
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
