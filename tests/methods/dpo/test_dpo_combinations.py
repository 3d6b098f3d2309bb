"""Issue 30: DPO in the combinations users pick. A precomputed reference with a validation split
(item 2), a validation set that leaves a rank without a batch on 2 processes (item 3), a frozen
reference under bf16 (item 4), throughput's samples (item 7, in test_dpo.py) and DPO's own
defaults (item 9). References: the same run on one process, the live reference, TRL's DPOConfig."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from ...methods.dpo.test_dpo import _on_cpu, load, models, text_rows, tokenizer_of, write_jsonl  # noqa: F401

transformers = pytest.importorskip("transformers", reason="DPO fine-tunes Hugging Face models")

from hputrain.cli import main  # noqa: E402
from hputrain.methods.dpo.config import DPOConfig  # noqa: E402
from hputrain.methods.dpo.data import REF_KEYS, encode_pairs  # noqa: E402
from hputrain.errors import InputError  # noqa: E402
from hputrain.methods.dpo.trainer import DPOTrainer  # noqa: E402

BF16_TOLERANCE = dict(abs=1e-3, rel=5e-3)
"""2 processes against 1 in bf16: FSDP2 casts the weights to bf16 for the forward, autocast per op
on one process, and the gradients are reduced in another order. Measured at step 2: grad_norm
0.10438 against 0.10436 (1.4e-4 apart at step 1), rewards/margins 1.4e-4 apart, loss 7e-5."""

EVAL_METRICS = ("eval_loss", "eval_rewards/chosen", "eval_rewards/margins",
                "eval_rewards/accuracies", "eval_logps/chosen", "eval_logps/rejected")


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def last_eval(out: Path) -> dict:
    return [r for r in records(out) if "eval_loss" in r][-1]


def encoded(models, rows: list[dict]) -> list[dict]:  # noqa: F811
    pairs, _ = encode_pairs(((str(i), r) for i, r in enumerate(rows)), tokenizer_of(models[0]),
                            max_length=128)
    return pairs


# -- item 2: a precomputed reference and a validation split ----------------------------------------

def test_precomputed_reference_covers_the_validation_split(models, tmp_path, capsys):  # noqa: F811
    """Full-weight DPO (a frozen copy as the reference) with --precompute-ref-log-probs and a
    validation split ended in an AttributeError at the final evaluation. Now both splits are
    precomputed, the run finishes, and its evaluation equals the live reference's."""
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows(8))

    def run(name: str, *flags: str) -> tuple[dict, str]:
        status = main(["train", "--model", str(models[0]), "--dataset", str(data),
                       "--max-steps", "2", "--per-device-train-batch-size", "3",
                       "--learning-rate", "1e-2", "--validation-split-percentage", "25",
                       "--precision", "fp32", "--disable-tqdm", "--output-dir", str(tmp_path / name),
                       *flags])
        out = capsys.readouterr().out
        assert status == 0
        return last_eval(tmp_path / name), out

    live, _ = run("live")
    pre, out = run("pre", "--precompute-ref-log-probs")
    assert "reference forwards: 0 during training, 2 to precompute" in out  # train, then eval
    assert live["eval_rewards/margins"] != 0  # the policy moved: a real comparison
    for key in EVAL_METRICS:
        assert pre[key] == pytest.approx(live[key], abs=1e-6), key
    assert (tmp_path / "pre" / "final" / "model.safetensors").is_file()
    assert len(list((tmp_path / "pre" / ".cache").glob("dpo-ref-*.npy"))) == 2


def test_evaluating_other_pairs_after_the_reference_is_freed(models, tmp_path):  # noqa: F811
    """After train() with a precomputed reference, the frozen reference is gone: pairs whose
    log-probs are cached evaluate as with the live reference; others are one line."""
    rows = text_rows(6)
    pairs = encoded(models, rows)
    args = DPOConfig(output_dir=str(tmp_path), precompute_ref_log_probs=True, max_steps=1,
                     learning_rate=1e-2, per_device_train_batch_size=4, report_to="none",
                     disable_tqdm=True, max_length=128)
    trainer = DPOTrainer(load(models[0]), args, ref_model=load(models[1]),
                         processing_class=tokenizer_of(models[0]), train_dataset=pairs[:4],
                         eval_dataset=pairs[4:5])
    trainer.train()
    assert trainer.objective.reference is None  # freed: every split carries its log-probs
    cached = trainer.evaluate(pairs[:4])  # the training pairs: from the cache
    with pytest.raises(InputError, match="reference model was freed") as error:
        trainer.evaluate(pairs[5:])
    assert "\n" not in str(error.value)
    trainer.objective.reference = trainer._place_frozen(load(models[1]))  # back, to compare with
    live = trainer.evaluate(pairs[:4])
    assert trainer.precompute_forwards == 2  # the training and the validation pairs, once
    for key in EVAL_METRICS:
        assert cached[key] == pytest.approx(live[key], abs=1e-6), key


