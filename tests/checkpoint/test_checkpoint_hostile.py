"""Crafted and damaged checkpoints are refused in one line before anything uses them: optimizer
state that does not fit the parameters (fused AdamW would write through it unchecked),
trainer_state.json fields of the wrong type or range, fp8 scaling state with the wrong keys, and
pickles that would run code (the reason kept, torch's advice to load unsafely never shown)."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from hputrain.checkpoint.folder import CheckpointError
from hputrain.checkpoint.saving import load_checkpoint, save_checkpoint
from hputrain.execution.fp8 import Fp8Linear, Fp8Recipe

from ..checkpoint.test_checkpoint import SHAPE, tiny_run, train


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """checkpoint-3 of a tiny GPT trained 3 steps with AdamW (its state filled in)."""
    run = tiny_run()
    train(*run, steps=3)
    model, optimizer, scheduler = run
    return save_checkpoint(tmp_path_factory.mktemp("pristine"), 3, model=model,
                           optimizer=optimizer, scheduler=scheduler, accelerator=None,
                           state={"global_step": 3, "epoch": 0.5, "world_size": 1, "seed": 42,
                                  "global_batch_size": 2})


@pytest.fixture
def folder(tmp_path, pristine):
    """A copy of the pristine checkpoint-3 to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "checkpoint-3"))


def assert_one_line(err, *words):
    message = str(err.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message


def rewrite_optimizer(folder, change):
    saved = torch.load(folder / "optimizer.pt", weights_only=True)
    change(saved)
    torch.save(saved, folder / "optimizer.pt")
    torch.load(folder / "optimizer.pt", weights_only=True)  # torch itself accepts it


def _set(path, value):
    """A change that sets saved[path[0]][path[1]]... to value."""
    def change(saved):
        target = saved
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


# Parameter 0 of the tiny GPT is the (256, 16) token embedding.
OPTIMIZER_DAMAGE = {
    "exp_avg too small": (_set(["state", 0, "exp_avg"], torch.zeros(3)), "exp_avg"),
    "exp_avg_sq transposed": (_set(["state", 0, "exp_avg_sq"], torch.zeros(16, 256)), "exp_avg_sq"),
    "exp_avg 0-dim": (_set(["state", 0, "exp_avg"], torch.tensor(0.0)), "exp_avg"),
    "exp_avg expanded from one number": (_set(["state", 0, "exp_avg"], torch.zeros(1, 1).expand(256, 16)), "strides (0, 0)"),
    "exp_avg of integers": (_set(["state", 0, "exp_avg"], torch.zeros(256, 16, dtype=torch.int64)), "int64"),
    "negative step": (_set(["state", 0, "step"], torch.tensor(-1.0)), "step"),
    "nan step": (_set(["state", 0, "step"], torch.tensor(float("nan"))), "step"),
    "step of two numbers": (_set(["state", 0, "step"], torch.tensor([1.0, 2.0])), "step"),
    "step as text": (_set(["state", 0, "step"], "3"), "step"),
    "exp_avg_sq missing": (lambda s: s["state"][0].pop("exp_avg_sq"), "lacks exp_avg_sq"),
    "state of no parameter": (_set(["state", 999], {"step": torch.tensor(1.0)}), "parameter 999"),
    "state not a dict": (_set(["state", 0], [1, 2]), "not a dict"),
    "a group too many": (lambda s: s["param_groups"].append(dict(s["param_groups"][0])), "parameter groups"),
    "a parameter too few": (lambda s: s["param_groups"][0]["params"].pop(), "parameters"),
    "a parameter twice": (lambda s: s["param_groups"][0]["params"].__setitem__(1, 0), "twice"),
    "parameter numbers as text": (_set(["param_groups", 0, "params"], ["a"]), "parameter numbers"),
    "lr as text": (_set(["param_groups", 0, "lr"], "fast"), "lr"),
    "one beta": (_set(["param_groups", 0, "betas"], (0.9,)), "betas"),
    "lr missing": (lambda s: s["param_groups"][0].pop("lr"), "lr"),
}


@pytest.mark.parametrize("name", OPTIMIZER_DAMAGE)
def test_optimizer_state_that_does_not_fit_is_refused(folder, name):
    # Only loaded here, never stepped: a bad tensor is harmless until a fused step writes through it.
    change, word = OPTIMIZER_DAMAGE[name]
    rewrite_optimizer(folder, change)
    model, optimizer, scheduler = tiny_run()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder, model=model, optimizer=optimizer, scheduler=scheduler)
    assert_one_line(err, "optimizer.pt", word)
    assert optimizer.state_dict()["state"] == {}  # nothing was loaded into it


