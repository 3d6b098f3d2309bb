"""Issue 32: GRPO as an objective of the loop. The references: the log-probabilities of a direct
forward (every position's logits, tempered, gathered at the completion tokens) fed to TRL's loss
(test_grpo_loss.py holds grpo_loss equal to TRL's _compute_loss), an uninterrupted run for a
resumed one, and a reward that must rise when the policy learns."""
from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch

from .hf_fixtures import tiny_llama_folder

transformers = pytest.importorskip("transformers", reason="GRPO fine-tunes Hugging Face models")

from hputrain import GRPOConfig, GRPOTrainer, grpo_loss  # noqa: E402
from hputrain.cli import main  # noqa: E402
from hputrain.errors import InputError  # noqa: E402

PROMPTS = ["the quick", "to be or", "a stitch", "def add", "that is", "a penny", "one two", "x y z"]


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("grpo") / "llama", seed=0)


def load(folder: Path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return transformers.AutoModelForCausalLM.from_pretrained(folder), tokenizer


def tens(prompts, completions, completion_ids, **columns):
    """A verifiable reward: the share of completion tokens whose id is a multiple of ten (about
    a tenth for an untrained model)."""
    return [sum(t % 10 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def config(out: Path, **overrides) -> GRPOConfig:
    values = dict(output_dir=str(out), per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=16, learning_rate=3e-2, max_steps=4, logging_steps=1,
                  disable_tqdm=True, save_steps=0, report_to=[], seed=0)
    return GRPOConfig(**(values | overrides))


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_reward_rises_as_the_policy_learns(folder, tmp_path):
    model, tokenizer = load(folder)
    trainer = GRPOTrainer(model, config(tmp_path, max_steps=30), reward_funcs=[tens],
                          train_dataset=[{"prompt": p} for p in PROMPTS], processing_class=tokenizer)
    trainer.train()
    rewards = [r["reward"] for r in records(tmp_path) if "reward" in r]
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert 0.05 < start < 0.2  # about a tenth, untrained
    assert end >= 2 * start, rewards
    assert {"rewards/tens/mean", "rewards/tens/std", "reward_std", "frac_reward_zero_std",
            "completions/mean_length", "completions/clipped_ratio", "entropy",
            "clip_ratio/region_mean", "generation_share"} <= set(records(tmp_path)[0])
    lines = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert {"step", "prompt", "completion", "completion_tokens", "tens", "reward",
            "advantage"} <= set(lines[0])
    assert lines[0]["prompt"] in PROMPTS and len(lines) % 8 == 0


def test_the_loss_is_trls_on_a_direct_forwards_log_probs(folder, tmp_path):
    """The objective's loss on a rollout batch equals grpo_loss (TRL's) fed the log-probs of a
    plain forward over every position, tempered and gathered at the completion tokens."""
    model, tokenizer = load(folder)
    args = config(tmp_path, temperature=0.7, beta=0.04, num_iterations=2, loss_type="dapo")
    trainer = GRPOTrainer(model, args, reward_funcs=[tens],
                          train_dataset=[{"prompt": p} for p in PROMPTS], processing_class=tokenizer)
    objective = trainer.objective
    batch = next(trainer.train_batches().iterate(0))
    assert "old_logps" in batch and "ref_logps" in batch  # two iterations; beta > 0
    ours = objective.compute_loss(trainer.wrapped, batch)
    completion = batch["completion_mask"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, -completion - 1:-1].float() / 0.7
    direct = logits.log_softmax(-1).gather(-1, batch["input_ids"][:, -completion:, None])[..., 0]
    theirs = grpo_loss(direct, batch["old_logps"], batch["ref_logps"], batch["advantages"],
                       batch["completion_mask"], loss_type="dapo", beta=0.04,
                       num_items_in_batch=batch["num_items"], steps_per_generation=1,
                       max_completion_length=completion).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # the old log-probs are the policy's own at the rollout (no update yet)
    torch.testing.assert_close(batch["old_logps"], direct.detach(), rtol=1e-5, atol=1e-5)


def test_a_resumed_run_equals_an_uninterrupted_one(folder, tmp_path):
    """Stopped after step 1 of a two-iteration cycle (the checkpoint holds the cycle's batches
    and their old log-probs) and resumed: the same weights, bit for bit."""
    rows = [{"prompt": p} for p in PROMPTS]

    def run(out: Path, steps: int, resume: str | None = None):
        model, tokenizer = load(folder)
        trainer = GRPOTrainer(model, config(out, max_steps=steps, num_iterations=2, save_steps=1,
                                            lr_scheduler_type="constant"),
                              reward_funcs=[tens], train_dataset=rows, processing_class=tokenizer)
        trainer.train(resume_from_checkpoint=resume)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    whole = run(tmp_path / "whole", 3)
    run(tmp_path / "part", 1)
    resumed = run(tmp_path / "part", 3, resume=str(tmp_path / "part" / "checkpoint-1"))
    for name, tensor in whole.items():
        assert torch.equal(tensor, resumed[name]), name


def test_rollouts_have_one_shape_and_groups_share_a_prompt(folder, tmp_path):
    model, tokenizer = load(folder)
    rows = [{"prompt": p * (1 + i % 3), "answer": str(i)} for i, p in enumerate(PROMPTS)]
    seen = []

    def answer(prompts, completions, completion_ids, answer, **_):
        seen.append((list(prompts), list(answer)))
        return [1.0 if a == "3" else 0.0 for a in answer]

    trainer = GRPOTrainer(model, config(tmp_path), reward_funcs=[answer], train_dataset=rows,
                          processing_class=tokenizer)
    batches = trainer.train_batches().iterate(0)
    shapes = {tuple(next(batches)["input_ids"].shape) for _ in range(4)}
    assert shapes == {(8, 16 + 16)}  # the smallest prompt bucket + max_completion_length
    for prompts, answers in seen:
        assert len(prompts) == 8
        for group in range(2):  # num_generations completions of one prompt, side by side
            assert len(set(prompts[4 * group:4 * group + 4])) == 1
            assert len(set(answers[4 * group:4 * group + 4])) == 1


def test_completions_end_at_every_end_id_of_the_generation_config(folder, tmp_path):
    """Issue 39 item 4: as TRL, generation stops at the tokenizer's eos and at each id of the
    model's generation_config.eos_token_id (a chat model's end of turn), and those ids decide the
    completion mask, which completions are truncated (clipped_ratio, mask_truncated_completions)
    and what the reward functions see. The reference: the same rollout (same seed) with eos only,
    cut by hand after the first end id."""
    rows = [{"prompt": p} for p in PROMPTS]

    def rollout(end_ids=None):
        model, tokenizer = load(folder)
        if end_ids is not None:
            model.generation_config.eos_token_id = end_ids
        seen = []

        def record(prompts, completions, completion_ids, **_):
            seen.extend(completion_ids)
            return [0.0] * len(completion_ids)

        trainer = GRPOTrainer(model, config(tmp_path, mask_truncated_completions=True),
                              reward_funcs=[record], train_dataset=rows, processing_class=tokenizer)
        batch = next(trainer.train_batches().iterate(0))
        return seen, trainer.objective.rollout_metrics[-1], batch, tokenizer

    free, _, _, tokenizer = rollout()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    # an "end of turn": the token the untrained model writes most often early in its completions
    counts = collections.Counter(t for ids in free for t in ids[1:8] if t not in (eos, pad))
    turn_end = counts.most_common(1)[0][0]
    ended, metrics, batch, _ = rollout([eos, turn_end])

    def cut(ids):
        ends = [i for i, t in enumerate(ids) if t in (eos, turn_end)]
        return ids[:ends[0] + 1] if ends else ids

    expected = [cut(ids) for ids in free]
    assert ended == expected
    assert sum(map(len, expected)) < sum(map(len, free))  # some stopped at the end of turn
    truncated = [ids[-1] not in (eos, turn_end, pad) for ids in expected]
    assert 0 < sum(truncated) < len(truncated)
    assert metrics["completions/clipped_ratio"] == pytest.approx(sum(truncated) / len(truncated))
    lengths = [len(ids) for ids, t in zip(expected, truncated) if not t]
    assert metrics["completions/mean_terminated_length"] == pytest.approx(sum(lengths) / len(lengths))
    # mask_truncated_completions: a truncated completion counts no token (rows are shuffled)
    counted = sorted(0 if t else len(ids) for ids, t in zip(expected, truncated))
    assert sorted(batch["completion_mask"].sum(1).tolist()) == counted


def test_bad_input_is_one_line(folder, tmp_path):
    model, tokenizer = load(folder)
    rows = [{"prompt": p} for p in PROMPTS]

    def broken(prompts, completions, completion_ids, **_):
        raise ValueError("no answer column")

    trainer = GRPOTrainer(model, config(tmp_path), reward_funcs=[broken], train_dataset=rows,
                          processing_class=tokenizer)
    with pytest.raises(InputError, match="broken.*no answer column"):
        trainer.train()
    with pytest.raises(InputError, match="num_generations"):
        config(tmp_path, num_generations=1)
    with pytest.raises(InputError, match="temperature"):
        GRPOTrainer(model, config(tmp_path, temperature=0.0), reward_funcs=[tens],
                    train_dataset=rows, processing_class=tokenizer)
    with pytest.raises(InputError, match="reward_funcs"):
        GRPOTrainer(model, config(tmp_path), train_dataset=rows, processing_class=tokenizer)


def hputrain_train(capsys, *args: str) -> tuple[int, str, str]:
    """`hputrain train --cpu ARGS` through the command line's entry (in this process)."""
    status = main(["train", "--cpu", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_from_the_command_line(folder, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "answer": str(i)}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def tens(prompts, completions, completion_ids, answer, **_):\n"
                       "    return [sum(t % 10 == 0 for t in ids) / len(ids) for ids in completion_ids]\n"
                       "def broken(prompts, completions, **_):\n    return [1.0]\n")
    common = ["--model", str(folder), "--dataset", str(prompts), "--max-completion-length", "8",
              "--per-device-train-batch-size", "8", "--max-steps", "2", "--disable-tqdm",
              "--logging-steps", "1"]
    status, out, err = hputrain_train(capsys, *common, "--num-generations", "4", "--reward-funcs",
                                      f"{rewards}:tens", "--output-dir", str(tmp_path / "out"),
                                      "--lora-r", "4", "--beta", "0.04")
    assert status == 0, err[-2000:]
    assert "method: GRPO on prompts" in out
    assert "reference: the base model with the LoRA adapters disabled" in out
    assert (tmp_path / "out" / "final" / "adapter_config.json").is_file()
    assert "kl" in records(tmp_path / "out")[0]
    for args, message in [(["--reward-funcs", f"{rewards}:broken"], "broken"),
                          (["--reward-funcs", f"{rewards}:missing"], "missing"),
                          (["--reward-funcs", str(tmp_path / "nowhere.py:f")], "nowhere"),
                          (["--num-generations", "4"], "--reward-funcs"),
                          (["--reward-funcs", f"{rewards}:tens", "--num-generations", "1"],
                           "num_generations")]:
        if "--num-generations" not in args:
            args = [*args, "--num-generations", "4"]
        status, _, err = hputrain_train(capsys, *common, *args, "--output-dir", str(tmp_path / "bad"))
        lines = [line for line in err.splitlines() if line.startswith("hputrain: error")]
        assert status == 2 and len(lines) == 1 and message in lines[0], (args, err[-1500:])
        assert "Traceback" not in err
