"""Checkpoints: exact round trips, rotation, atomic saves (even under SIGKILL), corrupt files."""

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

import hputrain.checkpoint.saving as ckpt
from hputrain.accelerators.cpu import CPUAccelerator
from hputrain.checkpoint.folder import CheckpointError
from hputrain.checkpoint.saving import (latest_checkpoint, load_checkpoint, resolve_checkpoint,
                                        save_checkpoint)
from hputrain.errors import InputError
from hputrain.models.gpt import GPT, GPTConfig
from hputrain.training.optim import resume_notes

SHAPE = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8}


def tiny_run(seed: int = 0, **shape):
    """A tiny GPT with AdamW and a LambdaLR schedule, seeded."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**SHAPE, **shape}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, steps: int = 3) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 9), generator=generator)
        model(tokens[:, :-1], labels=tokens[:, 1:])["loss"].backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def save(output_dir, step, run=None, **kwargs):
    model, optimizer, scheduler = run or tiny_run()
    return save_checkpoint(output_dir, step, model=model, optimizer=optimizer, scheduler=scheduler,
                           state={"epoch": 0}, accelerator=CPUAccelerator(), **kwargs)


def draws():
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_round_trip_restores_weights_optimizer_scheduler_state_and_rng(tmp_path):
    run = tiny_run()
    train(*run)
    model, optimizer, scheduler = run
    random.seed(5), np.random.seed(5)
    folder = save_checkpoint(tmp_path, 3, model=model, optimizer=optimizer, scheduler=scheduler,
                             state={"epoch": 1, "samples_seen": 6, "log_history": [{"loss": 5.1}]},
                             accelerator=CPUAccelerator())
    assert folder == tmp_path / "checkpoint-3"
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "model.safetensors", "optimizer.pt", "rng_state_0.pt", "scheduler.pt",
        "trainer_state.json"]
    assert json.loads((folder / "config.json").read_text()) == dataclasses.asdict(model.config)
    expected = draws()

    fresh = tiny_run(seed=7)  # other weights, and it moves the torch generator
    state = load_checkpoint(folder, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2],
                            accelerator=CPUAccelerator())
    assert draws() == expected
    assert state == {"epoch": 1, "samples_seen": 6, "log_history": [{"loss": 5.1}], "step": 3}
    assert_same_weights(model, fresh[0])
    assert fresh[2].last_epoch == scheduler.last_epoch == 3
    assert fresh[1].param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    saved, loaded = optimizer.state_dict(), fresh[1].state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    assert saved["state"].keys() == loaded["state"].keys()
    for index, entry in saved["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(loaded["state"][index][name]))

    # Training on from both gives the same weights: nothing was left out.
    train(*run, steps=1)
    train(*fresh, steps=1)
    assert_same_weights(model, fresh[0])


def test_restore_rng_false_leaves_generators_alone(tmp_path):
    folder = save(tmp_path, 1)
    random.seed(9)
    expected = random.random()
    random.seed(9)
    load_checkpoint(folder, model=tiny_run()[0], restore_rng=False)
    assert random.random() == expected


def test_tied_embedding_survives(tmp_path):
    run = tiny_run()
    train(*run)
    folder = save(tmp_path, 1, run)
    fresh = tiny_run(seed=3)[0]
    load_checkpoint(folder, model=fresh)
    assert fresh.lm_head.weight is fresh.wte.weight
    assert torch.equal(fresh.wte.weight, run[0].wte.weight)


def test_wrapped_model_saves_and_loads_the_inner_module(tmp_path):
    class Wrapper(torch.nn.Module):  # stands in for DistributedDataParallel
        def __init__(self, module):
            super().__init__()
            self.module = module

    model, optimizer, scheduler = tiny_run()
    folder = save(tmp_path, 1, (Wrapper(model), optimizer, scheduler))
    fresh = tiny_run(seed=3)[0]
    load_checkpoint(folder, model=Wrapper(fresh))
    assert_same_weights(model, fresh)


def test_rotation_keeps_the_newest(tmp_path):
    run = tiny_run()
    for step in (10, 2, 30, 40):
        save(tmp_path, step, run, save_total_limit=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-30", "checkpoint-40"]
    save(tmp_path, 5, run, save_total_limit=1)  # never deletes the one just written
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-5"]
    with pytest.raises(InputError):
        save(tmp_path, 6, run, save_total_limit=0)


def test_resave_of_the_same_step_replaces_it(tmp_path):
    save(tmp_path, 1, tiny_run(seed=0))
    run = tiny_run(seed=1)
    folder = save(tmp_path, 1, run)
    fresh = tiny_run(seed=2)[0]
    load_checkpoint(folder, model=fresh)
    assert_same_weights(run[0], fresh)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-1"]


def test_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    run = tiny_run()
    save(tmp_path, 1, run)

    def half_then_crash(obj, path):
        path.write_bytes(b"\x80\x02partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "torch_save", half_then_crash)
    with pytest.raises(CheckpointError, match="checkpoint-2: disk full"):
        save(tmp_path, 2, run)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-1"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    load_checkpoint(tmp_path / "checkpoint-1", model=tiny_run()[0], optimizer=tiny_run()[1])


def test_failed_rename_on_resave_puts_the_old_folder_back(tmp_path, monkeypatch):
    run = tiny_run()
    save(tmp_path, 1, run)
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(src)
        if len(calls) == 2:  # the first moves the old folder aside, the second publishes the new
            raise OSError("rename failed")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace)
    with pytest.raises(CheckpointError, match="rename failed"):
        save(tmp_path, 1, run)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-1"]
    load_checkpoint(tmp_path / "checkpoint-1", model=tiny_run()[0])


KILLED_SAVE = textwrap.dedent("""
    import sys, time, torch
    import hputrain.checkpoint.saving as ckpt
    from hputrain.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{shape!r}))
    optimizer = torch.optim.AdamW(model.parameters())
    args = dict(model=model, optimizer=optimizer, scheduler=None, state={{}}, accelerator=None)
    ckpt.save_checkpoint(sys.argv[1], 1, **args)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real = ckpt.torch_save
    def slow(obj, path):
        real(obj, path)
        print("MIDSAVE", flush=True)
        time.sleep(60)
    ckpt.torch_save = slow
    ckpt.save_checkpoint(sys.argv[1], 2, **args)
