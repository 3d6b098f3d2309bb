"""fp8 training: the layer against bf16, the scaling state, minimize_memory, the trainer, Gaudi."""
import copy
import json

import pytest
import torch

from hputrain import Trainer, TrainingArguments
from hputrain.checkpoint.folder import EXTRA_STATE_FILE
from hputrain.errors import InputError
from hputrain.execution.fp8 import (E4M3, E5M2, GRAD, INPUT, WEIGHT, Fp8Linear, Fp8Recipe,
                                    convert_to_fp8, fp8_layer_names)
from hputrain.models.gpt import GPT, GPTConfig
from hputrain.training.telemetry import SavedForBackward

from ..conftest import requires_cuda
from ..execution.test_execution import HPUOnCPU

E4M3_MAX, E5M2_MAX = torch.finfo(E4M3).max, torch.finfo(E5M2).max


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run(layer, x, grad):
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        out = layer(x)
    out.backward(grad)
    return out, x.grad


def test_fp8_linear_matches_bf16_linear_within_fp8_tolerance():
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 256)
    fp8 = Fp8Linear.from_linear(copy.deepcopy(linear), Fp8Recipe())
    x, grad = torch.randn(3, 37, 128), torch.randn(3, 37, 256)  # 111 rows: padded to 112
    out8, dx8 = run(fp8, x, grad)
    out16, dx16 = run(linear, x, grad)
    assert out8.dtype == torch.bfloat16 and fp8.weight.grad.dtype == torch.float32
    # E4M3 keeps 3 mantissa bits (relative step 1/8), E5M2 2: a few percent over a dot product
    assert rel(out8, out16) < 0.06
    assert rel(dx8, dx16) < 0.10
    assert rel(fp8.weight.grad, linear.weight.grad) < 0.10
    torch.testing.assert_close(fp8.bias.grad, linear.bias.grad)  # the bias stays wide
    # and it is fp8, not bf16 under another name: bf16 alone would be within 1%
    assert rel(out8, out16) > 0.01 and rel(dx8, dx16) > 0.02


def test_delayed_scaling_uses_the_history_and_records_each_amax():
    torch.manual_seed(0)
    layer = Fp8Linear(64, 64, recipe=Fp8Recipe(amax_history_len=4))
    x1, g = torch.randn(32, 64), torch.randn(32, 64)
    run(layer, x1, g)
    amax1 = x1.abs().max()
    # the first step has no history: its own amax sets the scale
    assert layer.amax_history[INPUT, 0] == amax1
    assert layer.scale[INPUT] == pytest.approx(E4M3_MAX / amax1.item())
    assert layer.amax_history[WEIGHT, 0] == layer.weight.detach().bfloat16().abs().max().float()
    assert layer.amax_history[GRAD, 0] == g.bfloat16().abs().max().float()
    assert layer.scale[GRAD] == pytest.approx(E5M2_MAX / layer.amax_history[GRAD, 0].item())

    x2 = 4 * x1  # an outlier step: delayed scaling still scales by the history, and saturates
    out, _ = run(layer, x2, g)
    assert layer.scale[INPUT] == pytest.approx(E4M3_MAX / amax1.item())
    assert layer.amax_history[INPUT, :2].tolist() == [x2.abs().max().item(), amax1.item()]
    assert torch.isfinite(out).all()
    run(layer, x1, g)  # now the largest amax in the history (x2's) sets the scale
    assert layer.scale[INPUT] == pytest.approx(E4M3_MAX / x2.abs().max().item())


def test_dynamic_scaling_uses_the_current_amax_and_eval_records_nothing():
    torch.manual_seed(0)
    layer = Fp8Linear(64, 64, recipe=Fp8Recipe(scaling="dynamic"))
    x, g = torch.randn(32, 64), torch.randn(32, 64)
    run(layer, x, g)
    run(layer, 4 * x, g)
    assert layer.scale[INPUT] == pytest.approx(E4M3_MAX / (4 * x).abs().max().item())
    history = layer.amax_history.clone()
    layer.eval()
    with torch.no_grad():
        layer(10 * x)
    assert torch.equal(layer.amax_history, history)


def saved_bytes(module, x):
    """Bytes kept for backward by one forward pass, each storage counted once."""
    with SavedForBackward() as saved, torch.autocast("cpu", torch.bfloat16):
        out = module(x)
    return saved.nbytes, out


