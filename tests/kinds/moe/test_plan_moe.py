"""Issue 40 item 5: `hputrain plan` on mixtures of experts. The references: the same training
step measured in a real run of hputrain's Trainer (StepPeak on the real tensors), the parameters
of the model transformers builds from the folder, and the expert-parallel forward's own buffer
(kinds/moe/experts/parallel.py)."""
from __future__ import annotations

import json
import re

import pytest

from hputrain.cli import main

from ...hf_fixtures import llama_config, on_cpu  # noqa: F401  (fixtures)
from ...moe_fixtures import mixtral_folder, moe_folders  # noqa: F401  (fixtures)
from ...plan_step_script import measured, planned

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("on_cpu")


def flags(folder, *more: str) -> list[str]:
    return ["--model", str(folder), "--block-size", "128", "--per-device-train-batch-size", "4",
            "--precision", "fp32", *more]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_the_plan_of_a_tiny_moe_is_within_10_percent_of_the_measured_step(family, mixtral_folder,
                                                                          moe_folders):
    """The router's loss asked for (Mixtral's folder), a transposed family with expert biases
    (GPT-OSS): every expert's weights, gradients and AdamW moments, and the T·k pairs'
    intermediates the experts keep for backward, as the run holds them."""
    folder = mixtral_folder if family == "mixtral" else moe_folders(family)
    plan, real = planned(flags(folder)), measured(flags(folder))
    assert plan.peak_bytes == pytest.approx(real.peak_bytes, rel=0.10), (plan.breakdown, real.breakdown)
    assert plan.breakdown["activations"] == pytest.approx(real.breakdown["activations"], rel=0.10)
    # AdamW's two moments of every parameter, every expert's included
    assert plan.breakdown["optimizer"] == pytest.approx(real.breakdown["optimizer"], rel=0.01)


@pytest.mark.slow
def test_the_plan_of_a_tiny_moe_in_bf16_with_checkpointing_is_within_10_percent(mixtral_folder):
    more = flags(mixtral_folder, "--gradient-checkpointing")
    more[more.index("fp32")] = "bf16-mixed"
    plan, real = planned(more), measured(more)
    assert plan.peak_bytes == pytest.approx(real.peak_bytes, rel=0.10), (plan.breakdown, real.breakdown)


def test_the_plan_counts_every_expert_stored_and_top_k_of_them_active(moe_folders, capsys):
    """Stored: every parameter of the model transformers builds. Active per token: the same
    model with only k experts (its router k rows smaller) and the router's full E rows."""
    folder = moe_folders("qwen3_moe")
    assert main(["plan", "--json", *flags(folder)]) == 0
    moe = json.loads(capsys.readouterr().out)["moe"]
    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_config(config)
    experts, k = config.num_experts, config.num_experts_per_tok
    assert moe["parameters"] == sum(p.numel() for p in model.parameters())
    assert (moe["layers"], moe["experts"], moe["top_k"]) == (config.num_hidden_layers, experts, k)
    config.num_experts = k
    only_k = transformers.AutoModelForCausalLM.from_config(config)
    router_rows = (experts - k) * config.hidden_size * config.num_hidden_layers
    assert moe["active_parameters"] == sum(p.numel() for p in only_k.parameters()) + router_rows
    assert moe["expert_parallel_size"] == 1 and moe["all_to_all_send_bytes_per_layer"] == 0
    # the T·k (token, expert) pairs' (2I) gate-and-up intermediates of each layer
    assert moe["intermediate_bytes_per_layer"] == 4 * 128 * k * 2 * config.moe_intermediate_size * 4


def test_the_plan_names_the_experts_in_its_header(moe_folders, capsys):
    assert main(["plan", *flags(moe_folders("mixtral"))]) == 0
    out = capsys.readouterr().out
    assert "experts: 2 MoE layers of 8 experts, top-2" in out and "active per token" in out


