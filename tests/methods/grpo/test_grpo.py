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

from ...conftest import auto_dtype
from ...hf_fixtures import tiny_llama_folder

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


def test_a_records_loss_metrics_average_its_micro_batches_means(folder, tmp_path, monkeypatch):
    """Issue 39 item 7: as TRL logs them, a record's entropy and clip ratios are the average of
    each micro-batch's masked mean, not a mean pooled over every token. Two steps of two
    micro-batches per record, completions of unequal lengths (the `complete` hook), two
    iterations, a low temperature (entropies that differ between tokens); the reference: the
    entropies and masks grpo_loss was given."""
    import hputrain.methods.grpo.trainer as grpo

    given = []

    def complete(generation: int, prompts: list[list[int]]) -> list[list[int]]:
        """1 to 16 tokens, the shorter ones ending with eos."""
        out = []
        for row, prompt in enumerate(prompts):
            length = 1 + (sum(prompt) + 5 * row + 3 * generation) % 16
            tokens = [4 + (sum(prompt) + 13 * j + row) % 290 for j in range(length)]
            out.append(tokens[:-1] + [tokenizer.eos_token_id] if length < 16 else tokens)
        return out

    def spy(*args, **kwargs):
        given.append((kwargs["entropies"].detach(), args[4].float()))
        return grpo_loss_(*args, **kwargs)

    grpo_loss_ = grpo.grpo_loss
    monkeypatch.setattr(grpo, "grpo_loss", spy)
    model, tokenizer = load(folder)
    args = config(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  max_steps=4, logging_steps=2, num_iterations=2, temperature=0.05)
    trainer = GRPOTrainer(model, args, reward_funcs=[tens],
                          train_dataset=[{"prompt": p} for p in PROMPTS], processing_class=tokenizer,
                          complete=complete)
    trainer.train()
    logged = [r for r in records(tmp_path) if "entropy" in r]
    assert len(logged) == 2 and len(given) == 8
    for record, calls in zip(logged, (given[:4], given[4:])):
        means = [(e * m).sum() / m.sum() for e, m in calls]
        assert record["entropy"] == pytest.approx(float(sum(means) / 4), abs=1e-6)
        pooled = sum((e * m).sum() for e, m in calls) / sum(m.sum() for _, m in calls)
        assert abs(record["entropy"] - float(pooled)) > 1e-5  # the two rules differ here
    counts = {int(m.sum()) for _, m in given}
    assert len(counts) > 1  # micro-batches of unequal token counts


