"""`hputrain doctor`: its findings on small scripts (tests/doctor_scripts/), a tiny Hugging Face
Llama among them, and the CPU lazy backend's own gaps, each checked op by op."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hputrain.accelerators.cpu import CPUAccelerator
from hputrain.accelerators.cpu_lazy import BACKEND_FALLBACKS, LazyBackendGaps, _composed_attention
from hputrain.doctor import DoctorFinished

SCRIPTS = Path(__file__).parent / "doctor_scripts"


def doctor(tmp_path, *script_args, steps=6, script="common.py", env=None):
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "doctor", "--steps", str(steps), "--json",
                           str(SCRIPTS / script), *script_args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=None if env is None else {**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    report["stderr"] = proc.stderr
    return report


def kinds(report):
    return sorted(f["kind"] for f in report["findings"])


# -- the built-in GPT ---------------------------------------------------------------------------------

def test_doctor_clean_script_has_no_findings(tmp_path):
    report = doctor(tmp_path, "clean")
    assert report["steps"] == 6 and report["findings"] == []
    assert report["compiles_per_step"][2:] == [0, 0, 0, 0]
    assert report["host_syncs_per_step"] == [0] * 6  # the trainer's logging every 2 steps is not a sync
    assert not list(tmp_path.iterdir())  # the script's output_dir was redirected


def test_doctor_finds_item_in_forward(tmp_path):
    report = doctor(tmp_path, "item")
    assert kinds(report) == ["host_sync"] and report["host_syncs_per_step"] == [1] * 6
    message = report["findings"][0]["message"]
    assert "item at common.py:18 (6x)" in message
    assert "read it only on logging steps" in message  # the known fix for .item() in the user's code


def test_doctor_finds_fallbacks(tmp_path):
    report = doctor(tmp_path, "fallback")
    assert kinds(report) == ["fallback"] and report["fallback_ops"] == {"nonzero": 6}


def test_doctor_finds_changing_shapes(tmp_path):
    report = doctor(tmp_path, "ragged", steps=8)
    assert kinds(report) == ["recompilation"] and report["shapes"]["growing"]
    assert sum(report["compiles_per_step"][2:]) > 0
    message = report["findings"][0]["message"]
    assert "keep growing" in message and "pad or bucket" in message


def test_doctor_is_not_swallowed_by_except_exception(tmp_path):
    """DoctorFinished is a BaseException: the script's `except Exception:` lets it through, and
    nothing after the training call runs."""
    assert not issubclass(DoctorFinished, Exception) and issubclass(DoctorFinished, BaseException)
    report = doctor(tmp_path, "swallow")
    assert report["steps"] == 6 and report["findings"] == []
    assert "carrying on" not in report["stderr"] and "kept running" not in report["stderr"]


def test_doctor_bad_input(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "doctor", str(tmp_path / "nope.py")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "nope.py does not exist" in proc.stderr and proc.stderr.count("\n") == 1
    (tmp_path / "idle.py").write_text("print('no training here')\n")
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "doctor", str(tmp_path / "idle.py")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "trained no step" in proc.stderr


# -- a Hugging Face Llama -----------------------------------------------------------------------------

@pytest.fixture
def llama(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install hputrain[hf])")
    return lambda *layout, env=None: doctor(tmp_path, *layout, script="llama.py", env=env)


def test_doctor_llama_padded_to_a_fixed_length_is_clean(llama):
    report = llama("fixed")
    assert report["findings"] == [] and report["fallback_ops"] == {}
    assert report["compiles_per_step"][2:] == [0, 0, 0, 0]
    # RoPE's sin is the CPU backend's gap, not the model's: left out, and the report says so
    assert set(report["backend_gaps_left_out"]) == {"sin"}
    assert any(n.startswith("left out of the findings") and "sin (6x)" in n for n in report["notes"])


def test_doctor_llama_ragged_lengths_recompile(llama):
    report = llama("ragged")
    assert kinds(report) == ["recompilation"] and report["shapes"]["growing"]
    assert len(report["shapes"]["distinct"]) >= 4
    assert "keep growing" in report["findings"][0]["message"]


def test_doctor_llama_length_buckets_are_compiled_once(llama):
    report = llama("bucketed")
    assert report["findings"] == [] and not report["shapes"]["growing"]
    assert report["shapes"]["distinct"] == ["[4, 32]", "[4, 16]"]
    assert report["shapes"]["new_at_steps"] == [1, 3] and report["compiles_per_step"][2] > 0  # after warm-up
    assert any(n.startswith("2 batch shapes, each compiled once") for n in report["notes"])


def test_doctor_llama_all_ones_attention_mask(llama):
    """run_clm's blocks carry an attention_mask of ones, which transformers reads every step: the
    read is put on the user's line, inside transformers' file, with the fix."""
    report = llama("blocks")
    assert kinds(report) == ["host_sync"] and report["host_syncs_per_step"] == [1] * 6
    message = report["findings"][0]["message"]
    assert "in transformers/masking_utils.py:" in message and "called from llama.py:" in message
    assert "is all ones: leave attention_mask out of the batches" in message


def test_doctor_llama_padding_mask(llama):
    """A mask with padding builds a boolean attention mask by integer indexing: both stay in the
    graph (no index.Tensor, no logical_not fallback); the read of the mask is the finding."""
    report = llama("fixed", "--mask")
    assert kinds(report) == ["host_sync"] and report["fallback_ops"] == {}
    assert "padding on the right and labels -100" in report["findings"][0]["message"]


@pytest.mark.slow  # two doctor runs, ~20 s
def test_doctor_llama_step_graph_does_not_depend_on_the_hash_seed(llama):
    """The step graph is the same whatever PYTHONHASHSEED is: no compile after warm-up under
    either seed. Before, one of these seeds compiled again at step 3 or 4 (a 0-dim torch.zeros
    in the indexing route-around; which seed changed with unrelated code, so the deterministic
    check is test_scalar_zeros_enter_the_graph_as_host_values)."""
    reports = [llama("fixed", "--mask", env={"PYTHONHASHSEED": seed}) for seed in ("3", "10")]
    assert reports[0]["compiles_per_step"] == reports[1]["compiles_per_step"]
    assert not any(reports[0]["compiles_per_step"][2:])


# -- the CPU lazy backend's own gaps ------------------------------------------------------------------

# one op per entry of BACKEND_FALLBACKS; (x: float, m: bool) -> the op
PROBES = {
    "sin": lambda x, m: x.sin(),
    "where.self": lambda x, m: torch.where(m, x, 0.0),
    "logical_not.out": lambda x, m: m.logical_not(),
    "bitwise_not": lambda x, m: ~m,
}


def eager_ops(fn, *args) -> dict:
    """The ops that fell back to eager execution while `fn(*args)` ran lazily, with its result."""
    from torch._lazy import metrics

    accelerator = CPUAccelerator("lazy")
    device = accelerator.setup()
    metrics.reset()
    out = fn(*(a.to(device) for a in args))
    accelerator.mark_step()
    ops = {n[6:]: metrics.counter_value(n) for n in metrics.counter_names()
           if n.startswith("aten::") and metrics.counter_value(n)}
    return ops, out


def probe_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.rand(4, 8, generator=g) > 0.5


def test_every_listed_gap_has_a_probe():
    assert set(PROBES) == set(BACKEND_FALLBACKS)


@pytest.mark.parametrize("op", sorted(BACKEND_FALLBACKS))
def test_listed_gap_still_falls_back(op):
    """Fails once torch gives the op a lazy kernel: then drop it from BACKEND_FALLBACKS."""
    ops, _ = eager_ops(PROBES[op], *probe_inputs())
    assert ops == {op: 1}


def test_cos_stays_in_the_graph():
    """The probe's control: an op the backend has shows no fallback."""
    ops, out = eager_ops(lambda x, m: x.cos(), *probe_inputs())
    assert ops == {}
    torch.testing.assert_close(out.cpu(), probe_inputs()[0].cos())


