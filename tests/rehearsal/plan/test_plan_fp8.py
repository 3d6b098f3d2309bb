"""Issue 46, item 16: `hputrain plan --fp8` counts fp8 as a speed-up only on a target with fp8
matrix units (Gaudi 2 and 3, H100 and H200); on the CPU, where fp8 is emulated, it says it counts
none, and on an A100 that a run there refuses fp8. The memory is the same fp8 layers' either way."""
from __future__ import annotations

import json

import pytest

from hputrain.accelerators.cpu import CPUAccelerator
from hputrain.cli import main

TINY = ["--seq-len", "32", "--per-device-train-batch-size", "2"]


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


def plan_json(capsys, *flags) -> dict:
    assert main(["plan", "--json", *TINY, *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_fp8_is_a_speed_up_only_where_the_target_has_fp8_units(capsys):
    if not CPUAccelerator().supports_fp8():
        pytest.skip("this torch has no CPU kernel for torch._scaled_mm")
    h100 = plan_json(capsys, "--fp8", "--target", "h100")
    assert h100["fp8"]["runs"] == "native" and h100["fp8"]["speedup"]
    assert h100["fp8"]["peak_vs_bf16"] == pytest.approx(2.0, abs=0.01)  # 1979 / 989 TFLOP/s
    cpu = plan_json(capsys, "--fp8", "--target", "cpu")
    assert cpu["fp8"] == {"runs": "emulated", "speedup": False, "peak_vs_bf16": None,
                          "note": cpu["fp8"]["note"]}
    assert cpu["fp8"]["note"].startswith("fp8 counted as no speed-up on cpu, where it is emulated: the cpu "
                                         "has no fp8 matrix units, so it runs many times slower")
    assert cpu["breakdown"] == h100["breakdown"]  # the same fp8 layers traced for either
    # and the plan for people says it on its first line
    assert main(["plan", *TINY, "--fp8", "--target", "cpu"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "; fp8 counted as no speed-up on cpu, where it is emulated" in first
    assert first.endswith("a correctness rehearsal of fp8 on gaudi2, gaudi3, h100 or h200")


def test_the_other_targets_fp8():
    """The same decision for the targets the test above does not trace: a Gaudi 2 and 3 count it
    (no fp8 peak of theirs is published here), an A100 has no fp8 units, and without --fp8 the
    plan says nothing of it."""
    from types import SimpleNamespace

    from hputrain.rehearsal.plan import _fp8

    fp8 = SimpleNamespace(fp8=True)
    for gaudi in ("gaudi2", "gaudi3"):
        assert _fp8(fp8, gaudi) == {"runs": "native", "speedup": True, "peak_vs_bf16": None,
                                    "note": f"fp8 counted as a speed-up on {gaudi}: its fp8 matrix units"}
    a100 = _fp8(fp8, "a100")
    assert a100["runs"] is None and not a100["speedup"] and a100["note"].endswith("(a run there refuses fp8)")
    assert _fp8(SimpleNamespace(fp8=False), "h100") is None
