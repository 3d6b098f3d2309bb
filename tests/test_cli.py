"""The command line as a user meets it: output, exit codes, one-line errors; import hygiene."""
import json
import os
import subprocess
import sys

import pytest
import torch

from hputrain.cli import main


def run_cli(*argv, env=None):
    """Run `hputrain ...` in a fresh interpreter (as a user would), return (rc, stdout, stderr)."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("HPUTRAIN_ACCELERATOR", None) if not (env or {}).get("HPUTRAIN_ACCELERATOR") else None
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", *argv], capture_output=True,
                          text=True, env=full_env, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def test_env_json():
    rc, out, err = run_cli("env", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert {"accelerator", "device_count", "available", "torch", "hputrain", "env"} <= set(report)
    assert report["torch"] == torch.__version__
    assert report["available"]["cpu"] == 1
    assert report["accelerator"] == ("cuda" if torch.cuda.is_available() else "cpu")


def test_env_reports_forcing_variable():
    rc, out, _ = run_cli("env", "--json", env={"HPUTRAIN_ACCELERATOR": "cpu"})
    report = json.loads(out)
    assert rc == 0 and report["accelerator"] == "cpu" and report["env"]["HPUTRAIN_ACCELERATOR"] == "cpu"


def test_env_cpu_flag(capsys):
    assert main(["env", "--cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accelerator"] == "cpu"
    os.environ.pop("HPUTRAIN_ACCELERATOR", None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_absent_accelerator_is_one_line_and_exit_2():
    rc, out, err = run_cli("env", "--accelerator", "cuda")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "'cuda'" in err and "found: cpu" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, words", [
    (["env", "--jsn"], ["unrecognized arguments: --jsn", "did you mean --json"]),
    (["bogus"], ["invalid choice"]),
    ([], ["required"]),
])
def test_usage_errors_are_one_line(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hputrain: error:")
    assert all(w in err for w in words)


def test_import_runs_nothing():
    """`import hputrain` imports no vendor runtime, starts no subprocess and patches nothing."""
    code = r"""
import sys
events = []
sys.addaudithook(lambda event, args: events.append(event)
                 if event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.fork") else None)
import torch
gather, mark = torch.gather, set(sys.modules)
import hputrain
assert not events, events
assert torch.gather is gather
vendor = [m for m in sys.modules if m.startswith(("habana_frameworks", "transformers", "lightning", "accelerate"))]
assert not vendor, vendor
print("clean", len(set(sys.modules) - mark))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("clean")
