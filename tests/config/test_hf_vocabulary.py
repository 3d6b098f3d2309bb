"""The Hugging Face Trainer's vocabulary: every TrainingArguments field and Trainer keyword of
transformers (and Optimum for Intel Gaudi) is either taken or refused in one line that says what
to use instead, from Python, a config file and the command line. Never a bare TypeError."""
import dataclasses
import inspect
import json
import math

import pytest
import torch

from hputrain.accelerators.cpu import CPUAccelerator
from hputrain.cli import main
from hputrain.config.accelerator_config import AcceleratorConfig
from hputrain.config.fields import ConfigError
from hputrain import Trainer
from hputrain.config.arguments import TrainingArguments, as_training_arguments, check_trainer_kwargs
from hputrain.training.optim import create_optimizer, create_scheduler
from hputrain.config.sections import OptimizerSettings

# GaudiTrainingArguments' own fields (optimum-habana is not installed here).
GAUDI_FIELDS = """use_habana gaudi_config_name use_lazy_mode use_hpu_graphs use_hpu_graphs_for_inference
use_hpu_graphs_for_training use_compiled_autograd compile_dynamic disable_tensor_cache_hpu_graphs
max_hpu_graphs distribution_strategy context_parallel_size throughput_warmup_steps adjust_throughput
pipelining_fwd_bwd ignore_eos non_blocking_data_copy profiling_warmup_steps profiling_steps
profiling_record_shapes profiling_with_stack sdp_on_bf16 fp8""".split()
# transformers 4 fields that transformers 5 dropped, still in scripts people copy.
LEGACY_FIELDS = """per_gpu_train_batch_size per_gpu_eval_batch_size evaluation_strategy
overwrite_output_dir warmup_ratio no_cuda use_mps_device logging_dir save_safetensors fp16_opt_level
half_precision_backend fp16_backend tpu_num_cores push_to_hub_model_id push_to_hub_token
include_inputs_for_metrics use_ipex jit_mode_eval""".split()
OURS = set(TrainingArguments.__dataclass_fields__)


def _hf_fields() -> list[str]:
    transformers = pytest.importorskip("transformers")
    # the fields a user can pass (transformers before 5 also has a private `_n_gpu`, init=False)
    return [f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init]


def _one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


# -- TrainingArguments ---------------------------------------------------------------------------

def test_every_hugging_face_field_is_taken_or_refused_in_one_line():
    names = sorted(set(_hf_fields()) | set(GAUDI_FIELDS) | set(LEGACY_FIELDS))
    refused = [name for name in names if name not in OURS]
    assert len(refused) > 80  # the check below is not vacuous
    for name in refused:
        with pytest.raises(ConfigError) as exc:
            TrainingArguments(**{name: True})
        assert _one_line(exc).startswith(f"TrainingArguments: {name} "), name


@pytest.mark.parametrize("kwargs, words", [
    ({"fp16": True}, ["fp16 is not supported", "bf16=True", "Gaudi has no fp16"]),
    ({"save_strategy": "best"}, ["load_best_model_at_end=True", "metric_for_best_model"]),
    ({"gradient_checkpointing_kwargs": {"use_reentrant": True}}, ["use_reentrant=False"]),
    ({"activation_checkpointing": True}, ["spelled gradient_checkpointing"]),
    ({"fsdp_config": {}}, ["fsdp_cpu_offload"]),
    ({"deepspeed": "ds.json"}, ["strategy is one of"]),
    ({"push_to_hub": True}, ["offline"]),
    ({"hub_model_id": "me/model"}, ["offline"]),
    ({"per_gpu_train_batch_size": 4}, ["per_device_train_batch_size"]),
    ({"evaluation_strategy": "steps"}, ["use eval_strategy"]),
    ({"use_hpu_graphs_for_inference": True}, ["use_graphs_for_inference"]),
    ({"gaudi_config_name": "Habana/gpt2"}, ["accelerator_config"]),
    ({"lerning_rate": 1e-3}, ["unknown argument 'lerning_rate'", "did you mean 'learning_rate'"]),
    ({"eval_strategy": "epochs"}, ["did you mean 'epoch'"]),
    ({"save_strategy": "best"}, ["save_strategy='best' is not supported"]),
    ({"save_strategy": "step"}, ["did you mean 'steps'"]),
    ({"logging_strategy": "no"}, ["logging_strategy='no' is not supported"]),
    ({"optim": "sgd"}, ["optim='sgd' is not supported yet", "AdamW"]),
    ({"optim": "adamw_torch_fusd"}, ["did you mean 'adamw_torch_fused'"]),
    ({"report_to": "comet_ml"}, ["report_to='comet_ml' is not supported yet", "mlflow"]),
    ({"report_to": ["tensorboard", "tensorbord"]}, ["did you mean 'tensorboard'"]),
    ({"use_cpu": True, "accelerator": "cuda"}, ["use_cpu=True conflicts with accelerator='cuda'"]),
    ({"use_habana": True, "no_cuda": True}, ["use_habana=True conflicts with accelerator='cpu'"]),
    ({"use_lazy_mode": True, "execution_mode": "compile"}, ["conflicts with execution_mode"]),
    ({"warmup_ratio": 1.5}, ["warmup_ratio must lie in [0, 1]"]),
    ({"warmup_ratio": 0.1, "warmup_steps": 5}, ["both set"]),
    ({"warmup_steps": 0.1}, ["warmup_steps must be a whole number", "use warmup_ratio"]),
])
def test_python_api_refuses_in_one_line(kwargs, words):
    with pytest.raises(ConfigError) as exc:
        TrainingArguments(**kwargs)
    message = _one_line(exc)
    assert all(w in message for w in words), message


