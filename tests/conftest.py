"""Shared fixtures: the fake Gaudi runtime, device markers."""
import os
import sys
from pathlib import Path

import pytest
import torch

FAKES = str(Path(__file__).parent / "fakes")
_HPU_ENV = ("PT_HPU_LAZY_MODE", "PT_ENABLE_INT64_SUPPORT", "PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST",
            "PT_HPU_AUTOCAST_FP32_OPS_LIST", "PT_HPU_FP8_MINIMIZE_MEMORY", "HPUTRAIN_ACCELERATOR")

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


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
