"""Sharded checkpoints (torch.distributed.checkpoint shards in sharded/): the folder protocol
around them, exact round trips, `hputrain export`, resuming on another number of processes
(through `hputrain launch`, tests/sharded_script.py), and corrupt, incomplete, foreign or
malicious shards refused in one line."""
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hputrain.accelerators.cpu import CPUAccelerator
from hputrain.checkpoint.folder import SHARDED_DIR, CheckpointError
from hputrain.checkpoint.full import FullState
from hputrain.checkpoint.saving import (latest_checkpoint, load_checkpoint, save_checkpoint,
                                        state_io_for)
from hputrain.checkpoint.sharded import METADATA_FILE, ShardedState
from hputrain.cli import main as cli

from ..checkpoint.test_checkpoint import assert_same_weights, tiny_run, train

ROOT = Path(__file__).resolve().parents[2]


def save_sharded(output_dir, step=3, run=None, **kwargs):
    run = run or tiny_run()
    model, optimizer, scheduler = run
    return save_checkpoint(output_dir, step, model=model, optimizer=optimizer, scheduler=scheduler,
                           state={"epoch": 0, "world_size": 1}, accelerator=CPUAccelerator(),
                           state_io=ShardedState(), **kwargs)


def trained(tmp_path, **kwargs):
    run = tiny_run()
    train(*run)
    return run, save_sharded(tmp_path, run=run, **kwargs)


def test_the_strategy_chooses_the_state_io():
    class Sharding:
        shards_state = True

    assert isinstance(state_io_for(Sharding()), ShardedState)
    assert isinstance(state_io_for(object()), FullState)


def test_round_trip_is_exact_and_the_folder_holds_shards(tmp_path):
    run, folder = trained(tmp_path)
    assert (folder / SHARDED_DIR / METADATA_FILE).is_file()
    assert not (folder / "model.safetensors").exists() and not (folder / "optimizer.pt").exists()
    assert latest_checkpoint(tmp_path) == folder
    fresh = tiny_run(seed=1)
    state = load_checkpoint(folder, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2])
    assert state["step"] == 3
    assert_same_weights(run[0], fresh[0])
    for mine, theirs in zip(run[1].state_dict()["state"].values(),
                            fresh[1].state_dict()["state"].values()):
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), key
    train(*run, steps=2), train(*fresh, steps=2)  # the resumed run continues bitwise
    assert_same_weights(run[0], fresh[0])


def test_consolidated_model_and_export_load_into_the_plain_model(tmp_path):
    run, folder = trained(tmp_path, consolidate=True)
    plain = tiny_run(seed=2)[0]
    load_checkpoint(folder, model=plain, restore_rng=False)
    consolidated = load_file(folder / "model.safetensors")
    exported = tmp_path / "out" / "exported.safetensors"
    assert cli(["export", "--checkpoint", str(folder), "--output", str(exported)]) == 0
    assert (tmp_path / "out" / "config.json").is_file()
    for tensors in (consolidated, load_file(exported)):
        model = tiny_run(seed=3)[0]
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to wte
        assert_same_weights(run[0], model)


def _truncate(folder):
    shard = next((folder / SHARDED_DIR).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])


class Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def _malicious_metadata(folder):
    (folder / SHARDED_DIR / METADATA_FILE).write_bytes(pickle.dumps(Payload()))


def _foreign_shard_path(folder):
    metadata = folder / SHARDED_DIR / METADATA_FILE
    # the same length, so the pickle stays well formed
    metadata.write_bytes(metadata.read_bytes().replace(b"__0_0.distcp", b"../_0.distcp"))


@pytest.mark.parametrize("damage, reason", [
    (lambda f: (f / SHARDED_DIR / METADATA_FILE).unlink(), r"\.metadata is missing"),
    (_truncate, "is truncated"),
    (lambda f: next((f / SHARDED_DIR).glob("*.distcp")).unlink(), "is missing"),
    (lambda f: (f / SHARDED_DIR / METADATA_FILE).write_bytes(b"\x80\x04junk"), "not DCP metadata"),
    (_malicious_metadata, "posix.system, which a DCP .metadata never holds"),
    (_foreign_shard_path, "outside"),
])
def test_a_damaged_checkpoint_is_one_line_and_runs_nothing(tmp_path, monkeypatch, damage, reason):
    monkeypatch.chdir(tmp_path)
    _, folder = trained(tmp_path)
    damage(folder)
    fresh = tiny_run()
    with pytest.raises(CheckpointError, match=reason) as err:
        load_checkpoint(folder, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2])
    assert "\n" not in str(err.value)
    assert cli(["export", "--checkpoint", str(folder)]) == 2
    assert not (tmp_path / "PWNED").exists()


