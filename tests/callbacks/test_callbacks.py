"""Callbacks in the Trainer: the hooks' order, a callback stopping training (EarlyStopping), the
"epoch" strategies, load_best_model_at_end with rotation, and the default-callbacks hook."""
import json

import pytest
import torch
from safetensors.torch import load_file

from hputrain import Callback, EarlyStopping, Trainer
from hputrain.callbacks import added_to_every_trainer
from hputrain.callbacks.writers import MetricsFile
from hputrain.errors import InputError

from ..training.test_trainer import Regression, records, regression_data
from ..training.test_trainer import args as trainer_args


def args(tmp_path, **kw):
    """test_trainer's arguments without TensorBoard (slow to import; tested in test_hf_parity)."""
    return trainer_args(tmp_path, **({"report_to": "none"} | kw))


class Recorder(Callback):
    """Every hook call as (hook, step, detail)."""

    def __init__(self):
        self.calls = []

    def on_train_begin(self, trainer):
        self.calls.append(("train_begin", trainer.global_step, None))

    def on_step_begin(self, trainer):
        self.calls.append(("step_begin", trainer.global_step, None))

    def on_step_end(self, trainer):
        self.calls.append(("step_end", trainer.global_step, None))

    def on_log(self, trainer, record):
        kind = "eval" if "eval_loss" in record else "loss" if "loss" in record else "summary"
        self.calls.append(("log", trainer.global_step, kind))

    def on_evaluate(self, trainer, metrics):
        self.calls.append(("evaluate", trainer.global_step, round(metrics["eval_loss"], 12)))

    def on_save(self, trainer, folder):
        self.calls.append(("save", trainer.global_step, folder.name))

    def on_train_end(self, trainer):
        self.calls.append(("train_end", trainer.global_step, None))


def test_hooks_fire_in_order(tmp_path):
    recorder = Recorder()
    trainer = Trainer(Regression(), args(tmp_path, max_steps=4, logging_steps=2, eval_steps=2, save_steps=4),
                      train_dataset=regression_data(), eval_dataset=regression_data(16, seed=5),
                      callbacks=[recorder])
    trainer.train()
    calls = [(hook, step, detail if hook in ("log", "save") else None) for hook, step, detail in recorder.calls]
    step = lambda n: [("step_begin", n - 1, None), ("step_end", n, None)]  # noqa: E731
    evaluated = lambda n: [("log", n, "loss"), ("log", n, "eval"), ("evaluate", n, None)]  # noqa: E731
    assert calls == [("train_begin", 0, None), *step(1), *step(2), *evaluated(2), *step(3), *step(4),
                     *evaluated(4), ("save", 4, "checkpoint-4"), ("log", 4, "summary"), ("train_end", 4, None)]
    # the metrics a callback sees are those written to metrics.jsonl
    evals = [r["eval_loss"] for r in records(tmp_path) if "eval_loss" in r]
    assert [d for h, _, d in recorder.calls if h == "evaluate"] == [round(v, 12) for v in evals]


def test_early_stopping_stops_and_saves_the_stop_step(tmp_path):
    """A learning rate so small that eval_loss moves by far less than the threshold: the first
    evaluation sets the best, two more without improvement stop training after step 3."""
    recorder = Recorder()
    stopper = EarlyStopping(metric="loss", patience=2, threshold=1e-3)  # "eval_" may be left out
    trainer = Trainer(Regression(), args(tmp_path, max_steps=20, learning_rate=1e-9, eval_steps=1, logging_steps=1,
                                         save_steps=0, save_total_limit=None),
                      train_dataset=regression_data(), eval_dataset=regression_data(16, seed=5),
                      callbacks=[stopper, recorder])
    out = trainer.train()
    assert out.global_step == 3 and out.interrupted_by is None
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-3"]
    assert json.loads((tmp_path / "out" / "checkpoint-3" / "trainer_state.json").read_text())["step"] == 3
    assert [r["step"] for r in records(tmp_path) if "eval_loss" in r] == [1, 2, 3]  # no extra evaluation
    assert recorder.calls[-1] == ("train_end", 3, None)
    # with no threshold the tiny improvements count: it trains on
    out = Trainer(Regression(), args(tmp_path / "b", max_steps=6, learning_rate=1e-3, eval_steps=1),
                  train_dataset=regression_data(), eval_dataset=regression_data(16, seed=5),
                  callbacks=[EarlyStopping(patience=2)]).train()
    assert out.global_step == 6


