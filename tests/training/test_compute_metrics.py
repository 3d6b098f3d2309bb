"""compute_metrics: its results in metrics.jsonl beside eval_loss, equal to the same metric
computed directly from the model's outputs; the ready metrics of metrics.py."""
import json

import pytest
import torch

from hputrain import Trainer, TrainingArguments
from hputrain import metrics
from hputrain.errors import InputError

from ..hf_fixtures import llama_folder  # noqa: F401


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    def forward(self, x, labels):
        logits = self.net(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


EVAL_SIZE = 13  # does not split evenly over two ranks


def classes(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    labels = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return [{"x": x[i], "labels": labels[i]} for i in range(n)]


def run_args(tmp_path, **kw):
    return TrainingArguments(**({"output_dir": str(tmp_path / "out"), "max_steps": 3, "learning_rate": 1e-2,
                                 "save_steps": -1, "disable_tqdm": True, "report_to": "none",
                                 "per_device_train_batch_size": 8, "per_device_eval_batch_size": 4} | kw))


def eval_records(tmp_path):
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "eval_loss" in r]


def test_accuracy_of_a_classifier_in_metrics_jsonl(tmp_path):
    evaluation_set = classes(22, seed=2)  # 22 = 5 batches of 4 and one of 2
    trainer = Trainer(Classifier(), run_args(tmp_path, eval_steps=3), train_dataset=classes(64, seed=1),
                      eval_dataset=evaluation_set, compute_metrics=metrics.accuracy)
    trainer.train()
    [record] = eval_records(tmp_path)
    with torch.no_grad():  # the reference: the model itself on the whole set
        x = torch.stack([s["x"] for s in evaluation_set])
        labels = torch.stack([s["labels"] for s in evaluation_set])
        expected = (trainer.model.net(x).argmax(-1) == labels).double().mean().item()
    predicted = trainer.predict(evaluation_set)
    assert record["eval_accuracy"] == pytest.approx(expected, abs=1e-12)
    assert metrics.accuracy((predicted.predictions, predicted.label_ids))["accuracy"] == pytest.approx(expected)
    assert 0 < expected < 1 and record["step"] == 3 and "eval_perplexity" in record


def test_both_call_shapes_and_the_eval_prefix(tmp_path):
    seen = []

    def two(predictions, label_ids):  # (predictions, label_ids), numpy arrays
        seen.append((type(predictions).__name__, predictions.shape, label_ids.shape))
        return {"eval_count": len(label_ids), "mean_label": label_ids.mean()}

    trainer = Trainer(Classifier(), run_args(tmp_path), train_dataset=classes(64, seed=1),
                      eval_dataset=classes(10, seed=2), compute_metrics=two)
    result = trainer.evaluate()
    assert seen == [("ndarray", (10, 3), (10,))]
    labels = torch.stack([s["labels"] for s in classes(10, seed=2)]).double()
    assert result["eval_count"] == 10 and result["eval_mean_label"] == pytest.approx(labels.mean().item())

    def one(eval_pred):  # Hugging Face's: .predictions, .label_ids, and it unpacks as a pair
        predictions, label_ids = eval_pred
        assert predictions is eval_pred.predictions and label_ids is eval_pred.label_ids
        return {"n": predictions.shape[0]}

    trainer.compute_metrics = one
    assert trainer.evaluate()["eval_n"] == 10
    trainer.compute_metrics = lambda eval_pred: {"bad": "text"}
    with pytest.raises(InputError, match="compute_metrics returned bad='text'"):
        trainer.evaluate()


def token_windows(tokenizer, lengths):
    """Windows of the sample text, each `lengths[i]` tokens long, labels = input_ids (the model
    shifts them), in that order: pairs of equal length make ragged batches of 2."""
    from ..hf_fixtures import SAMPLE_TEXT

    ids = tokenizer(" ".join(SAMPLE_TEXT * 4), return_tensors="pt")["input_ids"][0]
    rows, start = [], 0
    for length in lengths:
        window = ids[start:start + length]
        rows.append({"input_ids": window, "labels": window.clone()})
        start += 7
    return rows


def test_token_accuracy_of_a_causal_lm(tmp_path, llama_folder):  # noqa: F811
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_folder)
    evaluation_set = token_windows(tokenizer, [12, 12, 16, 16, 9, 9])
    trainer = Trainer(model, run_args(tmp_path, per_device_train_batch_size=4, per_device_eval_batch_size=2,
                                      learning_rate=3e-3, max_steps=4),
                      train_dataset=token_windows(tokenizer, [16] * 16), eval_dataset=evaluation_set,
                      compute_metrics=metrics.token_accuracy)
    trainer.train()
    [record] = eval_records(tmp_path)
    right = total = 0
    with torch.no_grad():  # the reference: each window alone, unpadded
        for row in evaluation_set:
            logits = trainer.model(input_ids=row["input_ids"][None]).logits[0]
            right += int((logits[:-1].argmax(-1) == row["input_ids"][1:]).sum())
            total += len(row["input_ids"]) - 1
    assert record["eval_accuracy"] == pytest.approx(right / total, abs=1e-12)
    predicted = trainer.predict(evaluation_set)  # padded with -100 across batches
    assert predicted.predictions.shape[:2] == (6, 16)
    assert metrics.token_accuracy((predicted.predictions, predicted.label_ids))["accuracy"] == pytest.approx(right / total)
    assert 0 < right < total


def test_accuracy_ignores_minus_100_and_checks_shapes():
    logits = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]).numpy()
    assert metrics.accuracy((logits, torch.tensor([1, 1, -100]).numpy())) == {"accuracy": 0.5}
    with pytest.raises(InputError, match="token_accuracy needs logits"):
        metrics.token_accuracy((logits, torch.tensor([1, 1, 0]).numpy()))


@pytest.mark.slow
@pytest.mark.ci
def test_two_processes_see_the_whole_evaluation_set_once(tmp_path):
    """Each rank evaluates its share; compute_metrics gets the gathered set: every sample once."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "launch", "--nproc-per-node", "2",
                           str(root / "tests" / "metrics_script.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "metrics.json").read_text())
    model, rows = Classifier(), classes(EVAL_SIZE, seed=2)
    with torch.no_grad():
        logits = model.net(torch.stack([r["x"] for r in rows]))
    expected = (logits.argmax(-1) == torch.stack([r["labels"] for r in rows])).double().mean().item()
    assert result["eval_samples"] == EVAL_SIZE
    assert result["eval_accuracy"] == pytest.approx(expected, abs=1e-12)