def test_shards_that_do_not_fit_the_model_are_refused(tmp_path):
    _, folder = trained(tmp_path)
    other = tiny_run(n_embd=32)
    with pytest.raises(CheckpointError, match=r"does not fit the model: wte.weight has shape"):
        load_checkpoint(folder, model=other[0], optimizer=other[1])


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's, on the test's own save
def test_a_malicious_optimizer_value_is_not_unpickled(tmp_path, monkeypatch):
    """Non-tensor values (the optimizer's hyper-parameters) are loaded with weights_only=True,
    where DCP's own planner would run what they hold."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    monkeypatch.chdir(tmp_path)
    run, folder = trained(tmp_path)
    optimizer_state = get_optimizer_state_dict(run[0], run[1])
    optimizer_state["param_groups"][0]["lr"] = Payload()
    state = {"model": get_model_state_dict(run[0]), "optimizer": optimizer_state}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder / SHARDED_DIR), no_dist=True)
    fresh = tiny_run()
    refused = r"cannot be loaded: rank 0: torch.load\(weights_only=True\) refused it \(.*posix.system"
    with pytest.raises(CheckpointError, match=refused):
        load_checkpoint(folder, model=fresh[0], optimizer=fresh[1])
    assert not (tmp_path / "PWNED").exists()


def test_a_sharding_strategy_refuses_full_files(tmp_path):
    from ..checkpoint.test_checkpoint import save

    folder = save(tmp_path, 1)
    with pytest.raises(CheckpointError, match="holds full state"):
        load_checkpoint(folder, model=tiny_run()[0], state_io=ShardedState())


def test_export_of_a_folder_without_shards_is_one_line(tmp_path, capsys):
    from ..checkpoint.test_checkpoint import save

    assert cli(["export", "--checkpoint", str(save(tmp_path, 1))]) == 2
    assert cli(["export", "--checkpoint", str(tmp_path / "nowhere")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "is not a sharded checkpoint" in lines[0] and "does not exist" in lines[1]


# -- through `hputrain launch`: FSDP2 shards on the CPU with Gloo ----------------------------------
def launch(processes: int, output_dir: Path, steps: int = 8, resume: Path | None = None):
    script = ROOT / "tests" / "sharded_script.py"
    command = [sys.executable, "-m", "hputrain.cli", "launch", "--cpu", "--nproc-per-node",
               str(processes), str(script), str(output_dir), str(steps)]
    return subprocess.run(command + ([str(resume)] if resume else []), check=False,
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def run(processes: int, output_dir: Path, **kwargs) -> tuple[dict, dict]:
    """The losses by step and the final whole model of a launched run."""
    proc = launch(processes, output_dir, **kwargs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    losses = {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}
    return losses, load_file(output_dir / "checkpoint-8" / "model.safetensors")


def assert_matches(resumed, straight, tolerance) -> None:
    (losses, weights), (ref_losses, ref_weights) = resumed, straight
    assert sorted(losses) == [5, 6, 7, 8]
    for step, loss in losses.items():
        assert abs(loss - ref_losses[step]) <= tolerance, step
    for name, value in weights.items():  # one process writes the tied weight once
        assert (value - ref_weights[name]).abs().max() <= tolerance, name


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("two")
    return folder, run(2, folder)


@pytest.mark.slow
@pytest.mark.ci
def test_resume_on_the_same_number_of_processes_is_bitwise(two_process_run, tmp_path):
    folder, straight = two_process_run
    checkpoint = folder / "checkpoint-4"
    assert sorted(p.name for p in (checkpoint / SHARDED_DIR).iterdir()) == [
        METADATA_FILE, "__0_0.distcp", "__1_0.distcp"]
    assert not (checkpoint / "model.safetensors").exists()  # only the last save consolidates
    assert_matches(run(2, tmp_path, resume=checkpoint), straight, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 4])
def test_resume_from_two_processes_on_another_number(two_process_run, tmp_path, processes):
    folder, straight = two_process_run
    assert_matches(run(processes, tmp_path, resume=folder / "checkpoint-4"), straight, 1e-5)


@pytest.mark.slow
def test_resume_from_four_processes_on_two(tmp_path):
    straight = run(4, tmp_path / "four")
    assert_matches(run(2, tmp_path / "two", resume=tmp_path / "four" / "checkpoint-4"), straight, 1e-5)


@pytest.mark.slow
def test_a_damaged_sharded_checkpoint_ends_a_launched_run_in_one_line(two_process_run, tmp_path):
    folder, _ = two_process_run
    damaged = tmp_path / "checkpoint-4"
    subprocess.run(["cp", "-r", str(folder / "checkpoint-4"), str(damaged)], check=True)
    _truncate(damaged)
    proc = launch(2, tmp_path / "out", resume=damaged)
    assert proc.returncode != 0
    # every rank meets the same bad input: its one line and status 2, said once for the job, by
    # the launcher, which names the rank (distributed/failure.py)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hputrain launch:")]
    assert len(errors) == 1 and "__0_0.distcp is truncated" in errors[0], proc.stderr[-3000:]
    assert re.match(r"hputrain launch: ranks? (0|1|0, 1) failed \(exit code 2\): hputrain: error: Sharded "
                    r"checkpoint", errors[0]), errors
    assert "Traceback" not in proc.stderr


def test_fp8_scaling_state_round_trips_through_shards(tmp_path):
    """fp8 layers' extra state (a dict of tensors: amax history, scales) is stored by DCP under
    NAME._extra_state.KEY; loading it back used to be refused as 'unexpected' (fsdp + fp8 runs
    could not resume)."""
    from hputrain.execution.fp8 import Fp8Recipe, convert_to_fp8
    from hputrain.models.gpt import GPT, GPTConfig

    def fp8_gpt():
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=16))
        return model, convert_to_fp8(model, Fp8Recipe())

    model, names = fp8_gpt()
    with torch.no_grad():
        for name in names:  # as training leaves them: histories and scales no layer starts with
            layer = model.get_submodule(name)
            layer.amax_history.uniform_(0.5, 2.0)
            layer.scale.uniform_(0.5, 2.0)
    save_checkpoint(tmp_path, 1, model=model, optimizer=None, scheduler=None, state={},
                    accelerator=CPUAccelerator(), state_io=ShardedState())
    fresh, _ = fp8_gpt()
    load_checkpoint(tmp_path / "checkpoint-1", model=fresh, restore_rng=False, state_io=ShardedState())
    for name in names:
        saved, loaded = model.get_submodule(name), fresh.get_submodule(name)
        assert torch.equal(saved.amax_history, loaded.amax_history), name
        assert torch.equal(saved.scale, loaded.scale), name
    for (name, saved), (_, loaded) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(saved, loaded), name
