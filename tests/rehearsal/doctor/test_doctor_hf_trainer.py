"""`hputrain doctor` on a transformers Trainer script (rehearsal/doctor/hf.py): transformers sees the
stand-in's HPU, the steps run lazily with Optimum's step boundaries, and the findings name the
Trainer's arguments. The script (doctor_scripts/hf_trainer.py) fine-tunes a tiny Llama folder
written here; the rehearsal runs in this process, as doctor.run() runs it."""
import runpy
import sys
from pathlib import Path

import pytest
import torch

from hputrain.accelerators.cpu_lazy import HostReads
from hputrain.rehearsal.doctor.hf import HFRehearsal, optimum_missing
from hputrain.rehearsal.findings import DoctorFinished, sync_site
from hputrain.rehearsal.shapes import MAX_SHAPES
from hputrain.rehearsal.standin import StandIn

from ...hf_fixtures import lazy_rehearses_hf_models, tiny_llama_folder

pytestmark = lazy_rehearses_hf_models
SCRIPT = Path(__file__).parents[2] / "doctor_scripts" / "hf_trainer.py"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install hputrain[hf])")
    return tiny_llama_folder(tmp_path_factory.mktemp("llama") / "model")


def rehearse(folder, *script_args, steps=4, warmup=2, monkeypatch=None):
    """The doctor's rehearsal of the script, as run() drives it: the stand-in, the host reads, the
    HF Trainer watch; the report for `steps` steps."""
    from accelerate.state import AcceleratorState

    # A transformers.TrainingArguments made earlier in this process (another test's) leaves
    # accelerate's process-wide state on the CPU, which the script's Trainer would then take; the
    # doctor runs a script in a process of its own (`hputrain doctor`), where there is none.
    AcceleratorState._reset_state(reset_partial_state=True)
    reads = HostReads(locate=sync_site)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), str(folder), *script_args])
    with StandIn() as runtime, reads, HFRehearsal(steps, reads, runtime) as rehearsal:
        with pytest.raises(DoctorFinished):
            runpy.run_path(str(SCRIPT), run_name="__main__")
    assert rehearsal.claimed and len(rehearsal.records) == steps
    return rehearsal.report(warmup)


def kinds(report):
    return sorted(f["kind"] for f in report["findings"])


def test_padding_to_the_longest_row_is_found_with_the_collator_fix(folder, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    report = rehearse(folder, "longest", monkeypatch=monkeypatch)
    out = capsys.readouterr().out
    # transformers' own detection saw the HPU and chose hpu:0, which the stand-in maps to lazy
    assert "device: lazy, hpu available: True" in out
    assert "should have stopped" not in out and not list(tmp_path.iterdir())  # no output_dir written
    run = report["run_shapes"]  # the Trainer's own dataloader, walked ahead: 96 rows, batches of 4
    assert run["walked"] == "an epoch of 24 steps" and run["micro_batches"] == 24
    assert run["padding"] == "longest row" and not run["bounded"] and len(run["row_lengths"]) > MAX_SHAPES
    [shapes] = [f["message"] for f in report["findings"] if f["kind"] == "recompilation"]
    assert "Your data_collator (DataCollatorForLanguageModeling) pads each batch to its longest row" in shapes
    assert 'train_sampling_strategy="group_by_length"' in shapes and "is not enough" in shapes
    assert "pad_to_multiple_of=" in shapes and 'padding="max_length" with max_length=' in shapes
    assert "length_buckets" not in shapes  # hputrain's own argument is no fix for this Trainer
    assert report["trainer"] == "transformers" and report["fallback_ops"] == {}


def test_fixed_length_padding_has_no_recompilation(folder, monkeypatch, tmp_path):
    """Rows padded to 48 tokens by the tokenizer: one shape, no graph compiled after warm-up. The
    one finding left is transformers' own nan/inf check of each micro-batch's loss, a host read
    on a Gaudi too, named by its TrainingArguments switch."""
    monkeypatch.chdir(tmp_path)
    report = rehearse(folder, "max_length", monkeypatch=monkeypatch)
    assert "recompilation" not in kinds(report)
    run = report["run_shapes"]
    assert (run["count"], run["padding"], run["bounded"], run["listing"]) == (1, "fixed", True, "[4, 48]")
    assert report["compiles_per_step"][3:] == [0]  # step 3 may compile step 1's shape once more
    assert report["fallback_ops"] == {}  # AdamW's lerp, the clip's norm and isnan stay in the graph
    assert kinds(report) == ["host_sync"] and min(report["host_syncs_per_step"]) >= 2  # isnan, isinf
    message = report["findings"][0]["message"]
    assert "in transformers/trainer.py:" in message and "logging_nan_inf_filter=False" in message
    assert any("rehearsed unfused" in note for note in report["notes"])


@pytest.mark.slow  # one more rehearsal, ~30 s
def test_group_by_length_is_not_enough(folder, monkeypatch, tmp_path):
    """train_sampling_strategy="group_by_length" still pads each batch to its longest row: found."""
    monkeypatch.chdir(tmp_path)
    report = rehearse(folder, "longest", "--group-by-length", monkeypatch=monkeypatch)
    assert "recompilation" in kinds(report) and report["run_shapes"]["padding"] == "longest row"


def test_the_rehearsal_leaves_transformers_and_torch_as_they_were(folder, monkeypatch, tmp_path):
    from transformers import Trainer
    from transformers.utils import is_torch_hpu_available

    monkeypatch.chdir(tmp_path)
    before = (torch.gather, torch.Tensor.gather, torch.compile, Trainer.__init__)
    rehearse(folder, "max_length", steps=1, warmup=0, monkeypatch=monkeypatch)
    assert (torch.gather, torch.Tensor.gather, torch.compile, Trainer.__init__) == before
    assert not is_torch_hpu_available() and "habana_frameworks" not in sys.modules


def test_missing_optimum_habana_is_one_line():
    line = optimum_missing(ModuleNotFoundError("No module named 'optimum'", name="optimum"))
    assert line.startswith("optimum-habana is not installed: the script imports optimum")
    assert "\n" not in line and "pip install optimum-habana" in line
    assert optimum_missing(ModuleNotFoundError("No module named 'numpyy'", name="numpyy")) is None
    assert optimum_missing(ValueError("optimum")) is None


def test_doctor_cli_names_missing_optimum_habana_in_one_line(tmp_path):
    import importlib.util
    import subprocess

    if importlib.util.find_spec("optimum") is not None:
        pytest.skip("optimum is installed here")
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "doctor", str(SCRIPT.parent / "hf_optimum.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "optimum-habana is not installed: the script imports optimum" in proc.stderr


@pytest.mark.slow  # the whole CLI in a subprocess, ~40 s
def test_doctor_cli_rehearses_a_trainer_script(folder, tmp_path):
    import json
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "doctor", "--steps", "3", "--json", str(SCRIPT),
                           str(folder), "longest"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert report["trainer"] == "transformers" and report["steps"] == 3
    assert "recompilation" in kinds(report) and not list(tmp_path.iterdir())
