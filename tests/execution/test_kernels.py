"""The device's kernels in Hugging Face models (kernels.py): the same numbers as the model
unmodified on the CPU, FusedSDPA and FusedRMSNorm on the (fake) Gaudi, checkpoints that plain
transformers loads, a user's attention choice kept, lazy mode without recompiles."""
import copy
import json

import pytest
import torch
import torch.nn.functional as F

from hputrain import Trainer, TrainingArguments
from hputrain.execution import kernels
from hputrain.accelerators.cpu import CPUAccelerator
from hputrain.accelerators.hpu import HPUAccelerator
from hputrain.errors import InputError

from ..hf_fixtures import lazy_rehearses_hf_models, llama_folder  # noqa: F401

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install hputrain[hf])")

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    # a sliding window shorter than the sequence: the window arrives as a mask
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 5}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
}


def build(name, seed=0, **overrides):
    config_class, model_class, extra = ARCHITECTURES[name]
    torch.manual_seed(seed)
    return model_class(config_class(**(SMALL | extra | overrides)))


def batch(padded=False):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0  # left padding in the first row
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def loss_and_grads(model, inputs):
    model.zero_grad()
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_same_loss_and_gradients_as_the_unmodified_model(name, padded):
    reference = build(name)
    model = copy.deepcopy(reference)
    summary = kernels.substitute(model, CPUAccelerator(), True)
    layers = SMALL["num_hidden_layers"]
    assert summary == {"attention: sdpa": layers, "rms_norm: rms_norm": 2 * layers + 1}
    assert model.config._attn_implementation == kernels.ATTENTION
    assert reference.config._attn_implementation == "sdpa"
    inputs = batch(padded)
    loss, grads = loss_and_grads(model, inputs)
    ref_loss, ref_grads = loss_and_grads(reference, inputs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-5, atol=1e-5, msg=key)
    assert kernels.FALLBACK not in summary


def test_state_dict_and_save_pretrained_unchanged(tmp_path):
    model = build("llama")
    keys = list(model.state_dict())
    kernels.substitute(model, CPUAccelerator(), "auto")
    assert list(model.state_dict()) == keys
    assert isinstance(model.model.norm, kernels.FusedRMSNorm)
    assert model.model.norm.weight is model.state_dict(keep_vars=True)["model.norm.weight"]
    model.save_pretrained(tmp_path)
    assert "hputrain" not in (tmp_path / "config.json").read_text()
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert plain.config._attn_implementation == "sdpa"
    assert not any(isinstance(m, kernels.FusedRMSNorm) for m in plain.modules())
    inputs = batch(padded=True)
    with torch.no_grad():
        torch.testing.assert_close(plain(**inputs).logits, model(**inputs).logits, rtol=1e-5, atol=1e-5)


def test_explicit_attention_choice_is_kept():
    model = build("llama", attn_implementation="eager")
    reference = copy.deepcopy(model)
    summary = kernels.substitute(model, CPUAccelerator(), True)
    assert model.config._attn_implementation == "eager"
    assert summary == {"rms_norm: rms_norm": 5}  # the norms are still the device's
    inputs = batch()
    torch.testing.assert_close(model(**inputs).loss, reference(**inputs).loss, rtol=1e-5, atol=1e-5)


def test_off_means_untouched():
    model = build("llama")
    before = [type(m) for m in model.modules()]
    assert kernels.substitute(model, CPUAccelerator(), False) == {}
    assert [type(m) for m in model.modules()] == before and model.config._attn_implementation == "sdpa"

    class Slower(CPUAccelerator):
        def prefers_fused_kernels(self):
            return False

    assert kernels.substitute(model, Slower(), "auto") == {}
    assert kernels.substitute(model, Slower(), True) != {}


