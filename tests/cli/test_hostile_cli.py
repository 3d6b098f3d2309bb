"""`hputrain train` given crafted or damaged checkpoints, a full disk or an output_dir it cannot
write: exit 2 and one line, never a traceback, never code from a pickle, and the checkpoint it
had stays whole."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

SMALL = ["--seq-len", "32", "--logging-steps", "1", "--eval-steps", "0", "--save-steps", "2",
         "--per-device-train-batch-size", "4", "--disable-tqdm", "--max-corpus-bytes", "30000",
         "--throughput-warmup-steps", "0", "--cpu"]

# `hputrain train` with torch.save failing as on a full disk (after the imports, which need none).
DISK_FULL = textwrap.dedent("""
    import errno, os, sys, torch
    from hputrain.cli import main
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    torch.save = no_space
    sys.exit(main(sys.argv[1:]))
""")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "a.py").write_bytes(Path(os.__file__).read_bytes()[:40_000])
    return folder


def train(corpus, out, *argv, script=None):
    start = ["-c", script] if script else ["-m", "hputrain.cli"]
    return subprocess.run([sys.executable, *start, "train", "--corpus", str(corpus), "--output-dir",
                           str(out), *SMALL, *argv], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def base_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "run"
    proc = train(corpus, out, "--max-steps", "2")
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture
def run(base_run, tmp_path):
    return Path(shutil.copytree(base_run, tmp_path / "run"))


def assert_one_line_exit_2(proc, *words):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


class SystemCall:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _pickle(folder, marker):
    torch.save({"state": SystemCall(f"touch {marker}"), "param_groups": []}, folder / "optimizer.pt")


def _exp_avg(folder, marker):
    saved = torch.load(folder / "optimizer.pt", weights_only=True)
    saved["state"][0]["exp_avg"] = torch.zeros(3)
    torch.save(saved, folder / "optimizer.pt")


def _state(**change):
    def damage(folder, marker):
        state = json.loads((folder / "trainer_state.json").read_text())
        state.update(change)
        (folder / "trainer_state.json").write_text(
            json.dumps({k: v for k, v in state.items() if v is not None}))
    return damage


@pytest.mark.parametrize("damage, words", [
    (_pickle, ["optimizer.pt", "unsupported GLOBAL"]),
    (_exp_avg, ["optimizer.pt", "exp_avg", "(3,)"]),
    (_state(global_step="30"), ["trainer_state.json", "global_step must be an integer"]),
    (_state(global_step=25.5), ["trainer_state.json", "global_step must be an integer"]),
    (_state(global_step=-5), ["trainer_state.json", "global_step must be an integer >= 0"]),
    (_state(global_step=10**6, step=10**6), ["trainer_state.json", "checkpoint-2"]),
    (_state(step=None), ["trainer_state.json", "has no step"]),
], ids=["os.system pickle", "exp_avg shape", "step as text", "step fractional", "step negative",
        "step 10^6", "step missing"])
def test_a_crafted_checkpoint_is_one_line_exit_2(corpus, run, tmp_path, damage, words, cli_here):
    marker = tmp_path / "pwned"
    damage(run / "checkpoint-2", marker)
    before = {p.name: p.read_bytes() for p in (run / "checkpoint-2").iterdir()}
    if damage is _pickle:  # the one that would run code: in a process of its own, as a user's
        proc = train(corpus, run, "--max-steps", "4", "--resume-from-checkpoint", "latest")
    else:  # the same command in this process: the interpreter's start is most of its time
        status, out, err = cli_here("train", "--corpus", corpus, "--output-dir", run, *SMALL,
                                    "--max-steps", "4", "--resume-from-checkpoint", "latest")
        proc = subprocess.CompletedProcess([], status, out, err)
    assert_one_line_exit_2(proc, *words)
    assert not marker.exists()
    assert "weights_only` set to `False`" not in proc.stderr and "Re-running" not in proc.stderr
    assert {p.name: p.read_bytes() for p in (run / "checkpoint-2").iterdir()} == before


def test_a_disk_that_fills_up_mid_save_is_one_line_and_keeps_the_checkpoint(corpus, run):
    before = {p.name: p.read_bytes() for p in (run / "checkpoint-2").iterdir()}
    proc = train(corpus, run, "--max-steps", "4", "--resume-from-checkpoint", "latest",
                 script=DISK_FULL)
    assert_one_line_exit_2(proc, "No space left on device", str(run / "checkpoint-4"))
    assert sorted(p.name for p in run.glob("*checkpoint*")) == ["checkpoint-2"]  # no temp folder
    assert {p.name: p.read_bytes() for p in (run / "checkpoint-2").iterdir()} == before


@pytest.mark.parametrize("where", ["under a file", "/proc"])
def test_an_output_dir_that_cannot_be_written_is_one_line_exit_2(corpus, tmp_path, where):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "run" if where == "under a file" else Path("/proc/hputrain-test-run")
    proc = train(corpus, out, "--max-steps", "2")
    assert_one_line_exit_2(proc, str(out if where == "/proc" else tmp_path / "file"))