def test_attention_with_a_boolean_mask_stays_in_the_graph():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    mask = torch.rand(2, 1, 6, 6, generator=g) > 0.3
    mask[..., 0] = True
    ops, out = eager_ops(lambda q, k, v, m: _composed_attention(q, k, v, attn_mask=m), q, k, v, mask)
    assert ops == {}  # logical_not.out before
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_integer_indexing_stays_in_the_graph():
    """`x[batch_idx, kv_idx]`, transformers' mask building: forward and backward in the graph, the
    same values and gradients as eager; boolean indexing still falls back, as on Gaudi."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, generator=g, requires_grad=True)
    rows, cols = torch.arange(3)[:, None, None], torch.tensor([[[0, 4, -1, 2]]])
    weights = torch.randn(3, 1, 4, 7, generator=g)
    (x[rows, cols] * weights).sum().backward()

    def lazy_index(x, rows, cols, weights):
        x.requires_grad_()
        with LazyBackendGaps():
            out = x[rows, cols]
        (out * weights).sum().backward()
        return out, x.grad

    ops, (out, grad) = eager_ops(lazy_index, x.detach(), rows, cols, weights)
    assert ops == {}  # index.Tensor, and index_put_ in backward, before
    torch.testing.assert_close(out.cpu(), x[rows, cols].detach())
    torch.testing.assert_close(grad.cpu(), x.grad)
    mask = torch.tensor([True, False, True])
    with LazyBackendGaps():
        ops, out = eager_ops(lambda x, m: x[m], x.detach(), mask)
    assert ops == {"index.Tensor": 1} and out.shape == (2, 5, 7)


ZEROS = {
    "zeros": lambda x: torch.zeros((), dtype=torch.long, device=x.device),
    "zeros_like": lambda x: torch.zeros_like(x[0, 0]),
    "new_zeros": lambda x: x.new_zeros(()),
    "integer indexing": lambda x: x[torch.tensor([1]), torch.tensor([-1])].sum() * 0,
}


@pytest.mark.parametrize("make", sorted(ZEROS))
def test_scalar_zeros_enter_the_graph_as_host_values(make):
    """A 0-dim zeros on the lazy device is the backend's uninitialised `empty` zeroed in the
    graph; that empty is a graph input found by its (garbage) value in the backend's scalar data
    cache, so whether it shared an input with another scalar, and the graph's hash, varied from
    step to step (an extra compile at step 3 of the Llama doctor run, by PYTHONHASHSEED). Under
    LazyBackendGaps it is a zero copied from the host: no `aten::zero` in its graph."""
    accelerator = CPUAccelerator("lazy")
    x = torch.arange(6.0).reshape(2, 3).to(accelerator.setup())
    with LazyBackendGaps():
        zero = ZEROS[make](x)
    assert zero.shape == () and "aten::zero" not in torch._C._lazy._get_tensors_text([zero])
    assert zero.item() == 0
    assert "aten::zero" in torch._C._lazy._get_tensors_text([torch.zeros((), device=x.device)])


def test_llama_with_a_padding_mask_trains_lazily_like_eager(tmp_path):
    """The routes around the backend's gaps (integer indexing, the attention mask) keep the
    numbers: a Llama with padded batches and their mask, lazy against eager."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install hputrain[hf])")
    import importlib.util

    from hputrain import Trainer, TrainingArguments

    spec = importlib.util.spec_from_file_location("doctor_llama", SCRIPTS / "llama.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    losses = {}
    for mode in ("eager", "lazy"):
        args = TrainingArguments(output_dir=str(tmp_path / mode), max_steps=4, logging_steps=1, save_steps=0,
                                 per_device_train_batch_size=4, learning_rate=1e-3, disable_tqdm=True,
                                 execution_mode=mode, accelerator="cpu")
        Trainer(script.model(), args, train_dataset=script.rows("ragged"),
                data_collator=script.collator("ragged", mask=True)).train()
        lines = (tmp_path / mode / "metrics.jsonl").read_text().splitlines()
        losses[mode] = [json.loads(l)["loss"] for l in lines if "loss" in json.loads(l)]
    assert len(losses["lazy"]) == 4 and losses["lazy"] == pytest.approx(losses["eager"], abs=1e-5)