def test_a_missing_reference_is_one_line_not_an_attribute_error(models, tmp_path):  # noqa: F811
    pairs = encoded(models, text_rows(2))
    args = DPOConfig(output_dir=str(tmp_path), report_to="none", disable_tqdm=True, max_length=128)
    trainer = DPOTrainer(load(models[0]), args, ref_model=load(models[1]),
                         processing_class=tokenizer_of(models[0]), train_dataset=pairs)
    trainer.objective.reference = None
    with pytest.raises(InputError, match="carry no reference log-probs"):
        trainer.evaluate(pairs)
    with_ref = [{**p, REF_KEYS[0]: -1.0, REF_KEYS[1]: -2.0} for p in pairs]
    assert "eval_loss" in trainer.evaluate(with_ref)  # pairs that carry them need no reference


# -- item 3: a validation set that does not give every rank a batch --------------------------------

class RecordingGroup:
    """One process's stand-in for the process group: records what enters the all-reduce."""

    def __init__(self) -> None:
        self.reduced: list[list[float]] = []

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.reduced.append(tensor.tolist())
        return tensor


def test_a_rank_that_summed_nothing_still_enters_the_all_reduce():
    from hputrain.methods.dpo.trainer import METRICS, PreferenceObjective

    objective, group = PreferenceObjective(DPOConfig()), RecordingGroup()
    objective.loop = types.SimpleNamespace(device=torch.device("cpu"))
    assert objective.metrics(group, prefix="eval_") == {}
    assert group.reduced == [[0.0] * (len(METRICS) + 1)]  # zeros, and 0 pairs
    logps = torch.tensor([-1.0, -2.0])
    with objective.uncounted():  # a filler batch: in no metric
        objective._add_metrics(logps[:1], logps[1:], logps[:1] + 1, logps[1:])
    assert objective.sums is None and objective.pairs == 0
    objective._add_metrics(logps[:1], logps[1:], logps[:1] + 1, logps[1:])
    metrics = objective.metrics(group)
    assert metrics["rewards/chosen"] == pytest.approx(-0.1) and group.reduced[-1][-1] == 1


def run_cli(out: Path, *args: str, timeout: int) -> None:
    """`hputrain train` in a process group of its own, killed whole (workers included) when it
    runs past `timeout`: a hang fails the test instead of hanging it."""
    command = [sys.executable, "-m", "hputrain.cli", "train", "--cpu", *args, "--output-dir",
               str(out), "--logging-steps", "1", "--disable-tqdm", "--precision", "fp32"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"hputrain train did not finish within {timeout} s (hung?): {stderr[-2000:]}")
    assert proc.returncode == 0, stdout[-1500:] + stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, reference", [
    ("ddp", "lora"), ("fsdp", "frozen copy")])  # make test runs item 3 in test_combinations.py
def test_a_rank_without_a_validation_batch_neither_hangs_nor_counts(models, tmp_path, strategy,  # noqa: F811
                                                                     reference):
    """40 pairs, 8% held out: 3 validation pairs, one batch of 4, all on rank 0. Rank 1 skipped
    the metrics' all-reduce and the job hung after training (ddp); under fsdp rank 1 runs a
    filler batch to keep in step, which was added into eval_rewards/*. The evaluation must equal
    the one-process run's."""
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows(40))
    common = ["--model", str(models[0]), "--dataset", str(data), "--max-steps", "2", "--seed", "5",
              "--learning-rate", "1e-2", "--validation-split-percentage", "8",
              "--per-device-eval-batch-size", "4",
              *(["--lora-r", "4", "--lora-dropout", "0"] if reference == "lora" else [])]
    run_cli(tmp_path / "one", *common, "--per-device-train-batch-size", "4", timeout=300)
    run_cli(tmp_path / "two", *common, "--per-device-train-batch-size", "2", "--devices", "2",
            "--strategy", strategy, timeout=300)
    one, two = last_eval(tmp_path / "one"), last_eval(tmp_path / "two")
    assert one["eval_rewards/margins"] != 0  # trained away from the reference: a real check
    for key in EVAL_METRICS:
        assert two[key] == pytest.approx(one[key], abs=2e-5, rel=1e-5), key


