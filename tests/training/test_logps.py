"""Issue 32, item 5: per-token log-probs and entropies of completion positions, in checkpointed
chunks inside the model's head (training/logps.py). The references: the full logits of the same
model, log_softmax(logits / temperature) gathered and the entropy written out here, their
gradients, and TRL 1.16's selective_log_softmax / entropy_from_logits on the same logits."""
from __future__ import annotations

import pytest
import torch

from ..hf_fixtures import tiny_llama_config

transformers = pytest.importorskip("transformers")

from hputrain.errors import InputError  # noqa: E402
from hputrain.models.gpt import GPT, GPTConfig  # noqa: E402
from hputrain.methods.dpo.trainer import completion_logps  # noqa: E402
from hputrain.training.logps import output_head, shifted_labels, token_logps  # noqa: E402

VOCAB = 300
ROWS, LENGTH = 3, 12


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


def llama(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(tiny_llama_config(VOCAB, **overrides))


def lora(targets: list[str]):
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                        init_lora_weights=False))


def batch(vocab: int = VOCAB) -> tuple[dict, torch.Tensor]:
    """Inputs (right-padded rows) and labels: completion tokens after a prompt of 3 to 5, -100 on
    the prompt, the padding and the last position."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab, (ROWS, LENGTH), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # padding
    completion = torch.zeros_like(ids)
    for row, prompt in enumerate((3, 5, 4)):
        completion[row, prompt:] = 1
    completion *= mask
    return {"input_ids": ids, "attention_mask": mask}, shifted_labels(ids, completion)


def call(module, inputs):
    return module(**inputs, use_cache=False)


def reference(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    """The full-logits computation: log_softmax(logits / temperature) at the labels, and
    -sum p log p, both 0 where the label is -100."""
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)
    scored = labels != -100
    picked = logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logps.exp() * logps).sum(-1)
    return picked * scored, entropy * scored


def weighted(logps, entropy):
    """A loss that uses every position's log-prob and entropy with its own weight."""
    weights = torch.linspace(0.5, 1.5, logps.numel()).view_as(logps).to(logps.device)
    return -(logps * weights).sum() + 0.1 * (entropy * weights.flip(0)).sum()


def grads(model) -> dict:
    result = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return result


MODELS = {"llama": llama, "lora": lambda: lora(["q_proj", "v_proj"]),
          "lora-head": lambda: lora(["q_proj", "v_proj", "lm_head"])}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("kind", list(MODELS))
def test_equal_to_the_full_logits_with_their_gradients(kind, temperature):
    model = MODELS[kind]()
    inputs, labels = batch()
    want_logps, want_entropy = reference(call(model, inputs).logits, labels, temperature)
    weighted(want_logps, want_entropy).backward()
    want_grads = grads(model)

    # 7 tokens a chunk over 3 rows: chunks of 2 columns, the last of 1 (uneven on purpose)
    got = token_logps(call, model, inputs, labels, temperature=temperature, entropy=True, chunk=7)
    torch.testing.assert_close(got.logps, want_logps, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.entropy, want_entropy, rtol=0, atol=1e-5)
    weighted(got.logps, got.entropy).backward()
    got_grads = grads(model)
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, msg=name)
    assert "forward" not in vars(output_head(model))  # the head is itself again


def test_unscored_positions_give_zero():
    model, (inputs, labels) = llama(), batch()
    got = token_logps(call, model, inputs, labels, entropy=True, chunk=5)
    unscored = labels == -100
    assert unscored.any() and (~unscored).any()
    assert (got.logps[unscored] == 0).all() and (got.entropy[unscored] == 0).all()
    assert (got.logps[~unscored] < 0).all() and (got.entropy[~unscored] > 0).all()
    assert got.logps.dtype == torch.float32 and got.logps.shape == labels.shape


