"""Issue 25: preference training (DPO). The references: a direct computation (each sequence
through the model alone, unpadded, log-probabilities summed in float64, the loss formula written
out here) and TRL 1.16's DPOTrainer on the same model, reference and pairs (where TRL is
installed: it is in the test extra)."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from ...hf_fixtures import lazy_rehearses_hf_models, tiny_llama_folder

transformers = pytest.importorskip("transformers", reason="DPO fine-tunes Hugging Face models")

from hputrain.cli import main  # noqa: E402
from hputrain.methods.dpo.config import DPOConfig  # noqa: E402
from hputrain.methods.dpo.data import PairCollator, encode_pairs  # noqa: E402
from hputrain.methods.dpo.trainer import DPOTrainer, preference_loss  # noqa: E402

TEMPLATES = Path(__file__).parents[2] / "chat_templates"
PROMPTS = ["the quick brown", "to be or", "a stitch in time", "def add(a, b):", "a penny saved",
           "that is the"]
CHOSEN = [" fox jumps", " not to be", " saves nine", "\n    return a + b", " is a penny earned",
          " question"]
REJECTED = [" dog sleeps over", " maybe", " is late and slow", " pass", " is lost", " answer, no"]


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama (the policy) and another of the same shape with other weights (a reference)."""
    root = tmp_path_factory.mktemp("dpo-models")
    return tiny_llama_folder(root / "policy", seed=0), tiny_llama_folder(root / "reference", seed=1)


def text_rows(n: int = 6) -> list[dict]:
    return [{"prompt": PROMPTS[i % 6], "chosen": CHOSEN[i % 6], "rejected": REJECTED[i % 6]}
            for i in range(n)]


