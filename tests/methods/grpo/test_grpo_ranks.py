"""Issue 32: GRPO on two processes trains as one process does with the same global batch. With
fixed completions (the trainer's `complete` hook, tests/grpo_ranks_script.py), two ranks of 4
rows (ddp, fsdp; launched through `hputrain launch --cpu`) give one rank of 8 rows' per-step
loss, grad norm and rollout metrics within 1e-5, and its final weights: when each prompt's group
sits on one rank, when a group is split over the ranks (its rewards gathered before they are
normalised), with gradient accumulation, and with two iterations per generation (old log-probs,
clipped ratios). On a first iteration the probability ratio is 1, so the loss is a token-weighted
mean of the advantages whatever the weights: the grad norm and the final weights carry the comparison there."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ...hf_fixtures import tiny_llama_folder
from ...distributed.test_distributed import hputrain_launch

pytest.importorskip("transformers", reason="GRPO fine-tunes Hugging Face models")

from ... import grpo_ranks_script  # noqa: E402

SCRIPT = str(Path(__file__).parents[2] / "grpo_ranks_script.py")
TIMEOUT = 420  # seconds for one launch: past it the launcher is killed, and its workers with it
SCALARS = ("loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std", "entropy")
PREFIXES = ("rewards/", "clip_ratio/", "completions/")


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("grpo-ranks") / "llama", seed=0)


@pytest.fixture(scope="module")
def single(folder, tmp_path_factory):
    """One process of 8 rows per case, run here on first use: the reference."""
    out, done = tmp_path_factory.mktemp("single"), set()

    def case(name: str) -> Path:
        if name not in done:
            grpo_ranks_script.main([str(folder), str(out), "single", name])
            done.add(name)
        return out / name

    return case


def two_processes(folder: Path, out: Path, strategy: str, *cases: str) -> Path:
    """`cases` run one after the other by two launched ranks of 4 rows each, into out/CASE."""
    proc, _ = hputrain_launch("--cpu", "--nproc-per-node", "2", SCRIPT, str(folder), str(out),
                              strategy, *cases, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    return out


def compared(record: dict) -> dict:
    """The values of a logging record that must not depend on the process count."""
    return {k: v for k, v in record.items() if k in SCALARS or k.startswith(PREFIXES)}


def steps(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [compared(r) for r in lines if "loss" in r]


def assert_same_run(expected: Path, actual: Path) -> list[dict]:
    """Every step's loss, grad norm and metrics within 1e-5, and the final weights close."""
    want, got = steps(expected), steps(actual)
    assert len(want) == len(got) == grpo_ranks_script.STEPS
    for step, (a, b) in enumerate(zip(want, got), start=1):
        assert a.keys() == b.keys(), step
        for key in a:
            assert b[key] == pytest.approx(a[key], abs=1e-5, rel=1e-5), (step, key, a[key], b[key])
    one, two = torch.load(expected / "weights.pt"), torch.load(actual / "weights.pt")
    assert one.keys() == two.keys()
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-4, msg=key)
    return want


def assert_not_trivial(records: list[dict], case: str) -> None:
    """The compared values carry information: rewards that differ inside a group, ended and
    truncated completions, an update every step; and, on a second iteration, clipped tokens.
    (A step that trains on an earlier rollout again has no rollout metrics of its own.)"""
    first = records[0]
    assert {"rewards/tens/mean", "completions/clipped_ratio", "clip_ratio/region_mean"} <= set(first)
    assert all(r["grad_norm"] > 0 for r in records)
    assert all(r["reward_std"] > 0 for r in records if "reward_std" in r)
    assert 0 < first["completions/clipped_ratio"] < 1
    if case == "iterations":
        assert max(r["clip_ratio/region_mean"] for r in records) > 0


@pytest.mark.ci
def test_a_group_split_over_two_ddp_ranks_trains_as_one_process(folder, single, tmp_path):
    """The representative case: one prompt per generation, its 8 completions 4 on each rank."""
    two = two_processes(folder, tmp_path, "ddp", "split")
    assert_not_trivial(assert_same_run(single("split"), two / "split"), "split")


@pytest.fixture(scope="module")
def ddp_two(folder, tmp_path_factory) -> Path:
    return two_processes(folder, tmp_path_factory.mktemp("ddp"), "ddp", "groups", "accumulate",
                         "iterations")


@pytest.fixture(scope="module")
def fsdp_two(folder, tmp_path_factory) -> Path:
    return two_processes(folder, tmp_path_factory.mktemp("fsdp"), "fsdp",
                         *grpo_ranks_script.CASES)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["groups", "accumulate", "iterations"])
def test_two_ddp_ranks_train_as_one_process(ddp_two, single, case):
    assert_not_trivial(assert_same_run(single(case), ddp_two / case), case)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(grpo_ranks_script.CASES))
def test_two_fsdp_ranks_train_as_one_process(fsdp_two, single, case):
    assert_not_trivial(assert_same_run(single(case), fsdp_two / case), case)
