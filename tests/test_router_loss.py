"""Issue 40 items 2 and 3: the router's load-balancing loss of a mixture of experts (training/
router.py) against transformers' own number, on packed blocks, with its coefficient, over two
processes as in one; and the router's load metrics in metrics.jsonl."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from .moe_fixtures import mixtral_folder, moe_folders, tiny_moe_config  # noqa: F401

transformers = pytest.importorskip("transformers")

from hputrain import Trainer, TrainingArguments  # noqa: E402
from hputrain.cli import main  # noqa: E402
from hputrain.data.packing import block_causal_mask  # noqa: E402
from hputrain.distributed.group import ProcessGroup  # noqa: E402
from hputrain.training import router as routing  # noqa: E402
from hputrain.training.objective import Objective  # noqa: E402

LOSS_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"]
"""The families whose model computes transformers' load_balancing_loss_func."""


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


def tiny_model(family: str, **overrides):
    torch.manual_seed(0)
    config = tiny_moe_config(family, output_router_logits=True, router_aux_loss_coef=0.02,
                             **overrides)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def router_for(model, coef=None):
    args = SimpleNamespace(router_aux_loss_coef=coef, gradient_accumulation_steps=1)
    return routing.router_of(model, args, ProcessGroup(0, 0, 1, "gloo"), None)


def recorded_aux(router, model, mask, **inputs) -> torch.Tensor:
    """Our loss of one forward of `model` (transformers' own computed beside it when asked)."""
    with torch.enable_grad(), router.recording(mask):
        out = model(**inputs)
    aux = router._pending.pop()
    return aux, out


def padded_batch(lengths, vocab=300, seed=1):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(4, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return ids, mask


@pytest.mark.parametrize("family", LOSS_FAMILIES)
@pytest.mark.parametrize("masked", [True, False], ids=["padding-mask", "no-mask"])
def test_aux_loss_is_transformers_number(family, masked):
    model = tiny_model(family)
    router = router_for(model)
    assert router.trained and router.coef == 0.02
    ids, mask = padded_batch([9, 5, 12])
    inputs = {"input_ids": ids, "attention_mask": mask} if masked else {"input_ids": ids}
    ours, out = recorded_aux(router, model, routing.token_mask(inputs), output_router_logits=True,
                             **inputs)
    assert out.aux_loss is not None
    torch.testing.assert_close(ours, out.aux_loss.float(), rtol=1e-6, atol=0)
    assert ours.requires_grad  # the router's probabilities carry its gradient


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_packed_block_gives_the_loss_of_its_examples_unpacked(family):
    """Two examples packed in one block of 16 (padding after them) = transformers' loss on the
    same examples as a padded batch with its 2-D mask: each example its own segment, padding out."""
    model = tiny_model(family)
    router = router_for(model)
    ids, mask = padded_batch([5, 7])
    reference = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    block = torch.full((1, 16), 3)
    block[0, :5], block[0, 5:12] = ids[0, :5], ids[1, :7]
    seq_lens = torch.tensor([[5, 7] + [0] * 14])
    positions = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)])[None]
    batch = {"input_ids": block, "seq_lens": seq_lens}
    ours, _ = recorded_aux(router, model, routing.token_mask(batch), input_ids=block,
                           position_ids=positions, output_router_logits=False,
                           attention_mask=block_causal_mask(seq_lens, 16, torch.float32))
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    # the padding's tokens would change it
    everything, _ = recorded_aux(router, model, None, input_ids=block, position_ids=positions,
                                 output_router_logits=False, attention_mask=block_causal_mask(seq_lens, 16, torch.float32))
    assert abs(everything.item() - reference.item()) > 1e-4


def test_families_without_the_loss_have_no_router():
    for family in ("deepseek_v3", "llama4_text"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family))
        assert isinstance(router_for(model, coef=0.1), routing.NoRouter)
        assert not isinstance(router_for(model, coef=0.1), routing.Router)


def test_the_coefficient_comes_from_the_config_and_the_flag_overrides_it():
    assert router_for(tiny_model("mixtral")).coef == 0.02
    assert router_for(tiny_model("mixtral"), coef=0.5).coef == 0.5
    off = router_for(tiny_model("mixtral"), coef=0.0)
    assert not off.trained and off.forward_kwargs == {"output_router_logits": False}
    torch.manual_seed(0)  # output_router_logits false: the config's coefficient is not trained
    quiet = transformers.AutoModelForCausalLM.from_config(tiny_moe_config("mixtral"))
    assert not router_for(quiet).trained and router_for(quiet, coef=0.1).trained


