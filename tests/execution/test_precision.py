"""Precision plugins and op-list autocast: each listed op computes in its listed dtype, in its
functional and operator forms; gradients keep the parameters' dtype; Gaudi config files drive it."""
import json

import pytest
import torch
import torch.nn.functional as F

import hputrain
from hputrain import AcceleratorConfig, Trainer, TrainingArguments
from hputrain.accelerators.cpu import CPUAccelerator
from hputrain.accelerators.hpu import HPUAccelerator
from hputrain.errors import InputError
from hputrain.execution.precision import (BF16Autocast, OpListAutocast, Precision, autocast,
                                          select_precision)
from hputrain.config.names import parse_precision
from hputrain.config.sections import PrecisionSettings

torch.manual_seed(0)
A, B = torch.randn(4, 4), torch.randn(4, 4)
IDX = torch.tensor([0, 2, 1, 3])


def iadd(a, b):
    x = a.clone()
    x += b
    return x


# (op name, a call that reaches it). Operators and functional forms both.
CALLS = [
    ("add", lambda: A + B), ("add", lambda: torch.add(A, B)),
    ("sub", lambda: A - B), ("rsub", lambda: 1 - A),
    ("mul", lambda: A * B), ("div", lambda: torch.div(A, B)), ("truediv", lambda: A / B),
    ("pow", lambda: A ** 2),
    ("matmul", lambda: A @ B), ("mm", lambda: torch.mm(A, B)), ("bmm", lambda: torch.bmm(A[None], B[None])),
    ("addmm", lambda: torch.addmm(A, A, B)), ("linear", lambda: torch.nn.Linear(4, 3)(A)),
    ("layer_norm", lambda: torch.nn.LayerNorm(4)(A)), ("group_norm", lambda: torch.nn.GroupNorm(2, 4)(A[None, :, :, None])),
    ("softmax", lambda: F.softmax(A, -1)), ("softmax", lambda: A.softmax(-1)),
    ("log_softmax", lambda: F.log_softmax(A, -1)), ("logsumexp", lambda: torch.logsumexp(A, -1)),
    ("gelu", lambda: F.gelu(A)), ("silu", lambda: F.silu(A)), ("softplus", lambda: F.softplus(A)),
    ("exp", lambda: A.exp()), ("log", lambda: A.abs().log()), ("rsqrt", lambda: A.abs().rsqrt()),
    ("embedding", lambda: torch.nn.Embedding(4, 4)(IDX)), ("dropout", lambda: F.dropout(A, 0.1)),
    ("nll_loss", lambda: F.nll_loss(A, IDX)), ("conv2d", lambda: torch.nn.Conv2d(1, 2, 3)(A[None, None])),
]


@pytest.mark.parametrize("name, call", CALLS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CALLS)])
@pytest.mark.parametrize("listed", ["bf16", "fp32"])
def test_each_listed_op_yields_its_dtype(name, call, listed):
    lists = {"bf16_ops": [name]} if listed == "bf16" else {"fp32_ops": [name]}
    with autocast("cpu", **lists):
        out = call()
    assert out.dtype == (torch.bfloat16 if listed == "bf16" else torch.float32)


def test_in_place_add_casts_its_operand_and_keeps_its_dtype():
    """`x += y` with iadd listed: y is cast to the listed dtype; x, updated in place, keeps its own."""
    with autocast("cpu", bf16_ops=["iadd"]):
        out = iadd(A, B)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, A + B.bfloat16().float(), rtol=0, atol=0)
    assert not torch.equal(out, A + B)
    x = A.bfloat16()
    with autocast("cpu", fp32_ops=["iadd"]):
        x += B
    assert x.dtype == torch.bfloat16


def test_unlisted_ops_follow_torch_autocast():
    with autocast("cpu", bf16_ops=["softmax"]):
        assert torch.mm(A, B).dtype == torch.bfloat16  # autocast lowers it anyway
        assert A.exp().dtype == torch.float32  # autocast keeps it in fp32
        assert F.softmax(A, -1).dtype == torch.bfloat16  # listed
    with autocast("cpu"), torch.autocast("cpu", enabled=False):
        pass
    with autocast("cpu"):  # no lists: exactly torch.autocast
        assert F.linear(A, B).dtype == torch.bfloat16 and F.softmax(A, -1).dtype == torch.float32