def test_start_leaves_the_first_positions_out():
    """GRPO's prompt, left-padded to a fixed length: the head never scores it (its projection
    sees only the later columns), and the numbers are the full path's."""
    model, (inputs, labels) = llama(), batch()
    head, projected = output_head(model), []
    original = head.forward
    head.forward = lambda hidden: projected.append(hidden.shape[1]) or original(hidden)  # a spy
    got = token_logps(call, model, inputs, labels, temperature=0.7, entropy=True, start=6)
    assert sum(projected) == LENGTH - 6  # only the columns from 6 on went through the head
    del head.forward
    want_logps, want_entropy = reference(call(model, inputs).logits, labels, 0.7)
    want_logps[:, :6] = want_entropy[:, :6] = 0
    torch.testing.assert_close(got.logps, want_logps, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.entropy, want_entropy, rtol=0, atol=1e-5)
    full = token_logps(call, model, inputs, labels, temperature=0.7, start=6, chunk=None)
    torch.testing.assert_close(full.logps, got.logps, rtol=0, atol=1e-6)
    assert full.entropy is None


def test_head_restored_after_an_exception_and_keeps_a_forward_of_its_own():
    model, (inputs, labels) = llama(), batch()
    head = output_head(model)

    def failing(module, batch):
        assert "forward" in vars(head)  # swapped during the call ...
        raise RuntimeError("out of memory, say")

    with pytest.raises(RuntimeError, match="out of memory"):
        token_logps(failing, model, inputs, labels)
    assert "forward" not in vars(head)  # ... and restored after it

    original = head.forward
    own = lambda hidden: original(hidden)  # noqa: E731 (an accelerate-style instance forward)
    head.forward = own
    token_logps(call, model, inputs, labels)
    assert vars(head)["forward"] is own


def test_no_grad_as_for_a_reference_model():
    model, (inputs, labels) = llama(), batch()
    with torch.no_grad():
        got = token_logps(call, model, inputs, labels, chunk=4)
        want, _ = reference(call(model, inputs).logits, labels, 1.0)
    assert not got.logps.requires_grad
    torch.testing.assert_close(got.logps, want, rtol=0, atol=1e-5)


def test_the_built_in_gpt_falls_back_to_the_full_logits():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=VOCAB))
    inputs, labels = batch()
    inputs = {"input_ids": inputs["input_ids"]}
    assert output_head(model) is None
    got = token_logps(call_gpt, model, inputs, labels, temperature=0.7, entropy=True)
    want_logps, want_entropy = reference(call_gpt(model, inputs)["logits"], labels, 0.7)
    torch.testing.assert_close(got.logps, want_logps, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.entropy, want_entropy, rtol=0, atol=1e-5)


def call_gpt(module, inputs):
    return module(**inputs)


def test_a_softcapping_config_takes_the_full_logits():
    model = llama(final_logit_softcapping=30.0)
    assert output_head(model) is None
    inputs, labels = batch()
    got = token_logps(call, model, inputs, labels)
    want, _ = reference(call(model, inputs).logits, labels, 1.0)
    torch.testing.assert_close(got.logps, want, rtol=0, atol=1e-5)


