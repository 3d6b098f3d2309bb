"""The output_dir: one run at a time (an advisory lock), leftovers of killed saves cleared at the
next start, and folders or disks that cannot be written told in one line, the earlier checkpoint
kept whole."""
import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

import hputrain.checkpoint.folder as ckpt
import hputrain.checkpoint.full as full_state
from hputrain.checkpoint.folder import CheckpointError, clear_leftovers, lock_output_dir
from hputrain.checkpoint.saving import latest_checkpoint, load_checkpoint
from hputrain.errors import InputError

from ..checkpoint.test_checkpoint import assert_same_weights, save, tiny_run

HOLDER = textwrap.dedent("""
    import sys, time
    from hputrain.checkpoint.folder import lock_output_dir
    lock = lock_output_dir(sys.argv[1])
    print("LOCKED", flush=True)
    time.sleep(120)
""")


def hold_lock(folder: Path) -> subprocess.Popen:
    """Another process holding `folder`'s lock (it says so before this returns)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "LOCKED", proc.stderr.read()
    return proc


def test_second_holder_is_refused_naming_the_pid(tmp_path):
    out = tmp_path / "run"
    lock = lock_output_dir(out)
    assert (out / ".hputrain.lock").read_text().strip() == str(os.getpid())
    with pytest.raises(InputError, match=rf"{out} is in use by another run \(pid {os.getpid()}\)") as err:
        lock_output_dir(out)
    assert "\n" not in str(err.value)
    lock.release()
    with lock_output_dir(out):  # free again once released
        pass
    lock_output_dir(out).release()


def test_a_lock_held_by_another_process_and_dropped_by_kill_9(tmp_path):
    proc = hold_lock(tmp_path)
    try:
        with pytest.raises(InputError, match=rf"in use by another run \(pid {proc.pid}\)"):
            lock_output_dir(tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    lock_output_dir(tmp_path).release()  # the kernel dropped it with the process


def test_cli_run_on_a_locked_output_dir_exits_2_in_one_line(tmp_path):
    """`hputrain train` on an output_dir another run holds: exit 2, one line naming its pid."""
    proc = hold_lock(tmp_path)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "hputrain.cli", "train", "--output-dir", str(tmp_path),
             "--max-steps", "2", "--seq-len", "32", "--max-corpus-bytes", "20000",
             "--disable-tqdm", "--cpu"], capture_output=True, text=True, timeout=300)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    assert f"pid {proc.pid}" in run.stderr
    assert not list(tmp_path.glob("checkpoint-*"))


def test_leftovers_of_killed_saves_are_cleared_and_a_lone_old_copy_put_back(tmp_path):
    run = tiny_run()
    save(tmp_path, 1, run)
    save(tmp_path, 2, run)
    os.replace(tmp_path / "checkpoint-1", tmp_path / ".deleting-checkpoint-1")  # killed rotation
    os.replace(tmp_path / "checkpoint-2", tmp_path / ".old-checkpoint-2")  # killed mid-finalize
    (tmp_path / ".tmp-checkpoint-2").mkdir()
    (tmp_path / ".tmp-checkpoint-2" / "model.safetensors").write_bytes(b"half")
    save(tmp_path, 3, run)
    (tmp_path / ".old-checkpoint-3").mkdir()  # the new checkpoint-3 is in place: this goes
    (tmp_path / ".tmp-checkpoint-4").mkdir()
    (tmp_path / "notes.txt").write_text("the user's own")

    removed = clear_leftovers(tmp_path)
    assert sorted(p.name for p in removed) == [
        ".deleting-checkpoint-1", ".old-checkpoint-3", ".tmp-checkpoint-2", ".tmp-checkpoint-4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3", "notes.txt"]
    model = tiny_run(seed=4)[0]
    load_checkpoint(tmp_path / "checkpoint-2", model=model)
    assert_same_weights(model, run[0])


def test_leftovers_of_a_killed_export_are_cleared_and_a_lone_old_final_put_back(tmp_path):
    """Export writes final/ by the same protocol (.tmp-final, then .old-final while it replaces
    one): a kill leaves them; the next start clears .tmp-final and puts back an .old-final whose
    final/ is gone, the only copy of the earlier model."""
    (tmp_path / ".tmp-final").mkdir()
    (tmp_path / ".tmp-final" / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".old-final").mkdir()
    (tmp_path / ".old-final" / "config.json").write_text("{}")
    assert clear_leftovers(tmp_path) == [tmp_path / ".tmp-final"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert (tmp_path / "final" / "config.json").read_text() == "{}"
    (tmp_path / ".old-final").mkdir()  # final/ is in place: the old copy goes
    assert clear_leftovers(tmp_path) == [tmp_path / ".old-final"] and (tmp_path / "final").is_dir()


def test_taking_the_lock_clears_leftovers(tmp_path):
    (tmp_path / ".deleting-checkpoint-7").mkdir()
    (tmp_path / ".deleting-checkpoint-7" / "optimizer.pt").write_bytes(b"x")
    with lock_output_dir(tmp_path):
        assert not (tmp_path / ".deleting-checkpoint-7").exists()


def test_dropping_what_was_set_aside_never_leaves_half_a_run_in_it(tmp_path, monkeypatch):
    """drop_set_aside renames .overwritten away before deleting it: a kill midway leaves
    .deleting-overwritten, which the next start clears, never a half-deleted run in .overwritten."""
    run = tmp_path / ckpt.SET_ASIDE_DIR / "run-1"
    save(run, 2)
    deleted = []
    monkeypatch.setattr(ckpt.shutil, "rmtree", lambda path, **kw: deleted.append(Path(path)))  # "killed"
    ckpt.drop_set_aside(tmp_path)
    monkeypatch.undo()
    assert deleted[-1] == tmp_path / ".deleting-overwritten" and not run.parent.exists()
    assert clear_leftovers(tmp_path) == [tmp_path / ".deleting-overwritten"]
    assert list(tmp_path.iterdir()) == []
    ckpt.drop_set_aside(tmp_path)  # nothing set aside: nothing to do


def _regular_file(tmp_path):
    (tmp_path / "file").write_text("x")
    return tmp_path / "file"


@pytest.mark.parametrize("where, reason", [
    (lambda tmp: _regular_file(tmp) / "out", "Not a directory"),
    (lambda tmp: _regular_file(tmp), "is not a folder"),
    (lambda tmp: Path("/proc/hputrain-test-out"), "No such file or directory"),
    (lambda tmp: Path("/proc/self"), "No such file or directory"),
])
def test_unwritable_output_dir_is_one_line(tmp_path, where, reason):
    out = where(tmp_path)
    with pytest.raises(InputError, match=reason) as err:
        lock_output_dir(out)
    assert str(out) in str(err.value) and "\n" not in str(err.value)


def test_read_only_file_system_is_one_line(tmp_path, monkeypatch):
    real_open = os.open

    def read_only(path, flags, *args):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(ckpt.os, "open", read_only)
    with pytest.raises(InputError, match=rf"{tmp_path} cannot be written: Read-only file system"):
        lock_output_dir(tmp_path)


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("writer", ["torch.save", "safetensors", "json"])
def test_disk_full_mid_save_is_one_line_and_keeps_the_earlier_checkpoint(tmp_path, monkeypatch, writer):
    run = tiny_run()
    save(tmp_path, 1, run)
    if writer == "torch.save":
        monkeypatch.setattr(torch, "save", _no_space)
    elif writer == "safetensors":
        def save_file(tensors, path, metadata=None):
            Path(path).write_bytes(b"partial")
            raise SafetensorError("Error while serializing: I/O error: No space left on "
                                       "device (os error 28)")
        monkeypatch.setattr(full_state, "save_file", save_file)
    else:
        monkeypatch.setattr(Path, "write_text", _no_space)
    with pytest.raises(CheckpointError) as err:
        save(tmp_path, 2, run)
    message = str(err.value)
    assert "\n" not in message and "No space left on device" in message, message
    assert "checkpoint-2" in message and str(tmp_path) in message
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]  # no temp folder
    model, optimizer, scheduler = tiny_run(seed=3)
    load_checkpoint(latest_checkpoint(tmp_path), model=model, optimizer=optimizer, scheduler=scheduler)
    assert_same_weights(model, run[0])


def test_output_dir_under_a_file_at_save_time_is_one_line(tmp_path):
    with pytest.raises(CheckpointError, match=r"Cannot save checkpoint .*checkpoint-1: Not a directory"):
        save(_regular_file(tmp_path) / "out", 1)
