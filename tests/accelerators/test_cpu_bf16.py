"""bf16 on a CPU with and without native support: detection (flags, confirmed by a timed probe),
precision="auto", the warning when bf16 is asked for where it is slow, `hputrain env`, and the MFU
against the measured peak.

This machine may well have native bf16, so the other CPUs are made by substituting the flags and
the probe's measurement; one test runs the real probe.
"""
import json
import os
import re
from pathlib import Path

import pytest
import torch

from hputrain import AcceleratorConfig, TrainingArguments
from hputrain.accelerators import cpu as cpu_module
from hputrain.accelerators.cpu import NATIVE_BF16_SWITCH, CPUAccelerator, measured_matmul_flops
from hputrain.cli import main
from hputrain.execution.precision import BF16Autocast, Precision, select_precision
from hputrain.training.telemetry import ThroughputClock, flops_per_token, job_peak_flops
from hputrain.config.sections import PrecisionSettings

# The AMD EPYC: AVX2 only, bf16 matmul at ~1 GFLOP/s against ~100 in fp32.
AVX2_ONLY = frozenset({"fpu", "sse4_2", "fma", "avx", "avx2"})
EMULATED = {torch.float32: 100e9, torch.bfloat16: 100e9 / 87}
# A CPU with AVX512-BF16, where bf16 products run faster than fp32 ones.
AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
NATIVE = {torch.float32: 120e9, torch.bfloat16: 380e9}

SLOW_LINE = ("bf16 on this CPU runs 87x slower than fp32 (no AVX512-BF16/AMX): use precision='auto' "
             "or fp32 (training continues in bf16, as asked)")


@pytest.fixture
def cpu_like(monkeypatch):
    """cpu_like(flags, rates): this process's CPU reports `flags` and the probe measures `rates`
    (and the test switch, which `make test-bf16-both` sets, is off: the CPU decides)."""
    monkeypatch.delenv(NATIVE_BF16_SWITCH, raising=False)

    def make(flags, rates):
        monkeypatch.setattr(cpu_module, "_cpu_flags", lambda: flags)
        monkeypatch.setattr(cpu_module, "measured_matmul_flops", lambda threads: rates)
        monkeypatch.setattr(cpu_module.platform, "machine", lambda: "x86_64")
        return CPUAccelerator()
    return make


def select(cpu, **training):
    return select_precision(PrecisionSettings.of(TrainingArguments(**training)), AcceleratorConfig(), cpu)


def test_the_probe_measures_both_dtypes_on_this_machine_once_per_process():
    threads = torch.get_num_threads()
    rates = measured_matmul_flops(threads)
    assert set(rates) == {torch.float32, torch.bfloat16}
    assert all(rate > 0 for rate in rates.values())
    assert measured_matmul_flops(threads) is rates  # cached: the probe ran once
    assert CPUAccelerator().measured_peak_flops(torch.bfloat16) == rates[torch.bfloat16]


def test_the_probe_leaves_the_global_random_generator_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    measured_matmul_flops.__wrapped__(torch.get_num_threads(), sizes=(64,), rounds=1)
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)


def test_a_cpu_without_bf16_flags_and_a_slow_probe_is_not_native(cpu_like):
    cpu = cpu_like(AVX2_ONLY, EMULATED)
    assert cpu.native_bf16() is False
    assert cpu.bf16_shortfall() == "bf16 on this CPU runs 87x slower than fp32 (no AVX512-BF16/AMX)"


def test_auto_picks_fp32_where_bf16_is_not_native(cpu_like):
    plugin = select(cpu_like(AVX2_ONLY, EMULATED), precision="auto")
    assert type(plugin) is Precision and plugin.notice is None


def test_bf16_asked_for_where_it_is_not_native_stays_bf16_with_one_line(cpu_like):
    cpu = cpu_like(AVX2_ONLY, EMULATED)
    for training in ({"bf16": True}, {"precision": "bf16-mixed"}, {"precision": "auto", "bf16": True}):
        plugin = select(cpu, **training)
        assert isinstance(plugin, BF16Autocast), training  # what the user asked for
        assert plugin.notice == SLOW_LINE and "\n" not in plugin.notice
    plugin = select_precision(PrecisionSettings.of(TrainingArguments()), AcceleratorConfig(use_torch_autocast=True), cpu)
    assert plugin.notice == SLOW_LINE  # a GaudiConfig's autocast asks for bf16 too


def test_auto_picks_bf16_where_it_is_native(cpu_like):
    cpu = cpu_like(AVX512_BF16, NATIVE)
    assert cpu.native_bf16() is True and cpu.bf16_shortfall() is None
    assert isinstance(select(cpu, precision="auto"), BF16Autocast)
    assert select(cpu, bf16=True).notice is None
    assert type(select(cpu)) is Precision  # no precision given: fp32, as before


def test_the_probe_overrules_flags_when_bf16_measures_slow(cpu_like):
    cpu = cpu_like(AVX512_BF16, EMULATED)  # e.g. a torch build whose kernels do not use the flag
    assert cpu.native_bf16() is False
    assert "although the CPU reports avx512_bf16" in cpu.bf16_shortfall()


