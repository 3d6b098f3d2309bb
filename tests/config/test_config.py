"""TrainingArguments and AcceleratorConfig: fields, validation, files and derived flags."""
import argparse
import json

import pytest

from hputrain.config.accelerator_config import AcceleratorConfig
from hputrain.config.fields import ConfigError, field_docs
from hputrain.config.arguments import TrainingArguments
from hputrain.config.flags import add_dataclass_flags

DESIGN_FIELDS = """output_dir per_device_train_batch_size gradient_accumulation_steps learning_rate
weight_decay adam_beta1 adam_beta2 adam_epsilon max_grad_norm num_train_epochs max_steps warmup_steps
lr_scheduler_type logging_steps eval_steps save_steps save_total_limit seed bf16 torch_compile
torch_compile_backend ddp_backend resume_from_checkpoint accelerator devices num_nodes strategy
execution_mode throughput_warmup_steps pipelining_fwd_bwd non_blocking_data_copy
use_graphs_for_inference use_graphs_for_training context_parallel_size minimize_memory fp8""".split()


def test_fields_of_the_design_each_with_a_docstring():
    fields = set(TrainingArguments.__dataclass_fields__)
    assert set(DESIGN_FIELDS) <= fields
    docs = field_docs(TrainingArguments)
    assert fields == set(docs) and all(docs.values())


def test_kw_only():
    with pytest.raises(TypeError):
        TrainingArguments("out")


@pytest.mark.parametrize("bad, match", [
    ({"per_device_train_batch_size": 0}, "per_device_train_batch_size must be at least 1"),
    ({"learning_rate": -1.0}, "learning_rate must be positive"),
    ({"max_steps": 0}, "max_steps must be positive or -1"),
    ({"lr_scheduler_type": "cosin"}, "did you mean 'cosine'"),
    ({"strategy": "deepspeed"}, "strategy must be one of auto, single, ddp, fast_ddp"),
    ({"execution_mode": "graph"}, "execution_mode must be one of"),
    ({"torch_compile": True, "execution_mode": "lazy"}, "conflicts"),
    ({"minimize_memory": True}, "minimize_memory needs fp8"),
    ({"save_total_limit": 0}, "save_total_limit"),
])
def test_validation(bad, match):
    with pytest.raises(ConfigError, match=match):
        TrainingArguments(**bad)


def test_torch_compile_means_compile():
    assert TrainingArguments(torch_compile=True).execution_mode == "compile"
    assert TrainingArguments().execution_mode == "auto"


def test_from_json_and_toml(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"learning_rate": 3e-4, "max_steps": 7, "bf16": True,
                                                 "save_total_limit": None, "adam_epsilon": 1}))
    args = TrainingArguments.from_file(tmp_path / "a.json")
    assert (args.learning_rate, args.max_steps, args.bf16, args.adam_epsilon) == (3e-4, 7, True, 1.0)
    (tmp_path / "a.toml").write_text('learning_rate = 0.001\nstrategy = "ddp"\nlogging_steps = 5\n')
    args = TrainingArguments.from_file(tmp_path / "a.toml", logging_steps=2)
    assert (args.learning_rate, args.strategy, args.logging_steps) == (1e-3, "ddp", 2)


@pytest.mark.parametrize("text, suffix, match", [
    ('{"learnig_rate": 1}', ".json", "unknown key 'learnig_rate'.*did you mean 'learning_rate'"),
    ('{"max_steps": "ten"}', ".json", "max_steps .* must be int, got 'ten'"),
    ('{"bf16": 1}', ".json", "bf16 .* must be bool"),
    ('{"max_steps": 10', ".json", "not valid JSON"),
    ("max_steps = = 1", ".toml", "not valid TOML"),
    ("[1, 2]", ".json", "must hold an object"),
    ("max_steps: [\n", ".yaml", "not valid YAML: .* at line 2, column 1$"),
    ("- 1\n", ".yml", "must hold an object"),
    ("learnig_rate: 1.0e-5\n", ".yaml", "unknown key 'learnig_rate'.*did you mean 'learning_rate'"),
])
def test_bad_files(tmp_path, text, suffix, match):
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        TrainingArguments.from_file(path)