def test_minimize_memory_keeps_the_fp8_weight_and_changes_no_number():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=128, block_size=64))
    x = torch.randint(0, 256, (4, 64))
    results = {}
    for minimize in (False, True):
        m = copy.deepcopy(model)
        names = convert_to_fp8(m, Fp8Recipe(minimize_memory=minimize))
        nbytes, out = saved_bytes(m, x)
        out["logits"].float().logsumexp(-1).mean().backward()
        results[minimize] = nbytes, out["logits"], [p.grad for p in m.parameters()]
    weights = sum(model.get_submodule(n).weight.numel() for n in names)
    # a bf16 weight copy is 2 bytes an element, the fp8 weight 1
    assert results[False][0] - results[True][0] == weights
    assert torch.equal(results[False][1], results[True][1])
    assert all(torch.equal(a, b) for a, b in zip(results[False][2], results[True][2]))
    bf16_bytes, _ = saved_bytes(copy.deepcopy(model), x)  # and fp8 keeps less than bf16 autocast
    assert results[False][0] < bf16_bytes


def test_the_skip_rule():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32))
    names = fp8_layer_names(model)
    assert "blocks.0.attn.qkv" not in names and "lm_head" not in names  # the first and the last
    assert names == ["blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj", "blocks.1.attn.qkv",
                     "blocks.1.attn.proj", "blocks.1.mlp.fc", "blocks.1.mlp.proj"]
    odd = torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in
                                [(64, 64), (64, 96), (96, 100), (100, 64), (64, 32), (32, 64), (64, 64)]))
    assert fp8_layer_names(odd) == ["1"]  # 100 is no multiple of 16; 32 is below 64
    tied = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=32))
    convert_to_fp8(tied, Fp8Recipe())
    assert tied.lm_head.weight is tied.wte.weight


def train(tmp_path, name, steps=40, **settings):
    from hputrain.data.batching import load_corpus

    train_data, _ = load_corpus(seq_len=32, max_bytes=200_000)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32))
    args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=steps, logging_steps=1,
                             learning_rate=3e-3, per_device_train_batch_size=8, disable_tqdm=True,
                             accelerator="cpu", throughput_warmup_steps=0, **{"save_steps": 0, **settings})
    trainer = Trainer(model, args, train_dataset=train_data)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return trainer, {r["step"]: r["loss"] for r in records if "loss" in r}


def test_fp8_training_tracks_bf16_for_40_steps(tmp_path):
    _, bf16 = train(tmp_path, "bf16", bf16=True)
    trainer, fp8 = train(tmp_path, "fp8", fp8=True)
    assert len(trainer.precision.layers) == 7
    assert isinstance(trainer.model.blocks[1].mlp.fc, Fp8Linear)
    assert len(fp8) == 40 and fp8[40] < 0.6 * fp8[1]  # it learns
    assert all(abs(fp8[s] - bf16[s]) < 0.10 * bf16[s] for s in bf16)
    assert fp8 != bf16


def test_fp8_resume_restores_weights_and_scaling_state_exactly(tmp_path):
    straight, _ = train(tmp_path, "straight", steps=12, fp8=True, save_steps=6)
    halfway = tmp_path / "straight" / "checkpoint-6"
    assert (halfway / EXTRA_STATE_FILE).is_file()
    resumed, _ = train(tmp_path, "resumed", steps=12, fp8=True, resume_from_checkpoint=str(halfway))
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    for name in resumed.precision.layers:
        a, b = straight.model.get_submodule(name), resumed.model.get_submodule(name)
        assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale), name
        assert a.amax_history[:, 6:].count_nonzero() > 0  # the history reaches back before the save
    # the master weights load into a model without fp8 (inference, export)
    from hputrain.checkpoint.saving import load_checkpoint

    plain = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32))
    load_checkpoint(tmp_path / "straight" / "checkpoint-12", model=plain, restore_rng=False)
    assert torch.equal(plain.blocks[1].mlp.fc.weight, resumed.model.blocks[1].mlp.fc.weight)


def test_fp8_refusals(tmp_path):
    with pytest.raises(InputError, match="cannot run fp8 matrix products in execution_mode='lazy'"):
        Trainer(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=32)),
                TrainingArguments(output_dir=str(tmp_path), fp8=True, accelerator="cpu", execution_mode="lazy"))
    small = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with pytest.raises(InputError, match="no layer of Sequential qualifies"):
        Trainer(small, TrainingArguments(output_dir=str(tmp_path), fp8=True, accelerator="cpu"))
    with pytest.raises(InputError, match="fp8_scaling must be one of delayed, dynamic"):
        TrainingArguments(fp8=True, fp8_scaling="static")