def test_gradients_keep_the_parameters_dtype():
    layer, norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    with autocast("cpu", bf16_ops=["layer_norm"], fp32_ops=["linear"]):
        hidden = layer(A)
        assert hidden.dtype == torch.float32
        out = norm(hidden)
        assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert {p.grad.dtype for p in [*layer.parameters(), *norm.parameters()]} == {torch.float32}


def test_fp32_listed_op_is_computed_in_fp32():
    with autocast("cpu", fp32_ops=["mm"]):
        out = torch.mm(A, B)
    torch.testing.assert_close(out, A @ B)  # bf16 would be off by ~1e-2


def test_public_api():
    assert hputrain.autocast is autocast


@pytest.mark.parametrize("lists, match", [
    ({"bf16_ops": ["linaer"]}, "unknown op 'linaer'.*did you mean 'linear'"),
    ({"fp32_ops": ["softmax", "bogus_op"]}, "unknown op 'bogus_op'"),
    ({"bf16_ops": ["softmax"], "fp32_ops": ["softmax"]}, "disagree"),
    ({"bf16_ops": ["div"], "fp32_ops": ["truediv"]}, "disagree"),
])
def test_bad_op_lists(lists, match):
    with pytest.raises(InputError, match=match):
        with autocast("cpu", **lists):
            pass


@pytest.mark.parametrize("spelling, expected", [
    (True, "bf16-mixed"), ("bf16", "bf16-mixed"), ("bf16-mixed", "bf16-mixed"), ("BF16", "bf16-mixed"),
    (False, "32-true"), ("32", "32-true"), ("32-true", "32-true"), ("fp32", "32-true"),
    ("auto", "auto"), (" Auto ", "auto"),
])
def test_spellings(spelling, expected):
    assert parse_precision(spelling) == expected


def test_unknown_spelling_is_an_error_not_fp32():
    with pytest.raises(InputError, match="fp16 is not supported"):
        parse_precision("16-mixed")
    with pytest.raises(InputError, match="unknown precision .* or auto"):
        TrainingArguments(precision="half-ish")
    assert TrainingArguments(precision="bf16-mixed").bf16 is True


def test_auto_follows_the_device(fake_hpu):
    class Emulated(CPUAccelerator):
        def native_bf16(self):
            return False

        def bf16_shortfall(self):
            return "bf16 here runs 50x slower than fp32"
    auto = TrainingArguments(precision="auto")
    assert isinstance(select_precision(PrecisionSettings.of(auto), AcceleratorConfig(), HPUAccelerator()), BF16Autocast)
    assert type(select_precision(PrecisionSettings.of(auto), AcceleratorConfig(), Emulated())) is Precision
    asked = select_precision(PrecisionSettings.of(TrainingArguments(bf16=True)), AcceleratorConfig(), Emulated())
    assert isinstance(asked, BF16Autocast) and asked.notice.startswith("bf16 here runs 50x slower")
    assert select_precision(PrecisionSettings.of(TrainingArguments(bf16=True)), AcceleratorConfig(), HPUAccelerator()).notice is None


LEGACY = {"use_habana_mixed_precision": True, "hmp_opt_level": "O1", "hmp_is_verbose": False,
          "use_fused_adam": True, "use_fused_clip_norm": True,
          "hmp_bf16_ops": ["add", "addmm", "bmm", "div", "dropout", "gelu", "iadd", "linear",
                           "layer_norm", "matmul", "mm", "rsub", "softmax", "truediv"],
          "hmp_fp32_ops": ["embedding", "nll_loss", "log_softmax"]}
CURRENT = {"use_torch_autocast": True, "use_fused_adam": True, "autocast_bf16_ops": ["linear", "matmul"],
           "autocast_fp32_ops": ["softmax"]}


def config_file(tmp_path, data):
    path = tmp_path / "gaudi_config.json"
    path.write_text(json.dumps(data))
    return AcceleratorConfig.from_file(path)