def test_device_switches_map_onto_accelerator_and_execution_mode():
    assert TrainingArguments(use_cpu=True).accelerator == "cpu"
    assert TrainingArguments(no_cuda=True).accelerator == "cpu"
    args = TrainingArguments(use_habana=True, use_lazy_mode=True)
    assert (args.accelerator, args.execution_mode) == ("hpu", "lazy")
    assert TrainingArguments(use_lazy_mode=False).execution_mode == "eager"
    assert TrainingArguments(use_lazy_mode=False, torch_compile=True).execution_mode == "compile"
    assert TrainingArguments(use_habana=False).accelerator == "auto"
    # translated once: a later replace (as the doctor does) is not held to the old switch
    assert (args.use_habana, args.use_lazy_mode) == (False, None)
    moved = dataclasses.replace(args, accelerator="cpu", execution_mode="eager")
    assert (moved.accelerator, moved.execution_mode) == ("cpu", "eager")


def test_strategies_map_onto_steps():
    assert TrainingArguments(eval_strategy="steps", logging_steps=7).eval_steps == 7
    assert TrainingArguments(eval_strategy="steps", eval_steps=3).eval_steps == 3
    assert TrainingArguments(eval_strategy="no", eval_steps=3).eval_steps == 0
    assert TrainingArguments(save_strategy="no", save_steps=100).save_steps == -1
    assert TrainingArguments(save_strategy="steps", save_steps=100).save_steps == 100
    assert TrainingArguments(logging_strategy="steps", logging_steps=4).logging_steps == 4
    harmless = TrainingArguments(overwrite_output_dir=True, do_train=True, do_eval=True)
    assert harmless.save_steps == TrainingArguments().save_steps


@pytest.mark.parametrize("given, read", [
    (None, None), ("none", []), ([], []), ("all", ["all"]), ("tensorboard", ["tensorboard"]),
    (["tensorboard", "all"], ["all"]), (["none"], []), (["mlflow", "wandb", "mlflow"], ["mlflow", "wandb"]),
])
def test_report_to_reads_as_a_list(given, read):
    args = TrainingArguments(report_to=given)
    assert args.report_to == read
    assert dataclasses.replace(args).report_to == read


def test_config_file_keys(tmp_path):
    path = tmp_path / "hf.json"
    path.write_text(json.dumps({"warmup_ratio": 0.1, "optim": "adamw_torch", "report_to": "none",
                                "save_strategy": "no", "use_cpu": True, "do_train": True}))
    args = TrainingArguments.from_file(path)
    assert (args.warmup_ratio, args.optim, args.report_to) == (0.1, "adamw_torch", [])
    assert (args.save_steps, args.accelerator) == (-1, "cpu")
    path.write_text(json.dumps({"fp16": True}))
    with pytest.raises(ConfigError) as exc:
        TrainingArguments.from_file(path)
    assert _one_line(exc) == (f"config file {path}: fp16 is not supported: "
                              "use bf16=True (Gaudi has no fp16 training path)")


