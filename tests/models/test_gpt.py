"""Unit tests for the GPT model (tiny shapes, CPU)."""

import math

import pytest
import torch
import torch.nn.functional as F

from hputrain.models.gpt import GPT, GPTConfig

VOCAB = 256


def tiny_model(seed: int = 0, **overrides) -> GPT:
    """A very small GPT, seeded so every test sees the same weights."""
    torch.manual_seed(seed)
    fields = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, **overrides}
    return GPT(GPTConfig(**fields))


def random_tokens(batch: int, time: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, time), generator=generator)


def test_output_shapes():
    model = tiny_model()
    out = model(random_tokens(3, 10))
    assert set(out) == {"logits"}
    assert out["logits"].shape == (3, 10, VOCAB)
    out = model(random_tokens(3, 10), labels=random_tokens(3, 10, seed=2))
    assert out["loss"].shape == ()


def test_loss_at_init_is_near_uniform():
    model = tiny_model()
    tokens = random_tokens(4, 33)
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])["loss"].item()
    assert abs(loss - math.log(VOCAB)) < 0.3


def test_loss_matches_cross_entropy_on_logits():
    model = tiny_model()
    inputs, labels = random_tokens(2, 12), random_tokens(2, 12, seed=5)
    out = model(inputs, labels=labels)
    expected = F.cross_entropy(out["logits"].reshape(-1, VOCAB), labels.reshape(-1))
    torch.testing.assert_close(out["loss"], expected)


def test_ignore_index_positions_are_left_out():
    model = tiny_model()
    inputs, labels = random_tokens(2, 12), random_tokens(2, 12, seed=5)
    masked = labels.clone()
    masked[:, 6:] = -100
    out = model(inputs, labels=masked)
    expected = F.cross_entropy(out["logits"][:, :6].reshape(-1, VOCAB), labels[:, :6].reshape(-1))
    torch.testing.assert_close(out["loss"], expected)
    # Un-ignoring one position must change the loss, so the mask is what left them out.
    unmasked_one = masked.clone()
    unmasked_one[0, 6] = labels[0, 6]
    assert not torch.allclose(model(inputs, labels=unmasked_one)["loss"], expected)


def test_attention_is_causal():
    model = tiny_model().eval()
    tokens = random_tokens(1, 16)
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % VOCAB
    before, after = model(tokens)["logits"], model(changed)["logits"]
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_position_ids_arange_matches_default_and_positions_matter():
    model = tiny_model().eval()
    tokens = random_tokens(2, 8)
    default = model(tokens)["logits"]
    explicit = model(tokens, position_ids=torch.arange(8))["logits"]
    batched = model(tokens, position_ids=torch.arange(8).expand(2, 8))["logits"]
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)
    torch.testing.assert_close(default, batched, rtol=0, atol=0)
    shifted = model(tokens, position_ids=torch.arange(8) + 4)["logits"]
    assert not torch.allclose(default, shifted)



def test_a_causal_mask_equals_no_mask_and_a_mask_is_used_as_given():
    model = tiny_model().eval()
    tokens = random_tokens(2, 8)
    default = model(tokens)["logits"]
    causal = torch.ones(8, 8, dtype=torch.bool).tril().expand(2, 1, 8, 8)
    additive = torch.zeros(2, 1, 8, 8).masked_fill(~causal, torch.finfo(torch.float32).min)
    for mask in (causal, additive):
        torch.testing.assert_close(model(tokens, attention_mask=mask)["logits"], default,
                                   rtol=0, atol=1e-5)
    # A 4-D mask is not made causal: one that lets token 0 see token 5 changes token 0.
    peeking = causal.clone()
    peeking[:, :, 0, 5] = True
    assert not torch.allclose(model(tokens, attention_mask=peeking)["logits"][:, 0], default[:, 0])