def test_yaml_file_reads_as_its_json_twin(tmp_path):
    """TRL's and most fine-tuning tools' configs are YAML; `1e-5` is a number there, as YAML 1.2
    and those tools read it, though PyYAML's YAML 1.1 would make it a string."""
    (tmp_path / "c.yaml").write_text("# a TRL-style config\nlearning_rate: 1e-5\nmax_steps: 10\n"
                                     "bf16: true\nreport_to: [tensorboard]\nwarmup_ratio: .5\n"
                                     "output_dir: runs/x\n")
    (tmp_path / "c.json").write_text(json.dumps({
        "learning_rate": 1e-5, "max_steps": 10, "bf16": True, "report_to": ["tensorboard"],
        "warmup_ratio": 0.5, "output_dir": "runs/x"}))
    from_yaml = TrainingArguments.from_file(tmp_path / "c.yaml")
    assert from_yaml == TrainingArguments.from_file(tmp_path / "c.json")
    assert from_yaml.learning_rate == 1e-5 and from_yaml.max_steps == 10


YAML_WORDS = """save_strategy: no
eval_strategy: no
report_to: none
lr_scheduler_type: constant
bf16: yes
use_cpu: off
fused_kernels: on
greater_is_better: No
output_dir: runs/no
"""


def test_yaml_words_keep_the_field_type(tmp_path):
    """Issue 46 item 14: YAML 1.1 (PyYAML) reads no, on, off and yes as booleans, so a string
    field given one was refused ("must be str or null, got False"). A string field keeps the word
    written; a bool field takes yes/on as true and no/off as false, as TRL's YAML 1.1 loader
    means them; the same settings in JSON say the same."""
    (tmp_path / "c.yaml").write_text(YAML_WORDS)
    args = TrainingArguments.from_file(tmp_path / "c.yaml")
    twin = TrainingArguments(save_strategy="no", eval_strategy="no", report_to="none",
                             lr_scheduler_type="constant", bf16=True, use_cpu=False,
                             fused_kernels=True, greater_is_better=False, output_dir="runs/no")
    assert args == twin
    assert args.save_steps == -1 and args.eval_steps == 0 and args.report_to == []
    assert (args.bf16, args.fused_kernels, args.greater_is_better) == (True, True, False)
    from hputrain.config.fields import read_mapping

    assert read_mapping(tmp_path / "c.yaml")["save_strategy"] == "no"
    assert type(TrainingArguments.from_file(tmp_path / "c.yaml").output_dir) is str  # not YamlWord


@pytest.mark.parametrize("text, match", [
    ("lr_scheduler_type: on\n", r"lr_scheduler_type must be one of .*; got 'on'$"),
    ("bf16: maybe\n", r"bf16 in config file .* must be bool \(true or false\), got 'maybe'$"),
    ("bf16: y\n", r"bf16 in config file .* must be bool \(true or false\), got 'y'$"),
    ("max_steps: off\n", r"max_steps in config file .* must be int, got 'off'$"),
])
def test_yaml_words_that_fit_no_field_are_one_line(tmp_path, text, match):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError, match=match):
        TrainingArguments.from_file(tmp_path / "c.yaml")


