"""Issue 40 items 2 and 3: the router's load-balancing loss of a mixture of experts (training/
router.py) against transformers' own number, on packed blocks, with its coefficient, over two
processes as in one; and the router's load metrics in metrics.jsonl.

Issue 47 items 5, 6, 9, 11 and 12: every family's load metrics from its router's own picks
(DeepSeek-V2's group-limited and V3's biased top-k), DeepSeek-V3's aux-loss-free bias update,
the header's words on the balancing, the loss's two ends in transformers' formula, gradient
accumulation (per micro-batch, said), expert parallelism with the loss on, fsdp + EP +
accumulation, and a biased family through hputrain's own experts."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ...moe_fixtures import mixtral_folder, moe_folders, tiny_moe_config  # noqa: F401

transformers = pytest.importorskip("transformers")

from hputrain import Trainer, TrainingArguments  # noqa: E402
from hputrain.cli import main  # noqa: E402
from hputrain.data.packing import block_causal_mask  # noqa: E402
from hputrain.distributed.group import ProcessGroup  # noqa: E402
from hputrain.training.extras import token_mask  # noqa: E402
from hputrain.errors import InputError  # noqa: E402
from hputrain.kinds.moe import router as routing  # noqa: E402
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


def router_for(model, coef=None, rate=0.0, accumulate=1):
    args = SimpleNamespace(router_aux_loss_coef=coef, router_bias_update_rate=rate,
                           gradient_accumulation_steps=accumulate)
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
    ours, out = recorded_aux(router, model, token_mask(inputs), output_router_logits=True,
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
    ours, _ = recorded_aux(router, model, token_mask(batch), input_ids=block,
                           position_ids=positions, output_router_logits=False,
                           attention_mask=block_causal_mask(seq_lens, 16, torch.float32))
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    # the padding's tokens would change it
    everything, _ = recorded_aux(router, model, None, input_ids=block, position_ids=positions,
                                 output_router_logits=False, attention_mask=block_causal_mask(seq_lens, 16, torch.float32))
    assert abs(everything.item() - reference.item()) > 1e-4


LOAD = "; load logged per MoE layer (router/max_load, router/dead_experts)"


@pytest.mark.parametrize("family, line", [
    ("mixtral", "router loss off (the config's output_router_logits is false; "
                "--router-aux-loss-coef C turns it on)"),
    ("deepseek_v2", "router loss off (DeepseekV2ForCausalLM computes none in transformers; "
                    "--router-aux-loss-coef C turns on the load-balancing loss)"),
    ("deepseek_v3", "router balancing off (the routing's correction bias stays as loaded; "
                    "--router-bias-update-rate R updates it as DeepSeek-V3 does)"),
    ("llama4_text", "router balancing: none (Llama4ForCausalLM has no router loss in transformers)")])
def test_every_family_has_a_router_that_says_its_balancing(family, line):
    """Issue 47 items 5 and 6: DeepSeek-V2/V3 and Llama 4 got no Router (no load metric); a
    config without output_router_logits (Mixtral-8x7B's, Qwen3-30B-A3B's) trains no loss, and
    the header says why and how to turn it on."""
    torch.manual_seed(0)
    router = router_for(transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family)))
    assert isinstance(router, routing.Router) and not router.trained
    assert router.line == line + LOAD


def test_the_header_names_the_balancing_asked_for():
    assert router_for(tiny_model("mixtral")).line.startswith(
        "router loss: load balancing × 0.02 (the config's router_aux_loss_coef), its expert counts "
        "pooled over every rank's tokens; load")
    assert router_for(tiny_model("mixtral"), coef=0.5, accumulate=2).line.startswith(
        "router loss: load balancing × 0.5 (--router-aux-loss-coef), its expert counts pooled over "
        "every rank's tokens; per micro-batch: the 2 micro-batches of a step do not pool their "
        "counts (docs/moe.md)")
    assert router_for(tiny_model("mixtral"), coef=0.0).line == "router loss off (--router-aux-loss-coef 0)" + LOAD
    v2 = transformers.AutoModelForCausalLM.from_config(tiny_moe_config("deepseek_v2"))
    assert router_for(v2, coef=0.1).trained
    v3 = transformers.AutoModelForCausalLM.from_config(tiny_moe_config("deepseek_v3"))
    assert router_for(v3, rate=0.001).line == (
        "router balancing: DeepSeek-V3's bias update, each expert's correction bias moved by 0.001 "
        "a step towards the mean load of the step's global batch (--router-bias-update-rate)" + LOAD)


@pytest.mark.parametrize("family, flags, words", [
    ("deepseek_v3", dict(coef=0.1), "router_aux_loss_coef=0.1: DeepseekV3ForCausalLM balances its "
     "experts by its routing's correction bias (DeepSeek-V3's), not by a loss: set "
     "router_bias_update_rate instead (DeepSeek-V3 trained with 0.001)"),
    ("llama4_text", dict(coef=0.1), "router_aux_loss_coef=0.1: Llama4ForCausalLM has no router loss "
     "in transformers: leave router_aux_loss_coef unset"),
    ("mixtral", dict(rate=0.001), "router_bias_update_rate=0.001: MixtralForCausalLM's router picks "
     "its experts without a correction bias (DeepSeek-V3's routing), so there is none to update; "
     "balance it with router_aux_loss_coef"),
    ("dense", dict(rate=0.001), "router_bias_update_rate=0.001: LlamaForCausalLM has no router that "
     "picks its experts with a correction bias (DeepSeek-V3's routing)")])
def test_a_balancing_the_family_has_not_is_one_line(family, flags, words):
    from ...hf_fixtures import tiny_llama_config

    config = tiny_llama_config(300) if family == "dense" else tiny_moe_config(family)
    with pytest.raises(InputError) as error:
        router_for(transformers.AutoModelForCausalLM.from_config(config), **flags)
    assert str(error.value) == words


def test_a_refused_balancing_is_one_line_from_the_command_line(tmp_path, moe_folders, capsys):  # noqa: F811
    data, folder = completion_rows(tmp_path / "rows.jsonl", n=8), moe_folders("deepseek_v3")
    capsys.readouterr()  # (writing the folder's weights shows a progress bar)
    for flags, line in ((["--router-aux-loss-coef", "0.1"], "router_aux_loss_coef=0.1: "
                         "DeepseekV3ForCausalLM balances its experts by its routing's correction bias"),
                        (["--router-bias-update-rate", "-0.001"],
                         "router_bias_update_rate must not be negative, got -0.001")):
        argv = ["train", "--model", str(folder), "--dataset", str(data),
                "--output-dir", str(tmp_path / "out"), "--max-steps", "1", *flags]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hputrain: error: " + line) and "\n" not in err, err


def first_routers(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith(("TopkRouter", "TopKRouter", "Router"))]


def routers_picks(model, inputs: dict) -> torch.Tensor:
    """[MoE layers, E]: the tokens each expert got in a forward, from what each router returned
    (its top-k indices; Llama 4's: the top-k of its logits), counted apart from hputrain."""
    seen = []

    def keep(module, args, output):
        ints = [t for t in output if not t.is_floating_point()]
        seen.append(ints[0] if ints else torch.topk(output[1], module.top_k, dim=-1).indices)

    hooks = [r.register_forward_hook(keep) for r in first_routers(model)]
    with torch.no_grad():
        model(**inputs)
    for hook in hooks:
        hook.remove()
    mask = inputs.get("attention_mask")
    keep_rows = torch.ones(seen[0].shape[0], dtype=torch.bool) if mask is None else mask.reshape(-1).bool()
    return torch.stack([torch.bincount(s[keep_rows].reshape(-1), minlength=8).float() for s in seen])


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "llama4_text", "mixtral"])
def test_the_load_metrics_count_the_routers_own_picks(family):
    """DeepSeek-V2's group-limited and V3's bias-corrected top-k are not the top-k of the
    logits: the load is what the router picked. V3 with a large bias on expert 5 sends every
    token there (max load E/k = 4), which its logits alone never say."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family)).eval()
    if family == "deepseek_v3":
        for router in first_routers(model):
            router.e_score_correction_bias[5] = 10.0
    router = router_for(model)
    ids, mask = padded_batch([9, 5, 12])
    inputs = {"input_ids": ids, "attention_mask": mask}
    expected = routers_picks(model, inputs)
    with torch.enable_grad(), router.recording(token_mask(inputs)):
        model(**inputs)
    record = router.metrics(ProcessGroup(0, 0, 1, "gloo"))
    assert record == routing.load_metrics(expected, router.layers)
    assert len(record) == 2 * len(router.layers) and "aux_loss" not in record
    if family == "deepseek_v3":
        assert router.layers == [1, 2]  # layer 0 is dense
        assert record["router/max_load.layer1"] == record["router/max_load.layer2"] == 4.0


def test_deepseek_v2_trains_the_load_balancing_loss_when_asked():
    """Greedy top-k (V2-Lite's): transformers' load_balancing_loss_func on V2's router logits;
    group-limited (V2's): the same sum over the router's own picks, as DeepSeek-V2 counts them."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    ids, mask = padded_batch([9, 5, 12])
    inputs = {"input_ids": ids, "attention_mask": mask}
    for method in ("greedy", "group_limited_greedy"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            tiny_moe_config("deepseek_v2", topk_method=method)).eval()
        router = router_for(model, coef=0.1)
        ours, out = recorded_aux(router, model, token_mask(inputs),
                                 output_router_logits=True, **inputs)
        theirs = load_balancing_loss_func(out.router_logits, 8, 2, mask)
        picks = routers_picks(model, inputs)
        probs = sum((torch.softmax(layer, -1) * mask.reshape(-1, 1)).sum(0) for layer in out.router_logits)
        tokens = mask.sum() * len(out.router_logits)
        by_hand = 8 * (picks.sum(0) / tokens * probs / tokens).sum()
        torch.testing.assert_close(ours, by_hand, rtol=1e-5, atol=0)
        if method == "greedy":
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
        else:  # the grouped picks are not the logits' top-k
            assert abs(ours.item() - theirs.item()) > 1e-4


def test_the_loss_is_k_when_balanced_and_E_when_collapsed():
    """Issue 47 item 11: transformers' load_balancing_loss_func (and ours) give k = 2 when every
    expert gets k/E of the picks and 1/E of the probability, and E = 8 when every token picks
    the same 2 experts; the max load is 1 and E/k, the dead experts 0 and 1 - k/E."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    tokens, rows = 64, torch.arange(64)
    balanced = torch.zeros(tokens, 8)  # token t leans, by a hair, to experts 2t, 2t + 1 (mod 8)
    balanced[rows, (2 * rows) % 8] = balanced[rows, (2 * rows + 1) % 8] = 1e-3
    collapsed = torch.full((tokens, 8), -30.0)
    collapsed[:, :2] = 30.0
    for logits, ends in ((balanced, (2.0, 1.0, 0.0)), (collapsed, (8.0, 4.0, 0.75))):
        theirs = load_balancing_loss_func((logits, logits), 8, 2)
        picks, probs, real = routing.load_balancing_parts([logits, logits], 8, 2, None)
        ours = routing.load_balancing_loss(picks, probs, real, 8)
        assert theirs.item() == pytest.approx(ends[0], rel=1e-3)
        assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
        assert routing.load_metrics(picks) == {
            "router/max_load.layer0": ends[1], "router/dead_experts.layer0": ends[2],
            "router/max_load.layer1": ends[1], "router/dead_experts.layer1": ends[2]}


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


def test_a_biased_family_trains_the_router_loss_through_hputrains_experts(tmp_path):
    """Issue 47 item 12: GPT-OSS (a router bias, biased experts, interleaved gate/up) through the
    static experts the Trainer swaps in: every gradient of LM + coef · aux equals transformers'
    with its eager experts, the router's bias included."""
    reference = tiny_model("gpt_oss")
    reference.set_experts_implementation("eager")
    theirs = reference_gradients(reference, with_aux=True)
    model, grads = tiny_model("gpt_oss"), {}
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: grads.__setitem__(name, p.grad.detach().clone()))
    trainer = Trainer(model, TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=1, precision="fp32",
        report_to="none", disable_tqdm=True, save_steps=-1, max_grad_norm=0.0, fused_kernels=True),
        train_dataset=rows())
    assert trainer.kernels.get("experts: static") == 2 and trainer.router.trained
    trainer.train()
    for name, value in theirs.items():
        torch.testing.assert_close(grads[name], value, rtol=1e-4, atol=1e-7, msg=name)
    lm_only = reference_gradients(tiny_model("gpt_oss"), with_aux=False)
    bias = next(n for n in theirs if n.endswith("router.bias"))
    assert not torch.allclose(lm_only[bias], grads[bias], rtol=1e-3, atol=1e-6)


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