def test_expert_parallel_plans_e_over_n_experts_a_rank_and_the_forwards_own_buffers(moe_folders,
                                                                                     capsys):
    """--expert-parallel-size 2 on 2 ranks: 4 of the 8 experts a rank (their AdamW moments
    half of one process's), and the all-to-all buffer of the expert-parallel forward
    (kinds/moe/experts/sizes.py's peer_capacity, which the forward sizes its blocks by: its rows
    per peer, for this T and k)."""
    from hputrain.kinds.moe.experts.sizes import peer_capacity

    folder = moe_folders("mixtral")
    assert main(["plan", "--json", *flags(folder, "--devices", "2")]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main(["plan", "--json", *flags(folder, "--devices", "2", "--expert-parallel-size", "2")]) == 0
    split = json.loads(capsys.readouterr().out)
    moe = split["moe"]
    assert (moe["expert_parallel_size"], moe["experts_per_rank"]) == (2, 4)
    tokens, k, hidden = 4 * 128, moe["top_k"], 32
    capacity = peer_capacity(tokens, k, 8, 2)
    assert moe["all_to_all_rows_per_peer"] == capacity
    assert moe["all_to_all_send_bytes_per_layer"] == 2 * capacity * hidden * 4
    assert moe["expert_rows_per_layer"] == 2 * capacity  # every peer's block, received
    half = moe["expert_parameters"] // 2 * 8  # AdamW's two fp32 moments of the other rank's experts
    assert split["breakdown"]["optimizer"] == pytest.approx(whole["breakdown"]["optimizer"] - half, rel=0.01)


def test_an_expert_parallel_size_the_experts_refuse_is_one_line(moe_folders, capsys):
    folder = moe_folders("mixtral")
    assert main(["plan", *flags(folder, "--devices", "3", "--expert-parallel-size", "3")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "8 experts, which expert_parallel_size=3 does not divide" in err[0]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_expert_parallel_on_2_processes_is_within_10_percent_of_the_measured_step(strategy,
                                                                                  mixtral_folder,
                                                                                  tmp_path):
    """The experts split over 2 Gloo ranks (fsdp or ddp on the rest): the send and receive
    buffers, the received rows' intermediates and each rank's experts, as rank 0 holds them."""
    from ...rehearsal.plan.test_plan_accuracy import check

    planned_, measured_ = check(flags(mixtral_folder, "--expert-parallel-size", "2",
                                      "--strategy", strategy), tmp_path)
    assert planned_.breakdown["optimizer"] == pytest.approx(measured_["breakdown"]["optimizer"], rel=0.02)


@pytest.mark.parametrize("family", ["llama4_text", "gpt_oss"])
def test_transposed_experts_give_the_intermediates_of_the_config(family, moe_folders, capsys):
    """GPT-OSS's experts say they are transposed, Llama 4's are without saying so: the (T·k, 2I)
    intermediates are of the config's expert intermediate size either way."""
    folder = moe_folders(family)
    assert main(["plan", "--json", *flags(folder)]) == 0
    moe = json.loads(capsys.readouterr().out)["moe"]
    config = transformers.AutoConfig.from_pretrained(folder)
    pairs = 4 * 128 * config.num_experts_per_tok
    assert moe["intermediate_bytes_per_layer"] == pairs * 2 * config.intermediate_size * 4


# -- issue 47, item 10: the router's loss on chat data, the experts' category, lazy mode ----------

def chat_file(tmp_path):
    """A `messages` data set: the plan reads its columns (SFT examples packed into blocks)."""
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": "answer " * (1 + i % 4)}]}
            for i in range(8)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_the_plan_of_a_moe_with_its_router_loss_on_chat_data(mixtral_folder, tmp_path, capsys):
    """output_router_logits true (the folder's config) and packed SFT blocks: transformers' own
    router loss takes no 4-D block mask (a traceback in load_balancing_loss_func, where `train`
    works); the plan computes it as the run does (kinds/moe/router.py)."""
    assert main(["plan", *flags(mixtral_folder, "--dataset", str(chat_file(tmp_path)))]) == 0
    assert "SFT examples packed 4 to a block" in capsys.readouterr().out


@pytest.mark.slow  # a measured run beside the plan, ~25 s
def test_the_plan_of_a_moe_with_its_router_loss_on_chat_data_is_the_measured_step(mixtral_folder,
                                                                                 tmp_path):
    more = flags(mixtral_folder, "--dataset", str(chat_file(tmp_path)))
    plan, real = planned(more), measured(more)
    assert plan.peak_bytes == pytest.approx(real.peak_bytes, rel=0.10), (plan.breakdown, real.breakdown)
    for category in ("activations", "experts"):
        assert plan.breakdown[category] == pytest.approx(real.breakdown[category], rel=0.10)


def saved_by_the_experts(folder, more: list[str]) -> int:
    """The bytes the experts modules' forwards keep for backward, in a real forward of the run's
    model and batch on this machine: each saved tensor (torch's saved-tensor hooks) whose storage
    was made inside an experts forward (not a weight, not the forward's input), counted once."""
    import torch

    from hputrain.accelerators import detect_accelerator
    from hputrain.config.accelerator_config import AcceleratorConfig
    from hputrain.config.sections import Sections
    from hputrain.distributed.strategies import Strategy
    from hputrain.execution.precision import select_precision
    from hputrain.kinds.moe.plan import experts_modules
    from hputrain.training.prepare import prepare_model

    from ...plan_step_script import settings

    step, args = settings(more)
    accelerator, sections = detect_accelerator("cpu", "eager"), Sections.of(args)
    precision = select_precision(sections.precision, AcceleratorConfig(), accelerator)
    prepared = prepare_model(step.build(False), args, sections, accelerator=accelerator,
                             precision=precision, strategy=Strategy(), device=torch.device("cpu"))
    weights = {p.untyped_storage().data_ptr() for p in prepared.model.parameters()}
    inside, entry, saved = [False], set(), {}

    def enter(module, inputs):
        inside[0] = True
        entry.clear()
        entry.update(t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor))

    def pack(tensor):
        storage = tensor.untyped_storage()
        if inside[0] and storage.data_ptr() not in weights | entry:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    for module in experts_modules(prepared.model):
        module.register_forward_pre_hook(enter)
        module.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        prepared.forward(prepared.wrapped, step.batch(args.per_device_train_batch_size),
                         output_router_logits=False)
    return sum(saved.values())


def test_the_plan_gives_the_experts_buffers_and_intermediates_a_category(mixtral_folder, llama,
                                                                         capsys):
    """What the experts' forward allocates, counted apart from the other activations: at the
    peak (backward's start) it is what the experts keep for backward, measured in a real forward
    by torch's saved-tensor hooks. In the text and the JSON; a dense model has no such part."""
    more = flags(mixtral_folder)
    assert main(["plan", "--json", *more]) == 0
    found = json.loads(capsys.readouterr().out)
    parts = found["breakdown"]
    assert list(parts) == ["parameters", "gradients", "optimizer", "activations", "experts",
                           "temporary"]
    assert sum(parts.values()) == found["peak_bytes"]
    assert parts["experts"] == pytest.approx(saved_by_the_experts(mixtral_folder, more), rel=0.05)
    # the (T·k, 2I) intermediates of each layer are among them
    assert parts["experts"] > found["moe"]["intermediate_bytes_per_layer"] * found["moe"]["layers"]
    assert main(["plan", *more]) == 0
    assert re.search(r"^\s+experts\s+[\d.,]+ MiB$", capsys.readouterr().out, re.M)
    assert main(["plan", "--json", *flags(llama)]) == 0
    assert "experts" not in json.loads(capsys.readouterr().out)["breakdown"]


def test_a_plan_of_ddp_in_lazy_mode_answers_for_ddp_in_lazy_mode(mixtral_folder):
    """Nothing fits (a device of 1 MiB): the changes are tried one on top of the other. fsdp
    runs in no lazy mode, so it is not among them (it ended the plan with fsdp's own refusal);
    the plan is of the run asked for, and says why fsdp is left out."""
    from hputrain.cli import build_parser
    from hputrain.cli.planning import plan_run

    asked = vars(build_parser().parse_args(["plan", *flags(
        mixtral_folder, "--strategy", "ddp", "--execution-mode", "lazy", "--devices", "2")]))
    asked["per_device_train_batch_size"] = 1
    result, name = plan_run(asked, "gaudi3", 2**20, time_budget=60)
    assert not result.fits and result.ranks == 2
    assert result.suggestions and not any("fsdp" in " ".join(s["flags"]) for s in result.suggestions)
    assert any(" + " in s["change"] for s in result.suggestions)  # one on top of the other
    assert "fsdp is not among the changes (strategy='fsdp' runs in eager or compile mode, not lazy" in name