def test_load_metrics():
    picks = torch.tensor([[4.0, 4.0, 4.0, 4.0], [8.0, 0.0, 8.0, 0.0]])
    assert routing.load_metrics(picks) == {
        "router/max_load.layer0": 1.0, "router/dead_experts.layer0": 0.0,
        "router/max_load.layer1": 2.0, "router/dead_experts.layer1": 0.5}
    # named by the decoder layer: Qwen2-MoE with layer 0 dense (mlp_only_layers)
    model = tiny_model("qwen2_moe", num_hidden_layers=3, mlp_only_layers=[0])
    assert router_for(model).layers == [1, 2]


# -- in the Trainer: what the optimizer sees ------------------------------------------------------

def rows(n=8, width=12):
    ids, mask = padded_batch([width - (i % 4) for i in range(n)], seed=7)
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": i, "attention_mask": m, "labels": lab} for i, m, lab in zip(ids, mask, labels)]


def trainer_gradients(model, tmp_path, objective=None, **args) -> dict:
    """The gradients of the Trainer's one step (AdamW would blow numerical noise up to lr)."""
    data, grads = rows(), {}
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: grads.__setitem__(name, p.grad.detach().clone()))
    Trainer(model, TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=len(data), max_steps=1,
        precision="fp32", report_to="none", disable_tqdm=True, save_steps=-1, logging_steps=1,
        max_grad_norm=0.0, **args), train_dataset=data, objective=objective).train()
    return grads


def reference_gradients(model, with_aux: bool) -> dict:
    """The gradients of transformers' own loss (LM + coef · aux on an unpacked batch)."""
    data = rows()
    batch = {k: torch.stack([row[k] for row in data]) for k in data[0]}
    model.train()
    model(**batch, output_router_logits=with_aux).loss.backward()
    return {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize("flag, checkpointed", [(None, False), (0.0, False), (None, True)],
                         ids=["config-coef", "flag-off", "activation-checkpointing"])
def test_the_optimizer_sees_lm_plus_coef_times_aux(tmp_path, flag, checkpointed):
    theirs = reference_gradients(tiny_model("mixtral"), with_aux=flag is None)
    ours = trainer_gradients(tiny_model("mixtral"), tmp_path, router_aux_loss_coef=flag,
                             gradient_checkpointing=checkpointed)
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-7, msg=name)
    if flag is None:  # the router loss is in the router's gradient: without it, another one
        lm_only = reference_gradients(tiny_model("mixtral"), with_aux=False)
        gate = next(n for n in theirs if ".gate." in n)
        assert not torch.allclose(lm_only[gate], theirs[gate], rtol=1e-3, atol=1e-6)


class CallModel(Objective):
    """A method whose loss calls the model through Loop.call_model, as DPO, GRPO and the reward
    model do: the LM loss computed by the method itself."""

    def compute_loss(self, module, batch):
        logits = self.loop.call_model(module, batch["input_ids"], batch["attention_mask"]).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 batch["labels"][:, 1:].flatten())


def test_a_method_calling_the_model_through_the_loop_trains_the_router_loss_too(tmp_path):
    theirs = reference_gradients(tiny_model("mixtral"), with_aux=True)
    ours = trainer_gradients(tiny_model("mixtral"), tmp_path, objective=CallModel())
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-7, msg=name)


def test_under_gradient_accumulation_each_micro_batch_has_its_own_router_loss(tmp_path):
    """Batch 4 × 2 micro-batches: the LM loss is the mean over the step's tokens (loss.py), the
    router's is transformers' on each micro-batch, averaged over the two."""
    model, seen = tiny_model("mixtral"), []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        {k: kwargs[k].clone() for k in ("input_ids", "attention_mask", "labels")}), with_kwargs=True)
    data, grads = rows(), {}
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: grads.__setitem__(name, p.grad.detach().clone()))
    Trainer(model, TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=1, precision="fp32", report_to="none", disable_tqdm=True, save_steps=-1,
        max_grad_norm=0.0), train_dataset=data).train()
    hook.remove()
    assert len(seen) == 2
    reference, coef = tiny_model("mixtral").train(), 0.02
    counts = [int((batch["labels"][:, 1:] != -100).sum()) for batch in seen]
    for batch, count in zip(seen, counts):
        out = reference(**batch, output_router_logits=True)
        lm = out.loss - coef * out.aux_loss
        (lm * count / sum(counts) + coef * out.aux_loss / 2).backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-7, msg=name)


