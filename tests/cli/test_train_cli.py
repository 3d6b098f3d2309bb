"""`hputrain train` end to end on a small corpus, resume, signals and bad input."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SMALL = ["--max-steps", "6", "--seq-len", "32", "--logging-steps", "2", "--eval-steps", "3",
         "--per-device-train-batch-size", "4", "--disable-tqdm", "--max-corpus-bytes", "60000",
         "--throughput-warmup-steps", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    source = Path(os.__file__).read_bytes()[:80_000]
    (folder / "a.py").write_bytes(source)
    (folder / "blob.bin").write_bytes(bytes(range(256)) * 10)
    return folder


def hputrain(*argv, cwd=None, timeout=300):
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env={**os.environ, "HPUTRAIN_ACCELERATOR": "cpu"})
    return proc.returncode, proc.stdout, proc.stderr


def test_train_resume_and_report(tmp_path, corpus):
    out = tmp_path / "run"
    rc, stdout, stderr = hputrain("train", "--corpus", str(corpus), "--output-dir", str(out), *SMALL)
    assert rc == 0, stderr
    assert (out / "checkpoint-6" / "model.safetensors").exists()
    assert all((out / name).stat().st_size > 1000 for name in ("loss.png", "throughput.png", "memory.png"))
    assert f"checkpoint: {out / 'checkpoint-6'}" in stdout
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["model"]["block_size"] == 32
    rc, _, stderr = hputrain("train", "--corpus", str(corpus), "--output-dir", str(out), *SMALL,
                             "--max-steps", "8", "--resume-from-checkpoint", "latest")
    assert rc == 0, stderr
    steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(l)]
    assert steps == [2, 4, 6, 8]


def test_corrupt_checkpoint_is_one_line_and_keeps_files(tmp_path, corpus, cli_here):
    out = tmp_path / "run"
    assert cli_here("train", "--corpus", corpus, "--output-dir", out, *SMALL, "--max-steps", "2")[0] == 0
    model = out / "checkpoint-2" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:100])
    rc, _, stderr = cli_here("train", "--corpus", corpus, "--output-dir", out, *SMALL,
                             "--resume-from-checkpoint", "latest")
    assert rc == 2 and stderr.count("\n") == 1 and "model.safetensors" in stderr
    assert "Traceback" not in stderr and model.exists() and (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("argv, words", [
    (["--max-stepz", "3"], ["--max-stepz", "did you mean --max-steps"]),
    (["--learning-rate", "fast"], ["expected float"]),
    (["--lr-scheduler-type", "cosin"], ["did you mean 'cosine'"]),
    (["--model-size", "huge"], ["tiny, small, base"]),
    (["--corpus", "/no/such/folder"], ["/no/such/folder"]),
    (["--resume-from-checkpoint", "checkpoint-9"], ["checkpoint-9 does not exist"]),  # "latest": test_run_start.py
])
def test_bad_input_is_one_line_exit_2(tmp_path, corpus, argv, words, cli_here):
    rc, _, stderr = cli_here("train", "--output-dir", tmp_path / "o", "--corpus", corpus, *SMALL, *argv)
    assert rc == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert all(w in stderr for w in words), stderr


def test_config_files(tmp_path, corpus, cli_here):
    (tmp_path / "bad.json").write_text('{"max_steps": 3,}')
    rc, _, stderr = cli_here("train", "--config", tmp_path / "bad.json")
    assert rc == 2 and "not valid JSON" in stderr
    (tmp_path / "run.toml").write_text(f'max_steps = 2\nseq_len = 32\ncorpus = "{corpus}"\n'
                                       f'output_dir = "{tmp_path / "toml"}"\nlogging_steps = 1\n')
    legacy = {"use_habana_mixed_precision": True, "use_fused_adam": True, "hmp_bf16_ops": ["linear"],
              "hmp_fp32_ops": ["softmax"]}
    (tmp_path / "gaudi_config.json").write_text(json.dumps(legacy))
    rc, _, stderr = hputrain("train", "--config", str(tmp_path / "run.toml"), "--disable-tqdm",
                             "--accelerator-config", str(tmp_path / "gaudi_config.json"), "--max-corpus-bytes", "60000")
    assert rc == 0, stderr
    records = [json.loads(l) for l in (tmp_path / "toml" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]


def test_sigterm_saves_a_checkpoint_and_exits(tmp_path, corpus):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hputrain.cli", "train", "--corpus", str(corpus),
                             "--output-dir", str(out), *SMALL, "--max-steps", "100000", "--save-steps", "0",
                             "--logging-steps", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HPUTRAIN_ACCELERATOR": "cpu"})
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr and "resume with --resume-from-checkpoint latest" in stdout
    saved = [p for p in out.iterdir() if p.name.startswith("checkpoint-")]
    assert len(saved) == 1 and 0 < int(saved[0].name.split("-")[1]) < 100000
    state = json.loads((saved[0] / "trainer_state.json").read_text())
    assert state["global_step"] == int(saved[0].name.split("-")[1])


@pytest.mark.slow  # 10-23 s; `make test-slow` runs it (keeps `make test` near 20 minutes)
def test_train_in_fp8_and_generate_from_its_checkpoint(tmp_path, corpus):
    out = tmp_path / "fp8"
    rc, stdout, stderr = hputrain("train", "--corpus", str(corpus), "--output-dir", str(out), *SMALL,
                                  "--fp8", "--minimize-memory")
    assert rc == 0, stderr
    assert (out / "checkpoint-6" / "model_extra_state.pt").exists()  # the fp8 scaling state
    rc, stdout, stderr = hputrain("generate", "--checkpoint", str(out / "checkpoint-6"), "--prompt", "def ",
                                  "--max-new-tokens", "4", "--no-graphs")
    assert rc == 0, stderr
    rc, _, stderr = hputrain("train", "--output-dir", str(out), "--fp8", "--fp8-scaling", "dynamc")
    assert rc == 2 and stderr.count("\n") == 1 and "did you mean 'dynamic'" in stderr, stderr


def _help_groups(text: str) -> dict[str, list[str]]:
    """`--help`'s flags by the title of the group that lists them."""
    groups, title = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            groups[title] = []
        elif title and line.startswith("  --"):
            groups[title].append(line.split()[0].rstrip(","))
    return groups


