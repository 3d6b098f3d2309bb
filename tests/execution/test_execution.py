"""Execution modes: lazy on the CPU against eager, the lazy call sequence on a (fake) Gaudi,
compile against eager, and graphs for training (`hputrain doctor` is tested in test_doctor.py)."""
import json

import pytest
import torch

from hputrain import AcceleratorConfig, Trainer, TrainingArguments
from hputrain.accelerators.hpu import HPUAccelerator
from hputrain.errors import InputError
from hputrain.models.gpt import GPT, GPTConfig

from ..training.test_trainer import Regression, regression_data


def token_data(n=64, seq=32):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (n, seq + 1), generator=g)
    return [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]


def train_gpt(tmp_path, mode, steps=20, **kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32))
    args = TrainingArguments(output_dir=str(tmp_path / mode), max_steps=steps, logging_steps=1,
                             learning_rate=1e-3, per_device_train_batch_size=4, save_steps=0,
                             disable_tqdm=True, execution_mode=mode, accelerator="cpu",
                             throughput_warmup_steps=2, **kw)
    out = Trainer(model, args, train_dataset=token_data()).train()
    losses = [json.loads(l)["loss"] for l in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(l)]
    return model, losses, out.metrics


def test_lazy_on_cpu_trains_like_eager(tmp_path):
    eager_model, eager, _ = train_gpt(tmp_path, "eager")
    lazy_model, lazy, summary = train_gpt(tmp_path, "lazy")
    assert len(lazy) == 20
    assert lazy == pytest.approx(eager, abs=1e-5)
    # the weight tied between embedding and output stays one weight on the lazy device
    assert lazy_model.lm_head.weight is lazy_model.wte.weight
    torch.testing.assert_close(lazy_model.wte.weight.cpu(), eager_model.wte.weight, rtol=1e-4, atol=1e-5)
    # a steady state with cached graphs once warm-up is over
    assert summary["graph_compiles"] > 0 and summary["graph_compiles_after_warmup"] == 0


def test_recipe_model_reaches_steady_state_in_lazy_mode(tmp_path):
    """The built-in recipe's GPT (tiny), logging and evaluating: no graph compiles after warm-up."""
    from hputrain.data.batching import load_corpus

    train, val = load_corpus(seq_len=64, max_bytes=200_000)
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=12, logging_steps=3, eval_steps=6,
                             per_device_train_batch_size=4, save_steps=6, disable_tqdm=True,
                             execution_mode="lazy", accelerator="cpu", throughput_warmup_steps=3,
                             learning_rate=1e-3, warmup_steps=2)
    out = Trainer(GPT(GPTConfig.from_size("tiny", block_size=64)), args, train_dataset=train,
                  eval_dataset=torch.utils.data.Subset(val, range(8))).train()
    assert out.metrics["graph_compiles_after_warmup"] == 0
    assert (tmp_path / "checkpoint-12" / "model.safetensors").exists()


class HPUOnCPU(HPUAccelerator):
    """The HPU backend over the fake runtime, with tensors left on the CPU."""

    def setup(self, local_rank=0):
        super().setup(local_rank)
        return torch.device("cpu")


@pytest.mark.parametrize("pipelining", [False, True])
def test_lazy_step_call_sequence_on_gaudi(tmp_path, fake_hpu, pipelining):
    model = Regression()
    model.register_forward_pre_hook(lambda m, a: fake_hpu.record("forward"))
    model.net.register_full_backward_hook(lambda m, gi, go: fake_hpu.record("backward"))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, gradient_accumulation_steps=2,
                             per_device_train_batch_size=4, logging_steps=100, save_steps=0,
                             disable_tqdm=True, pipelining_fwd_bwd=pipelining)
    config = AcceleratorConfig(use_fused_adam=True, use_fused_clip_norm=True)
    trainer = Trainer(model, args, train_dataset=regression_data(), accelerator_config=config,
                      accelerator=HPUOnCPU())
    assert fake_hpu.calls[0] == ("import", {"PT_HPU_LAZY_MODE": "1", "PT_ENABLE_INT64_SUPPORT": None})
    fake_hpu.calls.clear()
    trainer.train()
    names = [n for n in fake_hpu.names() if n in ("forward", "backward", "mark_step", "clip_norm", "FusedAdamW")]
    forward = ["forward", "mark_step", "backward"] if pipelining else ["forward", "backward"]
    micro = forward + ["mark_step"]
    one_step = micro + micro + ["clip_norm", "mark_step"]
    assert names == ["FusedAdamW"] + one_step + one_step


