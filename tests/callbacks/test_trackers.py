"""report_to trackers (trackers.py) through the real mlflow and wandb packages, offline: what a
fake trainer sends through the hooks is read back with each library's own client or records."""
import json
import os
import struct
import sys
import time
import types

import pytest

from hputrain.callbacks import trackers
from hputrain.config.arguments import TrainingArguments
from hputrain.errors import InputError

# What a run logs: two logging steps, an evaluation at the second, then the end-of-run summary
# at that same step (the step the W&B and MLflow callbacks must take twice).
LOGS = [{"step": 2, "epoch": 0.5, "loss": 1.5, "learning_rate": 0.01, "grad_norm": None},
        {"step": 4, "epoch": 1.0, "loss": 1.25, "learning_rate": 0.005, "grad_norm": 0.75}]
EVAL = {"eval_loss": 1.125, "eval_perplexity": 3.08}
SUMMARY = {"step": 4, "train_runtime": 2.0, "skipped_text": "x", "flag": True}


def fake_trainer(output_dir, **kw):
    """What the callbacks read from a Trainer: the process group, the arguments, the step."""
    args = TrainingArguments(output_dir=str(output_dir), learning_rate=0.01, report_to="none", **kw)
    return types.SimpleNamespace(group=types.SimpleNamespace(is_main=True), args=args,
                                 global_step=0, _stop_signal=None)


def drive(callback, trainer) -> None:
    """The hooks in the order train() reaches them, with LOGS, EVAL and SUMMARY."""
    callback.on_train_begin(trainer)
    for record in LOGS:
        trainer.global_step = record["step"]
        callback.on_step_end(trainer)
        callback.on_log(trainer, record)
    callback.on_evaluate(trainer, EVAL)  # the trainer's next call gives the same values
    callback.on_log(trainer, {"step": 4, **EVAL})  # the evaluation's record: what is logged
    callback.on_log(trainer, SUMMARY)
    callback.on_train_end(trainer)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No tracker configuration inherited from the machine: no tracking URI, no W&B key, netrc
    or settings folder of the user's."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID",
                 "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_PROJECT",
                 "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    # the callback sets MLFLOW_ALLOW_FILE_STORE itself; set then deleted here, so it is undone after
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "unset")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    cwd = tmp_path / "cwd"  # the trackers write under output_dir only, never ./mlruns or ./wandb
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield
    assert not list(cwd.iterdir())