def chat_rows(n: int = 4) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": PROMPTS[i]}],
             "chosen": [{"role": "assistant", "content": CHOSEN[i].strip()}],
             "rejected": [{"role": "assistant", "content": REJECTED[i].strip()}]} for i in range(n)]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def load(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def tokenizer_of(folder: Path, template: str | None = None):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if template:
        tokenizer.chat_template = (TEMPLATES / template).read_text()
    return tokenizer


# -- the direct computation ------------------------------------------------------------------------

def sequence_logp(model, ids: list[int], start: int) -> float:
    """log p(ids[start:] | ids[:start]) with the model called on this one sequence, in float64."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = logits.log_softmax(-1)
    return sum(logp[t - 1, ids[t]].item() for t in range(start, len(ids)))


def direct(policy, reference, pairs: list[dict], beta: float = 0.1) -> dict:
    """Mean loss (sigmoid), rewards, margins and accuracies over `pairs`, written out."""
    out = {"loss": [], "chosen": [], "rejected": [], "accuracy": []}
    for pair in pairs:
        start = len(pair["prompt_ids"])
        chosen = pair["prompt_ids"] + pair["chosen_ids"]
        rejected = pair["prompt_ids"] + pair["rejected_ids"]
        rc = beta * (sequence_logp(policy, chosen, start) - sequence_logp(reference, chosen, start))
        rr = beta * (sequence_logp(policy, rejected, start) - sequence_logp(reference, rejected, start))
        out["loss"].append(math.log1p(math.exp(-(rc - rr))))
        out["chosen"].append(rc)
        out["rejected"].append(rr)
        out["accuracy"].append(float(rc > rr))
    mean = {k: sum(v) / len(v) for k, v in out.items()}
    mean["margin"] = mean["chosen"] - mean["rejected"]
    return mean


# -- tokenization as TRL's -------------------------------------------------------------------------

@pytest.mark.parametrize("shape", ["text", "chat", "implicit_chat", "implicit_text"])
def test_pairs_are_tokenized_as_trl_tokenizes_them(models, shape):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizer = tokenizer_of(models[0], "chatml.jinja")
    rows = chat_rows() if "chat" in shape else text_rows()
    if shape == "implicit_chat":
        rows = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                for r in rows]
    elif shape == "implicit_text":
        rows = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                for r in rows]
    ours, _ = encode_pairs(((f"row {i}", r) for i, r in enumerate(rows)), tokenizer, max_length=1024)
    theirs = trl.DPOTrainer(load(models[0]), ref_model=load(models[1]), processing_class=tokenizer,
                            args=trl.DPOConfig(output_dir="/tmp/hputrain-trl", report_to=[],
                                               use_cpu=True, bf16=False),
                            train_dataset=datasets.Dataset.from_list(rows)).train_dataset
    assert ours == [{k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in theirs]


def test_max_length_keeps_the_start_and_leaves_out_prompts_that_fill_it(models):
    tokenizer = tokenizer_of(models[0])
    rows = [("a", {"prompt": "the quick brown fox " * 5, "chosen": " yes", "rejected": " no"}),
            ("b", {"prompt": "to be", "chosen": " or not to be " * 4, "rejected": " no"})]
    full, _ = encode_pairs(rows, tokenizer)
    limit = len(full[1]["prompt_ids"]) + 4
    assert len(full[0]["prompt_ids"]) >= limit  # the first prompt alone fills the limit
    pairs, stats = encode_pairs(rows, tokenizer, max_length=limit)
    assert stats.prompt_fills_block == 1 and stats.truncated == 1 and len(pairs) == 1
    assert pairs[0]["chosen_ids"] == full[1]["chosen_ids"][:4]
    assert pairs[0]["rejected_ids"] == full[1]["rejected_ids"][:4]
    kept, stats = encode_pairs(rows, tokenizer, max_length=limit, max_prompt_length=3)
    assert len(kept) == 2 and kept[0]["prompt_ids"] == full[0]["prompt_ids"][-3:]


# -- the loss and metrics --------------------------------------------------------------------------

def trainer_metrics(policy, reference, tokenizer, pairs, tmp_path, **config) -> dict:
    args = DPOConfig(output_dir=str(tmp_path / "ours"), per_device_eval_batch_size=len(pairs),
                     report_to="none", disable_tqdm=True, **config)
    trainer = DPOTrainer(policy, args, ref_model=reference, processing_class=tokenizer,
                         train_dataset=pairs)
    return trainer.evaluate(pairs)


def test_loss_rewards_and_accuracy_equal_a_direct_computation(models, tmp_path):
    tokenizer = tokenizer_of(models[0])
    pairs, _ = encode_pairs(((str(i), r) for i, r in enumerate(text_rows())), tokenizer)
    ours = trainer_metrics(load(models[0]), load(models[1]), tokenizer, pairs, tmp_path)
    expected = direct(load(models[0]), load(models[1]), pairs)
    assert ours["eval_loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert ours["eval_rewards/chosen"] == pytest.approx(expected["chosen"], abs=1e-5)
    assert ours["eval_rewards/rejected"] == pytest.approx(expected["rejected"], abs=1e-5)
    assert ours["eval_rewards/margins"] == pytest.approx(expected["margin"], abs=1e-5)
    assert ours["eval_rewards/accuracies"] == expected["accuracy"]
    assert 0 < expected["accuracy"] < 1  # the two models disagree on some pairs: a real check


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust"])
def test_loss_and_metrics_equal_trl_dpo_trainer(models, tmp_path, loss_type):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizer = tokenizer_of(models[0])
    rows = text_rows()
    smoothing = 0.1 if loss_type == "robust" else 0.0
    trainer = trl.DPOTrainer(load(models[0]), ref_model=load(models[1]), processing_class=tokenizer,
                             args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[],
                                                use_cpu=True, bf16=False, loss_type=[loss_type],
                                                label_smoothing=smoothing, beta=0.2),
                             train_dataset=datasets.Dataset.from_list(rows))
    encoded = [dict(row) for row in trainer.train_dataset]
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, trainer.data_collator(encoded)).item()
    theirs = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    ours = trainer_metrics(load(models[0]), load(models[1]), tokenizer, rows, tmp_path,
                           loss_type=loss_type, label_smoothing=smoothing, beta=0.2)
    assert ours["eval_loss"] == pytest.approx(loss, abs=1e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                 "logps/chosen", "logps/rejected"):
        assert ours[f"eval_{name}"] == pytest.approx(theirs[name], abs=1e-5, rel=1e-6), name


def test_label_smoothing_is_conservative_dpo():
    logits = torch.tensor([0.3, -1.2])
    zero = torch.zeros(2)
    loss = preference_loss(logits, zero, zero, zero, beta=1.0, label_smoothing=0.2)
    expected = -0.8 * torch.nn.functional.logsigmoid(logits) - 0.2 * torch.nn.functional.logsigmoid(-logits)
    assert torch.allclose(loss, expected)


def test_padding_to_a_bucket_changes_no_log_probability(models, tmp_path):
    """The same pairs in a batch padded to 128 and one padded to 32 give the same loss: padding
    and its attention mask leave the completions' log-probabilities alone."""
    tokenizer = tokenizer_of(models[0])
    pairs, _ = encode_pairs(((str(i), r) for i, r in enumerate(text_rows())), tokenizer)
    wide = PairCollator(tokenizer.pad_token_id, max_length=128, buckets=1)(pairs)
    narrow = PairCollator(tokenizer.pad_token_id, max_length=32, buckets=1)(pairs)
    assert wide["input_ids"].shape[1] == 128 and narrow["input_ids"].shape[1] == 32
    policy = load(models[0])
    from hputrain.methods.dpo.trainer import completion_logps
    with torch.no_grad():
        a, b = (completion_logps(policy(input_ids=x["input_ids"], attention_mask=x["attention_mask"]).logits,
                                 x["input_ids"], x["completion_mask"]) for x in (wide, narrow))
    assert torch.allclose(a, b, atol=1e-4)


# -- training through `hputrain train` -------------------------------------------------------------

def train(tmp_path: Path, name: str, *args: str) -> list[dict]:
    out = tmp_path / name
    status = main(["train", *args, "--output-dir", str(out), "--logging-steps", "1",
                   "--disable-tqdm", "--validation-split-percentage", "0", "--precision", "fp32"])
    assert status == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


def test_first_step_logs_the_direct_loss_with_another_reference(models, tmp_path, capsys):
    """The issue's 'done when': model A, reference B, the global batch = every pair: the first
    step's loss, margin and accuracy are the direct formula's."""
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows())
    logged = train(tmp_path, "run", "--model", str(models[0]), "--ref-model", str(models[1]),
                   "--dataset", str(data), "--max-steps", "1", "--per-device-train-batch-size", "6")
    header = capsys.readouterr().out
    assert "DPO on preference pairs" in header and f"--ref-model {models[1]}" in header
    pairs, _ = encode_pairs(((str(i), r) for i, r in enumerate(text_rows())),
                            tokenizer_of(models[0]), max_length=128)
    expected = direct(load(models[0]), load(models[1]), pairs)
    first = logged[0]
    assert first["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert first["rewards/margins"] == pytest.approx(expected["margin"], abs=1e-5)
    assert first["rewards/accuracies"] == pytest.approx(expected["accuracy"], abs=1e-6)


@pytest.mark.parametrize("lora", [True, False])
def test_without_a_reference_the_first_loss_is_log_2(models, tmp_path, lora):
    """LoRA: the adapter-disabled base; a full fine-tune: a frozen copy. Either way the reference
    is the policy at step 1: loss log 2, rewards 0; the output reloads."""
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows())
    extra = ["--lora-r", "4"] if lora else []
    logged = train(tmp_path, "run", "--model", str(models[0]), "--dataset", str(data),
                   "--max-steps", "3", "--per-device-train-batch-size", "2",
                   "--learning-rate", "1e-2", *extra)
    assert logged[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert logged[0]["rewards/chosen"] == 0 and logged[0]["rewards/margins"] == 0
    assert logged[-1]["rewards/chosen"] != 0  # the policy moved away from the reference
    final = tmp_path / "run" / "final"
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.PeftModel.from_pretrained(load(models[0]), final)
    else:
        model = load(final)
    assert model(torch.tensor([[1, 5, 7]])).logits.shape[-1] == len(tokenizer_of(models[0]))


def test_the_loss_is_a_mean_over_the_global_batch_however_it_is_split(models, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows(4))
    common = ["--model", str(models[0]), "--ref-model", str(models[1]), "--dataset", str(data),
              "--max-steps", "2", "--seed", "3"]
    whole = train(tmp_path, "whole", *common, "--per-device-train-batch-size", "4")
    split = train(tmp_path, "split", *common, "--per-device-train-batch-size", "2",
                  "--gradient-accumulation-steps", "2")
    for a, b in zip(whole, split):
        for key in ("loss", "grad_norm", "rewards/margins", "rewards/accuracies", "logps/chosen"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key


def test_training_raises_the_reward_accuracy_on_its_pairs(models, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows())
    logged = train(tmp_path, "run", "--model", str(models[0]), "--dataset", str(data),
                   "--lora-r", "8", "--max-steps", "20", "--per-device-train-batch-size", "6",
                   "--learning-rate", "3e-3", "--logging-steps", "1")
    assert logged[0]["rewards/accuracies"] == 0  # rewards all 0 at the start: no pair is won
    assert logged[-1]["rewards/accuracies"] == 1
    assert logged[-1]["rewards/margins"] > logged[4]["rewards/margins"] > 0
    assert logged[-1]["loss"] < logged[0]["loss"] - 0.02


def test_precomputed_reference_gives_the_live_loss_and_its_cache_is_reused(models, tmp_path, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows())
    common = ["--model", str(models[0]), "--ref-model", str(models[1]), "--dataset", str(data),
              "--max-steps", "2", "--per-device-train-batch-size", "3"]
    live = train(tmp_path, "live", *common)
    assert "reference forwards: 2 during training, 0 to precompute" in capsys.readouterr().out
    cached = train(tmp_path, "pre", *common, "--precompute-ref-log-probs")
    assert "reference forwards: 0 during training, 1 to precompute" in capsys.readouterr().out
    for a, b in zip(live, cached):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    resumed = train(tmp_path, "pre", *common, "--precompute-ref-log-probs", "--max-steps", "3",
                    "--resume-from-checkpoint", "latest")
    assert "reference forwards: 0 during training, 0 to precompute" in capsys.readouterr().out
    assert resumed[-1]["step"] == 3
    cache = list((tmp_path / "pre" / ".cache").glob("dpo-ref-*.npy"))
    assert len(cache) == 1
    shutil.rmtree(tmp_path / "pre" / "final")
    tokenizer = tokenizer_of(models[0])
    args = DPOConfig(output_dir=str(tmp_path / "pre"), precompute_ref_log_probs=True,
                     ref_key=None, report_to="none", disable_tqdm=True, max_length=128)
    pairs, _ = encode_pairs(((str(i), r) for i, r in enumerate(text_rows())), tokenizer, max_length=128)
    trainer = DPOTrainer(load(models[0]), args, ref_model=load(models[1]), processing_class=tokenizer,
                         train_dataset=pairs)
    trainer.precompute_reference(pairs)
    assert trainer.precompute_forwards > 0  # another key (a fingerprint): computed anew
    again = DPOTrainer(load(models[0]), args, ref_model=load(models[1]), processing_class=tokenizer,
                       train_dataset=pairs)
    with_ref = again.precompute_reference(pairs)
    assert again.precompute_forwards == 0  # the same reference: read from the cache
    assert len(list((tmp_path / "pre" / ".cache").glob("dpo-ref-*.npy"))) == 2
    assert all("ref_chosen_logps" in p for p in with_ref)


def test_resume_continues_exactly(models, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows())
    common = ["--model", str(models[0]), "--dataset", str(data), "--lora-r", "4",
              "--per-device-train-batch-size", "2", "--learning-rate", "1e-2", "--save-steps", "2"]
    straight = train(tmp_path, "a", *common, "--max-steps", "4", "--save-total-limit", "3")
    resumed = train(tmp_path, "b", *common, "--max-steps", "4",
                    "--resume-from-checkpoint", str(tmp_path / "a" / "checkpoint-2"))
    tail = [r for r in resumed if r["step"] > 2]
    assert [r["step"] for r in tail] == [3, 4]
    for a, b in zip(straight[2:], tail):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], abs=1e-6)


