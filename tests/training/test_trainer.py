"""The training loop against hand computation and a hand-written PyTorch loop."""
import json
import math
from types import SimpleNamespace

import pytest
import torch

from hputrain import Trainer, TrainingArguments
from hputrain.data.batching import MicroBatches, default_collate
from hputrain.errors import InputError
from hputrain.training.optim import lr_lambda
from hputrain.training.telemetry import ThroughputClock

LOG_KEYS = {"step", "epoch", "loss", "learning_rate", "grad_norm", "tokens_per_second",
            "memory_allocated_gb", "max_memory_allocated_gb", "total_memory_available_gb"}
SUMMARY_KEYS = {"step", "train_runtime", "train_samples_per_second", "train_tokens_per_second",
                "train_steps_per_second", "throughput_seconds", "throughput_samples_per_second",
                "throughput_tokens_per_second", "throughput_steps_per_second", "throughput_steps",
                "mfu", "mfu_vs_measured_peak"}


class Regression(torch.nn.Module):
    """A small model whose forward returns a dict with the loss, like Hugging Face models."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)}


def regression_data(n=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = x @ torch.randn(6, generator=g) + 0.1 * torch.randn(n, generator=g)
    return [{"x": x[i], "y": y[i]} for i in range(n)]


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=8, learning_rate=1e-2, logging_steps=2,
                save_steps=0, disable_tqdm=True, throughput_warmup_steps=0, per_device_train_batch_size=8)
    return TrainingArguments(**(base | kw))


def records(tmp_path):
    return [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]


# -- schedules --------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule, expected", [
    ("linear", [0, 0.5, 1, 0.75, 0.5, 0.25, 0, 0]),
    ("cosine", [0, 0.5, 1, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2, 0, 0]),
    ("constant", [0, 0.5, 1, 1, 1, 1, 1, 1]),
])
def test_schedules_by_hand(schedule, expected):
    factor = lr_lambda(schedule, warmup_steps=2, total_steps=6)
    assert [factor(s) for s in range(8)] == pytest.approx(expected)


def test_trainer_logs_the_scheduled_learning_rate(tmp_path):
    data = regression_data()
    Trainer(Regression(), args(tmp_path, warmup_steps=2, logging_steps=1, lr_scheduler_type="linear"),
            train_dataset=data).train()
    lrs = [r["learning_rate"] for r in records(tmp_path) if "learning_rate" in r]
    factor = lr_lambda("linear", 2, 8)
    assert lrs == pytest.approx([1e-2 * factor(s) for s in range(1, 9)])


# -- the step against a hand-written loop ------------------------------------------------------------

def hand_written_loop(data, steps, batch, accumulate, lr, clip, seed=42):
    """Plain PyTorch: the same sample order (randperm seeded per epoch), AdamW, clip_grad_norm_."""
    model = Regression()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.dim() >= 2], lr=lr, weight_decay=0.0)
    opt.add_param_group({"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda("linear", 0, steps))
    global_batch = batch * accumulate
    per_epoch = len(data) // global_batch
    losses = []
    for step in range(steps):
        epoch, s = divmod(step, per_epoch)
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + epoch))
        chunk = order[s * global_batch:(s + 1) * global_batch].tolist()
        total = 0.0
        for m in range(accumulate):
            b = default_collate([data[i] for i in chunk[m * batch:(m + 1) * batch]])
            loss = model(**b)["loss"] / accumulate
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(total)
    return model, losses


@pytest.mark.parametrize("batch, accumulate", [(8, 1), (4, 2), (2, 4)])
def test_matches_hand_written_loop(tmp_path, batch, accumulate):
    data = regression_data()
    model = Regression()
    Trainer(model, args(tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulate,
                        logging_steps=1, max_grad_norm=0.5, max_steps=12),
            train_dataset=data).train()
    reference, losses = hand_written_loop(data, 12, batch, accumulate, 1e-2, 0.5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    logged = [r["loss"] for r in records(tmp_path) if "loss" in r]
    assert logged == pytest.approx(losses, rel=1e-5)


def test_accumulation_equals_a_bigger_batch(tmp_path):
    a, b = Regression(), Regression()
    Trainer(a, args(tmp_path / "a", per_device_train_batch_size=8), train_dataset=regression_data()).train()
    Trainer(b, args(tmp_path / "b", per_device_train_batch_size=2, gradient_accumulation_steps=4),
            train_dataset=regression_data()).train()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_global_batch_is_the_same_for_any_number_of_processes():
    data = list(range(40))
    one = list(MicroBatches(data, list, 4, 1, 0, 1, seed=3).iterate(0, epochs=1))
    ranks = [list(MicroBatches(data, list, 2, 1, r, 2, seed=3).iterate(0, epochs=1)) for r in (0, 1)]
    assert [sorted(b) for b in one] == [sorted(r0 + r1) for r0, r1 in zip(*ranks)]
    resumed = list(MicroBatches(data, list, 4, 1, 0, 1, seed=3).iterate(3, epochs=1))
    assert resumed == one[3:]


# -- what a model may return, and what a batch may be ------------------------------------------------

class Plain(torch.nn.Module):
    def __init__(self, returns):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(6))
        self.returns = returns

    def forward(self, x, y):
        loss = ((x @ self.w - y) ** 2).mean()
        return {"tensor": loss, "object": SimpleNamespace(loss=loss, logits=x @ self.w)}[self.returns]


@pytest.mark.parametrize("returns", ["tensor", "object"])
def test_loss_forms(tmp_path, returns):
    model = Plain(returns)
    Trainer(model, args(tmp_path), train_dataset=regression_data()).train()
    assert model.w.abs().sum() > 0


def test_compute_loss_override(tmp_path):
    model = Regression()
    seen = []

    def l1(m, batch):
        seen.append(sorted(batch))
        return (m.net(batch["x"]).squeeze(-1) - batch["y"]).abs().mean()
    Trainer(model, args(tmp_path, max_steps=2), train_dataset=regression_data(), compute_loss=l1).train()
    assert seen[0] == ["x", "y"] and len(seen) == 2


def test_model_without_loss_is_a_clear_error(tmp_path):
    class NoLoss(Regression):
        def forward(self, x, y):
            return {"logits": self.net(x)}
    with pytest.raises(InputError, match="returned no loss"):
        Trainer(NoLoss(), args(tmp_path), train_dataset=regression_data()).train()


def test_iterable_dataset_needs_max_steps(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(regression_data())
    model = Regression()
    out = Trainer(model, args(tmp_path, max_steps=10), train_dataset=Stream()).train()
    assert out.global_step == 10
    with pytest.raises(InputError, match="set max_steps"):
        Trainer(Regression(), args(tmp_path / "again", max_steps=-1), train_dataset=Stream()).train()


def test_default_collate_pads_sequences():
    batch = default_collate([{"input_ids": [1, 2, 3], "labels": [1, 2, 3], "attention_mask": [1, 1, 1], "text": "a"},
                             {"input_ids": [4], "labels": [4], "attention_mask": [1], "text": "b"}])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3], [4, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["text"] == ["a", "b"]


def test_epochs_set_the_length(tmp_path):
    out = Trainer(Regression(), args(tmp_path, max_steps=-1, num_train_epochs=2, per_device_train_batch_size=16),
                  train_dataset=regression_data(64)).train()
    assert out.global_step == 8  # 64 samples / 16 per step x 2 epochs


# -- telemetry --------------------------------------------------------------------------------------

def test_metrics_records(tmp_path):
    data = regression_data()
    Trainer(Regression(), args(tmp_path, eval_steps=4), train_dataset=data, eval_dataset=data[:20]).train()
    recs = records(tmp_path)
    logs = [r for r in recs if "loss" in r]
    assert [r["step"] for r in logs] == [2, 4, 6, 8] and all(set(r) == LOG_KEYS for r in logs)
    assert all(r["grad_norm"] > 0 and r["memory_allocated_gb"] > 0 for r in logs)
    evals = [r for r in recs if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    assert evals[-1]["eval_perplexity"] == pytest.approx(math.exp(evals[-1]["eval_loss"]))
    assert set(recs[-1]) == SUMMARY_KEYS and recs[-1]["throughput_steps"] == 8


def test_evaluate_is_the_sample_mean(tmp_path):
    data = regression_data(21)
    model = Regression()
    trainer = Trainer(model, args(tmp_path, per_device_eval_batch_size=4), eval_dataset=data)
    batch = default_collate(data)
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(model.net(batch["x"]).squeeze(-1), batch["y"]).item()
    assert trainer.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-5)


class FakeTime:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_clock_leaves_out_warmup_and_pauses(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr("hputrain.training.telemetry.time.perf_counter", fake)
    clock = ThroughputClock(warmup_steps=2)
    for seconds in (10.0, 10.0, 1.0, 1.0, 1.0):  # two slow warm-up steps, then three fast ones
        fake.now += seconds
        clock.step_done(samples=4, tokens=40)
        if clock.steps == 2:
            clock.pause()
            fake.now += 100.0  # evaluation
            clock.resume()
    summary = clock.summary(flops_per_token=6.0, peak_flops=1200.0, measured_peak_flops=480.0)
    assert summary["throughput_steps"] == 3 and summary["throughput_seconds"] == pytest.approx(3.0)
    assert summary["throughput_steps_per_second"] == pytest.approx(1.0)
    assert summary["throughput_tokens_per_second"] == pytest.approx(40.0)
    assert summary["throughput_samples_per_second"] == pytest.approx(4.0)
    assert summary["mfu"] == pytest.approx(6.0 * 40.0 / 1200.0)
    assert summary["mfu_vs_measured_peak"] == pytest.approx(6.0 * 40.0 / 480.0)
    # The Hugging Face Trainer's names keep its meaning: the whole run, warm-up and pauses included.
    assert summary["train_runtime"] == pytest.approx(123.0)
    assert summary["train_steps_per_second"] == pytest.approx(5 / 123.0)
    assert summary["train_tokens_per_second"] == pytest.approx(5 * 40 / 123.0)
    assert summary["train_samples_per_second"] == pytest.approx(5 * 4 / 123.0)


def test_trainer_throughput_excludes_warmup_evaluation_and_saving(tmp_path, monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr("hputrain.training.telemetry.time.perf_counter", fake)

    class Timed(Regression):
        calls = 0

        def forward(self, x, y):
            Timed.calls += 1
            fake.now += 50.0 if Timed.calls <= 3 else 0.5  # warm-up steps are slow
            return super().forward(x, y)
    data = regression_data()
    trainer = Trainer(Timed(), args(tmp_path, throughput_warmup_steps=3, max_steps=10, eval_steps=5, save_steps=5),
                      train_dataset=data, eval_dataset=data[:8])
    real_evaluate, real_save = trainer.evaluate, trainer._save
    monkeypatch.setattr(trainer, "evaluate", lambda **kw: (setattr(fake, "now", fake.now + 1000), real_evaluate(**kw))[1])
    monkeypatch.setattr(trainer, "_save", lambda b: (setattr(fake, "now", fake.now + 1000), real_save(b))[1])
    summary = trainer.train().metrics
    # 7 measured steps; the evaluation forwards add 0.5 s per batch but run while the clock is paused
    assert summary["throughput_steps"] == 7
    assert summary["throughput_steps_per_second"] == pytest.approx(2.0)


def test_no_host_read_back_outside_logging_steps(tmp_path, monkeypatch):
    reads = []
    original = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: (reads.append(1), original(self))[1])
    Trainer(Regression(), args(tmp_path, max_steps=12, logging_steps=6), train_dataset=regression_data()).train()
    assert len(reads) == 2 * 2  # loss and grad norm, at steps 6 and 12 only


def test_save_steps_minus_one_never_saves(tmp_path):
    from hputrain.models.gpt import GPT, GPTConfig

    tokens = torch.randint(0, 256, (16, 17), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, save_steps=-1, disable_tqdm=True,
                             per_device_train_batch_size=4, accelerator="cpu")
    Trainer(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)), args, train_dataset=data).train()
    assert (tmp_path / "metrics.jsonl").exists() and not list(tmp_path.glob("*checkpoint*"))
    with pytest.raises(InputError, match="save_steps must be -1"):
        TrainingArguments(save_steps=-2)