@pytest.mark.parametrize("rates, native", [(NATIVE, True), (EMULATED, False)])
def test_without_readable_flags_the_probe_decides(cpu_like, rates, native):
    assert cpu_like(None, rates).native_bf16() is native


def test_arm_flags(cpu_like, monkeypatch):
    arm = cpu_like(frozenset({"fp", "asimd", "sve", "i8mm"}), EMULATED)
    monkeypatch.setattr(cpu_module.platform, "machine", lambda: "aarch64")
    assert "no BF16 extension" in arm.bf16_shortfall()
    assert cpu_like(frozenset({"asimd", "sve", "bf16", "svebf16"}), NATIVE).native_bf16()


def test_env_shows_native_bf16_the_flags_and_the_rates(cpu_like, capsys, monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")
    cpu_like(AVX2_ONLY, EMULATED)
    assert main(["env", "--cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["native_bf16"] is False and report["cpu_flags"] == ["avx2"]
    assert report["matmul_gflops"] == {"float32": 100.0, "bfloat16": 1.1}
    assert report["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert main(["env", "--cpu"]) == 0
    text = capsys.readouterr().out
    assert "native_bf16      no" in text and "float32=100.0, bfloat16=1.1" in text


def test_cpu_mfu_is_against_the_measured_peak(cpu_like):
    cpu = cpu_like(AVX2_ONLY, EMULATED)
    published, measured = job_peak_flops(cpu, torch.float32, world_size=2)
    assert published is None and measured == 2 * 100e9  # no published CPU peak: `mfu` stays null
    clock = ThroughputClock(warmup_steps=0)
    clock.step_done(samples=4, tokens=4000)
    summary = clock.summary(flops_per_token=1e6, peak_flops=published, measured_peak_flops=measured)
    assert summary["mfu"] is None
    rate = summary["throughput_tokens_per_second"]
    assert summary["mfu_vs_measured_peak"] == pytest.approx(1e6 * rate / 200e9)


def test_precision_auto_in_arguments_and_the_recipe():
    args = TrainingArguments(precision="AUTO")
    assert args.precision == "auto" and args.bf16 is False  # decided by the device at start
    assert TrainingArguments(precision="auto", bf16=True).bf16 is True
    from hputrain.recipes import resolve_settings

    assert resolve_settings({})[1].precision == "auto"


def test_trainer_says_so_once_at_start_and_reports_mfu_vs_the_measured_peak(cpu_like, tmp_path, capsys):
    from hputrain import Trainer

    from ..training.test_trainer import Regression, regression_data

    cpu_like(AVX2_ONLY, EMULATED)
    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, max_steps=4, logging_steps=2,
                             save_steps=-1, disable_tqdm=True, throughput_warmup_steps=1)
    trainer = Trainer(Regression(), args, train_dataset=regression_data())
    assert capsys.readouterr().err == f"hputrain: {SLOW_LINE}\n"
    assert isinstance(trainer.precision, BF16Autocast)
    summary = trainer.train().metrics
    assert summary["mfu"] is None
    expected = flops_per_token(trainer.model) * summary["throughput_tokens_per_second"] / EMULATED[torch.bfloat16]
    assert summary["mfu_vs_measured_peak"] == pytest.approx(expected)
    auto = Trainer(Regression(), TrainingArguments(output_dir=str(tmp_path), precision="auto"))
    assert type(auto.precision) is Precision and capsys.readouterr().err == ""


# -- the test switch: precision="auto" either way on any CPU (HPUTRAIN_CPU_NATIVE_BF16) -------------

SWITCHED_LINE = ("bf16 on this CPU is taken as emulated (HPUTRAIN_CPU_NATIVE_BF16=0, a test switch): "
                 "use precision='auto' or fp32 (training continues in bf16, as asked)")


def test_the_switch_decides_native_bf16_whatever_the_cpu_says(cpu_like, monkeypatch):
    from hputrain.accelerators.registry import target_runs_bf16

    cpu = cpu_like(AVX2_ONLY, EMULATED)
    monkeypatch.setenv(NATIVE_BF16_SWITCH, "1")
    assert cpu.native_bf16() is True and cpu.bf16_shortfall() is None
    assert isinstance(select(cpu, precision="auto"), BF16Autocast)
    assert select(cpu, bf16=True).notice is None
    assert type(select(cpu)) is Precision  # no precision given: fp32 still
    assert target_runs_bf16("cpu")  # `hputrain plan` plans what the run would pick
    cpu = cpu_like(AVX512_BF16, NATIVE)
    monkeypatch.setenv(NATIVE_BF16_SWITCH, "0")
    assert cpu.native_bf16() is False and not target_runs_bf16("cpu")
    assert type(select(cpu, precision="auto")) is Precision
    assert select(cpu, bf16=True).notice == SWITCHED_LINE  # as on a CPU without native bf16
    for unset in ("", " "):
        monkeypatch.setenv(NATIVE_BF16_SWITCH, unset)
        assert cpu.native_bf16() is True  # the CPU decides


def test_env_says_what_decided_native_bf16(cpu_like, capsys, monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")
    cpu_like(AVX512_BF16, NATIVE)
    assert main(["env", "--cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["native_bf16"] is True and report["bf16_decided_by"] == "CPU flags and measured rates"
    assert NATIVE_BF16_SWITCH not in report["env"]
    monkeypatch.setenv(NATIVE_BF16_SWITCH, "0")
    assert main(["env", "--cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["native_bf16"] is False
    assert report["bf16_decided_by"] == "HPUTRAIN_CPU_NATIVE_BF16=0 (a test switch)"
    assert report["env"][NATIVE_BF16_SWITCH] == "0"
    assert report["matmul_gflops"] == {"float32": 120.0, "bfloat16": 380.0}  # measured all the same
    assert main(["env", "--cpu"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^native_bf16 +no$", text, re.M), text
    assert re.search(r"^bf16_decided_by +HPUTRAIN_CPU_NATIVE_BF16=0 \(a test switch\)$", text, re.M), text
    cpu_like(None, EMULATED)
    monkeypatch.delenv(NATIVE_BF16_SWITCH)
    assert main(["env", "--cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bf16_decided_by"] == "measured rates"


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_a_switch_that_is_neither_1_nor_0_is_one_line_exit_2(cli_here, monkeypatch, value):
    monkeypatch.setenv(NATIVE_BF16_SWITCH, value)
    status, out, err = cli_here("env", "--cpu")
    assert status == 2 and out == "", out
    assert err == (f"hputrain: error: HPUTRAIN_CPU_NATIVE_BF16={value!r}: must be 1 (bf16 taken as "
                   "native), 0 (taken as emulated), or unset (the CPU decides)\n")


@pytest.mark.parametrize("switch, dtype", [("1", "bfloat16"), ("0", "float32")])
def test_the_built_in_recipe_runs_and_names_what_the_switch_made_auto_pick(cli_here, monkeypatch, tmp_path,
                                                                           switch, dtype):
    """`hputrain train` (precision="auto", the recipe's default) on either kind of CPU: the header
    names the dtype, and bf16 taken as emulated adds no line (auto never picks slow bf16)."""
    monkeypatch.setenv(NATIVE_BF16_SWITCH, switch)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.py").write_bytes(Path(os.__file__).read_bytes()[:20_000])
    status, out, err = cli_here("train", "--corpus", tmp_path / "corpus", "--output-dir", tmp_path / "out",
                                "--max-steps", "1", "--seq-len", "32", "--per-device-train-batch-size", "2",
                                "--disable-tqdm", "--save-steps", "-1", "--eval-steps", "0")
    assert status == 0, err
    header = next(line for line in out.splitlines() if " GPT (" in line)
    assert f") in {dtype}, " in header, header
    assert err == "", err


@pytest.mark.bf16_auto
def test_the_pytest_option_sets_the_switch_for_this_process_and_its_subprocesses(request):
    """`pytest --cpu-bf16=native|emulated|opposite` (make test-bf16-both, test-bf16-auto) sets the
    switch before any test module is read, so that the environments the tests hand to their
    subprocesses (copies of os.environ, made at import) carry it too."""
    import subprocess
    import sys

    from ..conftest import CPU_BF16, SWITCH
    from ..distributed.test_distributed import ENV, ROOT

    assert SWITCH == NATIVE_BF16_SWITCH

    choice, value = request.config.getoption("--cpu-bf16"), os.environ.get(NATIVE_BF16_SWITCH)
    if choice in CPU_BF16:
        assert value == CPU_BF16[choice]
    if choice == "opposite":
        own = cpu_module.BF16Support(cpu_module._cpu_flags(), measured_matmul_flops(torch.get_num_threads()))
        assert value == ("0" if own.native else "1")
    if not value:
        return  # the CPU decides: nothing was set
    assert CPUAccelerator().native_bf16() is (value == "1") and ENV.get(NATIVE_BF16_SWITCH) == value
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "env", "--cpu", "--json"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["bf16_decided_by"] == f"{NATIVE_BF16_SWITCH}={value} (a test switch)"


def test_every_file_with_a_bf16_auto_test_is_in_what_ci_runs_both_ways():
    """make test-bf16-both runs the bf16_auto tests of the files the Makefile lists (collecting the
    whole suite twice would cost CI a minute): a test marked elsewhere would run one way only."""
    root = Path(__file__).parents[2]
    listed = re.search(r"^BF16_AUTO_TESTS := (.*)$", (root / "Makefile").read_text(), re.M).group(1).split()
    marked = sorted(str(path.relative_to(root)) for path in (root / "tests").rglob("test_*.py")
                    if "mark.bf16_auto" in path.read_text() and path.name != "conftest.py")
    assert marked and set(marked) <= set(listed), (marked, listed)
    assert "test-bf16-both" in (root / ".ci" / "run").read_text()