def test_a_padding_mask_hides_the_padding_on_either_side():
    model = tiny_model().eval()
    tokens = random_tokens(1, 5)
    alone = model(tokens)["logits"]
    right = torch.cat([tokens, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    out = model(right, attention_mask=torch.tensor([[1] * 5 + [0] * 3]))["logits"]
    torch.testing.assert_close(out[:, :5], alone, rtol=0, atol=1e-5)
    left = torch.cat([torch.full((1, 3), 7), tokens], dim=1)
    out = model(left, position_ids=torch.tensor([0, 0, 0, 0, 1, 2, 3, 4]),
                attention_mask=torch.tensor([[0] * 3 + [1] * 5]))["logits"]
    assert torch.isfinite(out).all()  # the padding queries see themselves, not nothing
    torch.testing.assert_close(out[:, 3:], alone, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="attention_mask must be"):
        model(tokens, attention_mask=torch.ones(1, 4))

def test_lm_head_is_tied_to_token_embedding():
    model = tiny_model()
    assert model.lm_head.weight is model.wte.weight
    with torch.no_grad():
        model.wte.weight[0, 0] = 123.0
    assert model.lm_head.weight[0, 0] == 123.0


def test_residual_projections_have_scaled_init():
    model = tiny_model(n_layer=8, n_embd=64, n_head=4)
    expected = 0.02 / math.sqrt(2 * 8)
    proj_std = model.blocks[0].mlp.proj.weight.std().item()
    fc_std = model.blocks[0].mlp.fc.weight.std().item()
    assert abs(proj_std - expected) < 0.2 * expected
    assert abs(fc_std - 0.02) < 0.1 * 0.02


def test_num_parameters_and_flops():
    model = tiny_model()
    config = model.config
    all_params = sum(p.numel() for p in model.parameters())
    assert model.num_parameters(non_embedding=False) == all_params
    assert model.num_parameters() == all_params - config.block_size * config.n_embd
    # Hand count (no biases): embeddings; per block qkv, attn proj, MLP fc and proj, two LayerNorms;
    # the final LayerNorm.
    d, layers = config.n_embd, config.n_layer
    per_block = 3 * d * d + d * d + 4 * d * d + 4 * d * d + 2 * d
    assert all_params == VOCAB * d + config.block_size * d + layers * per_block + d
    assert model.flops_per_token() == 6 * model.num_parameters()


@pytest.mark.parametrize(
    ("name", "layers", "heads", "width"),
    [("tiny", 2, 4, 128), ("small", 6, 6, 384), ("base", 12, 12, 768)],
)
def test_from_size(name, layers, heads, width):
    config = GPTConfig.from_size(name, dropout=0.1)
    assert (config.n_layer, config.n_head, config.n_embd) == (layers, heads, width)
    assert config.dropout == 0.1
    assert config.vocab_size == 256


def test_from_size_unknown_name_lists_valid_sizes():
    with pytest.raises(ValueError, match="tiny, small, base"):
        GPTConfig.from_size("huge")


@pytest.mark.parametrize(
    "fields",
    [{"n_embd": 30, "n_head": 4}, {"n_layer": 0}, {"block_size": -1}, {"dropout": 1.0}],
)
def test_config_validation(fields):
    with pytest.raises(ValueError, match="GPTConfig"):
        GPTConfig(**fields)


@pytest.mark.parametrize("bias", [False, True])
def test_config_counts_parameters_without_building(bias):
    model = tiny_model(bias=bias, vocab_size=100, block_size=24)
    assert model.config.num_parameters() == model.num_parameters(non_embedding=False)


def test_config_from_dict_round_trips():
    import dataclasses

    config = GPTConfig.from_size("small", block_size=64, dropout=0.1, bias=True)
    assert GPTConfig.from_dict(dataclasses.asdict(config)) == config
    assert GPTConfig.from_dict({"n_layer": 1, "dropout": 0}).dropout == 0  # JSON writes 0.0 as 0 sometimes


@pytest.mark.parametrize(
    ("data", "match"),
    [([1, 2], "JSON object"), ({"n_layer": "2"}, "n_layer must be of type int"),
     ({"n_layer": 2.0}, "n_layer"), ({"bias": 1}, "bias must be of type bool"),
     ({"n_embd": True}, "n_embd"), ({"dropout": float("nan")}, "dropout"),
     ({"n_layers": 2}, "no field 'n_layers'"), ({"n_head": 0}, "n_head must be positive"),
     ({"n_embd": 30, "n_head": 4}, "divisible")],
)
def test_config_from_dict_refuses_bad_fields(data, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig.from_dict(data)


def test_config_from_dict_refuses_models_over_the_limit():
    huge = {"n_layer": 10_000, "n_head": 64, "n_embd": 65_536, "block_size": 1 << 20}
    with pytest.raises(ValueError, match=r"of [\d,]+ parameters \([\d,.]+ GB of float32 weights\), "
                                         r"more than the limit of 1,000,000"):
        GPTConfig.from_dict(huge, max_parameters=1_000_000)
    small = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16}
    assert GPTConfig.from_dict(small, max_parameters=1_000_000).num_parameters() < 1_000_000


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0, 1e-45, 1e-5])
def test_generate_refuses_temperatures_that_overflow(temperature):
    with pytest.raises(ValueError, match="temperature"):
        tiny_model().generate(random_tokens(1, 3), 2, temperature=temperature)


def test_smallest_temperature_samples_finite_probabilities():
    from hputrain.models.gpt import MIN_TEMPERATURE, pick_next_token

    logits = torch.tensor([[3e3, -3e3, 0.0]])
    assert pick_next_token(logits, MIN_TEMPERATURE, None).item() == 0


def test_sequence_longer_than_block_size_raises():
    model = tiny_model(block_size=8)
    with pytest.raises(ValueError, match="block_size 8"):
        model(random_tokens(1, 9))


def test_generate_greedy_is_deterministic_and_has_right_length():
    model = tiny_model(block_size=8)
    prompt = random_tokens(2, 5)
    first = model.generate(prompt, max_new_tokens=10, temperature=0)
    second = model.generate(prompt, max_new_tokens=10, temperature=0)
    assert first.shape == (2, 15)
    assert torch.equal(first[:, :5], prompt)
    assert torch.equal(first, second)
    assert model.training  # generate restores the mode it found


def test_generate_top_k_one_equals_greedy():
    model = tiny_model()
    prompt = random_tokens(1, 4)
    greedy = model.generate(prompt, max_new_tokens=6, temperature=0)
    top1 = model.generate(prompt, max_new_tokens=6, temperature=0.7, top_k=1)
    assert torch.equal(greedy, top1)


def test_a_few_adamw_steps_reduce_loss_on_a_fixed_batch():
    model = tiny_model()
    tokens = random_tokens(4, 17)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = model(inputs, labels=labels)["loss"].item()
    for _ in range(20):
        loss = model(inputs, labels=labels)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    last = model(inputs, labels=labels)["loss"].item()
    assert last < first - 0.5