def test_conversational_pairs_train_through_the_chat_template(models, tmp_path):
    folder = tmp_path / "chat-model"
    shutil.copytree(models[0], folder)
    tokenizer = tokenizer_of(folder, "chatml.jinja")
    tokenizer.save_pretrained(folder)
    data = write_jsonl(tmp_path / "pairs.jsonl", chat_rows())
    logged = train(tmp_path, "run", "--model", str(folder), "--dataset", str(data), "--lora-r", "4",
                   "--max-steps", "1", "--per-device-train-batch-size", "4")
    assert logged[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    saved = transformers.AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    assert saved.chat_template == tokenizer.chat_template


# -- bad input: one line, exit 2 -------------------------------------------------------------------

@pytest.mark.parametrize("rows, flags, message", [
    ([{"prompt": "a", "chosen": "b"}], [], "--method dpo needs preference rows"),
    ([{"prompt": "a", "chosen": "b", "rejected": 3}], [], "'rejected' is int"),
    ([{"prompt": "a", "chosen": "b", "rejected": None}], [], "has no 'rejected' field"),
    ([{"prompt": "a", "chosen": [{"role": "wizard", "content": "x"}], "rejected": "c"}], [],
     "wizard"),
    ([{"text": "just text"}], ["--beta", "0.2"], "--beta is for DPO (preference pairs) or GRPO"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--beta", "-1"], "beta must be positive"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--loss-type", "aot"], "is not computed"),
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}], ["--method", "sft"], "holds preference"),
])
def test_bad_input_is_one_line_and_exit_2(models, tmp_path, capsys, rows, flags, message):
    data = write_jsonl(tmp_path / "pairs.jsonl", rows * 4)
    method = ["--method", "dpo"] if message.startswith("--method dpo") else []
    status = main(["train", "--model", str(models[0]), "--dataset", str(data), "--max-steps", "1",
                   "--output-dir", str(tmp_path / "out"), *method, *flags])
    err = capsys.readouterr().err
    assert status == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


