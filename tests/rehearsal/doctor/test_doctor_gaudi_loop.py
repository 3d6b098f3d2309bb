"""`hputrain doctor` on plain PyTorch loops written for Gaudi (tests/doctor_scripts/gaudi_*.py),
run unmodified under the stand-in Gaudi runtime (rehearsal/standin.py): each classic mistake found
at its line of the script, a clean loop with no finding, one rank of a data-parallel script, and
the stand-in itself (its modules, the hpu device, and that it leaves nothing behind)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hputrain.accelerators import cpu_lazy
from hputrain.accelerators.cpu_lazy import HostReads
from hputrain.errors import InputError
from hputrain.rehearsal.doctor import diagnose, run
from hputrain.rehearsal.findings import period_unseen
from hputrain.rehearsal.standin import NOT_COVERED, StandIn

SCRIPTS = Path(__file__).parents[2] / "doctor_scripts"
LOOP = SCRIPTS / "gaudi_loop.py"
DOCS_LOOP = SCRIPTS / "gaudi_docs_loop.py"


def line_of(tag: str, script: Path = LOOP) -> str:
    """gaudi_loop.py:N of the line marked `# LINE: tag`."""
    for number, text in enumerate(script.read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# LINE: {tag}"):
            return f"{script.name}:{number}"
    raise AssertionError(tag)


@pytest.fixture(autouse=True)
def cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


def doctor(*args, script=LOOP, steps=6, warmup=2):
    return run(str(script), list(args), steps, warmup)


def kinds(report):
    return sorted(f["kind"] for f in report["findings"])


def test_clean_loop_has_no_finding():
    report = doctor()
    assert report["steps"] == 6 and report["findings"] == []
    assert report["compiles_per_step"][2:] == [0, 0, 0, 0] and report["host_syncs_per_step"] == [0] * 6
    assert report["fallback_ops"] == {} and report["shapes"]["distinct"] == ["[4, 16]"]
    assert report["loop"]["optimizer_step_at"] == line_of("step") and report["loop"]["mark_steps"] >= 12
    assert any("plain loop" in note for note in report["notes"])


def test_a_loop_written_as_the_docs_teach_has_no_finding():
    """The hpex fused ops, mark_step after backward and after the optimizer step, the running loss
    kept on the device and read every 4 steps: the read is a logging step's, not a per-step sync,
    and the graphs the step after it compiles (the reset of the running loss) are judged by the
    period: the watch goes on until they come round again (step 9), from the cache."""
    report = doctor(script=DOCS_LOOP)
    assert report["findings"] == [] and report["fallback_ops"] == {} and report["steps"] == 9
    assert report["host_syncs_per_step"] == [0, 0, 0, 0, 1, 0, 0, 0, 1]
    assert report["compiles_per_step"][2:] == [0, 0, 1, 0, 0, 0, 0]
    assert any("came round again at step(s) [9]" in note for note in report["notes"])
    assert any(note.startswith("values read back to the host at steps [5, 9] of 9 (every 4 steps): item at "
                               f"{line_of('read', DOCS_LOOP)} (2x)") for note in report["notes"])
    assert report["loop"]["optimizer_step_at"] == line_of("step", DOCS_LOOP)


def test_the_judgement_does_not_depend_on_what_ran_before_in_the_process():
    """torch hooks the step of each optimizer class once it has made an instance of it: after an
    hputrain lazy run made a cpu_lazy.AdamW (as a Trainer does), the stand-in's FusedAdamW's step
    calls a hooked parent step, and each optimizer step ran the doctor's hooks twice (half-steps,
    the logging read never in a step: a false recompilation). The graph cache, warm from the
    first rehearsal, makes the second one's steps compile nothing, and finds nothing either."""
    cpu_lazy.AdamW([torch.nn.Parameter(torch.zeros(2))])  # hooks cpu_lazy.AdamW.step for the process
    assert getattr(cpu_lazy.AdamW.step, "hooked", False)
    for report in (doctor(script=DOCS_LOOP), doctor(script=DOCS_LOOP)):
        assert report["findings"] == [] and report["fallback_ops"] == {}
        assert report["host_syncs_per_step"][:5] == [0, 0, 0, 0, 1]
        assert any(note.startswith("values read back to the host at steps [5") for note in report["notes"])