def test_deepseek_v3s_bias_moves_by_the_rate_against_each_steps_load(tmp_path):
    """Issue 47 item 5: after each step every layer's correction bias moves by rate · sign(mean
    load - load), the load of the step's two micro-batches together, and the next step routes
    with it (DeepSeek-V3, section 2.1.2). Counted here apart from hputrain: the picks each router
    returns in a forward of the untrained model (the weights move by ~1e-12 a step) on the
    batches the Trainer ran, with the bias as it should be at each step."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config("deepseek_v3"))
    reference, seen = copy.deepcopy(model).eval(), []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        {k: kwargs[k].clone() for k in ("input_ids", "attention_mask")}), with_kwargs=True)
    Trainer(model, TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=2, precision="fp32", report_to="none", disable_tqdm=True, save_steps=-1,
        learning_rate=1e-12, router_bias_update_rate=0.01), train_dataset=rows()).train()
    assert len(seen) == 4
    biases = [r.e_score_correction_bias for r in first_routers(reference)]
    for step in (seen[:2], seen[2:]):
        load = sum(routers_picks(reference, batch) for batch in step)
        for bias, layer in zip(biases, load):
            bias += 0.01 * torch.sign(layer.mean() - layer)
    trained = [r.e_score_correction_bias for r in first_routers(model)]
    for ours, theirs in zip(trained, biases):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)
    assert any(b.abs().max() > 0.015 for b in biases)  # both steps moved some expert


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
        (out / "stdout.txt").write_text(proc.stdout)
    else:
        assert main(argv) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_runs(tmp_path, names: tuple, keys: tuple, extra_weights: tuple = ()) -> None:
    """The two runs' step records agree on `keys` (1e-5) and their final/ weights within 1e-5."""
    from safetensors.torch import load_file

    logs = [[json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line] for name in names]
    assert [r["step"] for r in logs[0]] == [r["step"] for r in logs[1]] == [1, 2, 3]
    for a, b in zip(*logs):
        for key in keys:
            assert a[key] == pytest.approx(b[key], abs=1e-5, rel=1e-5), (a["step"], key)
    weights = [load_file(tmp_path / name / "final" / "model.safetensors") for name in names]
    assert weights[0].keys() == weights[1].keys()
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=1e-5, atol=1e-5, msg=name)
    for name in extra_weights:  # what must have moved (DeepSeek-V3's bias)
        assert weights[0][name].abs().max() > 0, name