def test_yaml_no_on_the_command_line(capsys, monkeypatch, tmp_path):
    """`hputrain train --config c.yaml` with save_strategy: no takes it (the run then stops at the
    missing corpus, as every setting was read); lr_scheduler_type: on is one line, exit 2."""
    from hputrain.cli import main

    monkeypatch.setenv("HPUTRAIN_CONFIG_FILE", str(tmp_path / "none.json"))
    missing = tmp_path / "missing"
    (tmp_path / "c.yaml").write_text(f"save_strategy: no\neval_strategy: no\ncorpus: {missing}\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(missing) in err and "save_strategy" not in err, err
    (tmp_path / "c.yaml").write_text(f"lr_scheduler_type: on\ncorpus: {missing}\n")
    assert main(["train", "--config", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lr_scheduler_type must be one of" in err and "got 'on'" in err, err


def test_json_keeps_its_types(tmp_path):
    """JSON has its own booleans: a string in a bool field stays an error there."""
    (tmp_path / "c.json").write_text(json.dumps({"bf16": "yes"}))
    with pytest.raises(ConfigError, match=r"bf16 .* must be bool \(true or false\), got 'yes'"):
        TrainingArguments.from_file(tmp_path / "c.json")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        TrainingArguments.from_file(tmp_path / "nope.json")


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, TrainingArguments)
    return vars(parser.parse_args(argv))


def test_flags_derived_from_the_dataclass():
    assert _parse(["--max-steps", "5", "--learning_rate", "0.01"]) == {"max_steps": 5, "learning_rate": 0.01}
    assert _parse(["--bf16"]) == {"bf16": True}
    assert _parse(["--no-bf16"]) == {"bf16": False}
    assert _parse(["--save-total-limit", "none"]) == {"save_total_limit": None}
    assert _parse([]) == {}  # defaults stay with the dataclass, so a file can fill them
    every = {f for f in TrainingArguments.__dataclass_fields__}
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, TrainingArguments)
    shown = {a.dest for a in parser._actions if a.dest != "help" and a.help != argparse.SUPPRESS}
    assert every == shown  # the hidden ones are Hugging Face names that say what to use instead


def test_bad_flag_value():
    with pytest.raises(SystemExit):
        _parse(["--max-steps", "many"])


# -- AcceleratorConfig -----------------------------------------------------------------------------

CURRENT = {"use_fused_adam": True, "use_fused_clip_norm": True, "use_torch_autocast": True,
           "autocast_bf16_ops": ["linear", "matmul"], "autocast_fp32_ops": ["softmax"],
           "optimum_version": "1.17.0", "transformers_version": "4.40.0"}
LEGACY = {"use_habana_mixed_precision": True, "hmp_opt_level": "O1", "hmp_is_verbose": False,
          "use_fused_adam": True, "use_fused_clip_norm": True, "log_device_mem_alloc": False,
          "hmp_bf16_ops": ["add", "addmm", "bmm", "div", "dropout", "gelu", "iadd", "linear",
                           "layer_norm", "matmul", "mm", "rsub", "softmax", "truediv"],
          "hmp_fp32_ops": ["embedding", "nll_loss", "log_softmax"]}


def test_current_gaudi_config(tmp_path):
    (tmp_path / "gaudi_config.json").write_text(json.dumps(CURRENT))
    config = AcceleratorConfig.from_file(tmp_path / "gaudi_config.json")
    assert config.use_fused_adam and config.use_fused_clip_norm and config.mixed_precision
    assert config.autocast_bf16_ops == ["linear", "matmul"] and config.autocast_fp32_ops == ["softmax"]


def test_legacy_hmp_lists_become_autocast_lists(tmp_path):
    (tmp_path / "legacy.json").write_text(json.dumps(LEGACY))
    config = AcceleratorConfig.from_file(tmp_path / "legacy.json")
    assert config.mixed_precision and not config.use_torch_autocast
    assert config.autocast_bf16_ops == LEGACY["hmp_bf16_ops"]
    assert config.autocast_fp32_ops == ["embedding", "nll_loss", "log_softmax"]


def test_defaults_leave_fusion_to_the_device():
    config = AcceleratorConfig()
    assert config.use_fused_adam is None and not config.mixed_precision


@pytest.mark.parametrize("data, match", [
    ({"use_fused_adamw": True}, "did you mean 'use_fused_adam'"),
    ({"hmp_bf16_op": ["add"]}, "did you mean 'hmp_bf16_ops'"),
    ({"autocast_bf16_ops": "linear"}, "autocast_bf16_ops .* must be list"),
    ({"use_torch_autocast": True, "use_habana_mixed_precision": True}, "cannot both be true"),
])
def test_bad_accelerator_configs(tmp_path, data, match):
    (tmp_path / "g.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=match):
        AcceleratorConfig.from_file(tmp_path / "g.json")


# -- bad numbers and bad files (one line, exit 2 through the CLI) ----------------------------------

FLOAT_FIELDS = [f.name for f in TrainingArguments.__dataclass_fields__.values()
                if "float" in str(f.type)]


def test_float_fields_are_all_covered():
    assert {"learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
            "max_grad_norm", "num_train_epochs", "warmup_ratio"} <= set(FLOAT_FIELDS)


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_float_fields_must_be_finite(name, value):
    with pytest.raises(ConfigError, match=f"{name} must be a finite number, got {value}"):
        TrainingArguments(**{name: value})


@pytest.mark.parametrize("seed", [2**63, 2**64, 10**30, -1])
def test_seed_must_fit_the_generators(seed):
    with pytest.raises(ConfigError, match="seed must be a whole number from 0 to 2\\*\\*63 - 1"):
        TrainingArguments(seed=seed)
    import torch

    largest = TrainingArguments(seed=2**63 - 1).seed
    torch.Generator().manual_seed(largest + 1000)  # the data order reseeds with seed + epoch


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_config_file_that_is_not_utf8(tmp_path, suffix):
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes('{"output_dir": "caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(ConfigError) as exc:
        TrainingArguments.from_file(path)
    assert str(exc.value) == f"config file {path} is not UTF-8 text (byte 19: b'\\xe9')"


def test_nan_in_a_json_file(tmp_path):
    (tmp_path / "c.json").write_text('{"learning_rate": NaN}')
    with pytest.raises(ConfigError, match="learning_rate must be a finite number, got nan"):
        TrainingArguments.from_file(tmp_path / "c.json")


@pytest.mark.parametrize("options, match", [
    ({"eval_batches": 0}, "eval_batches must be at least 1, got 0"),
    ({"eval_batches": -1}, "eval_batches must be at least 1, got -1"),
    ({"seq_len": 1}, "seq_len must be at least 2"),
    ({"max_corpus_bytes": 0}, "max_corpus_bytes must be at least 1"),
])
def test_recipe_options(options, match):
    from hputrain.recipes import RecipeOptions

    with pytest.raises(ConfigError, match=match):
        RecipeOptions(**options)


@pytest.mark.parametrize("argv, words", [
    (["--learning-rate", "inf"], ["learning_rate must be a finite number, got inf"]),
    (["--learning-rate", "nan"], ["learning_rate must be a finite number, got nan"]),
    (["--max-grad-norm", "inf"], ["max_grad_norm must be a finite number"]),
    (["--seed", str(2**64)], ["seed must be a whole number"]),
    (["--seed", "1" + "0" * 40], ["seed must be a whole number"]),
    (["--eval-batches", "0"], ["eval_batches must be at least 1, got 0"]),
    (["--eval-batches", "-1"], ["eval_batches must be at least 1, got -1"]),
])
def test_bad_numbers_on_the_command_line(capsys, monkeypatch, tmp_path, argv, words):
    from hputrain.cli import main

    monkeypatch.setenv("HPUTRAIN_CONFIG_FILE", str(tmp_path / "none.json"))
    # a missing corpus: were the value taken, the run would stop there, not train
    assert main(["train", "--corpus", str(tmp_path / "missing"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


def test_config_file_not_utf8_on_the_command_line(capsys, monkeypatch, tmp_path):
    from hputrain.cli import main

    monkeypatch.setenv("HPUTRAIN_CONFIG_FILE", str(tmp_path / "none.json"))
    (tmp_path / "c.json").write_bytes(b'{"max_steps": 3, "corpus": "\xff"}')
    assert main(["train", "--config", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"config file {tmp_path / 'c.json'} is not UTF-8" in err, err