def test_optimizer_state_of_a_real_run_loads(folder):
    model, optimizer, scheduler = tiny_run()
    optimizer.param_groups[0]["fused"] = None  # a flag of another torch version: still fine
    rewrite_optimizer(folder, lambda s: s["param_groups"][0].pop("maximize"))  # default applies
    load_checkpoint(folder, model=model, optimizer=optimizer, scheduler=scheduler)
    assert optimizer.state_dict()["state"][0]["exp_avg"].shape == (256, 16)


FUSED_STEP = textwrap.dedent("""
    import sys, torch
    from hputrain.checkpoint.folder import CheckpointError
    from hputrain.checkpoint.saving import load_checkpoint
    from hputrain.models.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(**{shape!r}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    try:
        load_checkpoint(sys.argv[1], model=model, optimizer=optimizer, restore_rng=False)
    except CheckpointError as exc:
        print(exc, file=sys.stderr)
        sys.exit(2)
    tokens = torch.randint(0, 256, (2, 9))
    model(tokens[:, :-1], labels=tokens[:, 1:])["loss"].backward()
    optimizer.step()
    print("STEPPED")
""").format(shape=SHAPE)


def test_wrong_exp_avg_shape_never_reaches_fused_adamw(folder):
    """Without the check, fused AdamW (the file says fused: load_state_dict takes the flag from
    it) writes a (256, 16) update through a 3-element tensor: memory corruption (a crash or a
    hang). In a subprocess, so that a regression cannot take the test process down."""
    rewrite_optimizer(folder, _set(["state", 0, "exp_avg"], torch.zeros(3)))
    rewrite_optimizer(folder, _set(["param_groups", 0, "fused"], True))
    proc = subprocess.run([sys.executable, "-c", FUSED_STEP, str(folder)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1 and "exp_avg" in proc.stderr and "(3,)" in proc.stderr


STATE_DAMAGE = {
    "global_step as text": ({"global_step": "3"}, "global_step must be an integer >= 0"),
    "global_step fractional": ({"global_step": 25.5}, "global_step must be an integer"),
    "global_step negative": ({"global_step": -5}, "global_step must be an integer >= 0"),
    "global_step a flag": ({"global_step": True}, "global_step must be an integer"),
    "global_step huge": ({"global_step": 10**6}, "global_step 1000000 is not its step 3"),
    "step huge": ({"global_step": 10**6, "step": 10**6}, "step 1000000 is not the folder's checkpoint-3"),
    "step missing": ({"step": None}, "has no step"),
    "epoch nan": ({"epoch": float("nan")}, "epoch must be a finite number"),
    "epoch negative": ({"epoch": -1}, "epoch must be a finite number >= 0"),
    "world_size zero": ({"world_size": 0}, "world_size must be an integer >= 1"),
    "seed as text": ({"seed": "42"}, "seed must be a 64-bit integer"),
    "seed beyond 64 bits": ({"seed": 2**64}, "seed must be a 64-bit integer"),
    "global_batch_size fractional": ({"global_batch_size": 1.5}, "global_batch_size must be an integer"),
}


@pytest.mark.parametrize("name", STATE_DAMAGE)
def test_trainer_state_fields_out_of_type_or_range_are_refused(folder, name):
    change, words = STATE_DAMAGE[name]
    state = json.loads((folder / "trainer_state.json").read_text())
    state.update(change)
    state = {key: value for key, value in state.items() if value is not None}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder, model=tiny_run()[0])
    assert_one_line(err, "trainer_state.json", words)


def test_a_renamed_checkpoint_folder_still_loads(tmp_path, folder):
    state = load_checkpoint(folder.rename(tmp_path / "best"), model=tiny_run()[0])
    assert state["step"] == state["global_step"] == 3


def fp8_checkpoint(tmp_path):
    """A model whose middle layer computes in fp8 (its scaling state is extra state), saved."""
    model = nn.Sequential(nn.Linear(64, 64), Fp8Linear(64, 64, recipe=Fp8Recipe(amax_history_len=4)),
                          nn.Linear(64, 64))
    model[1].amax_history.fill_(2.0)
    folder = save_checkpoint(tmp_path, 1, model=model, optimizer=None, scheduler=None,
                             state={}, accelerator=None)
    return model, folder


def _fp8_states(extra):
    return extra["1._extra_state"]


FP8_DAMAGE = {
    "a key too many": (lambda e: _fp8_states(e).update(code=torch.zeros(1)), "must hold amax_history and scale"),
    "scale missing": (lambda e: _fp8_states(e).pop("scale"), "must hold amax_history and scale"),
    "not a dict": (lambda e: e.update({"1._extra_state": [1, 2]}), "must hold amax_history and scale"),
    "history of integers": (lambda e: _fp8_states(e).update(amax_history=torch.zeros(3, 4, dtype=torch.int32)), "float tensor"),
    "history as a list": (lambda e: _fp8_states(e).update(amax_history=[0.0] * 12), "float tensor"),
    "history too long": (lambda e: _fp8_states(e).update(amax_history=torch.zeros(3, 8)), "fp8_amax_history_len differs"),
    "scales too many": (lambda e: _fp8_states(e).update(scale=torch.ones(30)), "scales of shape (30,)"),
    "scale zero": (lambda e: _fp8_states(e).update(scale=torch.zeros(3)), "scales not above 0"),
    "amax nan": (lambda e: _fp8_states(e)["amax_history"].fill_(float("nan")), "not finite"),
    "another layer's state": (lambda e: e.update({"0._extra_state": e.pop("1._extra_state")}), "0._extra_state"),
}


@pytest.mark.parametrize("name", FP8_DAMAGE)
def test_fp8_scaling_state_with_the_wrong_keys_or_values_is_refused(tmp_path, name):
    change, words = FP8_DAMAGE[name]
    model, folder = fp8_checkpoint(tmp_path)
    extra = torch.load(folder / "model_extra_state.pt", weights_only=True)
    change(extra)
    torch.save(extra, folder / "model_extra_state.pt")
    history = model[1].amax_history.clone()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder, model=model, restore_rng=False)
    assert_one_line(err, "model_extra_state.pt", words)
    assert torch.equal(model[1].amax_history, history)  # left as it was


def test_fp8_scaling_state_round_trips(tmp_path):
    model, folder = fp8_checkpoint(tmp_path)
    fresh = nn.Sequential(nn.Linear(64, 64), Fp8Linear(64, 64, recipe=Fp8Recipe(amax_history_len=4)),
                          nn.Linear(64, 64))
    load_checkpoint(folder, model=fresh, restore_rng=False)
    assert torch.equal(fresh[1].amax_history, model[1].amax_history)


class SystemCall:
    """Unpickles as os.system(command): a GLOBAL posix.system in the file."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state_0.pt"])
def test_malicious_pickle_does_not_run_and_the_reason_is_kept(tmp_path, folder, name):
    marker = tmp_path / "pwned"
    torch.save({"state": SystemCall(f"touch {marker}")}, folder / name)
    model, optimizer, scheduler = tiny_run()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder, model=model, optimizer=optimizer, scheduler=scheduler)
    assert not marker.exists()
    assert_one_line(err, name, "refused", f"unsupported GLOBAL {os.system.__module__}.system")
    message = str(err.value).lower()
    for advice in ("weights_only=false", "`weights_only` set to `false`", "re-running", "trust",
                   "add_safe_globals"):
        assert advice not in message, message
