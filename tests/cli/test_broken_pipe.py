"""`hputrain ... | head -1`: once the reader of stdout has gone, the command runs on to its end
quietly (a training run trains and saves as usual) instead of dying of a BrokenPipeError."""
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hputrain import cli

ROOT = Path(__file__).parents[2]


def test_a_closed_stdout_is_no_traceback(monkeypatch, capsys):
    read, write = os.pipe()
    os.close(read)  # the reader (head -1) has gone
    stdout = io.TextIOWrapper(os.fdopen(write, "wb"), line_buffering=True)
    monkeypatch.setattr(sys, "stdout", stdout)
    assert cli.main(["env", "--cpu"]) == 0
    assert sys.stdout is stdout  # put back as it was
    stdout.close()  # what was left over went to /dev/null: no BrokenPipeError here either


@pytest.mark.slow
def test_train_into_head_keeps_training_quietly(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_bytes(Path(os.__file__).read_bytes()[:20_000])
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "HPUTRAIN_CONFIG_FILE": "/nonexistent/hputrain.json"}
    proc = subprocess.Popen([sys.executable, "-m", "hputrain.cli", "train", "--corpus", str(corpus),
                             "--output-dir", str(out), "--max-steps", "3", "--seq-len", "32",
                             "--per-device-train-batch-size", "2", "--disable-tqdm", "--cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env)
    assert proc.stdout.readline().startswith(b"hputrain:")
    proc.stdout.close()  # as `head -1` does after its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err[-3000:]
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-3000:]
    assert (out / "checkpoint-3" / "trainer_state.json").exists()