# -- item 4: a frozen reference under bf16 ---------------------------------------------------------

def test_a_frozen_reference_is_kept_in_bf16_under_bf16(models, tmp_path):  # noqa: F811
    """Under bf16 the policy keeps float32 masters (autocast computes in bf16), but a frozen
    reference needs none: its weights are bf16 (half the memory), and the loss stays that of
    the float32 reference under the same autocast."""
    pairs = encoded(models, text_rows(6))
    args = DPOConfig(output_dir=str(tmp_path), bf16=True, per_device_eval_batch_size=6,
                     report_to="none", disable_tqdm=True, max_length=128)
    trainer = DPOTrainer(load(models[0]), args, ref_model=load(models[1]),
                         processing_class=tokenizer_of(models[0]), train_dataset=pairs)
    assert {p.dtype for p in trainer.objective.reference.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    in_bf16 = trainer.evaluate(pairs)
    trainer.objective.reference = load(models[1]).requires_grad_(False)  # float32, as before
    in_fp32 = trainer.evaluate(pairs)
    assert in_bf16["eval_loss"] == pytest.approx(in_fp32["eval_loss"], abs=1e-3)  # 9e-6 measured
    assert in_bf16["eval_rewards/margins"] == pytest.approx(in_fp32["eval_rewards/margins"], abs=1e-3)
    assert in_bf16["eval_logps/chosen"] == in_fp32["eval_logps/chosen"]  # the policy's: unchanged


# -- item 9: DPO's own defaults --------------------------------------------------------------------

def test_dpo_config_defaults_to_trls_learning_rate():
    trl = pytest.importorskip("trl")
    assert DPOConfig().learning_rate == trl.DPOConfig.__dataclass_fields__["learning_rate"].default
    assert DPOConfig(learning_rate=3e-4).learning_rate == 3e-4


@pytest.mark.parametrize("lora", [False, True])
def test_the_recipe_takes_dpos_defaults_and_a_flag_wins(models, tmp_path, lora):  # noqa: F811
    from hputrain.recipes import chosen_recipe

    pairs = write_jsonl(tmp_path / "pairs.jsonl", text_rows(4))
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "a line of text"}] * 4)
    extra = {"lora_r": 4} if lora else {}

    def learning_rate(dataset: Path, **flags) -> float:
        _, _, args = chosen_recipe({"model": str(models[0]), "dataset": str(dataset), **extra, **flags})
        return args.learning_rate

    assert learning_rate(pairs) == 1e-6  # TRL's DPOConfig, LoRA or not
    assert learning_rate(text) == (1e-4 if lora else 5e-5)  # the causal-LM defaults
    assert learning_rate(pairs, learning_rate=3e-4) == 3e-4
    assert learning_rate(pairs, method="dpo") == 1e-6


def test_the_header_names_dpos_defaults(models, tmp_path, capsys):  # noqa: F811
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows(4))
    common = ["train", "--model", str(models[0]), "--dataset", str(data), "--max-steps", "1",
              "--per-device-train-batch-size", "2", "--validation-split-percentage", "0",
              "--precision", "fp32", "--disable-tqdm"]
    assert main([*common, "--output-dir", str(tmp_path / "a")]) == 0
    assert ("hputrain: defaults for DPO: learning_rate 1e-06 (TRL's DPOConfig); set "
            "--learning-rate to change") in capsys.readouterr().out
    assert main([*common, "--output-dir", str(tmp_path / "b"), "--learning-rate", "1e-5"]) == 0
    assert "defaults for DPO" not in capsys.readouterr().out


# -- issue 32: LoRA under fsdp with a precomputed reference ----------------------------------------