def test_gemma_norms_with_one_plus_weight_are_not_swapped():
    config = transformers.GemmaConfig(**SMALL, head_dim=8)
    torch.manual_seed(0)
    reference = transformers.GemmaForCausalLM(config)
    with torch.no_grad():  # norms that are not all zeros, so that `1 + weight` matters
        for module in reference.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.normal_()
    model = copy.deepcopy(reference)
    summary = kernels.substitute(model, CPUAccelerator(), True)
    assert summary == {"attention: sdpa": 2}
    inputs = batch(padded=True)
    torch.testing.assert_close(model(**inputs).loss, reference(**inputs).loss, rtol=1e-5, atol=1e-5)


def test_a_model_that_is_not_from_transformers_keeps_its_attention():
    from hputrain.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    assert "attention" not in kernels.describe(kernels.substitute(model, CPUAccelerator(), True))


def test_what_the_kernel_cannot_do_falls_back_counted():
    model = build("llama")
    summary = kernels.substitute(model, CPUAccelerator(), True)
    attention = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, heads, 6, 8, generator=g) for heads in (4, 2, 2))
    out, weights = kernels.attention(attention, q, k, v, None, scaling=8 ** -0.5, output_attentions=True)
    assert summary[kernels.FALLBACK] == 1 and weights is None
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              is_causal=True)
    torch.testing.assert_close(out, expected.transpose(1, 2))
    assert kernels.describe(summary) == "attention: sdpa ×2, rms_norm: rms_norm ×5, attention: fallback ×1"


def test_describe_and_available():
    assert kernels.describe({}) == "none"
    assert kernels.available(CPUAccelerator()) == {"attention": "sdpa", "rms_norm": "rms_norm", "rotary": None,
                                                   "experts": "static"}
    assert kernels.available(HPUAccelerator())["attention"] == "fused_sdpa"


class HPUOnCPU(HPUAccelerator):
    """The HPU backend over the fake runtime, with tensors left on the CPU."""

    def setup(self, local_rank=0):
        super().setup(local_rank)
        return torch.device("cpu")

    def pins_memory(self):
        return False  # no pinned memory without a device


def counting_torch_sdpa(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(kwargs.get("is_causal"))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    return calls


def hf_rows(n=8, length=12):
    g = torch.Generator().manual_seed(4)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, SMALL["vocab_size"], (n, length), generator=g)]


def test_gaudi_training_step_runs_fused_kernels(tmp_path, fake_hpu, monkeypatch):
    torch_sdpa = counting_torch_sdpa(monkeypatch)
    model = build("llama")
    reference = copy.deepcopy(model)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                             logging_steps=1, save_steps=0, disable_tqdm=True)
    trainer = Trainer(model, args, train_dataset=hf_rows(2), accelerator=HPUOnCPU("eager"))
    assert trainer.kernels == {"attention: fused_sdpa": 2, "rms_norm: fused": 5}
    fake_hpu.calls.clear()
    trainer.train()
    names = fake_hpu.names()
    assert names.count("FusedSDPA") == 2 and names.count("FusedRMSNorm") == 5  # once per layer; 2 per layer + final
    assert torch_sdpa == []
    sdpa = [details for name, details in fake_hpu.calls if name == "FusedSDPA"]
    # causal without a mask, as many key heads as query heads, fp32 softmax, no recompute at 12 keys
    assert all(d["is_causal"] and not d["mask"] and d["heads"] == (4, 4) and d["softmax_mode"] == "None"
               and d["recompute"] is False for d in sdpa)
    # the fake computes the reference: the first step's loss is the unmodified model's
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    rows = hf_rows(2)
    expected = reference(input_ids=torch.stack([r["input_ids"] for r in rows]),
                         labels=torch.stack([r["labels"] for r in rows])).loss
    assert first["loss"] == pytest.approx(expected.item(), abs=1e-5)