def test_packed_training_logs_the_router_loss_and_load(tmp_path, mixtral_folder):  # noqa: F811
    data = completion_rows(tmp_path / "rows.jsonl")
    logs = train(tmp_path, "run", mixtral_folder, data, "--max-steps", "2",
                 "--per-device-train-batch-size", "2", "--eval-steps", "2")
    steps = [r for r in logs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        # E · Σ f·P is k = 2 balanced (E = 8 collapsed): a router that starts near uniform
        assert record["aux_loss"] == pytest.approx(2.0, rel=0.02)
        for layer in (0, 1):
            assert 1.0 <= record[f"router/max_load.layer{layer}"] <= 4.0  # at most E / k
            assert 0.0 <= record[f"router/dead_experts.layer{layer}"] <= 1.0
    evaluation = next(r for r in logs if "eval_loss" in r)
    assert "eval_aux_loss" in evaluation and "aux_loss" not in evaluation


def test_the_header_says_the_router_loss_is_off_where_the_config_leaves_it_off(
        tmp_path, moe_folders, capsys):  # noqa: F811
    """Issue 47 item 6: Mixtral-8x7B and Qwen3-30B-A3B ship output_router_logits: false."""
    data = completion_rows(tmp_path / "rows.jsonl", n=16)
    logs = train(tmp_path, "run", moe_folders("qwen3_moe"), data, "--max-steps", "1",
                 "--per-device-train-batch-size", "2", "--validation-split-percentage", "0")
    header = capsys.readouterr().out.splitlines()
    assert header[1] == ("hputrain: router loss off (the config's output_router_logits is false; "
                         "--router-aux-loss-coef C turns it on)" + LOAD), header[:3]
    assert "aux_loss" not in logs[0] and logs[0]["router/max_load.layer1"] >= 1.0


@pytest.mark.slow
def test_under_accumulation_the_lm_loss_is_batch_4s_and_the_router_loss_per_micro_batch(
        tmp_path, mixtral_folder, capsys):  # noqa: F811
    """Issue 47 item 9, kept per micro-batch (router.py says why pooling the step's counts is
    not done): accumulation 2 × batch 2 has batch 4's LM loss, not its router loss, and its
    header says so."""
    data = completion_rows(tmp_path / "rows.jsonl", n=16)
    common = ["--max-steps", "1", "--validation-split-percentage", "0"]
    whole = train(tmp_path, "whole", mixtral_folder, data, *common, "--per-device-train-batch-size", "4")
    assert "do not pool" not in capsys.readouterr().out
    parts = train(tmp_path, "parts", mixtral_folder, data, *common, "--per-device-train-batch-size",
                  "2", "--gradient-accumulation-steps", "2")
    assert ("per micro-batch: the 2 micro-batches of a step do not pool their counts"
            in capsys.readouterr().out.splitlines()[1])
    a, b = whole[0], parts[0]  # step 1 (after it the router loss's gradients have differed)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert abs(a["aux_loss"] - b["aux_loss"]) > 1e-5  # each micro-batch its own counts
    assert a["router/max_load.layer0"] == pytest.approx(b["router/max_load.layer0"], rel=1e-6)


@pytest.mark.slow
def test_deepseek_v3_logs_its_load_and_resumes_its_updated_bias(tmp_path, moe_folders, capsys):  # noqa: F811
    """Issue 47 item 5 through the command line: the header, the load of both MoE layers (no
    router loss), final/'s bias moved in steps of the rate, and a run resumed from checkpoint-1
    ending on the uninterrupted run's bias (the bias is in the checkpoint)."""
    from safetensors.torch import load_file

    data = completion_rows(tmp_path / "rows.jsonl", n=16)
    folder = moe_folders("deepseek_v3")
    common = ["--max-steps", "2", "--per-device-train-batch-size", "2", "--save-steps", "1",
              "--validation-split-percentage", "0", "--router-bias-update-rate", "0.001"]
    logs = train(tmp_path, "run", folder, data, *common)
    header = capsys.readouterr().out.splitlines()
    assert header[1].startswith("hputrain: router balancing: DeepSeek-V3's bias update, each "
                                "expert's correction bias moved by 0.001 a step"), header[:3]
    steps = [r for r in logs if "loss" in r]
    assert all("aux_loss" not in r and {"router/max_load.layer1", "router/dead_experts.layer2"} <= r.keys()
               for r in steps)
    train(tmp_path, "resumed", folder, data, *common, "--resume-from-checkpoint",
          str(tmp_path / "run" / "checkpoint-1"))
    names = [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)]
    ends = [load_file(tmp_path / run / "final" / "model.safetensors") for run in ("run", "resumed")]
    for name in names:
        steps_moved = ends[0][name] / 0.001
        assert ends[0][name].dtype == torch.float32 and steps_moved.abs().max() > 0.5
        torch.testing.assert_close(steps_moved, steps_moved.round(), rtol=0, atol=1e-3)
        torch.testing.assert_close(ends[1][name], ends[0][name], rtol=0, atol=0)


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
def test_lazy_mode_updates_deepseek_v3s_bias_as_eager_and_compiles_nothing_new(tmp_path, moe_folders):  # noqa: F811
    """The bias update on the device, in the step's graph: no host read, no new graph, the
    eager run's loads and biases."""
    from safetensors.torch import load_file

    data, folder = completion_rows(tmp_path / "rows.jsonl", n=24), moe_folders("deepseek_v3")
    common = ["--max-steps", "5", "--per-device-train-batch-size", "2", "--validation-split-percentage",
              "0", "--router-bias-update-rate", "0.01"]
    eager = [r for r in train(tmp_path, "eager", folder, data, *common) if "loss" in r]
    lazy = train(tmp_path, "lazy", folder, data, *common, "--execution-mode", "lazy")
    assert lazy[-1]["graph_compiles_after_warmup"] == 0
    for a, b in zip(eager, (r for r in lazy if "loss" in r)):
        for key in ("loss", "router/max_load.layer1", "router/max_load.layer2"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key)
    ends = [load_file(tmp_path / run / "final" / "model.safetensors") for run in ("eager", "lazy")]
    for layer in (1, 2):
        name = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        assert ends[0][name].abs().max() > 0
        torch.testing.assert_close(ends[1][name], ends[0][name], rtol=0, atol=1e-7)


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


