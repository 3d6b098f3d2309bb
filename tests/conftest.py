"""Shared fixtures: the fake Gaudi runtime, device markers, and the switch that decides which way
precision="auto" goes on the CPU (--cpu-bf16)."""
import os
import sys
from pathlib import Path

import pytest
import torch

FAKES = str(Path(__file__).parent / "fakes")
_HPU_ENV = ("PT_HPU_LAZY_MODE", "PT_ENABLE_INT64_SUPPORT", "PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST",
            "PT_HPU_AUTOCAST_FP32_OPS_LIST", "PT_HPU_FP8_MINIMIZE_MEMORY", "HPUTRAIN_ACCELERATOR")

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

# precision="auto" picks bf16 on a CPU with native bf16 and fp32 elsewhere, so a test that assumes
# either passes on one kind of CPU and fails on the other. The switch (accelerators/cpu.py) makes
# this CPU answer either way; set here, before any test module is imported, it reaches the tests'
# own processes and every subprocess (their environments copy os.environ).
CPU_BF16 = {"native": "1", "emulated": "0"}
SWITCH = "HPUTRAIN_CPU_NATIVE_BF16"  # accelerators/cpu.NATIVE_BF16_SWITCH, named without importing it


def pytest_addoption(parser):
    parser.addoption("--cpu-bf16", choices=[*CPU_BF16, "opposite"], default=None,
                     help="take bf16 on this CPU as native (precision='auto' picks bf16) or emulated "
                          "(fp32), or the opposite of what this CPU says, by setting "
                          "HPUTRAIN_CPU_NATIVE_BF16 for the run (default: the CPU decides)")


def pytest_configure(config):
    config.addinivalue_line("markers", "bf16_auto: reads back what precision='auto' picked; "
                                       "make test-bf16-both runs these with bf16 taken both ways")
    choice = config.getoption("--cpu-bf16")
    if choice is None:
        return
    if choice == "opposite":
        from hputrain.accelerators.cpu import CPUAccelerator

        os.environ.pop(SWITCH, None)  # this CPU's own answer, then the other one
        choice = "emulated" if CPUAccelerator().native_bf16() else "native"
    os.environ[SWITCH] = CPU_BF16[choice]


def auto_dtype() -> str:
    """The dtype precision="auto" picks on this CPU, as a header names it: what a test that runs
    with "auto" (the built-in recipes' default) asserts, rather than assuming float32."""
    from hputrain.accelerators.cpu import CPUAccelerator

    return "bfloat16" if CPUAccelerator().native_bf16() else "float32"


def pytest_report_header(config):
    value = os.environ.get(SWITCH, "").strip()
    if value:
        return f"{SWITCH}={value}: precision='auto' takes bf16 on the CPU as " \
               f"{'native' if value == '1' else 'emulated'} (a test switch)"
    return None


def _drop_habana_modules() -> None:
    for name in [m for m in sys.modules if m == "habana_frameworks" or m.startswith("habana_frameworks.")]:
        del sys.modules[name]


@pytest.fixture
def fake_hpu():
    """The fake habana_frameworks package on sys.path, not yet imported; yields its recorder.
    The Gaudi variables the code under test sets are put back as they were afterwards."""
    saved = {key: os.environ.pop(key, None) for key in _HPU_ENV}
    _drop_habana_modules()
    sys.path.insert(0, FAKES)
    import habana_frameworks.fake as fake

    fake.calls.clear()
    fake.available = True
    fake.graph_compilations = 0
    try:
        yield fake
    finally:
        sys.path.remove(FAKES)
        _drop_habana_modules()
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No test inherits a forced accelerator, or the defaults `hputrain config` saved, from the
    machine that runs pytest (subprocesses inherit this environment)."""
    monkeypatch.delenv("HPUTRAIN_ACCELERATOR", raising=False)
    monkeypatch.setenv("HPUTRAIN_CONFIG_FILE", os.path.join(os.path.dirname(FAKES), "no-such-defaults.json"))
    yield


@pytest.fixture
def cli_here(capsys, monkeypatch):
    """`hputrain ARGV` run by `hputrain.cli.main` in this process, on the CPU: (status, stdout,
    stderr). A command whose own process adds nothing to what a test checks (bad flags, a damaged
    checkpoint) is seconds faster without the interpreter's start and torch's import."""
    from hputrain.cli import main

    def run(*argv):
        monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")
        capsys.readouterr()
        status = main([str(arg) for arg in argv])
        printed = capsys.readouterr()
        return status, printed.out, printed.err
    return run