# -- choosing the trackers ---------------------------------------------------------------------
def test_report_to_picks_the_trackers_asked_for(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    args = TrainingArguments(output_dir=str(tmp_path))
    kinds = lambda report_to: [type(c) for c in trackers.tracker_callbacks(report_to, tmp_path, args)]
    assert kinds(None) == []  # unset: TensorBoard only, which is not a tracker here
    assert kinds([]) == []
    assert kinds(["tensorboard"]) == []
    assert kinds(["mlflow"]) == [trackers.MLflowCallback]
    assert kinds(["tensorboard", "wandb"]) == [trackers.WandbCallback]
    assert kinds(["all"]) == [trackers.MLflowCallback, trackers.WandbCallback]


def test_all_leaves_out_a_tracker_that_is_not_installed(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow now raises ImportError
    made = trackers.tracker_callbacks(["all"], tmp_path, TrainingArguments(output_dir=str(tmp_path)))
    assert [type(c) for c in made] == [trackers.WandbCallback]


@pytest.mark.parametrize("package, pip_name", [("mlflow", "mlflow-skinny"), ("wandb", "wandb")])
def test_a_named_tracker_that_is_not_installed_is_one_line(tmp_path, monkeypatch, package, pip_name):
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(InputError) as error:
        trackers.tracker_callbacks([package], tmp_path, TrainingArguments(output_dir=str(tmp_path)))
    message = str(error.value)
    assert "\n" not in message
    assert f"report_to='{package}' needs the {package} package: pip install {pip_name}" in message


def test_wandb_runs_offline_unless_credentials_or_a_mode_are_set(tmp_path, monkeypatch, offline):
    assert trackers._wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert trackers._wandb_mode() is None  # wandb reads WANDB_MODE itself
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert trackers._wandb_mode() is None  # `wandb login` was run: online, wandb's default
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert trackers._wandb_mode() == "offline"  # the key is for another host
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert trackers._wandb_mode() is None


# -- MLflow --------------------------------------------------------------------------------------
def _mlflow_runs(output_dir):
    mlflow = pytest.importorskip("mlflow")
    uri = (output_dir / "mlruns").resolve().as_uri()
    client = mlflow.MlflowClient(uri)
    return client, client.search_runs(["0"], order_by=["attributes.start_time ASC"])


def test_mlflow_run_holds_params_and_metrics_per_step(tmp_path, offline):
    pytest.importorskip("mlflow")
    output_dir = tmp_path / "run-a"
    trainer = fake_trainer(output_dir, lr_scheduler_type="cosine")
    callback, = trackers.tracker_callbacks(["mlflow"], output_dir, trainer.args)
    drive(callback, trainer)

    client, runs = _mlflow_runs(output_dir)
    assert len(runs) == 1
    run = runs[0]
    assert (run.info.run_name, run.info.status) == ("run-a", "FINISHED")
    history = lambda key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
    assert history("loss") == [(2, 1.5), (4, 1.25)]
    assert history("grad_norm") == [(4, 0.75)]  # None at step 2 is not a point
    assert history("eval_loss") == [(4, 1.125)]  # given twice at step 4, logged once
    assert history("train_runtime") == [(4, 2.0)]
    assert set(run.data.metrics) == {"epoch", "loss", "learning_rate", "grad_norm", "eval_loss",
                                     "eval_perplexity", "train_runtime"}  # no step, text or bool
    params = run.data.params
    assert params["learning_rate"] == "0.01"
    assert params["lr_scheduler_type"] == "cosine"
    assert params["report_to"] == "[]"
    assert len(params) == len(TrainingArguments.__dataclass_fields__)


def test_mlflow_params_keep_within_limits_and_a_stopped_run_is_killed(tmp_path, offline, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hputrain-tests")
    output_dir = tmp_path / "out"
    args = {f"field_{i}": i for i in range(150)} | {"long": "v" * 700, "nested": {"a": 1, "b": None}}
    trainer = fake_trainer(output_dir)
    for stop_signal in (None, 15):  # a second train() in the same folder: a new run
        trainer._stop_signal = stop_signal
        callback = trackers.MLflowCallback(output_dir, args)
        callback.on_train_begin(trainer)
        callback.on_log(trainer, {"step": 1, "loss": 2.0})
        callback.on_train_end(trainer)

    mlflow = pytest.importorskip("mlflow")
    client = mlflow.MlflowClient((output_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("hputrain-tests")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    assert [r.info.status for r in runs] == ["FINISHED", "KILLED"]
    params = runs[1].data.params
    assert len(params) == 153  # 150 + long + nested.a + nested.b: two batches of at most 100
    assert params["long"] == "v" * 500
    assert (params["nested.a"], params["nested.b"], params["field_149"]) == ("1", "None", "149")


def test_mlflow_run_fails_when_training_raises(tmp_path, offline):
    pytest.importorskip("mlflow")
    trainer = fake_trainer(tmp_path / "out")
    callback = trackers.MLflowCallback(tmp_path / "out", trainer.args)
    callback.on_train_begin(trainer)
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("out of memory")
        finally:
            callback.on_train_end(trainer)  # as the trainer's finally calls it
    _, runs = _mlflow_runs(tmp_path / "out")
    assert [r.info.status for r in runs] == ["FAILED"]


def test_mlflow_logs_nothing_on_other_ranks(tmp_path, offline):
    pytest.importorskip("mlflow")
    trainer = fake_trainer(tmp_path / "out")
    trainer.group.is_main = False
    drive(trackers.MLflowCallback(tmp_path / "out", trainer.args), trainer)
    assert not (tmp_path / "out" / "mlruns").exists()


# -- Weights & Biases ----------------------------------------------------------------------------
def read_wandb_records(path):
    """The records of a .wandb file, parsed with wandb's own protobuf messages. The file is a
    7-byte header (":W&B", magic, version) then LevelDB's log format: 32 KiB blocks of chunks,
    each a 7-byte header (CRC, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block, records, pending = path.read_bytes(), 32 * 1024, [], b""
    assert data[:4] == b":W&B"
    position = 7
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if (length == 0 and kind == 0) or position + 7 + length > len(data):
            break  # the zero-filled end of a block, or a chunk still being written
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def finished_wandb_records(run_folder, timeout=20.0):
    """The records of an offline run once its exit record is on disk: wandb's service process
    writes the file on its own and may still be flushing it when run.finish() returns."""
    wandb_file, = run_folder.glob("run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        records = read_wandb_records(wandb_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def _wandb_history(records) -> dict[int, dict]:
    rows = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            rows[row["_step"]] = row
    return rows


def test_wandb_offline_run_holds_config_and_one_row_per_step(tmp_path, offline, capsys):
    pytest.importorskip("wandb")
    output_dir = tmp_path / "run-b"
    trainer = fake_trainer(output_dir, seed=7)
    callback, = trackers.tracker_callbacks(["wandb"], output_dir, trainer.args)
    drive(callback, trainer)
    assert f"`wandb sync {output_dir / 'wandb'}{os.sep}offline-run-" in capsys.readouterr().err

    run_folder, = (output_dir / "wandb").glob("offline-run-*")
    records = finished_wandb_records(run_folder)
    rows = _wandb_history(records)
    assert sorted(rows) == [2, 4]
    assert {k: v for k, v in rows[2].items() if not k.startswith("_")} == {
        "epoch": 0.5, "loss": 1.5, "learning_rate": 0.01}
    # the log, the evaluation and the summary at step 4 merged into one row
    assert {k: v for k, v in rows[4].items() if not k.startswith("_")} == {
        "epoch": 1.0, "loss": 1.25, "learning_rate": 0.005, "grad_norm": 0.75, **EVAL,
        "train_runtime": 2.0}
    run, = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.display_name, run.project) == ("run-b", "hputrain")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["seed"] == 7
    assert config["learning_rate"] == 0.01
    exits = [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"]
    assert exits == [0]


# -- end to end, with the real Trainer -----------------------------------------------------------
def test_trainer_with_report_to_mlflow_logs_the_loss_of_metrics_jsonl(tmp_path, offline, monkeypatch):
    pytest.importorskip("mlflow")
    from hputrain import Trainer

    from ..training.test_trainer import Regression, args, regression_data

    calls = []
    original = trackers.tracker_callbacks

    def spy(*a, **kw):
        calls.append(a)
        return original(*a, **kw)

    # the trainer may hold the function under another module's name: replace it there too
    for name, module in list(sys.modules.items()):
        if name.startswith("hputrain") and getattr(module, "tracker_callbacks", None) is original:
            monkeypatch.setattr(module, "tracker_callbacks", spy)
    training = args(tmp_path, report_to=["mlflow"], max_steps=4, logging_steps=2)
    Trainer(Regression(), training, train_dataset=regression_data()).train()
    if not calls:
        pytest.skip("hputrain.training.trainer does not call trackers.tracker_callbacks yet "
                    "(the callback wiring of issue 17)")

    losses = [(r["step"], r["loss"]) for r in map(json.loads, (tmp_path / "out" / "metrics.jsonl")
                                                   .read_text().splitlines()) if "loss" in r]
    client, runs = _mlflow_runs(tmp_path / "out")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == losses == [(2, losses[0][1]), (4, losses[1][1])]
    assert runs[0].data.params["max_steps"] == "4"