def test_torch_s_transformer_encoder_layer_has_no_finding():
    """nn.TransformerEncoderLayer's attention meets the CPU lazy backend's gaps (all.dim,
    isneginf, where.self_out, each probed in test_doctor.py): left out of the findings, and named."""
    report = doctor("encoder", script=DOCS_LOOP)
    assert report["findings"] == [] and report["fallback_ops"] == {}
    assert {"all.dim", "isneginf", "where.self_out"} <= set(report["backend_gaps_left_out"])


def steps_of(*per_step):
    """Records of a loop's steps: (compiles, host reads) each, one batch shape."""
    return [{"step": n, "compiles": c, "host_syncs": r, "fallbacks": {}, "shapes": {"0": [4, 16]},
             "attention_mask": None} for n, (c, r) in enumerate(per_step, start=1)]


def test_a_logging_step_graph_that_compiles_each_time_round_is_found():
    """Judged by the period: compiled at step 5, the step after the first logging read, and from
    the cache at step 9 is fine; compiled again at step 9 is a recompilation."""
    reads = HostReads(locate=lambda name: name)
    cached = diagnose(steps_of((2, 0), (1, 0), (0, 0), (0, 0), (2, 1), (0, 0), (0, 0), (0, 0), (0, 1)), 2, reads)
    assert cached["findings"] == []
    again = diagnose(steps_of((2, 0), (1, 0), (0, 0), (0, 0), (2, 1), (0, 0), (0, 0), (0, 0), (2, 1)), 2, reads)
    assert [f["kind"] for f in again["findings"]] == ["recompilation"]
    assert again["findings"][0]["message"].startswith("step(s) [9] compiled new graphs")
    every_step = diagnose(steps_of(*[(0, 1)] * 6), 2, HostReads(locate=lambda name: name))
    assert [f["kind"] for f in every_step["findings"]] == ["host_sync"]
    # what makes the watch go on: a place in the period met once; not step 2's second compile of
    # step 1's graphs (the optimizer's state is created in step 1)
    assert period_unseen(steps_of((2, 0), (1, 0), (0, 0), (0, 0), (2, 1)), 2)
    assert not period_unseen(steps_of((2, 0), (1, 0), (0, 0)), 1)


def test_a_new_length_every_step_recompiles():
    report = doctor("lengths")
    assert kinds(report) == ["recompilation"] and report["shapes"]["growing"]
    assert report["shapes"]["distinct"] == [f"[4, {16 + 3 * s}]" for s in range(6)]
    assert all(report["compiles_per_step"][2:])
    assert f"moved to the device at {line_of('inputs')}" in report["findings"][0]["message"]


def test_item_in_the_step_is_a_host_sync():
    report = doctor("item")
    assert kinds(report) == ["host_sync"] and report["host_syncs_per_step"] == [1] * 6
    assert f"item at {line_of('item')} (6x)" in report["findings"][0]["message"]


def test_python_branch_on_a_tensor_is_a_host_sync():
    report = doctor("branch")
    assert kinds(report) == ["host_sync"]
    message = report["findings"][0]["message"]
    assert f"__bool__ at {line_of('branch')} (6x)" in message and "torch.where" in message


def test_boolean_indexing_falls_back():
    """Boolean indexing (a loss masked by `losses[mask]`) runs eagerly: its result's shape depends
    on the data, on Gaudi too; its backward falls on the `.backward()` line."""
    report = doctor("fallback")
    assert "fallback" in kinds(report)
    assert report["fallback_ops"] == {"index.Tensor": 6, "_index_put_impl_": 6}
    [finding] = [f for f in report["findings"] if f["kind"] == "fallback"]
    assert f"index.Tensor (6x, at {line_of('fallback')})" in finding["message"]


def test_missing_mark_step_is_found_at_the_optimizer_step():
    report = doctor("no-mark-step")
    assert kinds(report) == ["missing_mark_step"] and report["steps"] == 6
    assert report["loop"]["mark_steps"] == 0
    message = report["findings"][0]["message"]
    assert f"after optimizer.step() at {line_of('step')}" in message
    assert report["compiles_per_step"][3:] == [0, 0, 0]  # the doctor's marks make a steady step
    assert report["shapes"]["distinct"] == ["[4, 16]"]