# -- several processes -----------------------------------------------------------------------------

def launch(tmp_path: Path, name: str, *args: str) -> list[dict]:
    import subprocess
    import sys

    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "train", "--cpu", *args,
                           "--output-dir", str(out), "--logging-steps", "1", "--disable-tqdm",
                           "--validation-split-percentage", "0", "--precision", "fp32"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, reference", [
    pytest.param("ddp", "lora", marks=pytest.mark.ci), ("fsdp", "frozen copy")])
def test_two_processes_train_as_one_with_the_same_global_batch(models, tmp_path, strategy, reference):
    """2 processes × 2 pairs equal 1 process × 4 pairs: ddp with the adapter-disabled reference,
    fsdp with a frozen copy sharded like the policy."""
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows(4))
    common = ["--model", str(models[0]), "--dataset", str(data), "--max-steps", "2", "--seed", "5",
              "--learning-rate", "1e-2",  # LoRA without dropout: each rank would draw other masks
              *(["--lora-r", "4", "--lora-dropout", "0"] if reference == "lora" else [])]
    one = launch(tmp_path, "one", *common, "--per-device-train-batch-size", "4")
    two = launch(tmp_path, "two", *common, "--per-device-train-batch-size", "2", "--devices", "2",
                 "--strategy", strategy)
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm", "rewards/margins", "rewards/accuracies", "logps/rejected"):
            assert a[key] == pytest.approx(b[key], abs=2e-5, rel=1e-5), (a["step"], key)
    assert (tmp_path / "two" / "final").is_dir()


