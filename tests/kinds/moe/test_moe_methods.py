"""Issue 40, item 8: every method trains a mixture of experts (tiny Mixtral, and Qwen2-MoE with its
shared expert and shared-expert gate).

Each method's number is checked against the method's own reference, computed as its dense test
computes it: SFT's packed loss against each example alone (test_sft_recipe), DPO's first step
against the direct formula with another reference model (test_dpo), GRPO's loss against TRL's on
a direct forward's log-probabilities (test_grpo), the reward model's against the formula on the
scores of unpadded sequences (test_reward_model). Where the folder asks for the router's loss
(output_router_logits), it is logged beside the method's own loss (`aux_loss`), which stays the
method's. What is frozen stays as it was, and what trains moves.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from ...moe_fixtures import moe_folders  # noqa: F401
from ...methods.dpo.test_dpo import direct
from ...methods.dpo.test_dpo import text_rows as pair_rows
from ...methods.grpo.test_grpo import PROMPTS as GRPO_PROMPTS
from ...methods.grpo.test_grpo import config as grpo_config
from ...methods.grpo.test_grpo import tens
from ...methods.reward.test_reward_model import MARGINS
from ...methods.reward.test_reward_model import scores as reward_scores
from ...methods.sft.test_sft_recipe import reference_loss

transformers = pytest.importorskip("transformers")

from hputrain import GRPOConfig, GRPOTrainer, grpo_loss  # noqa: E402,F401
from hputrain.cli import main  # noqa: E402
from hputrain.methods.reward.config import RewardConfig  # noqa: E402
from hputrain.methods.dpo.data import encode_pairs  # noqa: E402
from hputrain.methods.reward.trainer import RewardTrainer  # noqa: E402

FAMILIES = ["mixtral", "qwen2_moe"]
SLOW_SECOND = ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow)]  # > 10 s a run
ROUTER_LOSS = dict(output_router_logits=True, router_aux_loss_coef=0.02)
ROUTERS = re.compile(r"\.(gate|shared_expert_gate)\.weight$")


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def train(out: Path, *argv: str) -> list[dict]:
    """`hputrain train` in fp32, one log a step, no evaluation: the logged rows with a loss."""
    assert main(["train", *argv, "--output-dir", str(out), "--logging-steps", "1",
                 "--disable-tqdm", "--validation-split-percentage", "0", "--precision", "fp32",
                 "--save-steps", "-1"]) == 0
    return [row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in row]


def causal(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def moved(before: dict, after: dict) -> set[str]:
    return {name for name, tensor in after.items() if not torch.equal(tensor, before[name])}


def transformers_aux(model, sequences: list[list[int]]) -> float:
    """transformers' load-balancing loss over the tokens of `sequences` together, each sequence
    through the model alone (no padding): the number a batch of them must log, however padded."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    layers = None
    with torch.no_grad():
        for ids in sequences:
            out = model.base_model(input_ids=torch.tensor([ids]), output_router_logits=True)
            logits = [layer.reshape(-1, layer.shape[-1]) for layer in out.router_logits]
            layers = logits if layers is None else [torch.cat(p) for p in zip(layers, logits)]
    config = model.config
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    return float(load_balancing_loss_func(tuple(layers), experts, config.num_experts_per_tok))


# -- SFT on packed prompt + completion rows ---------------------------------------------------------

def completion_rows() -> list[dict]:
    return [{"prompt": f"{i}: {GRPO_PROMPTS[i % 8]}", "completion": " and so it goes on"}
            for i in range(10)]


@pytest.mark.parametrize("family", SLOW_SECOND)
def test_packed_sft_on_moe_is_the_per_example_loss_and_lora_leaves_router_and_experts(
        moe_folders, tmp_path, capsys, family):  # noqa: F811
    folder = moe_folders(family, **ROUTER_LOSS)
    rows = completion_rows()
    data = write_jsonl(tmp_path / "sft.jsonl", rows)
    expected, count = reference_loss(folder, rows)
    assert main(["evaluate", "--model", str(folder), "--dataset", str(data), "--json",
                 "--block-size", "64"]) == 0  # packed: several examples a block
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["eval_tokens"] == count
    assert result["eval_loss"] == pytest.approx(expected, abs=1e-5)  # the LM loss, aux apart
    assert result["eval_aux_loss"] > 0
    logged = train(tmp_path / "run", "--model", str(folder), "--dataset", str(data),
                   "--block-size", "64", "--max-steps", "2", "--per-device-train-batch-size", "1",
                   "--lora-r", "4", "--learning-rate", "1e-2")
    assert all(row["aux_loss"] > 0 for row in logged)
    peft = pytest.importorskip("peft")
    trained = peft.PeftModel.from_pretrained(causal(folder), tmp_path / "run" / "final")
    lora = {name: p for name, p in trained.named_parameters() if "lora_B" in name}
    assert any(".self_attn." in name and p.abs().sum() > 0 for name, p in lora.items())
    assert not any(".experts" in name or ROUTERS.search(name.split(".lora_B")[0] + ".weight")
                   for name in lora)