def test_plugin_selection(tmp_path):
    cpu, args = CPUAccelerator(), TrainingArguments()
    assert type(select_precision(PrecisionSettings.of(args), AcceleratorConfig(), cpu)) is Precision
    assert type(select_precision(PrecisionSettings.of(TrainingArguments(bf16=True)), AcceleratorConfig(), cpu)) is BF16Autocast
    assert type(select_precision(PrecisionSettings.of(args), config_file(tmp_path, LEGACY), cpu)) is OpListAutocast
    assert type(select_precision(PrecisionSettings.of(args), config_file(tmp_path, CURRENT), cpu)) is OpListAutocast
    assert type(select_precision(PrecisionSettings.of(args), AcceleratorConfig(use_torch_autocast=True), cpu)) is BF16Autocast


def test_fp8_runs_inside_the_bf16_plugin_and_needs_a_device_with_fp8():
    from hputrain.execution.precision import Fp8Mixed

    lists = AcceleratorConfig(use_torch_autocast=True, autocast_fp32_ops=["softmax"])
    plugin = select_precision(PrecisionSettings.of(TrainingArguments(fp8=True, minimize_memory=True)), lists, CPUAccelerator())
    assert isinstance(plugin, Fp8Mixed) and isinstance(plugin.bf16, OpListAutocast)
    assert plugin.recipe.minimize_memory and plugin.recipe.scaling == "delayed"

    class NoFP8(CPUAccelerator):
        def supports_fp8(self):
            return False
    with pytest.raises(InputError, match="fp8 was asked for, but .* cannot run fp8 matrix products"):
        select_precision(PrecisionSettings.of(TrainingArguments(fp8=True)), AcceleratorConfig(), NoFP8())


def test_bf16_on_a_device_without_it_is_an_error():
    class NoBF16(CPUAccelerator):
        def supports_bf16(self):
            return False
    with pytest.raises(InputError, match="bf16 was asked for"):
        select_precision(PrecisionSettings.of(TrainingArguments(bf16=True)), AcceleratorConfig(), NoBF16())


def test_gaudi_gets_the_lists_as_files_before_import(tmp_path, fake_hpu):
    config = config_file(tmp_path, LEGACY)
    hpu = HPUAccelerator("lazy", (config.autocast_bf16_ops, config.autocast_fp32_ops))
    hpu.setup(0)
    import os
    bf16_file = os.environ["PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST"]
    fp32_file = os.environ["PT_HPU_AUTOCAST_FP32_OPS_LIST"]
    assert open(bf16_file).read().split() == LEGACY["hmp_bf16_ops"]
    assert open(fp32_file).read().split() == LEGACY["hmp_fp32_ops"]
    assert fake_hpu.calls[0][0] == "import"
    # the runtime applies the lists: plain torch.autocast on "hpu", no second layer of casting
    plugin = select_precision(PrecisionSettings.of(TrainingArguments()), config, hpu)
    assert type(plugin) is BF16Autocast and plugin.device_type == "hpu"
    # the same lists again agree with the runtime's environment; other lists do not
    HPUAccelerator("lazy", (config.autocast_bf16_ops, config.autocast_fp32_ops)).setup(0)
    with pytest.raises(InputError, match="PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST"):
        HPUAccelerator("lazy", (["mm"], None)).setup(0)


def test_training_with_a_legacy_hmp_config_tracks_plain_bf16(tmp_path):
    from hputrain.models.gpt import GPT, GPTConfig

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (64, 33), generator=g)
    data = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]
    losses = {}
    for name, config in [("bf16", AcceleratorConfig()), ("legacy", config_file(tmp_path, LEGACY))]:
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32))
        args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=20, logging_steps=5, bf16=True,
                                 learning_rate=3e-3, per_device_train_batch_size=8, save_steps=0,
                                 disable_tqdm=True, accelerator="cpu")
        trainer = Trainer(model, args, train_dataset=data, accelerator_config=config)
        assert type(trainer.precision) is (OpListAutocast if name == "legacy" else BF16Autocast)
        trainer.train()
        losses[name] = [json.loads(l)["loss"] for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                        if "loss" in json.loads(l)]
    assert losses["legacy"][-1] < 0.9 * losses["legacy"][0]  # it learns
    assert losses["legacy"] == pytest.approx(losses["bf16"], rel=0.02)