class Doubling(torch.nn.Module):
    """A model that scales its head's output without saying so in a config."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, **inputs):
        return {"logits": self.inner(**inputs).logits * 2}


def test_an_unknown_change_of_the_logits_is_refused():
    model, (inputs, labels) = Doubling(llama()), batch()
    with pytest.raises(InputError, match="chunk=None"):
        token_logps(call, model, inputs, labels)
    assert "forward" not in vars(model.get_output_embeddings())
    got = token_logps(call, model, inputs, labels, chunk=None)  # what the error says to do
    want, _ = reference(call(model, inputs)["logits"], labels, 1.0)
    torch.testing.assert_close(got.logps, want, rtol=0, atol=1e-5)


def test_hidden_states_of_another_shape_are_refused():
    model, (inputs, labels) = llama(), batch()
    with pytest.raises(InputError, match="do not match the labels"):
        token_logps(lambda m, i: m(**i, logits_to_keep=1), model, inputs, labels)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equal_to_trl_on_the_same_logits(temperature):
    utils = pytest.importorskip("trl.trainer.utils")
    model, (inputs, labels) = llama(), batch()
    with torch.no_grad():
        logits = call(model, inputs).logits
        got = token_logps(call, model, inputs, labels, temperature=temperature, entropy=True, chunk=5)
    scored = labels != -100
    trl_logps = utils.selective_log_softmax(logits, labels.clamp(min=0), temperature=temperature)
    trl_entropy = utils.entropy_from_logits(logits / temperature)
    torch.testing.assert_close(got.logps, trl_logps * scored, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.entropy, trl_entropy * scored, rtol=0, atol=1e-5)
    # the full logits path, handed those very logits
    fed = token_logps(lambda m, i: {"logits": logits}, None, None, labels,
                      temperature=temperature, entropy=True, chunk=None)
    torch.testing.assert_close(fed.logps, trl_logps * scored, rtol=0, atol=1e-5)
    torch.testing.assert_close(fed.entropy, trl_entropy * scored, rtol=0, atol=1e-5)


def test_dpo_sums_are_completion_logps():
    """What DPO takes: each row's sum over its completion, as methods/dpo/trainer.py computes it today."""
    model, (inputs, _) = llama(), batch()
    completion = torch.zeros_like(inputs["input_ids"])
    completion[:, 4:] = inputs["attention_mask"][:, 4:]
    with torch.no_grad():
        want = completion_logps(call(model, inputs).logits, inputs["input_ids"], completion)
        got = token_logps(call, model, inputs, shifted_labels(inputs["input_ids"], completion))
    torch.testing.assert_close(got.logps.sum(dim=1), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=0.0), "temperature"), (dict(start=LENGTH + 1), "start"),
    (dict(chunk=0), "chunk")])
def test_bad_arguments_are_one_line(bad, message):
    model, (inputs, labels) = llama(), batch()
    with pytest.raises(InputError, match=message):
        token_logps(call, model, inputs, labels, **bad)
    with pytest.raises(InputError, match="rows, length"):
        token_logps(call, model, inputs, labels[0])


@pytest.mark.parametrize("find_unused", [False, True])
def test_under_ddp_even_when_it_copies_the_output(find_unused):
    """DDP with find_unused_parameters hands back a copy of the head's output (its _DDPSink),
    through which the backward must go: accepted, and the gradients are the full path's."""
    dist = torch.distributed
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, (inputs, labels) = llama(), batch()
        wrapped = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
        want_logps, want_entropy = reference(call(wrapped, inputs).logits, labels, 0.7)
        weighted(want_logps, want_entropy).backward()
        want = grads(model)
        got = token_logps(call, wrapped, inputs, labels, temperature=0.7, entropy=True, chunk=7)
        weighted(got.logps, got.entropy).backward()
        torch.testing.assert_close(got.logps, want_logps, rtol=0, atol=1e-5)
        for name, grad in grads(model).items():
            torch.testing.assert_close(grad, want[name], msg=name)
    finally:
        dist.destroy_process_group()


class Tiny(torch.nn.Module):
    """An embedding and a head: enough for the lazy device, which runs no Llama by itself."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50)

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids):
        return {"logits": self.head(self.embed(ids))}


def test_on_the_lazy_device_as_the_doctor_runs():
    """torch.utils.checkpoint alone fails there (it looks up a `torch.lazy` for the RNG)."""
    pytest.importorskip("torch._lazy.ts_backend")
    from hputrain.accelerators.cpu import _start_lazy_backend

    _start_lazy_backend()  # once per process: another test may have started it already
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(-1, dims=1)
    labels[:, :2] = labels[:, -1] = -100
    results = []
    for device in ("cpu", "lazy"):
        model = Tiny().to(device)
        got = token_logps(lambda m, i: m(i), model, ids.to(device), labels.to(device),
                          entropy=True, chunk=4)
        weighted(got.logps, got.entropy).backward()
        torch._lazy.mark_step()
        results.append((got.logps.cpu(), model.head.weight.grad.cpu(), model.embed.weight.grad.cpu()))
    for eager, lazy_value in zip(*results):
        torch.testing.assert_close(lazy_value, eager)