# -- through the command line: packed rows, metrics.jsonl, two processes ---------------------------

def completion_rows(path: Path, n=48) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{i}: what is {i % 7}? ",
                                        "completion": "an answer" + " more" * (i % 5)}) + "\n"
                            for i in range(n)))
    return path


def train(tmp_path, name, model, data, *extra, processes=False) -> list[dict]:
    out = tmp_path / name
    argv = ["train", "--model", str(model), "--dataset", str(data), "--output-dir", str(out),
            "--block-size", "64", "--precision", "fp32", "--disable-tqdm", "--save-steps", "-1",
            "--logging-steps", "1", "--seed", "3", "--learning-rate", "3e-3", *extra]
    if processes:
        proc = subprocess.run([sys.executable, "-m", "hputrain.cli", *argv, "--cpu"],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    else:
        assert main(argv) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_packed_training_logs_the_router_loss_and_load(tmp_path, mixtral_folder):  # noqa: F811
    data = completion_rows(tmp_path / "rows.jsonl")
    logs = train(tmp_path, "run", mixtral_folder, data, "--max-steps", "2",
                 "--per-device-train-batch-size", "2", "--eval-steps", "2")
    steps = [r for r in logs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert 1.0 <= record["aux_loss"] <= 8.0  # E · Σ f·P: 1 balanced ... E/k·k
        for layer in (0, 1):
            assert 1.0 <= record[f"router/max_load.layer{layer}"] <= 4.0  # at most E / k
            assert 0.0 <= record[f"router/dead_experts.layer{layer}"] <= 1.0
    evaluation = next(r for r in logs if "eval_loss" in r)
    assert "eval_aux_loss" in evaluation and "aux_loss" not in evaluation


@pytest.mark.slow
def test_lazy_mode_trains_the_same_router_loss_and_compiles_nothing_new(tmp_path, mixtral_folder):  # noqa: F811
    data = completion_rows(tmp_path / "rows.jsonl")
    common = ["--max-steps", "4", "--per-device-train-batch-size", "2", "--validation-split-percentage", "0"]
    eager = [r for r in train(tmp_path, "eager", mixtral_folder, data, *common) if "loss" in r]
    lazy = train(tmp_path, "lazy", mixtral_folder, data, *common, "--execution-mode", "lazy")
    assert lazy[-1]["graph_compiles_after_warmup"] == 0
    for a, b in zip(eager, (r for r in lazy if "loss" in r)):
        for key in ("loss", "aux_loss", "router/max_load.layer1"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key)


@pytest.mark.slow
def test_two_processes_train_the_router_loss_as_one(tmp_path, mixtral_folder):  # noqa: F811
    """2 ranks × batch 2 = batch 4 in one process: the loss, the router's loss and the weights
    after 3 steps (the counts summed over the ranks)."""
    data = completion_rows(tmp_path / "rows.jsonl")
    common = ["--max-steps", "3", "--validation-split-percentage", "0", "--router-aux-loss-coef", "0.5"]
    one = train(tmp_path, "one", mixtral_folder, data, *common, "--per-device-train-batch-size", "4",
                processes=True)
    two = train(tmp_path, "two", mixtral_folder, data, *common, "--per-device-train-batch-size", "2",
                "--devices", "2", processes=True)
    one, two = ([r for r in logs if "loss" in r] for logs in (one, two))
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        for key in ("loss", "aux_loss", "router/max_load.layer0", "router/dead_experts.layer1"):
            assert a[key] == pytest.approx(b[key], abs=1e-5, rel=1e-5), (a["step"], key)
    from safetensors.torch import load_file
    weights = [load_file(tmp_path / name / "final" / "model.safetensors") for name in ("one", "two")]
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=1e-5, atol=1e-5, msg=name)