def test_graph_compiles_from_the_gaudi_runtime(fake_hpu):
    hpu = HPUAccelerator("lazy")
    fake_hpu.graph_compilations = 7
    assert hpu.graph_compiles() == 7 and ("metric_global", "graph_compilation") in fake_hpu.calls


def test_graphs_for_training(tmp_path, fake_hpu):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, disable_tqdm=True,
                             use_graphs_for_training=True, save_steps=0)
    Trainer(Regression(), args, train_dataset=regression_data(), accelerator=HPUOnCPU()).train()
    assert ("ModuleCacher", {"max_graphs": 10, "inplace": True}) in fake_hpu.calls
    with pytest.raises(InputError, match="the cpu has no graph capture for training"):
        Trainer(Regression(), TrainingArguments(use_graphs_for_training=True, accelerator="cpu"))


def test_hpu_graphs_for_training_need_lazy_mode(tmp_path, fake_hpu):
    args = TrainingArguments(output_dir=str(tmp_path), use_graphs_for_training=True)
    with pytest.raises(InputError, match="HPU graphs need lazy mode"):
        Trainer(Regression(), args, accelerator=HPUOnCPU("eager"))


@pytest.mark.slow
@pytest.mark.ci
def test_compile_matches_eager_in_bf16(tmp_path):
    _, eager, _ = train_gpt(tmp_path, "eager", steps=8, bf16=True)
    _, compiled, _ = train_gpt(tmp_path, "compile", steps=8, bf16=True)
    assert compiled == pytest.approx(eager, rel=2e-3)


class _AutocastOnItsDevice(torch.nn.Module):
    """Opens torch.autocast on its input's device: disabled, as transformers before 5.0 does in its
    rotary embeddings (to force float32) and PEFT's LoRA on parameters around its fold of the
    adapters, or enabled (to bf16)."""

    def __init__(self, enabled: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear, self.enabled = torch.nn.Linear(4, 1), enabled

    def forward(self, x, y):
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=self.enabled):
            return torch.nn.functional.mse_loss(self.linear(x), y)


def _autocast_run(tmp_path, mode: str, enabled: bool = False):
    args = TrainingArguments(output_dir=str(tmp_path / mode), max_steps=2, accelerator="cpu",
                             execution_mode=mode, report_to="none", disable_tqdm=True, precision="fp32",
                             logging_steps=1, save_strategy="no")
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, generator=g), torch.randn(1, generator=g)) for _ in range(16)]
    model = _AutocastOnItsDevice(enabled)
    Trainer(model, args, train_dataset=data).train()
    return model


def test_a_disabled_autocast_on_the_lazy_device_trains_as_eager(tmp_path):
    """torch has no autocast for the lazy device, so even a disabled one failed there ("unsupported
    scalarType"); it asks for nothing, and is taken as nothing: the weights after two steps are
    eager's."""
    lazy, eager = _autocast_run(tmp_path, "lazy"), _autocast_run(tmp_path, "eager")
    for (name, a), b in zip(lazy.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6, msg=name)


def test_a_model_that_autocasts_on_the_lazy_device_is_one_line(tmp_path):
    """An enabled autocast on the lazy device cannot run: "unsupported scalarType" deep in torch
    becomes one line naming the code that opens it and what to do."""
    with pytest.raises(InputError) as caught:
        _autocast_run(tmp_path, "lazy", enabled=True)
    message = str(caught.value)
    assert "\n" not in message and "torch.autocast on the lazy device" in message
    assert "test_execution.py:" in message and "--execution-mode eager" in message
