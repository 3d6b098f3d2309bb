"""Activation checkpointing (distributed/checkpointing.py) and the shared notion of blocks
(distributed/blocks.py): the same losses with less kept for backward, on the built-in GPT and a
Hugging Face Llama, in eager, lazy and compile mode, one process and two."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hputrain import AcceleratorConfig, TrainingArguments
from hputrain.cli import main
from hputrain.config.fields import ConfigError
from hputrain.distributed.blocks import block_modules
from hputrain.distributed.activation_checkpointing import (apply_activation_checkpointing,
                                                           is_checkpointed)
from hputrain.errors import InputError
from hputrain.training.telemetry import SavedForBackward
from hputrain.config.sections import ActivationCheckpointing

from .. import checkpointing_script as script

ROOT = Path(__file__).parents[2]
ON = {"gradient_checkpointing": True}


def _llama():
    pytest.importorskip("transformers")
    return "llama"


def _batch(kind: str) -> dict:
    return {k: torch.stack([row[k] for row in script.rows(kind)[:4]]) for k in ("input_ids", "labels")}


def _recomputed(model, blocks, kind: str, **checkpointing) -> list[int]:
    """How many times each block's MLP started in one training forward and backward: 2 where the
    block is recomputed in backward, 1 where its activations were kept. (A pre-hook: the
    recomputation stops as soon as it has what backward needs, before the MLP returns.)"""
    apply_activation_checkpointing(model, ActivationCheckpointing.of(TrainingArguments(**checkpointing)))
    calls = [0] * len(blocks)
    for i, block in enumerate(blocks):
        block.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    model.train()
    output = model(**_batch(kind))
    (output["loss"] if isinstance(output, dict) else output.loss).backward()
    return calls


# -- the same losses -------------------------------------------------------------------------------

@pytest.mark.parametrize("every", [1, 2])
def test_gpt_losses_equal_with_and_without_checkpointing(tmp_path, every):
    plain = script.train(str(tmp_path / "plain"), "gpt")
    checkpointed = script.train(str(tmp_path / "gc"), "gpt", **ON, gradient_checkpointing_every=every)
    assert len(plain) == 4
    assert checkpointed == pytest.approx(plain, abs=1e-6)


def test_llama_losses_equal_with_and_without_checkpointing(tmp_path):
    kind = _llama()
    plain = script.train(str(tmp_path / "plain"), kind)
    checkpointed = script.train(str(tmp_path / "gc"), kind, **ON)
    assert checkpointed == pytest.approx(plain, abs=1e-6)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_lazy_mode_with_checkpointing_matches_eager(tmp_path, kind):
    """torch.utils.checkpoint looks up torch.lazy for the lazy device's RNG and fails, and its
    recomputation would run outside the lazy backend's gap replacements: both routed around."""
    kind = _llama() if kind == "llama" else kind
    eager = script.train(str(tmp_path / "eager"), kind)
    lazy = script.train(str(tmp_path / "lazy"), kind, execution_mode="lazy", **ON,
                        gradient_checkpointing_every=2)
    assert lazy == pytest.approx(eager, abs=1e-5)


def test_a_hugging_face_models_own_checkpointing_runs_in_lazy_mode(tmp_path):
    """A script that turned on the model's checkpointing itself: it crashed under lazy mode
    (module 'torch' has no attribute 'lazy')."""
    _llama()
    from hputrain import Trainer

    model = script.build("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    args = TrainingArguments(output_dir=str(tmp_path), accelerator="cpu", execution_mode="lazy",
                             max_steps=2, logging_steps=1, per_device_train_batch_size=4,
                             save_steps=-1, disable_tqdm=True, report_to="none")
    output = Trainer(model, args, train_dataset=script.rows("llama")).train()
    assert output.global_step == 2 and torch.isfinite(torch.tensor(output.training_loss))


def test_op_list_autocast_losses_equal(tmp_path):
    """The recomputation runs under the op lists too (a torch-function mode outside backward)."""
    from hputrain import Trainer

    config = AcceleratorConfig(use_torch_autocast=True, autocast_bf16_ops=["linear", "matmul"],
                               autocast_fp32_ops=["softmax", "layer_norm"])
    losses = []
    for name, extra in (("plain", {}), ("gc", ON)):
        args = TrainingArguments(output_dir=str(tmp_path / name), accelerator="cpu", max_steps=3,
                                 logging_steps=1, per_device_train_batch_size=4, save_steps=-1,
                                 disable_tqdm=True, report_to="none", **extra)
        Trainer(script.build("gpt"), args, train_dataset=script.rows("gpt"),
                accelerator_config=config).train()
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        losses.append([r["loss"] for r in map(json.loads, lines) if "loss" in r])
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)


def test_fp8_losses_equal(tmp_path):
    settings = dict(layers=3, fp8=True)
    plain = script.train(str(tmp_path / "plain"), "gpt", **settings)
    checkpointed = script.train(str(tmp_path / "gc"), "gpt", **settings, **ON)
    assert checkpointed == pytest.approx(plain, abs=1e-6)


