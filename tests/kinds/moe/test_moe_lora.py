"""Issue 40, item 7: LoRA on mixtures of experts.

- By default the adapters go on attention and the dense layers (dense MLPs, shared experts); the
  routers and the experts' fused 3-D weights stay as they are, frozen. PEFT's own choice did not:
  on Mixtral it adapted nothing (an error), on Qwen3-MoE and OLMoE it adapted the router and the
  experts, on DeepSeek-V3 it moved the dense layers' adapters onto the experts, on Llama 4 the
  router.
- `--lora-target-modules ... experts` adapts the experts through PEFT's target_parameters; naming
  the router adapts it; nothing else of the router trains.
- final/ is what PeftModel.from_pretrained loads with the trained model's logits, and `hputrain
  export --merge` writes a model folder with those logits too.
- LoRA on the experts gives the same logits and gradients whichever experts implementation runs
  (transformers' eager loop as the reference).

References: PEFT loading the folder, transformers' eager experts, the model before training.
"""
from __future__ import annotations

import json
import re
import types

import pytest
import torch

from ...hf_fixtures import write_text_file
from ...moe_fixtures import mixtral_folder, moe_folders  # noqa: F401

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hputrain.checkpoint.export import save_model  # noqa: E402
from hputrain.cli import main  # noqa: E402
from hputrain.recipes.hf import add_lora  # noqa: E402
from hputrain.recipes.hf.adapters import moe_experts  # noqa: E402

IDS = torch.tensor([[1, 5, 9, 40, 77, 120, 33, 2, 17, 60]])
ROUTERS = re.compile(r"\.(gate|router|shared_expert_gate)\.")


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


def options(**given):
    settings = dict(lora_r=4, lora_alpha=None, lora_dropout=None, lora_target_modules=None)
    return types.SimpleNamespace(**(settings | given))


def load(folder, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)


def adapted(model) -> set[str]:
    """The base model's names of what carries adapters: modules, and PEFT-wrapped parameters."""
    names = set()
    for name, _ in model.named_parameters():
        if ".lora_A." in name:
            owner = name.split(".lora_A.")[0].removeprefix("base_model.model.")
            names.add(owner.replace(".base_layer", ""))
    return names


