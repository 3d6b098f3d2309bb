"""Issue 26: `hputrain plan`. The reference is the same training step measured in a real run of
hputrain's Trainer (rehearsal.plan.StepPeak: every live tensor counted, by kind, around the real
step), on this CPU."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hputrain import Trainer
from hputrain.accelerators import detect_accelerator
from hputrain.cli import build_parser, main
from hputrain.recipes import chosen_recipe
from hputrain.rehearsal.plan import CATEGORIES, StepModel, StepPeak, trace_step

from ...hf_fixtures import llama_config, on_cpu  # noqa: F401  (fixtures: llama, on_cpu)

transformers = pytest.importorskip("transformers")

GPT = ["--model-size", "small", "--seq-len", "128", "--per-device-train-batch-size", "4"]


pytestmark = pytest.mark.usefixtures("on_cpu")



def settings(flags: list[str]):
    values = {k: v for k, v in vars(build_parser().parse_args(["plan", *flags])).items()
              if k not in ("target", "json")}
    if "model" in values:
        values["dataset"] = "(unused)"
    recipe, options, args = chosen_recipe(values)
    return StepModel(**recipe.step_model(options)), args


def planned(flags: list[str]):
    step, args = settings(flags)
    return trace_step(step, args, detect_accelerator("cpu", "eager"))


def measured(flags: list[str], tmp_path: Path):
    """The third step of a real run of the same model and batch, counted by StepPeak."""
    step, args = settings(flags)
    args = dataclasses.replace(args, output_dir=str(tmp_path), max_steps=3, save_steps=-1,
                               disable_tqdm=True, report_to="none", eval_steps=0)
    torch.manual_seed(0)
    batch = step.batch(args.per_device_train_batch_size)
    samples = [{"input_ids": batch["input_ids"][i], "labels": batch["labels"][i]}
               for i in range(args.per_device_train_batch_size)] * 3
    peak = StepPeak()
    Trainer(step.build(step.lora), args, train_dataset=samples, callbacks=[peak]).train()
    return peak.trace


@pytest.mark.parametrize("case", ["gpt fp32", pytest.param("gpt bf16 checkpointing", marks=pytest.mark.slow),
                                  "llama fp32", "llama LoRA",
                                  pytest.param("llama bf16 checkpointing", marks=pytest.mark.slow)])
def test_the_plan_is_within_10_percent_of_the_measured_step(case, llama, tmp_path):
    flags = GPT if case.startswith("gpt") else ["--model", str(llama), "--block-size", "128",
                                                "--per-device-train-batch-size", "4"]
    flags = [*flags, "--precision", "bf16-mixed" if "bf16" in case else "fp32"]
    flags += ["--gradient-checkpointing"] if "checkpointing" in case else []
    flags += ["--lora-r", "8"] if "LoRA" in case else []
    plan, real = planned(flags), measured(flags, tmp_path)
    assert plan.peak_bytes == pytest.approx(real.peak_bytes, rel=0.10)
    assert set(plan.breakdown) == set(CATEGORIES) and sum(plan.breakdown.values()) == plan.peak_bytes


def test_checkpointing_lowers_activations_and_lora_the_optimizer(llama):
    base = ["--model", str(llama), "--block-size", "256", "--per-device-train-batch-size", "4",
            "--precision", "fp32"]
    plain, checkpointed = planned(base), planned([*base, "--gradient-checkpointing"])
    assert checkpointed.breakdown["activations"] < 0.5 * plain.breakdown["activations"]
    lora = planned([*base, "--lora-r", "8"])
    assert lora.breakdown["optimizer"] < 0.05 * plain.breakdown["optimizer"]


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_fsdp_at_n_ranks_holds_1_over_n_of_the_model_state(llama, ranks):
    base = ["--model", str(llama), "--block-size", "128", "--per-device-train-batch-size", "1",
            "--precision", "fp32", "--strategy", "fsdp"]
    one = planned(base)
    many = planned([*base, "--devices", str(ranks)])
    assert many.breakdown["optimizer"] == pytest.approx(one.breakdown["optimizer"] / ranks, rel=0.02)
    state = lambda t: sum(t.breakdown[k] for k in ("parameters", "gradients", "optimizer"))  # noqa: E731
    # the parameters gathered for the block being computed (and the root's) are whole on every rank
    assert state(many) < state(one) * (1 / ranks + 0.3)


def test_fsdp_plans_an_untied_embedding_and_head_as_units_of_their_own(llama):
    """Issue 39 item 15: at its peak, a rank of a 4-rank fsdp step holds its shards, the head
    (4 MiB: 4,096 x 256 fp32, kept gathered from its forward to its backward) and the last
    block, not the embedding and the head gathered together in the root unit all step long."""
    base = ["--model", str(llama), "--block-size", "128", "--per-device-train-batch-size", "1",
            "--precision", "fp32", "--strategy", "fsdp"]
    one, many = planned(base), planned([*base, "--devices", "4"])
    config = transformers.AutoConfig.from_pretrained(llama)
    assert not config.tie_word_embeddings
    matrix = config.vocab_size * config.hidden_size * 4
    block = (one.breakdown["parameters"] - 2 * matrix) / config.num_hidden_layers
    assert many.breakdown["parameters"] < one.breakdown["parameters"] / 4 + matrix + 1.2 * block


def test_json_says_whether_it_fits_and_suggests_what_would(llama, capsys):
    flags = ["--model", str(llama), "--block-size", "512", "--per-device-train-batch-size", "8",
             "--precision", "fp32"]
    assert main(["plan", "--json", *flags]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"peak_bytes", "target_bytes", "fits", "breakdown", "suggestions"}
    assert result["fits"] and result["suggestions"] == []
    tight = int(result["peak_bytes"] * 0.8)  # a device 20% too small: what fits on it?
    from hputrain.rehearsal.plan import plan

    step, args = settings(flags)
    smaller = plan(step, args, "test", tight, accelerator=detect_accelerator("cpu", "eager"))
    assert not smaller.fits and smaller.suggestions
    fitting = [s for s in smaller.suggestions if s["fits"]]
    assert fitting and fitting[0]["peak_bytes"] <= tight
    assert fitting[0]["flags"][0] == "--gradient-checkpointing"  # the cheapest first


@pytest.mark.parametrize("argv, says", [
    (["plan", "--target", "gaudi9"], "--target 'gaudi9' is not one hputrain plans for"),
    (["plan", "--model", "/nonexistent/model"], "is not a folder on this machine"),
    (["plan", "--model-size", "huge"], "Unknown GPT size"),
    (["plan", "--per-device-train-batch-size", "0"], "must be at least 1"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def test_a_config_that_cannot_be_read_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    assert main(["plan", "--model", str(tmp_path)]) == 2
    assert "config.json cannot be read" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's VmHWM")
def test_a_70b_config_plans_for_8_gaudi2_without_reading_or_allocating_it(tmp_path):
    """Llama-3-70B's shape, config.json only: planned under fsdp on 8 Gaudi 2 in a process that
    never holds more than a small fraction of one rank's share, let alone the model."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False}))
    argv = ["plan", "--json", "--model", str(tmp_path), "--target", "gaudi2", "--devices", "8",
            "--strategy", "fsdp", "--per-device-train-batch-size", "1", "--block-size", "2048"]
    # the plan's own peak, said by its process: the high-water mark of its own memory (VmHWM, in
    # kB). Not getrusage: RUSAGE_CHILDREN is the largest child this test process ever waited for
    # (another test's 4 GB one in the whole slow suite), and Linux carries a process's ru_maxrss
    # across exec, so RUSAGE_SELF counted this test process's 5 GB at the fork
    code = ("import sys\nfrom pathlib import Path\nfrom hputrain.cli import main\n"
            "status = main(sys.argv[1:])\n"
            "hwm = [l for l in Path('/proc/self/status').read_text().splitlines() if l.startswith('VmHWM:')]\n"
            "print('peak rss', hwm[0].split()[1], file=sys.stderr)\n"
            "sys.exit(status)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no weights, before or after
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    peak_rss = int(proc.stderr.rsplit("peak rss ", 1)[1].split()[0]) * 1024
    assert peak_rss < 2 * 2**30  # the model is 280 GB in fp32; one rank's share 35 GB
    assert result["breakdown"]["optimizer"] == pytest.approx(70.55e9 * 8 / 8, rel=0.05)
    assert not result["fits"]  # a full fine-tune does not fit 96 GiB a rank
    # the changes tried within the time budget, each traced, each smaller
    assert result["suggestions"]
    assert all(s["peak_bytes"] < result["peak_bytes"] for s in result["suggestions"])
