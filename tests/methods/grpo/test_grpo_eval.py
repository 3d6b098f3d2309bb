"""Issue 32: GRPO evaluated on a validation set, as TRL 1.16's GRPOTrainer evaluates it. The
references: a hand computation from fixed completions (the trainer's `complete` hook) of TRL's
definitions (prompts in the order of a permutation drawn from the seed, num_generations_eval
completions each, a batch of per_device_eval_batch_size; each batch's rewards normalised in its
groups, its metrics averaged over batches, eval_loss the batches' losses weighted by their
completions); the same run without evaluation (training's numbers do not move); an uninterrupted
run (resume)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ...hf_fixtures import tiny_llama_folder

transformers = pytest.importorskip("transformers", reason="GRPO fine-tunes Hugging Face models")

from hputrain import GRPOConfig, GRPOTrainer  # noqa: E402
from hputrain.cli import main  # noqa: E402
from hputrain.errors import InputError  # noqa: E402

PROMPTS = ["the quick", "to be or", "a stitch", "def add", "that is", "a penny", "one two", "x y z"]
VALIDATION = ["once upon", "in the", "so it"]
C = 12  # max_completion_length


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("grpo-eval") / "llama", seed=0)


def load(folder: Path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return transformers.AutoModelForCausalLM.from_pretrained(folder), tokenizer


def tens(prompts, completions, completion_ids, **columns):
    """The share of completion tokens whose id is a multiple of ten."""
    return [sum(t % 10 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def config(out: Path, **overrides) -> GRPOConfig:
    values = dict(output_dir=str(out), per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=C, learning_rate=3e-2, max_steps=3, logging_steps=1,
                  disable_tqdm=True, save_steps=0, report_to=[], seed=0)
    return GRPOConfig(**(values | overrides))


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def rows(prompts) -> list[dict]:
    return [{"prompt": p} for p in prompts]


def fixed(eos: int, calls: list):
    """The `complete` hook: completion j of a batch a function of its prompt, j and the
    generation index; every third runs to C tokens without an end (truncated)."""
    def complete(generation: int, prompts: list[list[int]]) -> list[list[int]]:
        calls.append((generation, [tuple(p) for p in prompts]))
        out = []
        for j, prompt in enumerate(prompts):
            base = sum(prompt) * 7 + j * 13 + generation * 5
            length = C if j % 3 == 2 else 1 + base % (C - 2)
            body = [3 + (base + 11 * k) % 90 for k in range(length)]
            out.append(body if j % 3 == 2 else body + [eos])
        return out
    return complete


def hand_metrics(batches: list[list[list[int]]], num_generations: int) -> dict:
    """TRL's evaluation numbers of batches of completions (token ids, end of sequence included,
    C at most), a batch's rows in groups of num_generations; the loss at ratio 1 is dapo's:
    minus the token-weighted mean advantage over the batch."""
    per_batch, losses, weights = [], [], []
    for completions in batches:
        rewards = torch.tensor(tens(None, None, completions))
        groups = rewards.view(-1, num_generations)
        mean = groups.mean(1).repeat_interleave(num_generations)
        std = groups.std(1).repeat_interleave(num_generations)  # Bessel, as TRL's nanstd
        advantages = (rewards - mean) / (std + 1e-4)
        lengths = torch.tensor([len(c) for c in completions], dtype=torch.float32)
        losses.append(float(-(advantages * lengths).sum() / lengths.sum()))
        weights.append(len(completions))
        per_batch.append({"reward": rewards.mean().item(), "reward_std": rewards.std().item(),
                          "completions/mean_length": lengths.mean().item(),
                          "frac_reward_zero_std": float(torch.isclose(std, torch.zeros(1)).float().mean())})
    out = {f"eval_{k}": sum(b[k] for b in per_batch) / len(per_batch) for k in per_batch[0]}
    out["eval_loss"] = sum(l * w for l, w in zip(losses, weights)) / sum(weights)
    return out


def test_evaluation_equals_a_hand_computation_of_trls(folder, tmp_path):
    """3 validation prompts, 3 completions each (num_generations_eval), 6 per batch: two batches
    of 2 and 1 prompts, in the seed's order."""
    model, tokenizer = load(folder)
    calls = []
    trainer = GRPOTrainer(model, config(tmp_path, num_generations_eval=3,
                                        per_device_eval_batch_size=6),
                          reward_funcs=[tens], train_dataset=rows(PROMPTS),
                          eval_dataset=rows(VALIDATION), processing_class=tokenizer,
                          complete=fixed(tokenizer.eos_token_id, calls))
    metrics = trainer.evaluate()

    order = torch.randperm(3, generator=torch.Generator().manual_seed(0)).tolist()
    ids = [tuple(tokenizer(p)["input_ids"]) for p in VALIDATION]
    expected_prompts = [[ids[i] for i in order[:2] for _ in range(3)], [ids[order[2]]] * 3]
    assert [g for g, _ in calls] == [-1, -2]  # evaluation batch k is generation -1 - k
    assert [p for _, p in calls] == expected_prompts
    completions = [fixed(tokenizer.eos_token_id, [])(g, [list(p) for p in prompts])
                   for g, prompts in zip((-1, -2), expected_prompts)]
    expected = hand_metrics([[c[:C] for c in batch] for batch in completions], 3)
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-5), name
    assert metrics["eval_rewards/tens/mean"] == pytest.approx(expected["eval_reward"], abs=1e-6)
    assert 0 < expected["eval_reward"] and expected["eval_loss"] != 0
    assert {"eval_rewards/tens/std", "eval_completions/clipped_ratio", "eval_entropy",
            "eval_clip_ratio/low_mean", "eval_clip_ratio/region_mean", "eval_clip_ratio/low_min",
            "eval_clip_ratio/high_max"} <= set(metrics)
    assert metrics["eval_clip_ratio/low_min"] == 0 and metrics["eval_clip_ratio/high_max"] == 0
    assert not {"eval_perplexity", "eval_generation_share", "eval_kl"} & set(metrics)
    with pytest.raises(InputError, match="per_device_eval_batch_size x ranks = 4 x 1.*num_generations_eval \\(3\\)"):
        GRPOTrainer(model, config(tmp_path, num_generations_eval=3, per_device_eval_batch_size=4),
                    reward_funcs=[tens], train_dataset=rows(PROMPTS), eval_dataset=rows(VALIDATION),
                    processing_class=tokenizer)