@pytest.mark.slow
def test_compile_mode_losses_equal(tmp_path):
    plain = script.train(str(tmp_path / "plain"), "gpt", layers=2, execution_mode="compile")
    checkpointed = script.train(str(tmp_path / "gc"), "gpt", layers=2, execution_mode="compile", **ON)
    assert checkpointed == pytest.approx(plain, abs=1e-5)


def _two_process_losses(tmp_path, strategy: str) -> tuple[list[float], list[float]]:
    """The losses of 2 processes through `hputrain launch`, without and with checkpointing."""
    _llama()

    def launch(folder, *flags):
        proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "launch", "--nproc-per-node", "2",
                               str(ROOT / "tests" / "checkpointing_script.py"), str(folder), "llama",
                               f'strategy="{strategy}"', "per_device_train_batch_size=2", *flags],
                              capture_output=True, text=True, timeout=300, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if "loss" in r]

    return launch(tmp_path / "plain"), launch(tmp_path / "gc", "gradient_checkpointing=true")


@pytest.mark.slow
def test_ddp_losses_equal_with_and_without_checkpointing(tmp_path):
    plain, checkpointed = _two_process_losses(tmp_path, "ddp")
    assert len(plain) == 4
    assert checkpointed == pytest.approx(plain, abs=1e-6)


@pytest.mark.slow
def test_fast_ddp_losses_equal_with_and_without_checkpointing(tmp_path):
    plain, checkpointed = _two_process_losses(tmp_path, "fast_ddp")
    assert checkpointed == pytest.approx(plain, abs=1e-6)


# -- less kept for backward, and exactly the blocks asked for --------------------------------------

@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_saved_for_backward_bytes_fall(kind):
    kind = _llama() if kind == "llama" else kind
    saved = []
    for checkpointing in ({}, ON):
        model = script.build(kind, layers=4)
        apply_activation_checkpointing(model, ActivationCheckpointing.of(TrainingArguments(**checkpointing)))
        model.train()
        with SavedForBackward() as counter:
            model(**_batch(kind))
        saved.append(counter.nbytes)
    assert saved[1] < saved[0] / 2, saved


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_saved_for_backward_leaves_out_the_excluded_weights(kind):
    """Linear keeps weight.t() for backward, a view in the weight's storage, not the Parameter:
    counted by SavedForBackward(), left out with exclude=model.parameters() and counted apart
    in excluded_nbytes (each Linear weight's bytes, once, the GPT's tied head too); the rest is
    the same count. With checkpointing the excluded weights fall out too: blocks keep nothing."""
    kind = _llama() if kind == "llama" else kind
    model = script.build(kind, layers=2)
    model.train()
    with SavedForBackward() as everything:
        model(**_batch(kind))
    with SavedForBackward(exclude=model.parameters()) as activations:
        model(**_batch(kind))
    storages = {m.weight.untyped_storage().data_ptr(): m.weight.untyped_storage().nbytes()
                for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert activations.excluded_nbytes == sum(storages.values()) > 0
    assert activations.nbytes + activations.excluded_nbytes == everything.nbytes
    assert 0 < activations.nbytes < everything.nbytes

    apply_activation_checkpointing(model, TrainingArguments(**ON))
    with SavedForBackward(exclude=model.parameters()) as checkpointed:
        model(**_batch(kind))
    heads = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
             and not any(f"{b}." in name for b in ("blocks", "layers"))]  # outside the blocks
    assert checkpointed.excluded_nbytes == sum(m.weight.untyped_storage().nbytes() for m in heads)
    assert checkpointed.nbytes < activations.nbytes / 2


@pytest.mark.parametrize("kind, layers, every, expected", [
    ("gpt", 5, 1, [2, 2, 2, 2, 2]),
    ("gpt", 5, 2, [2, 1, 2, 1, 2]),
    ("gpt", 5, 3, [2, 1, 1, 2, 1]),
    ("llama", 4, 2, [2, 1, 2, 1]),
    ("llama", 4, 1, [2, 2, 2, 2]),
])
def test_every_k_checkpoints_exactly_those_blocks(kind, layers, every, expected):
    kind = _llama() if kind == "llama" else kind
    model = script.build(kind, layers)
    blocks = block_modules(model)
    assert len(blocks) == layers
    calls = _recomputed(model, blocks, kind, **ON, gradient_checkpointing_every=every)
    assert calls == expected
    assert [is_checkpointed(b) for b in blocks] == [c == 2 for c in expected]


def test_without_checkpointing_nothing_is_recomputed():
    model = script.build("gpt", 3)
    assert _recomputed(model, block_modules(model), "gpt") == [1, 1, 1]