RANKS_SCRIPT = str((Path(__file__).parents[2] / "combinations_ranks.py"))


def launch_plan(plan: Path, runs: list[dict], timeout: int = 600) -> None:
    """`hputrain launch --nproc-per-node 2 combinations_ranks.py PLAN`: the runs one after the
    other in the same two processes (each `hputrain train` with the user's --devices 2), in a
    process group of its own, killed whole past `timeout`."""
    plan.write_text(json.dumps(runs))
    proc = subprocess.Popen([sys.executable, "-m", "hputrain.cli", "launch", "--nproc-per-node",
                             "2", "--cpu", RANKS_SCRIPT, str(plan)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the 2-process runs did not finish within {timeout} s (hung?): {out[-2000:]}")
    logs = "".join(p.read_text()[-3000:] for p in sorted(plan.parent.glob("*.rank*.log")))
    assert proc.returncode == 0, out[-2000:] + logs


def losses(out: Path) -> list[dict]:
    return [r for r in records(out) if "loss" in r]


@pytest.mark.slow
def test_lora_under_fsdp_with_a_precomputed_reference_trains_saves_and_resumes(models, tmp_path):  # noqa: F811
    """The triple was refused: the adapter-disabled pass before training made FSDP2's first
    forward see no trainable parameter (PEFT clears requires_grad while adapters are disabled),
    so it gave the float32 LoRA weights bf16 gradients (bf16), and it left the root and the last
    block gathered, so the optimizer held tensors that never got a gradient (fp32: no optimizer
    state to save). 2 processes x 2 pairs must equal 1 process x 4 pairs, in fp32 and in bf16,
    and a run resumed from its checkpoint the uninterrupted one."""
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows(8))
    common = ["--model", str(models[0]), "--dataset", str(data), "--lora-r", "4",
              "--lora-dropout", "0", "--precompute-ref-log-probs", "--max-steps", "3",
              "--save-steps", "1", "--save-total-limit", "3", "--seed", "5", "--learning-rate", "1e-2",
              "--logging-steps", "1",
              "--validation-split-percentage", "0", "--disable-tqdm", "--cpu"]
    precisions = {"fp32": "fp32", "bf16": "bf16-mixed"}
    runs = []
    for name, precision in precisions.items():
        two = [*common, "--precision", precision, "--devices", "2", "--strategy", "fsdp",
               "--per-device-train-batch-size", "2"]
        runs += [{"name": f"{name}-two", "out": str(tmp_path / f"{name}-two"), "argv": two},
                 {"name": f"{name}-resumed", "out": str(tmp_path / f"{name}-resumed"),
                  "argv": [*two, "--resume-from-checkpoint", str(tmp_path / f"{name}-two" / "checkpoint-1")]}]
    launch_plan(tmp_path / "plan.json", runs)
    for name, precision in precisions.items():
        assert main(["train", *common, "--precision", precision, "--per-device-train-batch-size",
                     "4", "--output-dir", str(tmp_path / f"{name}-one")]) == 0
        one, two, resumed = (losses(tmp_path / f"{name}-{run}") for run in ("one", "two", "resumed"))
        assert [r["step"] for r in two] == [1, 2, 3] and [r["step"] for r in resumed] == [2, 3]
        assert two[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # reference = policy at start
        assert one[-1]["rewards/margins"] != 0  # the adapters moved: a real comparison
        tolerance = dict(abs=2e-5, rel=1e-5) if name == "fp32" else BF16_TOLERANCE
        for a, b in zip(one, two):
            for key in ("loss", "grad_norm", "rewards/margins", "rewards/accuracies", "logps/rejected"):
                assert b[key] == pytest.approx(a[key], **tolerance), (name, a["step"], key)
        for a, b in zip(two[1:], resumed):
            for key in ("loss", "grad_norm", "rewards/margins"):
                assert b[key] == pytest.approx(a[key], abs=1e-6), (name, "resumed", a["step"], key)
        assert (tmp_path / f"{name}-two" / "checkpoint-3").is_dir()
        assert (tmp_path / f"{name}-two" / "final" / "adapter_model.safetensors").is_file()
        said = (tmp_path / f"{name}-two.rank0.log").read_text()
        assert "reference forwards: 0 during training, 1 to precompute" in said, said[-2000:]
