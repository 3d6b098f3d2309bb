"""Static-shape generation for Hugging Face models (execution/generation.py), against
transformers itself: greedy completions equal `model.generate`'s token for token (left padding,
end tokens inside, LoRA), the sampling distribution equals transformers' logits processors',
shapes and captures stay fixed, and a second rollout in lazy mode compiles nothing."""
from __future__ import annotations

import pytest
import torch

from ..hf_fixtures import lazy_rehearses_hf_models, tiny_llama_config

transformers = pytest.importorskip("transformers")

from hputrain.accelerators import detect_accelerator  # noqa: E402
from hputrain.errors import InputError  # noqa: E402
from hputrain.execution.generation import (  # noqa: E402
    Sampler, Sampling, StaticGenerator, completion_mask, inverse_cdf, process_logits,
    uniform_noise)

PAD, VOCAB, C = 3, 300, 10
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20], [40, 41, 42]]


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


def tiny_llama(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(tiny_llama_config(VOCAB, **overrides))


def reference(model, prompts, eos, max_new_tokens=C) -> torch.Tensor:
    """transformers' greedy completions of `prompts`, left-padded to the longest."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=PAD)
    return out[:, width:]


def generator(model, eos, graphs=False, capture=None, buckets=(16, 32), **kwargs):
    return StaticGenerator(model, detect_accelerator("cpu"), max_completion_length=C,
                           eos_token_ids=eos, pad_token_id=PAD, buckets=buckets, graphs=graphs,
                           capture=capture, **kwargs)


def an_inner_token(model) -> int:
    """A token that the greedy completion of the second prompt emits in its middle (not at its
    first position), so that using it as end token ends that row early."""
    free = reference(model, PROMPTS, eos=None)
    return int(free[1, 4])


def check_mask(ids: torch.Tensor, mask: torch.Tensor, eos: list[int]) -> None:
    for row, tokens in zip(mask.tolist(), ids.tolist()):
        ends = [i for i, t in enumerate(tokens) if t in eos]
        length = ends[0] + 1 if ends else len(tokens)
        assert row == [1] * length + [0] * (len(tokens) - length)
        assert all(t == PAD for t in tokens[length:])


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_greedy_equals_generate_with_left_padding_and_end_tokens(attention):
    model = tiny_llama(attn_implementation=attention)
    eos = [an_inner_token(model), 2]
    rollout = generator(model, eos).generate(PROMPTS, Sampling(temperature=0))
    expected = reference(model, PROMPTS, eos)
    # generate stops when every row has ended; ours always runs C tokens, padded after the end
    assert rollout.completion_ids.shape == (len(PROMPTS), C)
    assert torch.equal(rollout.completion_ids[:, :expected.shape[1]], expected)
    check_mask(rollout.completion_ids, rollout.completion_mask, eos)
    assert rollout.completion_mask[1].sum() < C  # the end token was met inside a row
    # prompts left-padded to the bucket, with their mask
    assert rollout.prompt_ids.shape == rollout.prompt_mask.shape == (len(PROMPTS), 16)
    assert rollout.prompt_ids[1].tolist() == [PAD] * 14 + PROMPTS[1]
    assert rollout.prompt_mask.sum(dim=1).tolist() == [len(p) for p in PROMPTS]


def test_greedy_equals_generate_for_lora_in_train_mode():
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           init_lora_weights=False)  # random B: the adapters change the output
    model = peft.get_peft_model(tiny_llama(), lora)
    model.train()
    rollout = generator(model, [2]).generate(PROMPTS, Sampling(temperature=0))
    assert model.training  # back in the caller's mode
    model.eval()
    expected = reference(model, PROMPTS, [2])
    assert torch.equal(rollout.completion_ids[:, :expected.shape[1]], expected)
    with model.disable_adapter():  # the adapters took part
        assert not torch.equal(reference(model, PROMPTS, [2]), expected)


def transformers_processed(logits, input_ids, sampling: Sampling) -> torch.Tensor:
    """transformers' processors for `sampling`, in generate's order."""
    g = transformers.generation.logits_process
    chain = []
    if sampling.repetition_penalty != 1.0:
        chain.append(g.RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
    if sampling.temperature != 1.0:
        chain.append(g.TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        chain.append(g.TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        chain.append(g.TopPLogitsWarper(sampling.top_p))
    if sampling.min_p is not None:
        chain.append(g.MinPLogitsWarper(sampling.min_p))
    for processor in chain:
        logits = processor(input_ids, logits)
    return logits


@pytest.mark.parametrize("sampling", [
    Sampling(), Sampling(temperature=0.7), Sampling(top_k=5), Sampling(top_p=0.8),
    Sampling(min_p=0.1), Sampling(repetition_penalty=1.3),
    Sampling(temperature=0.6, top_k=12, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
    Sampling(temperature=1.5, top_k=100, top_p=0.5)])
def test_processed_distribution_equals_transformers(sampling):
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    input_ids = torch.randint(0, 50, (4, 7))
    seen = torch.zeros(4, 50, dtype=torch.bool).scatter_(1, input_ids, True)
    ours = process_logits(logits, sampling, seen).softmax(dim=-1)
    theirs = transformers_processed(logits.clone(), input_ids, sampling).softmax(dim=-1)
    torch.testing.assert_close(ours, theirs)
    if sampling.top_k or sampling.top_p < 1 or sampling.min_p:
        assert (ours == 0).any()  # something was filtered out


@pytest.mark.parametrize("sampling", [
    Sampling(), Sampling(temperature=0.7, top_k=6), Sampling(top_p=0.8, min_p=0.02)])
def test_sampler_draws_each_token_with_its_probability(sampling):
    """Pearson's chi-square of 40000 seeded draws from a 12-token vocabulary against the
    probabilities transformers' processors give (11 degrees of freedom: a statistic over 45 has
    a chance below 1e-5 under the right distribution; a sampler off by a token's worth fails)."""
    torch.manual_seed(1)
    vocab, draws = 12, 40_000
    logits = torch.randn(1, vocab) * 1.5
    expected = transformers_processed(logits.clone(), torch.zeros(1, 0, dtype=torch.long),
                                      sampling).softmax(dim=-1)[0]
    uniform = uniform_noise(draws, logits, torch.Generator().manual_seed(0))
    tokens = Sampler(sampling)(logits.expand(draws, vocab), None, uniform)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts.sum() == draws and counts.shape == (vocab,)
    assert (counts[expected == 0] == 0).all()  # a filtered token is never drawn
    kept = expected > 0
    wanted = expected[kept].double() * draws
    chi2 = ((counts[kept] - wanted) ** 2 / wanted).sum().item()
    assert chi2 < 45, (chi2, counts.tolist(), wanted.tolist())


def test_inverse_cdf_at_the_ends_of_the_draws_skips_filtered_tokens():
    inf = float("inf")
    logits = torch.tensor([[-inf, 0.0, -inf, 0.0, -inf]] * 3)
    uniform = torch.tensor([[2.0 ** -24], [0.5], [1.0]])  # the smallest draw, half, the largest
    assert inverse_cdf(logits, uniform).tolist() == [1, 1, 3]


def test_uniform_draws_repeat_with_the_seed_and_lie_in_0_1():
    like = torch.zeros(2, 7)
    a = uniform_noise(5000, like, torch.Generator().manual_seed(3))
    assert a.shape == (5000, 1) and a.dtype == torch.float32
    assert torch.equal(a, uniform_noise(5000, like, torch.Generator().manual_seed(3)))
    assert 0 < a.min() and a.max() <= 1 and abs(a.mean().item() - 0.5) < 0.02


def test_greedy_with_repetition_penalty_equals_generate():
    """Prompts of one length, since generate penalises the left padding too (ours leaves it out)."""
    model = tiny_llama()
    same = [p[:2] for p in PROMPTS]
    penalised = Sampling(temperature=0, repetition_penalty=1.5)
    rollout = generator(model, [2]).generate(same, penalised)
    ids = torch.tensor(same)
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  do_sample=False, max_new_tokens=C, eos_token_id=[2],
                                  pad_token_id=PAD, repetition_penalty=1.5)[:, 2:]
    assert torch.equal(rollout.completion_ids[:, :expected.shape[1]], expected)
    plain = generator(model, [2]).generate(same, Sampling(temperature=0)).completion_ids
    assert not torch.equal(plain, rollout.completion_ids)  # the penalty changed something