def test_eval_and_no_grad_run_the_plain_forward():
    model = script.build("gpt", 2)
    apply_activation_checkpointing(model, ActivationCheckpointing.of(TrainingArguments(**ON)))
    model.eval()
    with SavedForBackward() as counter:
        model(**_batch("gpt"))
    reference = script.build("gpt", 2).eval()
    torch.testing.assert_close(model(**_batch("gpt"))["loss"], reference(**_batch("gpt"))["loss"])
    assert counter.nbytes > 0  # no checkpoint in eval: everything kept, as without


# -- checkpoints stay loadable -------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_parameter_names_and_state_dict_keys_unchanged(kind):
    kind = _llama() if kind == "llama" else kind
    plain, model = script.build(kind), script.build(kind)
    apply_activation_checkpointing(model, ActivationCheckpointing.of(TrainingArguments(**ON)))
    assert any(is_checkpointed(b) for b in block_modules(model))
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    plain.load_state_dict(model.state_dict())  # and back, strictly
    model.load_state_dict(plain.state_dict())


def test_a_deep_copy_checkpoints_its_own_blocks():
    model = script.build("gpt", 2)
    apply_activation_checkpointing(model, ActivationCheckpointing.of(TrainingArguments(**ON)))
    twin = copy.deepcopy(model)
    assert all(is_checkpointed(b) for b in twin.blocks)
    assert twin.blocks[0].forward.module is twin.blocks[0]


# -- which modules are blocks, and bad input ----------------------------------------------------

def test_blocks_come_from_the_model_or_the_named_classes():
    gpt = script.build("gpt", 3)
    assert block_modules(gpt) == list(gpt.blocks)
    assert block_modules(gpt, ["MLP"]) == [b.mlp for b in gpt.blocks]
    assert block_modules(gpt, ["Block", "MLP"]) == list(gpt.blocks)  # outermost only
    _llama()
    llama = script.build("llama", 2)
    assert block_modules(llama) == list(llama.model.layers)


def test_named_block_classes_are_checkpointed(tmp_path):
    model = script.build("gpt", 2)
    calls = [0, 0]
    for i, block in enumerate(model.blocks):
        block.attn.qkv.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    apply_activation_checkpointing(model, ActivationCheckpointing.of(TrainingArguments(**ON, fsdp_block_classes=["CausalSelfAttention"])))
    assert [is_checkpointed(b.attn) for b in model.blocks] == [True, True]
    assert not any(is_checkpointed(b) for b in model.blocks)
    model(**_batch("gpt"))["loss"].backward()
    assert calls == [2, 2]


def test_a_block_class_that_does_not_exist_is_one_line():
    with pytest.raises(InputError) as exc:
        apply_activation_checkpointing(script.build("gpt", 2),
                                       ActivationCheckpointing.of(TrainingArguments(**ON, fsdp_block_classes=["Blok"])))
    message = str(exc.value)
    assert "\n" not in message
    assert "'Blok'" in message and "no module class of GPT" in message and "'Block'" in message


def test_a_model_without_blocks_is_one_line():
    with pytest.raises(InputError, match="has no transformer blocks.*fsdp_block_classes"):
        apply_activation_checkpointing(torch.nn.Linear(4, 4), ActivationCheckpointing.of(TrainingArguments(**ON)))


@pytest.mark.parametrize("kwargs, words", [
    ({"gradient_checkpointing_every": 0}, "at least 1"),
    ({"gradient_checkpointing_every": 2}, "needs gradient_checkpointing=True"),
    ({"fsdp_block_classes": []}, "non-empty list of class names"),
    ({"fsdp_block_classes": ["Block", ""]}, "non-empty list of class names"),
])
def test_bad_settings_are_refused(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        TrainingArguments(**kwargs)


def test_one_class_name_is_taken_as_a_list():
    assert TrainingArguments(fsdp_block_classes="Block").fsdp_block_classes == ["Block"]


# -- the command line -------------------------------------------------------------------------------

@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("HPUTRAIN_CONFIG_FILE", str(tmp_path / "none.json"))
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.py").write_bytes(Path(os.__file__).read_bytes()[:40_000])
    return tmp_path / "corpus"


RECIPE = ["--accelerator", "cpu", "--max-steps", "2", "--seq-len", "32", "--logging-steps", "1",
          "--per-device-train-batch-size", "2", "--disable-tqdm", "--save-steps", "-1",
          "--report-to", "none", "--throughput-warmup-steps", "0"]


def test_train_flag_on_the_built_in_recipe(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    assert main(["train", "--corpus", str(corpus), "--output-dir", str(out), *RECIPE,
                 "--gradient-checkpointing", "--gradient-checkpointing-every", "2"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]


def test_a_missing_block_class_on_the_command_line_is_exit_2(tmp_path, corpus, capsys):
    assert main(["train", "--corpus", str(corpus), "--output-dir", str(tmp_path / "out"), *RECIPE,
                 "--gradient-checkpointing", "--fsdp-block-classes", "DecoderLayer"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'DecoderLayer'" in err and "Traceback" not in err