TRAINING = ("loss", "grad_norm", "reward", "reward_std", "entropy", "rewards/tens/mean",
            "completions/mean_length", "clip_ratio/region_mean", "clip_ratio/low_min",
            "clip_ratio/high_max")


def test_evaluating_leaves_training_as_it_was_and_resumes_exactly(folder, tmp_path):
    """Sampled completions (no hook), two iterations per generation, an evaluation every step:
    the training records equal those of the same run without evaluation, and a run stopped at
    step 1 and resumed ends on the same weights and the same evaluations."""
    def run(out: Path, steps: int, evaluate: bool, resume: str | None = None):
        model, tokenizer = load(folder)
        args = config(out, max_steps=steps, num_iterations=2, save_steps=1, eval_steps=1,
                      eval_strategy="steps" if evaluate else "no", lr_scheduler_type="constant")
        trainer = GRPOTrainer(model, args, reward_funcs=[tens], train_dataset=rows(PROMPTS),
                              eval_dataset=rows(VALIDATION) if evaluate else None,
                              processing_class=tokenizer)
        trainer.train(resume_from_checkpoint=resume)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    whole = run(tmp_path / "whole", 3, True)
    plain = run(tmp_path / "plain", 3, False)
    run(tmp_path / "part", 1, True)
    resumed = run(tmp_path / "part", 3, True, resume=str(tmp_path / "part" / "checkpoint-1"))
    for name, tensor in whole.items():
        assert torch.equal(tensor, plain[name]) and torch.equal(tensor, resumed[name]), name

    def split(out: Path):
        lines = records(out)
        steps = [{k: r[k] for k in TRAINING if k in r} for r in lines if "loss" in r]
        evals = {r["step"]: r for r in lines if "eval_loss" in r}
        return steps, evals

    steps, evals = split(tmp_path / "whole")
    assert steps == split(tmp_path / "plain")[0]
    assert len(steps) == 3 and "clip_ratio/high_max" in steps[0] and "reward" in steps[0]
    assert sorted(evals) == [1, 2, 3]
    assert {"eval_reward", "eval_reward_std", "eval_rewards/tens/mean",
            "eval_completions/mean_length", "eval_loss"} <= set(evals[1])
    _, again = split(tmp_path / "part")
    for step in (2, 3):
        assert {k: v for k, v in again[step].items() if k.startswith("eval_")} == \
            {k: v for k, v in evals[step].items() if k.startswith("eval_")}, step


