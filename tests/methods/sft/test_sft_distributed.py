"""Packed SFT over two processes (issue 24): `hputrain train --devices 2` on conversations trains
as one process does with the same global batch of blocks, the loss being the token mean over the
global batch's counted (assistant) tokens whatever the split."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ...methods.sft.test_sft_recipe import chat_model, chat_rows, write_jsonl  # noqa: F401

pytest.importorskip("transformers")


def launch(tmp_path: Path, name: str, *args: str) -> tuple[list[dict], str]:
    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "train", "--cpu", *args,
                           "--output-dir", str(out), "--logging-steps", "1", "--disable-tqdm",
                           "--validation-split-percentage", "0", "--precision", "fp32",
                           "--save-steps", "-1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]
    return logs, proc.stdout


@pytest.mark.slow
def test_two_processes_train_packed_conversations_as_one(
        tmp_path, chat_model, chat_rows):  # noqa: F811
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows * 2)
    common = ["--model", str(chat_model), "--dataset", str(data), "--block-size", "256",
              "--max-steps", "2", "--seed", "3", "--learning-rate", "3e-3"]
    one, header = launch(tmp_path, "one", *common, "--per-device-train-batch-size", "4")
    two, _ = launch(tmp_path, "two", *common, "--per-device-train-batch-size", "2",
                    "--devices", "2")
    assert "packed with attention kept inside each example" in header
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=1e-5, rel=1e-5), (a["step"], key)