""").format(shape=SHAPE)


def test_sigkill_mid_save_leaves_the_previous_checkpoint(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "MIDSAVE"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-checkpoint-2", "checkpoint-1"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    model = tiny_run(seed=5)[0]
    load_checkpoint(latest_checkpoint(tmp_path), model=model,
                    optimizer=torch.optim.AdamW(model.parameters()))
    assert_same_weights(model, tiny_run(seed=0)[0])
    save(tmp_path, 2)  # the next save clears the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-2"]


def test_distributed_save_writes_one_rng_file_per_rank(tmp_path):
    barrier, errors, results = threading.Barrier(2), [], {}
    run = tiny_run()

    def rank(r):
        try:
            results[r] = save(tmp_path, 4, run, rank=r, world_size=2, barrier=barrier.wait)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    folder = tmp_path / "checkpoint-4"
    assert results == {0: folder, 1: folder}
    assert (folder / "rng_state_0.pt").is_file() and (folder / "rng_state_1.pt").is_file()
    load_checkpoint(folder, model=tiny_run()[0], rank=1)
    with pytest.raises(ValueError, match="barrier"):
        save(tmp_path, 5, run, rank=0, world_size=2)


def test_a_rank_the_checkpoint_has_no_generators_for_is_seeded_from_seed_rank_and_step(tmp_path):
    """Issue 46 item 6: a checkpoint of 1 process resumed on more. Rank 0 restores its own
    generators; a rank beyond the saving processes is seeded from the run's seed, its rank and the
    step (every generator, as a run from the beginning is seeded), the same on every rerun, its own
    for each rank; rank 0 says so in one line. A rank of the saving processes whose file is gone
    is still a damaged checkpoint."""
    model, optimizer, scheduler = tiny_run()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    folder = save_checkpoint(tmp_path, 4, model=model, optimizer=optimizer, scheduler=scheduler,
                             state={"epoch": 0, "world_size": 1, "seed": 7},
                             accelerator=CPUAccelerator())
    saved = draws()

    def after_loading(rank, path=folder):
        load_checkpoint(path, model=tiny_run()[0], rank=rank)
        return draws()

    def seeded(seed):
        random.seed(seed), np.random.seed(seed % 2**32), torch.manual_seed(seed)
        return draws()

    assert after_loading(0) == saved
    rank1 = after_loading(1)
    assert rank1 == after_loading(1) == seeded(ckpt.derived_seed(7, 1, 4))
    assert rank1 != saved and after_loading(2) not in (rank1, saved)
    assert len({ckpt.derived_seed(seed, rank, step) for seed in (7, -7, 2**64 - 1)
                for rank in (1, 2) for step in (4, 8)}) == 12
    assert 0 <= ckpt.derived_seed(2**64 - 1, 7, 10**9) < 2**63

    state = json.loads((folder / "trainer_state.json").read_text())
    assert resume_notes(state, 2, scheduler, 1e-2, world_size=1) == []
    assert resume_notes(state, 2, scheduler, 1e-2, world_size=2) == [
        "resuming on 2 processes a checkpoint saved by 1 process: rank 1 has no saved generator "
        "state, so its generators are seeded from seed 7, the rank and step 4"]
    assert "ranks 1-3 have" in resume_notes(state, 2, scheduler, 1e-2, world_size=4)[0]
    assert resume_notes({**state, "world_size": 2}, 2, scheduler, 1e-2, world_size=1) == []

    two = json.loads((folder / "trainer_state.json").read_text()) | {"world_size": 2}
    (folder / "trainer_state.json").write_text(json.dumps(two))
    with pytest.raises(CheckpointError, match="rng_state_1.pt is missing"):
        load_checkpoint(folder, model=tiny_run()[0], rank=1)


def _corrupt_model(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage, named", [
    (_corrupt_model, "model.safetensors"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\x00" * 3), "model.safetensors"),
    (lambda f: (f / "optimizer.pt").write_bytes(b"not a torch file"), "optimizer.pt"),
    (lambda f: (f / "scheduler.pt").unlink(), "scheduler.pt"),
    (lambda f: (f / "trainer_state.json").write_text("{not json"), "trainer_state.json"),
    (lambda f: (f / "trainer_state.json").write_text("[1, 2]"), "trainer_state.json"),
    (lambda f: (f / "trainer_state.json").unlink(), "trainer_state.json"),
    (lambda f: (f / "rng_state_0.pt").write_bytes(b""), "rng_state_0.pt"),
])
def test_corrupt_checkpoint_raises_checkpoint_error_naming_the_file(tmp_path, damage, named):
    folder = save(tmp_path, 1)
    damage(folder)
    model, optimizer, scheduler = tiny_run()
    with pytest.raises(CheckpointError, match=named) as err:
        load_checkpoint(folder, model=model, optimizer=optimizer, scheduler=scheduler)
    assert "\n" not in str(err.value)
    assert isinstance(err.value, InputError)


def test_missing_folder_and_wrong_shapes(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint-9 does not exist"):
        load_checkpoint(tmp_path / "checkpoint-9", model=tiny_run()[0])
    folder = save(tmp_path, 1)
    with pytest.raises(CheckpointError, match="model.safetensors.*size mismatch"):
        load_checkpoint(folder, model=tiny_run(n_embd=32)[0])
    with pytest.raises(CheckpointError, match="rng_state_1.pt is missing"):
        load_checkpoint(folder, model=tiny_run()[0], rank=1)


PICKLE_RAN = []


def _record():
    PICKLE_RAN.append(True)
    return {}


class Payload:
    def __reduce__(self):
        return (_record, ())


def test_pickled_objects_are_refused(tmp_path):
    folder = save(tmp_path, 1)
    torch.save({"state": Payload(), "param_groups": []}, folder / "optimizer.pt")
    model, optimizer, _ = tiny_run()
    with pytest.raises(CheckpointError, match="optimizer.pt.*weights_only") as err:
        load_checkpoint(folder, model=model, optimizer=optimizer)
    assert "\n" not in str(err.value)
    assert PICKLE_RAN == []


def test_latest_and_resolve(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        resolve_checkpoint(tmp_path, "latest")
    assert latest_checkpoint(tmp_path / "absent") is None
    run = tiny_run()
    save(tmp_path, 2, run)
    save(tmp_path, 10, run)
    (tmp_path / "checkpoint-11").mkdir()  # no trainer_state.json: not complete
    (tmp_path / "checkpoint-11" / "model.safetensors").write_bytes(b"")
    (tmp_path / ".tmp-checkpoint-12").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"  # by number, not by name
    assert resolve_checkpoint(tmp_path, "latest") == tmp_path / "checkpoint-10"
    assert resolve_checkpoint(tmp_path, str(tmp_path / "checkpoint-2")) == tmp_path / "checkpoint-2"
    assert resolve_checkpoint(tmp_path, "checkpoint-2") == tmp_path / "checkpoint-2"
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path, str(tmp_path / "checkpoint-3"))


def test_rank_without_the_shared_folder_is_told_so(tmp_path):
    """A rank whose output_dir is not the one rank 0 wrote into (no shared filesystem)."""
    from hputrain.checkpoint.saving import write_rng_state

    with pytest.raises(CheckpointError, match="missing on rank 1: every rank must see the same output_dir"):
        write_rng_state(tmp_path / ".tmp-checkpoint-5", 1)