@pytest.mark.slow
def test_lora_under_fsdp_in_bf16_trains_against_the_adapter_disabled_base(models, tmp_path):
    """Found by hand: with the reference's forward before the policy's, FSDP2's mixed precision
    gave the float32 LoRA weights bf16 gradients and the run died; the policy goes first there."""
    import subprocess
    import sys

    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows(4))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "train", "--cpu", "--model",
                           str(models[0]), "--dataset", str(data), "--lora-r", "4", "--devices", "2",
                           "--strategy", "fsdp", "--precision", "bf16-mixed", "--max-steps", "2",
                           "--per-device-train-batch-size", "2", "--logging-steps", "1",
                           "--gradient-checkpointing", "--validation-split-percentage", "0",
                           "--disable-tqdm", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert logged[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the reference = the policy
    assert (out / "final" / "adapter_model.safetensors").is_file()


def summary_of(out: Path) -> dict:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if "graph_compiles" in line][-1]


@lazy_rehearses_hf_models
def test_lazy_mode_compiles_nothing_after_warm_up(models, tmp_path):
    """Chosen and rejected padded to a few static lengths: after the warm-up steps, DPO steps
    (policy forward, adapter-disabled reference forward, backward) compile no new graph."""
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows(12))
    train(tmp_path, "lazy", "--model", str(models[0]), "--dataset", str(data), "--lora-r", "4",
          "--max-steps", "6", "--per-device-train-batch-size", "2", "--execution-mode", "lazy",
          "--throughput-warmup-steps", "2", "--logging-steps", "3")
    summary = summary_of(tmp_path / "lazy")
    assert summary["graph_compiles"] > 0  # lazy mode really ran
    assert summary["graph_compiles_after_warmup"] == 0


def test_gradient_checkpointing_changes_no_number(models, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows())
    common = ["--model", str(models[0]), "--ref-model", str(models[1]), "--dataset", str(data),
              "--max-steps", "2", "--per-device-train-batch-size", "3", "--learning-rate", "1e-2"]
    plain = train(tmp_path, "plain", *common)
    checkpointed = train(tmp_path, "ckpt", *common, "--gradient-checkpointing")
    for a, b in zip(plain, checkpointed):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


# -- the Python API --------------------------------------------------------------------------------