def shaken(model, seed: int = 3):
    """Every adapter weight drawn at random (PEFT starts B at zero, which hides the adapters)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss",
                                    "olmoe", "llama4_text"])
def test_by_default_lora_adapts_attention_and_dense_layers_not_routers_or_experts(moe_folders, family):  # noqa: F811
    base = load(moe_folders(family))
    experts = set(moe_experts(base))
    body = {name for name, module in base.named_modules()
            if isinstance(module, torch.nn.Linear) and "." in name}
    wanted = {name for name in body if not ROUTERS.search(name + ".")}
    model = add_lora(base, options())
    assert adapted(model) == wanted  # every attention and dense layer, nothing else
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trained and all("lora_" in name for name in trained)  # routers and experts frozen
    assert experts and not any(name.startswith(tuple(experts)) for name in adapted(model))


@pytest.mark.parametrize("family,router", [("mixtral", "gate"), ("gpt_oss", "router"),
                                           ("llama4_text", "router")])
def test_lora_on_the_experts_and_the_router_when_named(moe_folders, family, router):  # noqa: F811
    base = load(moe_folders(family))
    experts = set(moe_experts(base))
    model = add_lora(base, options(lora_target_modules=["q_proj", "experts"]))
    assert {name for name in adapted(model) if "q_proj" not in name} == experts
    assert not any(ROUTERS.search(name + ".") for name in adapted(model))  # the router stays frozen
    assert model.peft_config["default"].lora_dropout == 0.0  # PEFT's ParamWrapper takes none
    routed = add_lora(load(moe_folders(family)), options(lora_target_modules=[router]))
    assert {name.rsplit(".", 1)[-1] for name in adapted(routed)} == {router}


def test_dropout_on_the_experts_is_one_line(moe_folders, capsys):  # noqa: F811
    from hputrain.errors import InputError

    with pytest.raises(InputError, match="--lora-dropout 0.1: LoRA on experts.down_proj"):
        add_lora(load(moe_folders("mixtral")),
                 options(lora_dropout=0.1, lora_target_modules=["experts"]))
    with pytest.raises(InputError, match="has no module named 'expert'.*experts"):
        add_lora(load(moe_folders("mixtral")), options(lora_target_modules=["expert"]))


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family,targets", [("mixtral", ["q_proj", "v_proj", "experts"]),
                                            ("qwen3_moe", ["q_proj", "experts", "gate"]),
                                            ("deepseek_v3", None), ("gpt_oss", ["experts"])])
def test_final_loads_in_peft_and_merges_with_the_same_logits(moe_folders, tmp_path, capsys,  # noqa: F811
                                                             family, targets):
    folder = moe_folders(family)
    model = shaken(add_lora(load(folder), options(lora_target_modules=targets))).eval()
    expected = logits(model)
    assert not torch.allclose(expected, logits(load(folder)), atol=1e-3)  # the adapters count
    final = save_model(model, tmp_path / "final")  # what a run writes into final/
    loaded = peft.PeftModel.from_pretrained(load(folder), final).eval()
    assert adapted(loaded) == adapted(model)
    torch.testing.assert_close(logits(loaded), expected, atol=1e-5, rtol=0)
    merged_folder = tmp_path / "merged"
    assert main(["export", "--merge", str(final), "--output", str(merged_folder)]) == 0
    merged = load(merged_folder).eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "qwen2_moe"])
def test_lora_on_the_experts_is_the_same_under_every_experts_implementation(moe_folders, family):  # noqa: F811
    """The adapters reach the experts through the parameter (PEFT's parametrization), so any
    experts implementation that reads the weights sees them: eager is the reference."""
    from hputrain.accelerators.cpu import CPUAccelerator
    from hputrain.execution.kernels import substitute

    folder = moe_folders(family)
    results = {}
    for implementation in dict.fromkeys([*_implementations(load(folder)), "hputrain"]):
        asked = {} if implementation == "hputrain" else {"experts_implementation": implementation}
        model = shaken(add_lora(load(folder, **asked),
                                options(lora_target_modules=["q_proj", "experts"])))
        if implementation == "hputrain":  # the static-shape experts, as a run substitutes them
            assert "experts: static" in " ".join(substitute(model, CPUAccelerator(), True))
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        grads = {name: param.grad.clone() for name, param in model.named_parameters()
                 if param.requires_grad}
        assert any(".experts." in name and grad.abs().sum() > 0 for name, grad in grads.items())
        results[implementation] = (loss.detach(), grads)
    reference_loss, reference_grads = results.pop("eager")
    assert results  # another implementation than eager ran
    for loss, grads in results.values():
        torch.testing.assert_close(loss, reference_loss, atol=1e-5, rtol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_grads[name], atol=1e-5, rtol=1e-4)


def _implementations(model) -> list[str]:
    """eager, the model's default, and transformers' own that run in fp32 on a CPU (batched_mm,
    grouped_mm where torch has it); not the expert-parallel forward, which runs on a split model
    only, nor deepgemm and sonicmoe (CUDA, bf16)."""
    names = ["eager", model.config._experts_implementation, "batched_mm"]
    names += ["grouped_mm"] if hasattr(torch, "_grouped_mm") else []
    return list(dict.fromkeys(names))


def test_a_lora_run_on_the_experts_trains_their_adapters_only(mixtral_folder, tmp_path):  # noqa: F811
    data = write_text_file(tmp_path / "text.txt", lines=60)
    assert main(["train", "--model", str(mixtral_folder), "--dataset", str(data), "--lora-r", "4",
                 "--lora-target-modules", "q_proj", "experts", "--block-size", "32",
                 "--max-steps", "2", "--learning-rate", "1e-2", "--save-steps", "-1",
                 "--precision", "32", "--validation-split-percentage", "0", "--disable-tqdm",
                 "--output-dir", str(tmp_path / "run")]) == 0
    final = tmp_path / "run" / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
    base = load(mixtral_folder)
    trained = peft.PeftModel.from_pretrained(load(mixtral_folder), final)
    lora_b = {name: param for name, param in trained.named_parameters()
              if "lora_B" in name and ".experts." in name}
    assert lora_b and all(param.abs().sum() > 0 for param in lora_b.values())  # they moved from 0
    before = dict(base.named_parameters())
    for name, param in trained.get_base_model().named_parameters():  # the rest is the base's
        if "lora_" not in name:
            plain = re.sub(r"(\.base_layer)+", "", name).replace(".parametrizations", "")
            torch.testing.assert_close(param, before[plain], atol=0, rtol=0)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_a_reward_models_lora_adapts_the_same_layers_and_trains_its_score_head(moe_folders, family):  # noqa: F811
    """A sequence classifier on a mixture of experts (--method reward --lora-r): the causal LM's
    layers are adapted, the routers and experts are not, and the score head trains whole."""
    from hputrain.methods.reward.recipe import add_reward_lora

    folder = moe_folders(family)
    wanted = adapted(add_lora(load(folder), options()))
    classifier = transformers.AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1)
    model = add_reward_lora(classifier, options())
    assert adapted(model) == wanted
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    assert any(".score." in name for name in trained)
    assert all("lora_" in name or ".score." in name for name in trained)


def test_with_its_adapters_disabled_a_model_with_lora_on_the_experts_is_the_base(moe_folders):  # noqa: F811
    """The reference of DPO and GRPO under LoRA (objective.adapters_disabled): the experts'
    adapters, which PEFT applies as a parametrization, are off too, and back on after."""
    from hputrain.training.objective import adapters_disabled

    folder = moe_folders("mixtral")
    model = shaken(add_lora(load(folder), options(lora_target_modules=["q_proj", "experts"])))
    with_adapters = logits(model)
    with adapters_disabled(model):
        torch.testing.assert_close(logits(model), logits(load(folder)), atol=1e-6, rtol=0)
    torch.testing.assert_close(logits(model), with_adapters, atol=0, rtol=0)
    assert all(param.requires_grad == ("lora_" in name) for name, param in model.named_parameters())


# -- issue 47, item 10: LoRA on the experts in lazy mode ------------------------------------------

def _step(model, device, forward_context, checkpointed: bool = False):
    """(loss, the adapters' gradients) of one forward and backward of `model` on `device`, the
    forward under `forward_context` (the accelerator's), with the blocks checkpointed as the
    run's --gradient-checkpointing does (recomputed in backward, outside that context)."""
    from hputrain.config.sections import ActivationCheckpointing
    from hputrain.distributed.activation_checkpointing import apply_activation_checkpointing

    model.train()
    if checkpointed:
        apply_activation_checkpointing(model, ActivationCheckpointing(
            gradient_checkpointing=True, gradient_checkpointing_every=1, fsdp_block_classes=None))
    model.to(device)
    ids = IDS.to(device)
    with forward_context():  # the router's loss off: the run computes it beside the model
        loss = model(input_ids=ids, labels=ids, output_router_logits=False).loss
    loss.backward()
    if device.type == "lazy":
        torch._lazy.mark_step()
    return loss.detach().cpu(), {name: param.grad.cpu() for name, param in model.named_parameters()
                                 if param.grad is not None}


@pytest.mark.parametrize("checkpointed", [False, True])
def test_lora_on_the_experts_trains_in_lazy_mode_as_in_eager(mixtral_folder, checkpointed):  # noqa: F811
    """PEFT's parameter LoRA opens `torch.autocast(device_type="lazy", enabled=False)` around its
    fold of the adapters into the experts' weights; torch has no autocast for the lazy device,
    and the run was refused with a line blaming transformers' rotary embeddings. A disabled
    autocast asks for nothing: the lazy step is eager's, recomputed blocks included."""
    from hputrain.accelerators.cpu import CPUAccelerator
    from hputrain.execution.kernels import substitute

    results = []
    for accelerator in (CPUAccelerator("eager"), CPUAccelerator("lazy")):
        model = shaken(add_lora(load(mixtral_folder), options(lora_target_modules=["q_proj", "experts"])))
        substitute(model, accelerator, True)  # the static experts, as the run has them
        device = accelerator.setup()
        results.append(_step(model, device, accelerator.forward_context, checkpointed))
    (loss, grads), (lazy_loss, lazy_grads) = results
    assert any(".experts." in name for name in grads) and grads.keys() == lazy_grads.keys()
    torch.testing.assert_close(lazy_loss, loss, atol=1e-5, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(lazy_grads[name], grad, atol=1e-5, rtol=1e-4)


def test_an_autocast_the_lazy_backend_cannot_run_is_one_line_naming_its_code():
    """An enabled autocast on the lazy device (torch has none there) is refused in one line that
    names the code opening it, not transformers' rotary embeddings."""
    from hputrain.accelerators.cpu import CPUAccelerator
    from hputrain.errors import InputError

    accelerator = CPUAccelerator("lazy")
    x = torch.ones(2, 2, device=accelerator.setup())
    with pytest.raises(InputError) as refused:
        with accelerator.forward_context():
            with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
                x + 1
    line = str(refused.value)
    assert "\n" not in line and "transformers" not in line
    assert line.startswith("lazy mode on the CPU cannot run this model: test_moe_lora.py:")
    assert torch.autocast is torch.amp.autocast_mode.autocast  # put back