# -- DPO --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", SLOW_SECOND)
def test_dpo_on_moe_first_step_is_the_direct_loss_and_every_part_trains(moe_folders, tmp_path,  # noqa: F811
                                                                        family):
    policy = moe_folders(family, **ROUTER_LOSS)
    reference = moe_folders(family, seed=1, **ROUTER_LOSS)
    data = write_jsonl(tmp_path / "pairs.jsonl", pair_rows())
    logged = train(tmp_path / "run", "--model", str(policy), "--ref-model", str(reference),
                   "--dataset", str(data), "--max-steps", "1", "--per-device-train-batch-size", "6",
                   "--learning-rate", "1e-3")
    pairs, _ = encode_pairs(((str(i), r) for i, r in enumerate(pair_rows())),
                            transformers.AutoTokenizer.from_pretrained(policy), max_length=128)
    expected = direct(causal(policy), causal(reference), pairs)
    assert logged[0]["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert logged[0]["rewards/margins"] == pytest.approx(expected["margin"], abs=1e-5)
    sequences = [pair["prompt_ids"] + pair[side] for pair in pairs
                 for side in ("chosen_ids", "rejected_ids")]
    assert logged[0]["aux_loss"] == pytest.approx(transformers_aux(causal(policy), sequences), abs=1e-5)
    before = causal(policy).state_dict()
    after = causal(tmp_path / "run" / "final").state_dict()
    changed = moved(before, after)
    assert any(".experts." in name for name in changed)  # a full fine-tune moves the experts
    assert any(ROUTERS.search(name) for name in changed)  # and the routers


# -- GRPO -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_grpo_on_moe_loss_is_trls_on_a_direct_forwards_log_probs(moe_folders, tmp_path, family):  # noqa: F811
    folder = moe_folders(family)
    model = causal(folder).train()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    args = grpo_config(tmp_path, temperature=0.7, beta=0.04, num_iterations=2, loss_type="dapo")
    trainer = GRPOTrainer(model, args, reward_funcs=[tens],
                          train_dataset=[{"prompt": p} for p in GRPO_PROMPTS],
                          processing_class=tokenizer)
    batch = next(trainer.train_batches().iterate(0))
    ours = trainer.objective.compute_loss(trainer.wrapped, batch)
    completion = batch["completion_mask"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, -completion - 1:-1].float() / 0.7
    logps = logits.log_softmax(-1).gather(-1, batch["input_ids"][:, -completion:, None])[..., 0]
    theirs = grpo_loss(logps, batch["old_logps"], batch["ref_logps"], batch["advantages"],
                       batch["completion_mask"], loss_type="dapo", beta=0.04,
                       num_items_in_batch=batch["num_items"], steps_per_generation=1,
                       max_completion_length=completion).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batch["old_logps"], logps.detach(), rtol=1e-5, atol=1e-5)
    assert batch["advantages"].abs().sum() > 0  # the rewards differ: the loss has a gradient
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.args.max_steps = 1
    trainer.train()  # one step: the experts move
    assert any(".experts." in name for name in moved(before, dict(model.named_parameters())))


def test_grpo_rollouts_of_a_config_that_asks_for_the_router_loss(moe_folders, tmp_path):  # noqa: F811
    """A config with output_router_logits (how MoE fine-tuning is configured): the rollouts' static
    decode step asks for no router loss (transformers' own over the cache-length mask was a shape
    error), and training adds the router's loss, logged as aux_loss."""
    folder = moe_folders("mixtral", **ROUTER_LOSS)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in GRPO_PROMPTS])
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def tens(prompts, completions, completion_ids, **_):\n"
                       "    return [sum(t % 10 == 0 for t in ids) / len(ids) for ids in completion_ids]\n")
    rows = train(tmp_path / "out", "--model", str(folder), "--dataset", str(prompts),
                 "--reward-funcs", f"{rewards}:tens", "--max-steps", "1",
                 "--num-generations", "2", "--max-completion-length", "4",
                 "--per-device-train-batch-size", "2")
    assert rows and rows[-1]["aux_loss"] > 0


# -- reward models ----------------------------------------------------------------------------------

def reward_folder(causal_folder: Path, where: Path) -> Path:
    """The causal folder's weights as a sequence classifier with a score head drawn once."""
    torch.manual_seed(5)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(causal_folder, num_labels=1)
    model.save_pretrained(where)
    transformers.AutoTokenizer.from_pretrained(causal_folder).save_pretrained(where)
    return where


@pytest.mark.parametrize("family", FAMILIES)
def test_a_reward_model_on_moe_is_the_formula_on_unpadded_scores_and_trains(moe_folders, tmp_path,  # noqa: F811
                                                                             family):
    folder = reward_folder(moe_folders(family, **ROUTER_LOSS), tmp_path / "reward")
    rows = [row | {"margin": MARGINS[i]} for i, row in enumerate(pair_rows())]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1).eval()
    chosen = reward_scores(model, tokenizer, [r["prompt"] + r["chosen"] + "</s>" for r in rows])
    rejected = reward_scores(model, tokenizer, [r["prompt"] + r["rejected"] + "</s>" for r in rows])
    expected = torch.log1p(torch.exp(-(chosen - rejected - torch.tensor(MARGINS)))).mean()
    args = RewardConfig(output_dir=str(tmp_path / "ours"), per_device_eval_batch_size=len(rows),
                        report_to="none", disable_tqdm=True)
    trainer = RewardTrainer(model, args, processing_class=tokenizer, train_dataset=rows)
    assert trainer.evaluate(rows)["eval_loss"] == pytest.approx(expected.item(), abs=1e-5)
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    logged = train(tmp_path / "run", "--method", "reward", "--model", str(folder),
                   "--dataset", str(data), "--max-steps", "1", "--per-device-train-batch-size", "6",
                   "--learning-rate", "1e-3")
    assert logged[0]["loss"] == pytest.approx(expected.item(), abs=1e-5)  # the whole set, step 1
    texts = [r["prompt"] + r[side] + "</s>" for r in rows for side in ("chosen", "rejected")]
    sequences = [tokenizer(text)["input_ids"] for text in texts]
    assert logged[0]["aux_loss"] == pytest.approx(transformers_aux(model, sequences), abs=1e-5)
    trained = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "final")
    changed = moved(model.state_dict(), trained.state_dict())
    assert "score.weight" in changed and any(".experts." in name for name in changed)