def test_one_rank_of_a_data_parallel_script(monkeypatch):
    """WORLD_SIZE=2 from a launcher: rank 0 rehearsed alone on an "hccl" (Gloo) group, the
    environment put back afterwards."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    report = doctor(script=SCRIPTS / "gaudi_ddp.py")
    assert report["steps"] == 6 and report["findings"] == []
    assert report["notes"][0].startswith("started as one rank of WORLD_SIZE=2: rehearsed as rank 0 alone")
    assert os.environ["WORLD_SIZE"] == "2" and "MASTER_PORT" not in os.environ
    assert not torch.distributed.is_initialized()


def test_uncovered_part_of_habana_frameworks_is_one_line():
    with pytest.raises(InputError) as error:
        doctor(script=SCRIPTS / "gaudi_uncovered.py")
    message = str(error.value)
    assert message.startswith("gaudi_uncovered.py failed in the rehearsal at gaudi_uncovered.py:8: AttributeError")
    assert f"{NOT_COVERED} habana_frameworks.torch.hpu.enable_dynamic_shape" in message
    assert "\n" not in message


def test_standin_modules_device_and_removal():
    """find_spec finds the modules (transformers asks it), torch.hpu is registered, hpu lands on
    the lazy device through .to, device= and Module.to; removing it leaves nothing behind."""
    with StandIn() as runtime:
        assert importlib.util.find_spec("habana_frameworks.torch.core") is not None
        import habana_frameworks.torch.core as htcore
        import habana_frameworks.torch.hpu as hthpu

        assert torch.hpu is hthpu and hthpu.is_available() and hthpu.device_count() >= 1
        model = torch.nn.Linear(3, 2).to("hpu")
        x = torch.ones(4, 3).to(torch.device("hpu:0"))
        y = torch.zeros(4, 2, device="hpu")
        assert {model.weight.device.type, x.device.type, y.device.type, x.hpu().device.type} == {"lazy"}
        assert hthpu.wrap_in_hpu_graph(model) is model
        assert torch.compile(model, backend="hpu_backend") is model
        out = (model(x) - y).sum()
        htcore.mark_step()
        assert runtime.mark_steps == 1
        weight, bias = model.weight.cpu(), model.bias.cpu()
        assert out.cpu().item() == pytest.approx(float((torch.ones(4, 3) @ weight.T + bias).sum()))
        stats = hthpu.memory_stats()
        assert 0 < stats["InUse"] <= stats["MaxInUse"] <= stats["Limit"]
    assert "habana_frameworks" not in sys.modules and not hasattr(torch, "hpu")
    assert importlib.util.find_spec("habana_frameworks") is None and not hasattr(torch.Tensor, "hpu")


def test_cli_prints_the_report_and_a_bad_script_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "doctor", "--steps", "4", str(LOOP), "item"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "HPUTRAIN_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert "hputrain doctor: 4 steps of" in proc.stdout and "host syncs per step:         [1, 1, 1, 1]" in proc.stdout
    assert "- host_sync: values read back to the host inside the step, 1 per step." in proc.stdout
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nimport habana_frameworks.torch.core as htcore\n"
                   "x = torch.ones(2).to('hpu')\nraise ValueError('no data in ./data')\n")
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "doctor", str(bad)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "bad.py failed in the rehearsal at bad.py:4: ValueError: no data in ./data" in proc.stderr


def test_json_report_of_a_loop_is_the_trainer_report_shape(tmp_path):
    """The same keys as an hputrain Trainer script's report, plus the loop's own; stdout is the
    one JSON object, the script's own prints go to stderr."""
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "doctor", "--json", "--steps", "3", str(LOOP),
                           "item"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    report = json.loads(proc.stdout)
    assert "step 0 loss" in proc.stderr and report["host_syncs_per_step"] == [1, 1, 1]
    assert {"steps", "compiles_per_step", "host_syncs_per_step", "shapes", "run_shapes", "fallback_ops",
            "backend_gaps_left_out", "findings", "notes", "loop"} <= set(report)