def test_python_api_trains_a_datasets_dataset_with_trl_names(models, tmp_path):
    import hputrain

    peft = pytest.importorskip("peft")
    datasets = pytest.importorskip("datasets")
    policy = peft.get_peft_model(load(models[0]), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    args = hputrain.DPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=3,
                              beta=0.2, logging_steps=1, report_to="none", disable_tqdm=True)
    trainer = hputrain.DPOTrainer(policy, args, train_dataset=datasets.Dataset.from_list(text_rows()),
                                  processing_class=tokenizer_of(models[0]))
    output = trainer.train()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert output.global_step == 2 and trainer.objective.reference_forwards == 2


@pytest.mark.parametrize("name, says", [("rpo_alpha", "is not computed here"),
                                        ("padding_free", "static lengths"),
                                        ("fp16", "use bf16=True"), ("betta", "did you mean 'beta'")])
def test_trl_names_hputrain_does_not_take_are_one_line(name, says):
    from hputrain.config.fields import ConfigError

    with pytest.raises(ConfigError, match=says):
        DPOConfig(**{name: 1})


def test_throughput_counts_the_tokens_of_the_sequences_and_pairs_as_samples(models, tmp_path):
    """A DPO step's loss is a mean over pairs, and its throughput counts tokens: every sequence's,
    chosen and rejected, without the padding; samples are pairs (issue 30 item 7: they were
    counted twice, once per row)."""
    row = text_rows(1)[0]
    data = write_jsonl(tmp_path / "pairs.jsonl", [row] * 8)
    train(tmp_path, "run", "--model", str(models[0]), "--dataset", str(data), "--lora-r", "4",
          "--max-steps", "6", "--per-device-train-batch-size", "2", "--throughput-warmup-steps", "1")
    summary = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
               if "train_tokens_per_second" in line][-1]
    (pair,), _ = encode_pairs([("row", row)], tokenizer_of(models[0]), max_length=128)
    tokens_per_pair = 2 * len(pair["prompt_ids"]) + len(pair["chosen_ids"]) + len(pair["rejected_ids"])
    ratio = summary["train_tokens_per_second"] / summary["train_samples_per_second"]
    assert ratio == pytest.approx(tokens_per_pair, rel=1e-6)
    pairs_per_step = summary["train_samples_per_second"] / summary["train_steps_per_second"]
    assert pairs_per_step == pytest.approx(2, rel=1e-6)  # --per-device-train-batch-size 2


def test_evaluation_between_logs_leaves_the_training_metrics_whole(models, tmp_path):
    """Evaluating every step while logging every second step: each log's rewards are still the
    mean over both of its steps (compared with the same run logging every step)."""
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows(6) + text_rows(2))

    def run(name: str, *flags: str) -> list[dict]:
        out = tmp_path / name
        assert main(["train", "--model", str(models[0]), "--ref-model", str(models[1]),
                     "--dataset", str(data), "--max-steps", "4", "--per-device-train-batch-size",
                     "3", "--learning-rate", "1e-2", "--validation-split-percentage", "25",
                     "--disable-tqdm", "--precision", "fp32", "--output-dir", str(out),
                     *flags]) == 0
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    records = run("eval", "--logging-steps", "2", "--eval-steps", "1")
    every = [r for r in run("every", "--logging-steps", "1") if "rewards/margins" in r]
    logged = [r for r in records if "rewards/margins" in r]
    assert [r["step"] for r in logged] == [2, 4]
    assert sum("eval_rewards/margins" in r for r in records) >= 4
    for record in logged:
        pair = [r for r in every if r["step"] in (record["step"] - 1, record["step"])]
        mean = sum(r["rewards/margins"] for r in pair) / 2
        assert record["rewards/margins"] == pytest.approx(mean, abs=1e-6)


def test_evaluate_takes_pairs_against_a_reference(models, tmp_path, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows())
    assert main(["evaluate", "--model", str(models[0]), "--ref-model", str(models[1]),
                 "--dataset", str(data), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    pairs, _ = encode_pairs(((str(i), r) for i, r in enumerate(text_rows())),
                            tokenizer_of(models[0]), max_length=128)
    expected = direct(load(models[0]), load(models[1]), pairs)
    assert result["eval_pairs"] == 6 and result["method"] == "dpo"
    assert result["eval_loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert result["eval_rewards/margins"] == pytest.approx(expected["margin"], abs=1e-5)
    assert main(["evaluate", "--model", str(models[0]), "--dataset", str(data)]) == 2
    assert "needs --ref-model DIR" in capsys.readouterr().err