def test_train_help_is_grouped_by_section(cli_here, capsys):
    """666 lines in one flat list were unreadable: the flags come in the configuration's
    sections, each once, without the underscore spellings (which still parse: test_config.py),
    and every help text renders as written (a `%` once printed argparse's own dictionary)."""
    from hputrain.config.arguments import TrainingArguments
    from hputrain.recipes import HFOptions, RecipeOptions

    with pytest.raises(SystemExit) as exit:
        cli_here("train", "--help")
    out = capsys.readouterr().out
    assert exit.value.code == 0 and out.splitlines()[0] == (
        "usage: hputrain train [--config FILE] [--model DIR --dataset PATH] [FLAGS]")
    groups = _help_groups(out)
    where = {flag: title for title, flags in groups.items() for flag in flags}
    listed = [flag for flags in groups.values() for flag in flags]
    fields = {f for cls in (TrainingArguments, HFOptions, RecipeOptions)
              for f in cls.__dataclass_fields__}
    assert sorted(listed) == sorted({f"--{name.replace('_', '-')}" for name in fields} | {
        "--config", "--accelerator-config", "--cpu"})  # each once
    for flag, title in {"--learning-rate": "optimizer", "--save-steps": "when to log",
                        "--strategy": "devices and parallelism", "--bf16": "precision",
                        "--execution-mode": "execution", "--max-steps": "the run",
                        "--resume-from-checkpoint": "the run", "--model": "the Hugging Face recipe",
                        "--num-generations": "GRPO", "--precompute-ref-log-probs": "DPO",
                        "--use-habana": "training: Hugging Face's and Optimum's spellings"}.items():
        assert where[flag].startswith(title), (flag, where[flag])
    assert max(len(flags) for flags in groups.values()) < 40
    assert "option_strings" not in out and "(shard i on rank i % ranks)" in out
    assert "--max_steps" not in out