def test_a_callback_stop_is_one_step_and_a_whole_run(tmp_path):
    """should_stop set in on_step_end: the step ends, the run ends as at its end (evaluation,
    checkpoint, summary), and train() returns."""
    class StopAt(Callback):
        def on_step_end(self, trainer):
            if trainer.global_step == 2:
                trainer.should_stop = True

    out = Trainer(Regression(), args(tmp_path, max_steps=8, logging_steps=4, save_steps=5),
                  train_dataset=regression_data(), eval_dataset=regression_data(16, seed=5),
                  callbacks=[StopAt()]).train()
    assert out.global_step == 2
    logged = records(tmp_path)
    assert [r["step"] for r in logged if "eval_loss" in r] == [2] and "train_runtime" in logged[-1]
    assert [p.name for p in (tmp_path / "out").glob("checkpoint-*")] == ["checkpoint-2"]


def test_epoch_strategies_evaluate_save_and_log_at_each_epoch_end(tmp_path):
    # 64 samples, global batch 8: 8 steps an epoch; 2.5 epochs are 20 steps
    trainer = Trainer(Regression(), args(tmp_path, max_steps=-1, num_train_epochs=2.5, eval_strategy="epoch",
                                         save_strategy="epoch", logging_strategy="epoch", logging_steps=3),
                      train_dataset=regression_data(), eval_dataset=regression_data(16, seed=5))
    trainer.train()
    logged = records(tmp_path)
    assert [r["step"] for r in logged if "eval_loss" in r] == [8, 16, 20]
    assert [r["step"] for r in logged if "loss" in r] == [8, 16, 20]
    assert sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out").glob("checkpoint-*")) == [8, 16, 20]


def test_epoch_strategy_with_an_iterable_dataset_is_one_line(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(regression_data())

    trainer = Trainer(Regression(), args(tmp_path, max_steps=4, eval_strategy="epoch"), train_dataset=Stream(),
                      eval_dataset=regression_data(16))
    with pytest.raises(InputError, match="eval_strategy='epoch' needs a train_dataset with a length") as err:
        trainer.train()
    assert "\n" not in str(err.value)


class RegressionWithLogits(Regression):
    def forward(self, x, y):
        prediction = self.net(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(prediction, y), "logits": prediction}


def scores(*values):
    """compute_metrics returning the next of `values` as "score" on each call."""
    left = list(values)
    return lambda eval_pred: {"score": left.pop(0)}


def test_load_best_model_at_end_loads_the_best_checkpoint_and_keeps_it(tmp_path):
    trainer = Trainer(RegressionWithLogits(), args(tmp_path, max_steps=8, eval_steps=2, save_steps=2, save_total_limit=1,
                                         load_best_model_at_end=True, metric_for_best_model="score",
                                         greater_is_better=False),
                      train_dataset=regression_data(), eval_dataset=regression_data(16, seed=5),
                      compute_metrics=scores(3.0, 1.0, 2.0, 4.0))
    trainer.train()
    out = tmp_path / "out"
    # the best (step 4) survives save_total_limit=1 beside the newest, from which a run resumes
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    best = load_file(str(out / "checkpoint-4" / "model.safetensors"))
    last = load_file(str(out / "checkpoint-8" / "model.safetensors"))
    state = trainer.model.state_dict()
    for name, tensor in best.items():
        torch.testing.assert_close(state[name].cpu(), tensor, rtol=0, atol=0)
    assert any(not torch.equal(best[name], last[name]) for name in best)  # the check could fail
    saved = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
    assert saved["best_metric"] == 1.0 and saved["best_model_checkpoint"].endswith("checkpoint-4")


def test_load_best_model_needs_an_evaluation_at_every_save(tmp_path):
    trainer = Trainer(Regression(), args(tmp_path, max_steps=8, eval_steps=2, save_steps=3,
                                         load_best_model_at_end=True),
                      train_dataset=regression_data(), eval_dataset=regression_data(16))
    with pytest.raises(InputError, match="step 3 saves .* make save_steps a multiple of eval_steps") as err:
        trainer.train()
    assert "\n" not in str(err.value) and not (tmp_path / "out" / "checkpoint-3").exists()
    trainer = Trainer(Regression(), args(tmp_path, max_steps=4, eval_steps=2, save_steps=2,
                                         load_best_model_at_end=True, metric_for_best_model="accuracy"),
                      train_dataset=regression_data(), eval_dataset=regression_data(16))
    with pytest.raises(InputError, match="'eval_accuracy' is not among the evaluation metrics"):
        trainer.train()


def test_remove_callback_and_callbacks_added_to_every_trainer(tmp_path):
    made = []

    def factory():
        made.append(Recorder())
        return made[-1]

    with added_to_every_trainer(factory):
        trainer = Trainer(Regression(), args(tmp_path, max_steps=2), train_dataset=regression_data())
    after = Trainer(Regression(), args(tmp_path / "b", max_steps=2), train_dataset=regression_data())
    assert len(made) == 1 and trainer.callbacks[0] is made[0]
    assert not any(isinstance(c, Recorder) for c in after.callbacks)
    trainer.remove_callback(MetricsFile)
    trainer.train()
    assert made[0].calls[-1] == ("train_end", 2, None)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