def header_counts(tmp_path, name: str) -> tuple[str, str]:
    """The model line of a run's header: (what it says of the kind, "N of M parameters")."""
    line = next(line for line in (tmp_path / name / "stdout.txt").read_text().splitlines()
                if line.startswith("hputrain: MixtralForCausalLM ("))
    kind, rest = line.removeprefix("hputrain: MixtralForCausalLM (").split("), ", 1)
    return kind, rest.split(" parameters trainable")[0]


@pytest.mark.slow
def test_expert_parallelism_trains_the_router_loss_as_one_process(tmp_path, mixtral_folder):  # noqa: F811
    """Issue 47 items 11 and 12: ddp + --expert-parallel-size 2 with the router loss on = one
    process with batch 4 (loss, router loss, load, weights), and its header counts the whole
    model and says how the experts are split."""
    data = completion_rows(tmp_path / "rows.jsonl")
    common = ["--max-steps", "3", "--validation-split-percentage", "0", "--router-aux-loss-coef", "0.5"]
    train(tmp_path, "one", mixtral_folder, data, *common, "--per-device-train-batch-size", "4",
          processes=True)
    train(tmp_path, "ep", mixtral_folder, data, *common, "--per-device-train-batch-size", "2",
          "--devices", "2", "--strategy", "ddp", "--expert-parallel-size", "2", processes=True)
    assert_same_runs(tmp_path, ("one", "ep"), ("loss", "aux_loss", "router/max_load.layer0",
                                               "router/dead_experts.layer1"))
    (kind, count), (ep_kind, ep_count) = header_counts(tmp_path, "one"), header_counts(tmp_path, "ep")
    assert ep_kind == kind + (", experts split over 2 ranks (4 a rank, all-to-all buffers 1.25x the average, "
                              "an overflow runs the forward again)")
    assert ep_count == count  # the whole model's parameters, not one rank's


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_fsdp_with_expert_parallelism_and_accumulation_trains_as_one_process(
        tmp_path, family, mixtral_folder, moe_folders):  # noqa: F811
    """Issue 47 item 12: fsdp over 2 processes, --expert-parallel-size 2, 2 micro-batches a step
    = one process with the same micro-batches: Mixtral with its router loss (each micro-batch
    pooled over the ranks), DeepSeek-V3 with its bias update (the step's loads pooled over the
    ranks and micro-batches; the bias a buffer fsdp leaves whole)."""
    data = completion_rows(tmp_path / "rows.jsonl")
    balancing = (["--router-aux-loss-coef", "0.5"] if family == "mixtral"
                 else ["--router-bias-update-rate", "0.01"])
    folder = mixtral_folder if family == "mixtral" else moe_folders("deepseek_v3")
    common = ["--max-steps", "3", "--validation-split-percentage", "0", "--gradient-accumulation-steps",
              "2", *balancing]
    train(tmp_path, "one", folder, data, *common, "--per-device-train-batch-size", "4", processes=True)
    train(tmp_path, "ep", folder, data, *common, "--per-device-train-batch-size", "2", "--devices",
          "2", "--strategy", "fsdp", "--expert-parallel-size", "2", processes=True)
    keys = ("loss", "router/max_load.layer1", "router/dead_experts.layer1")
    biases = tuple(f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2))
    assert_same_runs(tmp_path, ("one", "ep"), (*keys, "aux_loss") if family == "mixtral" else keys,
                     () if family == "mixtral" else biases)
