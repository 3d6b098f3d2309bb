"""A disk that fills up mid-save, on every save path (issue 46 item 7): checkpoint files through
torch.save's zip writer and safetensors, a sharded (DCP) checkpoint, final/ through
save_pretrained, the tokenizer and the streamed writer. Each is one line naming the file, exit 2,
and what was saved before stays whole. The full disk is a file size limit (RLIMIT_FSIZE, in a
process of its own: full_disk_script.py), under which a write fails as on a full disk (EFBIG
there, ENOSPC here) through the libraries' own error paths: torch.save's
"[enforce fail at inline_container.cc:672] . unexpected pos" RuntimeError among them."""
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hputrain.checkpoint.checks import write_failure

from ..hf_fixtures import llama_folder  # noqa: F401

HERE = Path(__file__).parents[1]


def run_cases(out: Path, *argv) -> dict:
    proc = subprocess.run([sys.executable, str(HERE / "full_disk_script.py"), str(out), *map(str, argv)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def assert_one_line(case: dict, error: str, saving: str, file: str) -> None:
    assert case["error"] == error, case
    assert "\n" not in case["message"] and case["message"].startswith(f"Cannot save {saving}"), case
    assert case["message"].endswith(f"File too large ({file}).") or \
        case["message"].endswith(f"File too large ({file})"), case
    assert case["earlier_whole"], case


def test_a_full_disk_mid_save_is_one_line_naming_the_file_on_every_torch_path(tmp_path):
    """Checkpoints (each file in turn: rng_state_0.pt and optimizer.pt through torch.save, which
    raised the RuntimeError whole; model.safetensors), a sharded checkpoint's shard, final/ of the
    built-in GPT, and the streamed writer's file: the error names the file; checkpoint-1 and the
    earlier final/ stay whole and load; no temporary folder is left."""
    cases = run_cases(tmp_path / "out", "torch")
    full = tmp_path / "out" / "full"
    for name in ("rng_state_0.pt", "model.safetensors", "optimizer.pt"):
        case = cases[f"checkpoint {name}"]
        assert_one_line(case, "CheckpointError", f"checkpoint {full / 'checkpoint-2'}",
                        full / ".tmp-checkpoint-2" / name)
        assert case["left"] == ["checkpoint-1"], case
    assert cases["earlier loads"] is True
    sharded = tmp_path / "out" / "sharded"
    assert_one_line(cases["checkpoint sharded"], "CheckpointError",
                    f"checkpoint {sharded / 'checkpoint-2'}",
                    sharded / ".tmp-checkpoint-2" / "sharded" / "__0_0.distcp")
    gpt = tmp_path / "out" / "gpt"
    assert_one_line(cases["final gpt"], "InputError", f"the model to {gpt / 'final'}",
                    gpt / ".tmp-final" / "model.safetensors")
    assert cases["final gpt"]["left"] == ["final"]
    streamed = cases["streamed"]
    assert streamed["error"] == "OSError" and streamed["earlier_whole"], streamed
    assert str(tmp_path / "out" / "streamed" / "model.safetensors") in streamed["message"], streamed


@pytest.mark.slow
def test_a_full_disk_mid_save_of_a_hugging_face_model_names_the_file(tmp_path, llama_folder):  # noqa: F811
    """final/ of a transformers Llama and its tokenizer: save_pretrained's safetensors file and
    its config.json, and the tokenizer's tokenizer.json (written in Rust) of a LoRA's final/."""
    cases = run_cases(tmp_path / "out", "hf", llama_folder)
    for run, name in (("llama", "model.safetensors"), ("llama", "config.json"), ("lora", "tokenizer.json")):
        out = tmp_path / "out" / run
        assert_one_line(cases[f"final {name}"], "InputError", f"the model to {out / 'final'}",
                        out / ".tmp-final" / name)
        assert cases[f"final {name}"]["left"] == ["final"]


@pytest.mark.slow
def test_a_full_disk_under_fsdp_on_two_processes_is_one_line_for_the_job(tmp_path):
    """`hputrain train --devices 2 --strategy fsdp` whose sharded checkpoint, and then whose
    streamed final/, meets a full disk: one line for the job (rank 0's), exit 2; the earlier
    checkpoint stays whole and resumable."""
    import resource
    import signal

    out = tmp_path / "run"
    run = [sys.executable, "-m", "hputrain.cli", "train", "--cpu", "--output-dir", str(out),
           "--seq-len", "64", "--max-corpus-bytes", "200000", "--per-device-train-batch-size", "2",
           "--eval-batches", "1", "--save-steps", "2", "--disable-tqdm", "--report-to", "none",
           "--precision", "fp32", "--devices", "2", "--strategy", "fsdp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run([*run, "--max-steps", "2"], capture_output=True, text=True, env=env,
                           timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = {p: p.read_bytes() for p in [*(out / "checkpoint-2").rglob("*"), *(out / "final").rglob("*")]
             if p.is_file()}
    shard = max(p.stat().st_size for p in (out / "checkpoint-2" / "sharded").glob("*.distcp"))
    weights = (out / "final" / "model.safetensors").stat().st_size

    for extra, limit, named in (
            (["--max-steps", "4", "--resume-from-checkpoint", "latest"], shard - 1, "_0.distcp"),
            (["--max-steps", "6", "--save-steps", "-1", "--resume-from-checkpoint", "latest"],
             weights - 1, ".tmp-final/model.safetensors")):
        def full_disk(limit=limit):  # the launcher and its workers inherit both
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

        proc = subprocess.run([*run, *extra], capture_output=True, text=True, env=env, timeout=600,
                              preexec_fn=full_disk)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
        assert lines[0].startswith("hputrain launch: rank 0 failed (exit code 2)") and named in lines[0]
        assert "File too large" in lines[0] or "stopped short" in lines[0], lines
    assert all(p.read_bytes() == data for p, data in saved.items())  # checkpoint-2, final/ whole
    assert not (out / "checkpoint-4").exists() and not (out / ".tmp-final").exists()
    resumed = subprocess.run([*run, "--max-steps", "4", "--resume-from-checkpoint", "latest"],
                             capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0 and (out / "checkpoint-4").is_dir(), resumed.stderr[-3000:]


def test_a_failed_write_is_the_systems_error_whichever_library_wrote():
    """write_failure: torch.save's RuntimeError around the write's OSError, and without one;
    safetensors' and tokenizers' words with the system's number; an OSError as it is; anything
    else is no failed write."""
    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as exc:
        torch_save = exc
    error = write_failure(torch_save)
    assert (error.errno, error.strerror) == (errno.ENOSPC, "No space left on device")
    alone = write_failure(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos"))
    assert alone.errno == errno.EIO and "full disk" in alone.strerror
    rust = write_failure(Exception("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert (rust.errno, rust.strerror) == (errno.ENOSPC, "No space left on device")
    kept = OSError(errno.EIO, "Error while serializing: I/O error: File too large (os error 27)", "/x/m")
    assert (write_failure(kept).strerror, write_failure(kept).filename) == ("File too large", "/x/m")
    plain = OSError(errno.EROFS, "Read-only file system")
    assert write_failure(plain) is plain
    assert write_failure(RuntimeError("CUDA out of memory")) is None
    assert write_failure(ValueError("bad")) is None
    # safetensors' own error while writing, with no system words: the write failed, EIO
    from safetensors import SafetensorError

    words = write_failure(SafetensorError("Error while serializing:\n  header too large"))
    assert (words.errno, words.strerror) == (errno.EIO, "Error while serializing: header too large")


def test_a_failed_write_names_the_file_it_was_writing(tmp_path):
    """checks.named_write: the file given, or the one a function of the error picks, where the
    error names none; a file the error names is kept; any other error passes as it is."""
    from hputrain.checkpoint.checks import named_write

    with pytest.raises(OSError) as err:
        with named_write(tmp_path / "optimizer.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")
    assert err.value.filename == str(tmp_path / "optimizer.pt") and err.value.errno == errno.EIO
    with pytest.raises(OSError) as err:
        with named_write(lambda exc: tmp_path / type(exc).__name__):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert err.value.filename == str(tmp_path / "OSError")
    with pytest.raises(OSError) as err:
        with named_write(tmp_path / "not this one"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/x/its own")
    assert err.value.filename == "/x/its own"
    with pytest.raises(ValueError):
        with named_write(tmp_path / "x"):
            raise ValueError("no write failed")