def test_fp8_on_gaudi_uses_the_transformer_engine(tmp_path, fake_hpu):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                             save_steps=0, disable_tqdm=True, fp8=True, minimize_memory=True,
                             fp8_amax_history_len=8, execution_mode="eager")
    tokens = torch.randint(0, 256, (8, 17))
    data = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=16))
    fc = model.blocks[0].mlp.fc.weight.detach().clone()
    trainer = Trainer(model, args, train_dataset=data, accelerator=HPUOnCPU("eager"))
    assert fake_hpu.import_env["PT_HPU_FP8_MINIMIZE_MEMORY"] == "true"  # set before the runtime loaded
    te = [d for n, d in fake_hpu.calls if n == "te.Linear"]
    assert te == [{"in_features": 64, "out_features": 64, "bias": False},  # attn.proj (qkv is first)
                  {"in_features": 64, "out_features": 256, "bias": False},
                  {"in_features": 256, "out_features": 64, "bias": False}]
    assert torch.equal(trainer.model.blocks[0].mlp.fc.weight, fc)  # the weights carried over
    trainer.train()
    recipes = [d["recipe"] for n, d in fake_hpu.calls if n == "fp8_autocast"]
    assert len(recipes) == 2 and all(d["enabled"] for n, d in fake_hpu.calls if n == "fp8_autocast")
    assert recipes[0].fp8_format.name == "HYBRID" and recipes[0].amax_history_len == 8
    assert recipes[0].amax_compute_algo == "max"
    forwards = [d["fp8"] for n, d in fake_hpu.calls if n == "te.Linear.forward"]
    assert len(forwards) == 6 and all(forwards)  # 3 layers x 2 steps, each inside fp8_autocast
    with pytest.raises(InputError, match="Gaudi's Transformer Engine scales from an amax history only"):
        Trainer(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=16)),
                TrainingArguments(output_dir=str(tmp_path), fp8=True, fp8_scaling="dynamic"),
                accelerator=HPUOnCPU("eager"))


@requires_cuda
def test_fp8_linear_on_a_gpu_matches_bf16():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 matrix products need an Ada or Hopper GPU")
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 512).cuda()
    fp8 = Fp8Linear.from_linear(copy.deepcopy(linear), Fp8Recipe())
    x, grad = torch.randn(8, 41, 256, device="cuda"), torch.randn(8, 41, 512, device="cuda")  # 328 rows: padded
    with torch.autocast("cuda", torch.bfloat16):
        out8, out16 = fp8(x), linear(x)
    out8.backward(grad)
    out16.backward(grad)
    assert rel(out8, out16) < 0.06
    assert rel(fp8.weight.grad, linear.weight.grad) < 0.10


# -- where fp8 has matrix units, and where it is emulated (issue 46, item 16) --------------------

def tiny_fp8_args(tmp_path, **settings):
    return TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                             save_steps=0, disable_tqdm=True, fp8=True, **settings)


def test_the_cpu_names_fp8_as_emulated_and_a_gaudi2_as_native(tmp_path, fake_hpu, monkeypatch):
    """What both run headers print after "in" (Precision.describe): on a CPU, which has no fp8
    matrix units, that fp8 is emulated and what for; on a Gaudi 2 (fake runtime), the dtype alone."""
    model = lambda: GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=16))  # noqa: E731
    on_cpu = Trainer(model(), tiny_fp8_args(tmp_path / "cpu", accelerator="cpu"))
    assert not on_cpu.accelerator.native_fp8() and on_cpu.accelerator.supports_fp8()
    said = on_cpu.precision.describe()
    assert said == ("float8_e4m3fn (emulated: the cpu has no fp8 matrix units, so it runs many times "
                    "slower than bf16, see docs/devices.md; a correctness rehearsal of fp8 on gaudi2, "
                    "gaudi3, h100 or h200)")
    gaudi2 = Trainer(model(), tiny_fp8_args(tmp_path / "hpu", execution_mode="eager"),
                     accelerator=HPUOnCPU("eager"))
    assert gaudi2.accelerator.native_fp8() and gaudi2.precision.describe() == "float8_e4m3fn"
    monkeypatch.setattr(fake_hpu, "device_name", "GAUDI")  # first generation: no fp8 at all
    with pytest.raises(InputError, match=r"fp8 was asked for, but GAUDI \(hpu\) cannot run fp8"):
        Trainer(model(), tiny_fp8_args(tmp_path / "gaudi1", execution_mode="eager"),
                accelerator=HPUOnCPU("eager"))


@pytest.mark.slow
def test_the_run_header_says_fp8_is_emulated_on_a_cpu(cli_here, tmp_path):
    status, out, _ = cli_here("train", "--fp8", "--max-steps", "1", "--seq-len", "32",
                              "--per-device-train-batch-size", "2", "--max-corpus-bytes", "20000",
                              "--eval-batches", "1", "--per-device-eval-batch-size", "2",
                              "--save-steps", "-1", "--disable-tqdm", "--output-dir", tmp_path)
    header = out.splitlines()[0]
    assert status == 0 and header.startswith("hputrain: tiny GPT")
    assert ("on cpu (" in header and " in float8_e4m3fn (emulated: the cpu has no fp8 matrix "
            "units, so it runs many times slower than bf16, see docs/devices.md; a correctness "
            "rehearsal of fp8 on gaudi2, gaudi3, h100 or h200), " in header)
    assert header.endswith("training sequences of 32 bytes from the Python standard library")