# -- the command line ------------------------------------------------------------------------------

@pytest.fixture
def no_saved_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("HPUTRAIN_CONFIG_FILE", str(tmp_path / "none.json"))


@pytest.mark.parametrize("argv, words", [
    (["--fp16"], ["--fp16: fp16 is not supported: use bf16=True"]),
    (["--fp16", "true"], ["bf16=True"]),
    (["--save-strategy", "best"], ["load_best_model_at_end=True"]),
    (["--gradient-checkpointing-kwargs", "{}"], ["use_reentrant=False"]),
    (["--per-gpu-train-batch-size", "4"], ["use per_device_train_batch_size"]),
    (["--eval-strategy", "epochs"], ["did you mean 'epoch'"]),
    (["--optim", "adafactor"], ["optim='adafactor' is not supported yet"]),
    (["--report-to", "tensorboard", "neptune"], ["report_to='neptune'"]),
    (["--no-cuda", "--accelerator", "hpu"], ["no_cuda=True conflicts with accelerator='hpu'"]),
])
def test_cli_refuses_in_one_line_exit_2(capsys, no_saved_defaults, tmp_path, argv, words):
    # a missing corpus: were the flags taken, the run would stop there, not train
    assert main(["train", "--corpus", str(tmp_path / "missing"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hputrain: error:"), err
    assert all(w in err for w in words), err


def test_cli_takes_the_supported_names(no_saved_defaults):
    from hputrain.cli import build_parser
    from hputrain.recipes import resolve_settings

    args = build_parser().parse_args([
        "train", "--use-cpu", "--use-lazy-mode", "--save-strategy", "no", "--optim", "adamw_hpu",
        "--report-to", "none", "--warmup-ratio", "0.05", "--warmup-steps", "0",
        "--overwrite-output-dir", "--do-train", "--do_eval"])
    _, training = resolve_settings(vars(args))
    assert (training.accelerator, training.execution_mode, training.save_steps) == ("cpu", "lazy", -1)
    assert (training.optim, training.report_to, training.warmup_ratio) == ("adamw_hpu", [], 0.05)


# -- what the supported names do -------------------------------------------------------------------

def _optimizer_for(model, schedule, warmup_ratio, total):
    args = TrainingArguments(learning_rate=1.0, lr_scheduler_type=schedule, warmup_ratio=warmup_ratio)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return optimizer, create_scheduler(optimizer, OptimizerSettings.of(args), total)


@pytest.mark.parametrize("schedule, reference", [
    ("linear", "get_linear_schedule_with_warmup"), ("cosine", "get_cosine_schedule_with_warmup")])
@pytest.mark.parametrize("ratio, total", [(0.1, 37), (0.25, 10), (0.0, 5)])
def test_warmup_ratio_matches_the_hugging_face_schedule(schedule, reference, ratio, total):
    transformers = pytest.importorskip("transformers")
    model = torch.nn.Linear(2, 2)
    ours, our_scheduler = _optimizer_for(model, schedule, ratio, total)
    theirs = torch.optim.SGD(model.parameters(), lr=1.0)
    their_scheduler = getattr(transformers, reference)(theirs, math.ceil(total * ratio), total)
    for _ in range(total + 1):
        assert ours.param_groups[0]["lr"] == pytest.approx(theirs.param_groups[0]["lr"], abs=1e-12)
        ours.step(), theirs.step(), our_scheduler.step(), their_scheduler.step()


@pytest.mark.parametrize("optim, use_fused_adam, fused", [
    ("auto", None, True),  # the CPU's default: torch's fused kernel
    ("adamw_torch", None, False),
    ("adamw_torch_fused", None, True),
    ("adamw_hpu", None, True),
    ("adamw_torch", True, True),  # Optimum for Intel Gaudi's pairing: the GaudiConfig decides
    ("adamw_torch_fused", False, False),
])
def test_optim_picks_the_fused_kernel_on_cpu(optim, use_fused_adam, fused):
    optimizer = create_optimizer(torch.nn.Linear(4, 4), OptimizerSettings.of(TrainingArguments(optim=optim)),
                                 AcceleratorConfig(use_fused_adam=use_fused_adam), CPUAccelerator())
    assert type(optimizer) is torch.optim.AdamW and bool(optimizer.defaults["fused"]) is fused


@pytest.mark.parametrize("optim, fused_adamw", [("adamw_hpu", True), ("adamw_torch_fused", True),
                                                ("adamw_torch", False), ("auto", False)])
def test_optim_on_gaudi_is_fused_adamw(fake_hpu, optim, fused_adamw):
    from hputrain.accelerators.hpu import HPUAccelerator

    optimizer = create_optimizer(torch.nn.Linear(4, 4), OptimizerSettings.of(TrainingArguments(optim=optim)),
                                 AcceleratorConfig(), HPUAccelerator())
    assert (type(optimizer).__name__ == "FusedAdamW") is fused_adamw
    assert ("FusedAdamW" in fake_hpu.names()) is fused_adamw


# -- Trainer keyword arguments ---------------------------------------------------------------------

def _our_trainer_arguments() -> set[str]:
    from hputrain.training.trainer import Trainer

    return set(inspect.signature(Trainer.__init__).parameters)


def test_every_hugging_face_trainer_keyword_is_refused_in_one_line():
    transformers = pytest.importorskip("transformers")
    theirs = set(inspect.signature(transformers.Trainer.__init__).parameters) | {
        "tokenizer", "gaudi_config", "peft_config"}  # transformers 4, Optimum for Intel Gaudi, TRL
    refused = sorted(theirs - _our_trainer_arguments())
    assert {"optimizers", "tokenizer", "model_init"} <= set(refused)
    for name in refused:
        with pytest.raises(ConfigError) as exc:
            Trainer(None, **{name: object()})  # refused before anything is built
        message = _one_line(exc)
        assert message.startswith(f"Trainer: {name} ") and "unknown" not in message, message


@pytest.mark.parametrize("kwargs, words", [
    ({"tokenizer": None}, ["spelled processing_class"]),
    ({"preprocess_logits_for_metrics": len}, ["compute_metrics"]),
    ({"compute_loss_func": len}, ["spelled compute_loss"]),
    ({"gaudi_config": None}, ["accelerator_config"]),
    ({"model_init": len}, ["pass the model itself"]),
    ({"train_datset": []}, ["unknown argument 'train_datset' in Trainer", "did you mean 'train_dataset'"]),
])
def test_trainer_keywords(kwargs, words):
    with pytest.raises(ConfigError) as exc:
        Trainer(None, **kwargs)  # refused before anything is built
    message = _one_line(exc)
    assert all(w in message for w in words), message


def test_no_keywords_pass():
    check_trainer_kwargs({}, [])


def test_trainer_args_as_a_dict_or_refused():
    assert as_training_arguments({"learning_rate": 1e-3, "use_cpu": True}) == TrainingArguments(
        learning_rate=1e-3, accelerator="cpu")
    assert as_training_arguments(None) == TrainingArguments()
    with pytest.raises(ConfigError, match="Trainer args: fp16 is not supported"):
        as_training_arguments({"fp16": True})
    with pytest.raises(ConfigError, match="learning_rate in Trainer args must be float"):
        as_training_arguments({"learning_rate": "fast"})
    transformers = pytest.importorskip("transformers")
    with pytest.raises(ConfigError) as exc:
        as_training_arguments(transformers.TrainingArguments(output_dir="o"))
    assert "got transformers.TrainingArguments" in _one_line(exc)


def test_report_to_none_writes_no_tensorboard_events(tmp_path):
    from hputrain import Trainer

    from ..training.test_trainer import Regression, args, regression_data

    Trainer(Regression(), args(tmp_path, report_to="none", max_steps=2),
            train_dataset=regression_data()).train()
    assert (tmp_path / "out" / "metrics.jsonl").exists()
    assert not (tmp_path / "out" / "tensorboard").exists()
    Trainer(Regression(), args(tmp_path / "tb", report_to="tensorboard", max_steps=2),
            train_dataset=regression_data()).train()
    assert list((tmp_path / "tb" / "out" / "tensorboard").iterdir())


def test_trainer_takes_args_as_a_dict_and_refuses_hf_keywords(tmp_path):
    from hputrain import Trainer
    from hputrain.config.fields import ConfigError

    from ..training.test_trainer import Regression

    trainer = Trainer(Regression(), {"output_dir": str(tmp_path), "max_steps": 3})
    assert trainer.args.max_steps == 3
    with pytest.raises(ConfigError, match="model_init is not supported"):
        Trainer(Regression(), {"output_dir": str(tmp_path)}, model_init=lambda: None)