def test_gaudi_attention_options(fake_hpu):
    hpu = HPUAccelerator("eager", autocast_op_lists=(["softmax", "linear"], ["log_softmax"]))
    hpu.attention_recompute = True
    q = torch.randn(1, 4, 5, 8)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    out = hpu.scaled_dot_product_attention(q, q[:, :2], q[:, :2], mask, False, None, 0.0)
    (_, details), = [call for call in fake_hpu.calls if call[0] == "FusedSDPA"]
    assert details["softmax_mode"] == "fast" and details["recompute"] is True and details["mask"]
    reference = F.scaled_dot_product_attention(q, q[:, :2], q[:, :2], is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, reference)
    weight = torch.randn(8, dtype=torch.bfloat16)
    normed = hpu.rms_norm(q, weight, 1e-6)  # fp32 input, bf16 weight: FusedRMSNorm takes one dtype
    assert normed.dtype == torch.bfloat16 and fake_hpu.calls[-1][1]["dtypes"] == (torch.bfloat16,) * 2


def test_context_parallel_without_causal_attention_is_an_error():
    from hputrain.distributed import context_parallel

    model = build("llama")
    kernels.substitute(model, CPUAccelerator(), True)
    cp = context_parallel.ContextParallel(group=object(), rank=0, size=2)
    with cp.forward_context(), pytest.raises(InputError, match="causal self-attention without padding"):
        model(**batch(padded=True))  # a padding mask: not the causal attention cp computes
    assert context_parallel.active_group() is None


@lazy_rehearses_hf_models
def test_lazy_mode_on_cpu_compiles_nothing_after_warmup(tmp_path, llama_folder):  # noqa: F811
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_folder)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=2,
                             logging_steps=3, save_steps=0, disable_tqdm=True, execution_mode="lazy",
                             accelerator="cpu", throughput_warmup_steps=2, learning_rate=1e-3)
    g = torch.Generator().manual_seed(5)
    rows = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, model.config.vocab_size, (12, 16), generator=g)]
    trainer = Trainer(model, args, train_dataset=rows)
    assert trainer.kernels == {"attention: sdpa": 2, "rms_norm: rms_norm": 5}
    out = trainer.train()
    assert out.metrics["graph_compiles"] > 0 and out.metrics["graph_compiles_after_warmup"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rounds_where_llama_rounds(dtype):
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 7, 64).to(dtype)
    ours = CPUAccelerator().rms_norm(x, norm.weight, 1e-5)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, norm(x), rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-6 if dtype == torch.float32 else 0)


def test_attention_recompute_reaches_fused_sdpa_from_training_arguments(tmp_path, fake_hpu):
    """Optimum's flash_attention_recompute, spelled attention_recompute: a 12-key step that would
    not recompute by default does when asked."""
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                             save_steps=-1, disable_tqdm=True, attention_recompute=True)
    Trainer(build("llama"), args, train_dataset=hf_rows(2), accelerator=HPUOnCPU("eager")).train()
    sdpa = [details for name, details in fake_hpu.calls if name == "FusedSDPA"]
    assert len(sdpa) == 2 and all(d["recompute"] is True for d in sdpa)


@pytest.mark.parametrize("name, words", [
    ("use_flash_attention", "fused_kernels"), ("flash_attention_recompute", "attention_recompute"),
    ("use_fused_rms_norm", "fused_kernels"), ("use_fused_rope", "no public hook"),
])
def test_optimum_kernel_switches_say_what_to_use(name, words):
    from hputrain.config.fields import ConfigError

    with pytest.raises(ConfigError, match=words):
        TrainingArguments(**{name: True})


def test_fallbacks_in_training_are_counted_in_the_summary(tmp_path):
    """A forward asking for attention weights (which no fused kernel returns) goes to
    transformers' own path, and the run's summary record says how many calls did."""
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                             save_steps=-1, disable_tqdm=True, report_to="none", fused_kernels=True)

    def loss_with_attention_weights(model, batch):
        return model(**batch, output_attentions=True).loss

    Trainer(build("llama"), args, train_dataset=hf_rows(4),
            compute_loss=loss_with_attention_weights).train()
    summary = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["attention_fallback_calls"] == 2 * 2  # two layers, two steps