def test_a_reward_no_function_gives_is_said_once_and_written_as_null(folder, tmp_path, capsys):
    """Issue 39 item 7: a reward function that returns None for every completion: TRL's warning
    (here one line, once), and TRL's None for the reward metrics, which metrics.jsonl and
    completions.jsonl write as null, never a bare NaN that strict JSON readers refuse."""
    def nothing(prompts, completions, completion_ids, log_extra, log_metric, **_):
        log_extra("why", [float("nan")] * len(prompts))  # NaN in a logged column too
        log_metric("confidence", float("nan"))
        return [None] * len(prompts)

    def strict(line: str) -> dict:
        return json.loads(line, parse_constant=lambda word: pytest.fail(f"{word} in {line}"))

    model, tokenizer = load(folder)
    trainer = GRPOTrainer(model, config(tmp_path, max_steps=2), reward_funcs=[nothing],
                          train_dataset=[{"prompt": p} for p in PROMPTS], processing_class=tokenizer)
    trainer.train()
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "returned None" in line]
    assert len(said) == 1 and said[0].startswith("hputrain: warning:") and "8 of 8" in said[0], err
    logged = [strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "reward" in r]
    assert len(steps) == 2
    for record in steps:
        assert record["reward"] is None and record["rewards/nothing/mean"] is None
        assert record["confidence"] is None
        assert record["loss"] == 0.0  # no advantage: nothing to learn from
    lines = [strict(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert lines and all(x["reward"] is None and x["nothing"] is None and x["why"] is None
                         for x in lines)


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
    with pytest.raises(InputError, match="reward_funcs"):
        GRPOTrainer(model, config(tmp_path), train_dataset=rows, processing_class=tokenizer)


def hputrain_train(capsys, *args: str) -> tuple[int, str, str]:
    """`hputrain train --cpu ARGS` through the command line's entry (in this process)."""
    status = main(["train", "--cpu", *args])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.bf16_auto  # precision="auto": the header names what it picked on this CPU
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
    # issue 39, item 8: the header says the precision, the learning rate, and the checkpoint a
    # rerun resumes from (issue 46: the precision "auto" picked on this CPU, not always float32)
    assert f") in {auto_dtype()}" in out and "learning rate 1e-06;" in out
    status, out, err = hputrain_train(capsys, *common[:-5], "--max-steps", "3", "--disable-tqdm",
                                      "--logging-steps", "1", "--num-generations", "4",
                                      "--reward-funcs", f"{rewards}:tens", "--lora-r", "4",
                                      "--beta", "0.04", "--output-dir", str(tmp_path / "out"),
                                      "--resume-from-checkpoint", "latest")
    assert status == 0 and "hputrain: resuming from checkpoint-2 (--resume-from-checkpoint)" in out, err
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
    # issue 39, item 8: the resumed run's header says the precision and the learning rate too
    assert f") in {auto_dtype()}" in out and "learning rate 1e-06;" in out


# -- issue 39: what reward functions are handed, and what they log ------------------------------

def test_reward_functions_logs_and_trainer_state_reach_the_files(folder, tmp_path):
    """Item 6: log_extra's columns land in completions.jsonl and log_metric's values are averaged
    into that step's metrics record (as TRL averages them), then forgotten. Item 8: trainer_state
    has the run's max_steps (TRL's), so a reward scheduled by progress runs. Item 9: two functions
    of one name keep both their metrics (tens, tens_2)."""
    model, tokenizer = load(folder)
    logged, states = {}, []

    def tens(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **_):
        states.append((trainer_state.global_step, trainer_state.max_steps))
        lengths = [len(ids) for ids in completion_ids]
        log_extra("length_seen", lengths)
        for value in (min(lengths), max(lengths)):
            log_metric("length_spread", float(value))
            logged.setdefault(trainer_state.global_step, []).append(float(value))
        progress = trainer_state.global_step / trainer_state.max_steps  # TRL's schedule by progress
        return [progress * sum(t % 10 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    def other():
        def tens(completion_ids, **_):
            return [0.0 for _ in completion_ids]
        return tens

    trainer = GRPOTrainer(model, config(tmp_path, max_steps=3), reward_funcs=[tens, other()],
                          train_dataset=[{"prompt": p} for p in PROMPTS], processing_class=tokenizer)
    trainer.train()
    assert states == [(1, 3), (2, 3), (3, 3)]
    assert trainer.objective.reward_funcs.names == ["tens", "tens_2"]
    assert trainer.objective.reward_funcs.take_logs() == ({}, {})  # handed over each rollout
    logs = [r for r in records(tmp_path) if "loss" in r]
    assert [r["length_spread"] for r in logs] == pytest.approx([sum(v) / len(v) for v in logged.values()])
    assert {"rewards/tens/mean", "rewards/tens_2/mean"} <= set(logs[0])
    lines = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(lines) == 3 * 8 and all(row["length_seen"] == row["completion_tokens"] for row in lines)


def test_temperature_0_decodes_greedily(folder, tmp_path):
    """Item 8: temperature 0 is greedy, as its docstring says (it was refused): a prompt's
    completions are all the model's argmax continuation, so their advantages are 0; the
    log-probs are then the model's own (temperature 1), so the loss is finite."""
    model, tokenizer = load(folder)
    trainer = GRPOTrainer(model, config(tmp_path, temperature=0.0, max_steps=1), reward_funcs=[tens],
                          train_dataset=[{"prompt": p} for p in PROMPTS], processing_class=tokenizer)
    trainer.train()
    lines = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    prompt = lines[0]["prompt"]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    greedy = load(folder)[0].generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None,
                                      pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]
    expected = tokenizer.decode(greedy, skip_special_tokens=True)
    group = [row for row in lines if row["prompt"] == prompt]
    assert group and all(row["completion"] == expected for row in group)
    assert all(row["advantage"] == 0 for row in lines)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records(tmp_path) if "loss" in r)


def test_prompts_longer_than_the_largest_bucket_are_kept_as_trl_keeps_them(folder, tmp_path):
    """Item 8: a prompt longer than the largest bucket gets the next multiple of it (TRL keeps
    every prompt whole); only one the model's positions cannot hold with the completion is left
    out. The tiny Llama has 128 positions: 128 - 16 completion tokens leave 112."""
    model, tokenizer = load(folder)
    long = " ".join(["the quick brown fox"] * 4)
    too_long = " ".join(["the quick brown fox"] * 12)
    sizes = [len(tokenizer(text).input_ids) for text in (long, too_long)]
    assert 16 < sizes[0] <= 112 < sizes[1]
    rows = [{"prompt": p} for p in PROMPTS[:7]] + [{"prompt": long}, {"prompt": too_long}]
    trainer = GRPOTrainer(model, config(tmp_path, max_steps=2, prompt_buckets=[8, 16]),
                          reward_funcs=[tens], train_dataset=rows, processing_class=tokenizer)
    assert trainer.objective.left_out == 1 and trainer.objective.longest_prompt == 112
    trainer.train()
    prompts = {json.loads(x)["prompt"] for x in (tmp_path / "completions.jsonl").read_text().splitlines()}
    assert long in prompts and too_long not in prompts


def test_a_resume_with_changed_settings_says_what_changed(folder, tmp_path, capsys):
    """Item 8: the checkpoint records num_generations, the reward functions and
    max_completion_length; a resume that changes them says so, one line each, and trains."""
    rows = [{"prompt": p} for p in PROMPTS]

    def other(prompts, completions, completion_ids, **_):
        return [1.0 for _ in completion_ids]

    for settings, funcs, resume in [({}, [tens], None),
                                    (dict(num_generations=2, max_completion_length=8), [other],
                                     str(tmp_path / "checkpoint-1"))]:
        model, tokenizer = load(folder)
        trainer = GRPOTrainer(model, config(tmp_path, max_steps=2 if resume else 1, save_steps=1,
                                            **settings),
                              reward_funcs=funcs, train_dataset=rows, processing_class=tokenizer)
        capsys.readouterr()
        trainer.train(resume_from_checkpoint=resume)
    said = capsys.readouterr()
    lines = [line for line in (said.out + said.err).splitlines() if line.startswith("resuming with")]
    assert lines == ["resuming with num_generations 2 where the checkpoint's run had 4: the new one "
                     "holds from here on",
                     "resuming with reward_funcs other where the checkpoint's run had tens: the new "
                     "one holds from here on",
                     "resuming with max_completion_length 8 where the checkpoint's run had 16: the "
                     "new one holds from here on"]
    assert (tmp_path / "checkpoint-2").is_dir()


def test_misleading_lines_now_say_what_is_wrong(folder, tmp_path, capsys):
    """Item 9: prompts without --reward-funcs, a data set without a 'prompt' column given
    --reward-funcs, an empty file, and the default --max-completion-length (512) on a model of
    128 positions: one line each that names the cause, before any header."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def tens(completion_ids, **_):\n    return [0.0 for _ in completion_ids]\n")
    data = {"prompts": [{"prompt": "the quick", "answer": "1"}] * 8,
            "questions": [{"question": "the quick", "answer": "1"}] * 8, "empty": []}
    for name, rows in data.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    funcs = ["--reward-funcs", f"{rewards}:tens"]
    for dataset, flags, says in [
            ("prompts", ["--max-completion-length", "8"],
             "--dataset {} holds prompts without completions (prompt, answer): GRPO trains on them "
             "with --reward-funcs FILE.py:NAME [...] or a reward-model folder; SFT needs a "
             "'completion' beside each 'prompt'"),
            ("questions", funcs, "--reward-funcs trains with GRPO on rows with a 'prompt' and no "
                                 "completion; --dataset {} has: question, answer"),
            ("empty", funcs, "--dataset {} holds no rows: it is empty"),
            ("empty", [], "--dataset {} holds no rows: it is empty"),
            ("prompts", funcs, "max_completion_length (--max-completion-length) 512 leaves no room "
                               "for a prompt in the model's 128 positions "
                               "(config.max_position_embeddings): give 127 or less")]:
        path = tmp_path / f"{dataset}.jsonl"
        status, out, err = hputrain_train(capsys, "--model", str(folder), "--dataset", str(path),
                                          "--output-dir", str(tmp_path / "out"), *flags)
        lines = [line for line in err.splitlines() if line.startswith("hputrain: error")]
        assert status == 2 and lines == [f"hputrain: error: {says.format(path)}"], err[-1500:]
        assert "hputrain:" not in out and "Traceback" not in err  # no header before the line