def test_the_best_checkpoint_by_eval_reward(folder, tmp_path):
    """metric_for_best_model eval_reward: greater is better without being told."""
    model, tokenizer = load(folder)
    args = config(tmp_path, save_steps=1, eval_steps=1, eval_strategy="steps",
                  load_best_model_at_end=True, metric_for_best_model="eval_reward")
    trainer = GRPOTrainer(model, args, reward_funcs=[tens], train_dataset=rows(PROMPTS),
                          eval_dataset=rows(VALIDATION), processing_class=tokenizer)
    trainer.train()
    evals = {r["step"]: r["eval_reward"] for r in records(tmp_path) if "eval_reward" in r}
    best = max(evals, key=lambda step: evals[step])
    assert len(set(evals.values())) > 1, evals
    assert trainer.best.folder.name == f"checkpoint-{best}"
    assert trainer.best.metric == pytest.approx(evals[best])


def test_from_the_command_line_with_a_validation_split(folder, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "answer": str(i)}) + "\n"
                               for i, p in enumerate(PROMPTS + VALIDATION)))
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def tens(prompts, completions, completion_ids, answer, **_):\n"
                       "    return [sum(t % 10 == 0 for t in ids) / len(ids) for ids in completion_ids]\n")
    argv = ["train", "--cpu", "--model", str(folder), "--dataset", str(prompts),
            "--reward-funcs", f"{rewards}:tens", "--num-generations", "4",
            "--max-completion-length", "8", "--per-device-train-batch-size", "8",
            "--per-device-eval-batch-size", "8", "--max-steps", "2", "--disable-tqdm",
            "--logging-steps", "1", "--eval-steps", "1", "--eval-strategy", "steps",
            "--validation-split-percentage", "25", "--output-dir", str(tmp_path / "out")]
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 0, err[-2000:]
    assert "validation: the last 25% held out (--validation-split-percentage), 2 prompt(s)" in out
    evals = [r for r in records(tmp_path / "out") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1, 2]
    assert all({"eval_reward", "eval_rewards/tens/mean", "eval_completions/mean_length"} <= set(r)
               for r in evals)
    status = main([*argv[:-1], str(tmp_path / "bad"), "--num-generations-eval", "3"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("hputrain: error")]
    assert status == 2 and len(lines) == 1 and "num_generations_eval (3)" in lines[0], err[-1500:]


def test_a_validation_share_holds_out_the_last_rows_and_never_all():
    from hputrain.errors import InputError
    from hputrain.recipes.hf.common import held_out

    assert [held_out(n, 25, "p.jsonl", "prompt") for n in (2, 4, 9, 40)] == [1, 1, 2, 10]
    with pytest.raises(InputError, match=r"--dataset p.jsonl has 1 prompt\(s\), too few to hold 5% out"):
        held_out(1, 5, "p.jsonl", "prompt")