def test_seeded_sampling_repeats_and_another_seed_differs():
    model = tiny_llama()
    engine = generator(model, [2])
    sampling = Sampling(temperature=1.0, top_k=50)

    def sample(seed):
        return engine.generate(PROMPTS, sampling, torch.Generator().manual_seed(seed)).completion_ids

    first = sample(7)
    assert torch.equal(first, sample(7))
    assert not torch.equal(first, sample(8))
    # and it samples: not the greedy answer
    assert not torch.equal(first, engine.generate(PROMPTS, Sampling(temperature=0)).completion_ids)


class Recorder:
    """A capture that records each captured module and the input shapes of every call."""

    def __init__(self):
        self.captured, self.shapes = [], []

    def __call__(self, module):
        self.captured.append(type(module).__name__)
        recorder = self

        def run(*args):
            recorder.shapes.append((type(module).__name__, tuple(
                tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)))
            return module(*args)
        return run


def test_shapes_never_change_and_one_capture_per_rows_and_bucket():
    model = tiny_llama()
    recorder = Recorder()
    engine = generator(model, [2], graphs=True, capture=recorder)
    greedy = Sampling(temperature=0)
    for prompts in (PROMPTS, [[1] * 16, [2], [3, 4], [5]], [[7, 8]] * 4):  # all in bucket 16
        engine.generate(prompts, greedy)
    assert recorder.captured == ["DecodeStep", "Sampler"]
    steps = [shapes for name, shapes in recorder.shapes if name == "DecodeStep"]
    assert len(steps) == 3 * (C - 1)  # exactly C - 1 decode calls, however early rows end
    assert set(steps) == {((4, 1), (4, 1), (1,))}
    engine.generate([[1] * 20] * 4, greedy)  # bucket 32: a step of its own
    engine.generate(PROMPTS[:2], greedy)  # two rows: another
    engine.generate(PROMPTS, Sampling(temperature=0.5))  # other sampling: a sampler only
    assert recorder.captured == ["DecodeStep", "Sampler", "DecodeStep", "DecodeStep", "Sampler",
                                 "Sampler"]


def test_completion_mask_is_trls_rule():
    ids = torch.tensor([[4, 5, 2, 6, 2], [4, 5, 6, 7, 8], [9, 4, 4, 4, 4], [2, 2, 2, 2, 2]])
    mask = completion_mask(ids, torch.tensor([2, 9]))
    assert mask.dtype == torch.int32
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1] * 5, [1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -1.0, "temperature"), ("temperature", 1e-6, "temperature"),
    ("temperature", float("nan"), "temperature"), ("top_p", 0.0, "top_p"),
    ("top_p", 1.5, "top_p"), ("top_k", -1, "top_k"), ("top_k", 2.5, "top_k"),
    ("min_p", 1.5, "min_p"), ("repetition_penalty", 0.0, "repetition_penalty")])
def test_bad_sampling_is_one_line(field, value, message):
    with pytest.raises(InputError, match=message) as error:
        Sampling(**{field: value}).check()
    assert "\n" not in str(error.value)


def test_bad_inputs_are_one_line():
    model = tiny_llama()
    with pytest.raises(InputError, match="exceeds the model's maximum of 128"):
        generator(model, [2]).generate([[1] * 120], Sampling(temperature=0))
    with pytest.raises(InputError, match="at least one token"):
        generator(model, [2]).generate([[1], []])
    with pytest.raises(InputError, match="max_completion_length"):
        StaticGenerator(model, detect_accelerator("cpu"), max_completion_length=0,
                        eos_token_ids=[2], pad_token_id=PAD)
    with pytest.raises(InputError, match="pad_token_id"):
        StaticGenerator(model, detect_accelerator("cpu"), max_completion_length=4,
                        eos_token_ids=[2], pad_token_id=None)


@pytest.mark.slow
def test_graphs_equal_eager_greedy_and_sampled():
    """torch.compile on the CPU (wrap_graph_inference) gives the eager tokens."""
    model = tiny_llama()
    eos = [an_inner_token(model), 2]
    eager, graphed = generator(model, eos), generator(model, eos, graphs=True)
    for sampling in (Sampling(temperature=0), Sampling(temperature=0.8, top_p=0.9)):
        a = eager.generate(PROMPTS, sampling, torch.Generator().manual_seed(3))
        b = graphed.generate(PROMPTS, sampling, torch.Generator().manual_seed(3))
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert torch.equal(a.completion_mask, b.completion_mask)


@lazy_rehearses_hf_models
def test_second_rollout_compiles_no_graph_in_lazy_mode():
    """Lazy mode on the CPU (a dry run of Gaudi's): the first rollout compiles the graphs, the
    second, with other prompt lengths in the same bucket, none; tokens as in eager mode."""
    model = tiny_llama()
    expected = generator(model, [2]).generate(PROMPTS, Sampling(temperature=0)).completion_ids
    lazy = detect_accelerator("cpu", execution_mode="lazy")
    model.to(lazy.setup(0))
    engine = StaticGenerator(model, lazy, max_completion_length=C, eos_token_ids=[2],
                             pad_token_id=PAD, buckets=(16,), graphs=False)
    compiles = []
    for prompts in ([[1, 2, 3]] * 4, PROMPTS):
        before = lazy.graph_compiles()
        rollout = engine.generate(prompts, Sampling(temperature=0))
        compiles.append(lazy.graph_compiles() - before)
    assert compiles[0] > 0 and compiles[1] == 0
    assert torch.equal(rollout.completion_ids.cpu(), expected)
