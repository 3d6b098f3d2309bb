"""The static-shape experts (kinds/moe/experts/): for every MoE family of tests/moe_fixtures.py the
same outputs and gradients as transformers' eager experts (fp32 within 1e-5, bf16 within bf16's
rounding), on routings that leave experts without a token and that send every token to one
expert; the grouped product against a per-expert loop; Gaudi's fused op called as documented; the
lazy backend's graph unchanged by the routing; and a walk over transformers' MoE model types that
names each one these tests do not cover."""
import copy
import re

import pytest
import torch

from hputrain.accelerators.cpu import CPUAccelerator
from hputrain.kinds.moe import experts
from hputrain.execution import kernels
from hputrain.kinds.moe.experts.forward import ExpertWeights, combine, local_experts, route
from hputrain.kinds.moe.experts.grouped import expert_of_rows, fixed_shape_grouped_mm, grouped_mm
from hputrain.kinds.moe.experts.llama4 import StaticLlama4TextMoe

from ...conftest import requires_cuda
from ...moe_fixtures import FAMILIES, mixtral_folder, moe_folders, tiny_moe_config  # noqa: F401

transformers = pytest.importorskip("transformers", reason="the experts need transformers")
pytest.importorskip("transformers.integrations.moe", reason="transformers before 5.0 has no ExpertsInterface")

INTERFACE_FAMILIES = [f for f in FAMILIES if f != "llama4_text"]
ROUTINGS = ["random", "experts without a token", "every token on one expert"]
TOKENS = 24


def build(family, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family)).to(dtype)


def first_experts(model):
    """The first experts module running through transformers' ExpertsInterface."""
    return next(m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed"))


def routing(kind, tokens, k, num_experts, seed=0):
    """(tokens, k) distinct experts per token: random over all experts, random over half of them,
    or slot 0 of every token on expert 2."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(num_experts)
    if kind == "experts without a token":
        pool = pool[::2]
    picks = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(tokens)])
    if kind == "every token on one expert":
        others = torch.stack([torch.randperm(num_experts - 1, generator=g)[:k - 1] for _ in range(tokens)])
        picks = torch.cat([torch.full((tokens, 1), 2), others + (others >= 2).long()], dim=1)
    return picks


def eager(module, hidden, index, weights):
    """transformers' own per-expert loop (the undecorated forward)."""
    return type(module).forward.__wrapped__(module, hidden, index, weights)


def outputs_and_grads(forward, module, hidden, index, weights):
    module.zero_grad()
    hidden, weights = hidden.detach().requires_grad_(), weights.detach().requires_grad_()
    out = forward(module, hidden, index, weights)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.device, out.dtype))
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    return out.detach(), hidden.grad, weights.grad, grads


def assert_same(ours, theirs, tolerance):
    for a, b in zip(ours[:3], theirs[:3]):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)
    assert ours[3].keys() == theirs[3].keys()
    for name in ours[3]:
        torch.testing.assert_close(ours[3][name], theirs[3][name], rtol=tolerance, atol=tolerance)


def with_kernel(module, accelerator):
    """The module bound to `accelerator`'s grouped product (None: the fixed-shape form)."""
    module._hputrain_kernels = kernels._Kernels(accelerator, {}) if accelerator else None
    return module


# -- every family against transformers' eager experts ---------------------------------------------

@pytest.mark.parametrize("form", ["device kernel", "fixed shape"])
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("family", INTERFACE_FAMILIES)
def test_experts_equal_transformers_eager(family, kind, form):
    module = with_kernel(first_experts(build(family)), CPUAccelerator() if form == "device kernel" else None)
    config = module.config
    k = config.num_experts_per_tok
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():  # biases too (GPT-OSS), which transformers starts at zero
            p.normal_(0, 0.2, generator=g)
    hidden = torch.randn(TOKENS, config.hidden_size, generator=g)
    index = routing(kind, TOKENS, k, module.num_experts)
    weights = torch.rand(TOKENS, k, generator=g)
    theirs = outputs_and_grads(eager, module, hidden, index, weights)
    ours = outputs_and_grads(experts.experts_forward, module, hidden, index, weights)
    assert_same(ours, theirs, 1e-5)
    if kind == "experts without a token":  # they get no gradient either
        assert ours[3]["down_proj"][1::2].abs().sum() == 0


@pytest.mark.parametrize("kind", ["random", "every token on one expert"])
def test_llama4_blocks_equal_transformers(kind):
    model = build("llama4_text")
    block = next(m for m in model.modules() if type(m).__name__ == "Llama4TextMoe")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2, generator=g)
        if kind == "every token on one expert":  # expert 2's logit is hidden[0], the others 0
            block.router.weight.zero_()
            block.router.weight[2, 0] = 1.0
    hidden = torch.randn(2, TOKENS // 2, model.config.hidden_size, generator=g)
    if kind == "every token on one expert":
        hidden[..., 0] = 10.0  # expert 2's logit dominates for every token
    ours_block = StaticLlama4TextMoe(block, kernels._Kernels(CPUAccelerator(), {}))

    def run(module):
        module.zero_grad()
        x = hidden.clone().requires_grad_()
        out, logits = module(x)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(9))).sum().backward()
        return out.detach(), logits.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}

    theirs, ours = run(block), run(ours_block)
    if kind == "every token on one expert":
        assert (torch.topk(theirs[1], 1).indices == 2).all()
    assert_same(ours, theirs, 1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_models_train_as_with_eager_experts(family):
    """Loss and every parameter's gradient (router and experts included) of the whole model, with
    the kernels substituted, against the same model with transformers' eager experts."""
    theirs = build(family)
    ours = copy.deepcopy(theirs)
    if theirs._can_set_experts_implementation():
        theirs.set_experts_implementation("eager")
    summary = kernels.substitute(ours, CPUAccelerator(), True)
    moe_layers = sum(1 for m in theirs.modules() if type(m).__name__.endswith(("Experts", "TextMoe"))
                     and (hasattr(m, "has_gate") or type(m).__name__ == "Llama4TextMoe"))
    assert summary["experts: static"] == moe_layers > 0
    assert_same_step(theirs, ours, torch.randint(0, theirs.config.vocab_size, (2, 16),
                                                 generator=torch.Generator().manual_seed(1)))


def assert_same_step(theirs, ours, ids, grad_rtol=1e-5):
    """The two models' loss on `ids` and every parameter's gradient agree."""
    losses = []
    for model in (theirs, ours):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(theirs.named_parameters(), ours.parameters()):
        if a.grad is not None or b.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=grad_rtol, atol=1e-5, msg=name)


@pytest.mark.parametrize("form", ["device kernel", "fixed shape"])
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_bf16_experts_round_as_transformers(family, form):
    module = with_kernel(first_experts(build(family, dtype=torch.bfloat16)),
                         CPUAccelerator() if form == "device kernel" else None)
    config = module.config
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(TOKENS, config.hidden_size, generator=g).bfloat16()
    index = routing("random", TOKENS, config.num_experts_per_tok, module.num_experts)
    weights = torch.rand(TOKENS, config.num_experts_per_tok, generator=g).bfloat16()
    theirs = outputs_and_grads(eager, module, hidden, index, weights)
    ours = outputs_and_grads(experts.experts_forward, module, hidden, index, weights)
    assert ours[0].dtype == torch.bfloat16
    assert_same(ours, theirs, 2e-2)


def test_a_users_experts_choice_is_kept():
    model = build("mixtral")
    model.set_experts_implementation("batched_mm")
    assert "experts: static" not in kernels.substitute(model, CPUAccelerator(), True)
    assert model.config._experts_implementation == "batched_mm"
    assert kernels.substitute(build("mixtral"), CPUAccelerator(), False) == {}


def test_the_run_header_names_the_static_experts():
    summary = kernels.substitute(build("qwen3_moe"), CPUAccelerator(), True)
    assert kernels.describe(summary).endswith("experts: static ×2")


@pytest.mark.parametrize("family, kind", [("mixtral", "mixture of experts: 8 experts, top-2"),
                                          ("deepseek_v3", "mixture of experts: 8 experts, top-2"),
                                          ("llama4_text", "mixture of experts: 8 experts, top-1")])
def test_the_model_kind_comes_from_the_config(family, kind):
    from hputrain.models.kind import describe

    assert describe(tiny_moe_config(family)) == kind
    assert describe(transformers.LlamaConfig()) == "dense"


@pytest.mark.slow
def test_a_run_from_the_command_line_names_its_kind_and_experts(tmp_path, mixtral_folder, capsys,  # noqa: F811
                                                               monkeypatch):
    from hputrain.cli import main

    from ...hf_fixtures import write_text_file

    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")
    data = write_text_file(tmp_path / "data.txt", lines=40)
    main(["train", "--model", str(mixtral_folder), "--dataset", str(data), "--output-dir",
          str(tmp_path / "out"), "--precision", "32", "--block-size", "32", "--max-steps", "2",
          "--per-device-train-batch-size", "2", "--save-steps", "-1", "--disable-tqdm"])
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("hputrain: MixtralForCausalLM (mixture of experts: 8 experts, top-2), ")
    assert header.endswith(", experts: static ×2"), header


# -- the grouped product ----------------------------------------------------------------------------

def per_expert_loop(x, weight, offsets):
    out, start = torch.zeros(x.size(0), weight.size(2), dtype=x.dtype), 0
    for e, end in enumerate(offsets.tolist()):
        out[start:end] = x[start:end] @ weight[e]
        start = end
    return out


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 10, 0, 0], [2, 2, 2, 2], [1, 0, 0, 3]])
@pytest.mark.parametrize("form", ["device kernel", "fixed shape"])
def test_grouped_mm_equals_a_loop_over_experts(counts, form):
    g = torch.Generator().manual_seed(0)
    rows = sum(counts)
    x = torch.randn(10, 16, generator=g).requires_grad_()
    weight = torch.randn(4, 16, 8, generator=g).requires_grad_()
    offsets = torch.cumsum(torch.tensor(counts), 0)
    accelerator = CPUAccelerator() if form == "device kernel" else None
    out = grouped_mm(x, weight, offsets, accelerator)
    expected = per_expert_loop(x, weight, offsets)
    torch.testing.assert_close(out[:rows], expected[:rows], rtol=1e-6, atol=1e-6)
    grad = torch.randn(out.shape, generator=g)
    grad[rows:] = 0  # rows past the last offset are unspecified (a caller masks its padding)
    ours = torch.autograd.grad(out, (x, weight), grad)
    theirs = torch.autograd.grad(expected, (x, weight), grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a[:rows] if a.dim() == 2 else a, b[:rows] if b.dim() == 2 else b,
                                   rtol=1e-5, atol=1e-5)
    if form == "fixed shape":
        assert (out[rows:] == 0).all()


@pytest.mark.parametrize("tile", [1, 3, 16])
def test_the_fixed_shape_form_is_exact_for_any_tile(tile):
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(12, 8, generator=g), torch.randn(5, 8, 4, generator=g)
    offsets = torch.cumsum(torch.tensor([0, 7, 1, 0, 4]), 0)
    torch.testing.assert_close(fixed_shape_grouped_mm(x, weight, offsets, tile),
                               per_expert_loop(x, weight, offsets), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("routing", ["balanced", "one expert", "one row each but one"])
@pytest.mark.parametrize("rows,experts", [(32768, 128), (40960, 16), (48, 8), (5, 4)])
def test_the_fixed_shape_form_multiplies_at_most_a_tile_an_expert_beyond_its_rows(rows, experts, routing):
    """Issue 47 item 3: the tiles hold any routing (a row's product is its own expert's), and
    their rows are at most R + E·tile (1.25·R + E while the tile, ceil(R/4E), is under 256; the
    old form's tile of R/E made about 2·R + E): sizes.py's count, checked on the layout the form
    builds for the worst routings: every row on one expert, and every expert with one row (each
    a part-filled tile)."""
    from hputrain.kinds.moe.experts import grouped
    from hputrain.kinds.moe.experts.sizes import tile_count, tile_rows

    if routing == "balanced":
        counts = [rows // experts + (e < rows % experts) for e in range(experts)]
    elif routing == "one expert":
        counts = [0] * (experts - 1) + [rows]
    else:
        counts = [1] * (experts - 1) + [rows - experts + 1]
    offsets = torch.cumsum(torch.tensor(counts), 0)
    tile = tile_rows(rows, experts)
    layout = grouped._TileLayout(offsets, rows, experts, tile)
    assert layout.tiles == tile_count(rows, experts, tile) and tile <= 256
    assert layout.tiles * tile <= rows + experts * tile
    if tile < 256:
        assert layout.tiles * tile <= 1.25 * rows + experts
    assert int(layout.valid.sum()) == rows  # every row in a tile, once
    assert sorted(layout.source[layout.valid].tolist()) == list(range(rows))
    owner = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))
    assert torch.equal(layout.expert.unsqueeze(1).expand_as(layout.valid)[layout.valid][
        torch.argsort(layout.source[layout.valid])], owner)  # each row with its own expert


def test_no_tile_keeps_a_copy_of_an_experts_matrix():
    """Issue 47 item 3: the tiles' matrices are gathered at most CHUNK_TILES at a time (never one
    for every tile at once: 1.6 GB for Qwen3-30B-A3B's gate_up a layer), and none is kept for
    backward; the weight gradient equals a loop over the experts'."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hputrain.kinds.moe.experts.grouped import CHUNK_TILES

    g = torch.Generator().manual_seed(0)
    rows, experts, width = 600, 4, 8
    x = torch.randn(rows, width, generator=g).requires_grad_()
    weight = torch.randn(experts, width, 6, generator=g).requires_grad_()
    offsets = torch.cumsum(torch.tensor([100, 0, 350, 150]), 0)

    class Gathers(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.index_select.default and args[0].dim() == 3:
                self.largest = max(self.largest, out.size(0))
            return out

    saved = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    with Gathers() as gathers, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fixed_shape_grouped_mm(x, weight, offsets, tile=8)  # 76 tiles
        grad = torch.autograd.grad(out, (x, weight), torch.ones_like(out))
    assert 0 < gathers.largest <= CHUNK_TILES
    assert not [shape for shape in saved if len(shape) == 3 and shape[1:] == (width, 6) and shape[0] != experts]
    expected = per_expert_loop(x, weight, offsets)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad[1], torch.autograd.grad(expected, weight, torch.ones_like(out))[0],
                               rtol=1e-4, atol=1e-4)


def test_the_up_and_down_products_share_one_tile_layout(monkeypatch):
    """The fixed-shape form lays the sorted rows out in tiles once per buffer, not per product."""
    from hputrain.kinds.moe.experts import grouped

    made = []
    layout = grouped._TileLayout
    monkeypatch.setattr(grouped, "_TileLayout", lambda *a: made.append(a) or layout(*a))
    module = first_experts(build("mixtral"))
    r = route(routing("random", TOKENS, 2, module.num_experts), module.num_experts)
    hidden = torch.randn(TOKENS * 2, module.config.hidden_size)
    local_experts(ExpertWeights.of(module), hidden, r.offsets)  # no accelerator: the tiles
    assert len(made) == 1


def test_the_cpu_kernel_is_torchs_grouped_mm_in_eager_mode_only():
    x, weight = torch.randn(4, 8), torch.randn(2, 8, 8)
    assert CPUAccelerator("eager").grouped_mm_kernel(x, weight) is not None
    assert CPUAccelerator("lazy").grouped_mm_kernel(x, weight) is None


def test_route_sorts_pairs_stably_and_counts_on_the_device():
    index = torch.tensor([[3, 1], [1, 0], [3, 2], [1, 3]])
    r = route(index, num_experts=5)
    assert r.counts.tolist() == [1, 3, 1, 3, 0] and r.offsets.tolist() == [1, 4, 5, 8, 8]
    assert index.reshape(-1)[r.order].tolist() == [0, 1, 1, 1, 2, 3, 3, 3]
    assert r.order.tolist() == [3, 1, 2, 6, 5, 0, 4, 7]  # stable: pairs in their order per expert
    assert r.tokens.tolist() == [1, 0, 1, 3, 2, 0, 2, 3]
    assert r.order[r.restore].tolist() == list(range(8))
    assert expert_of_rows(r.offsets, 9).tolist() == [0, 1, 1, 1, 2, 3, 3, 3, 5]


def test_the_middle_step_runs_a_slice_of_the_experts():
    """What expert parallelism does: the local experts on their own rows, as the whole does."""
    module = first_experts(build("qwen3_moe"))
    hidden = torch.randn(TOKENS, module.config.hidden_size)
    index = routing("random", TOKENS, 2, module.num_experts)
    weights = torch.rand(TOKENS, 2)
    r = route(index, module.num_experts)
    x_sorted = torch.nn.functional.embedding(r.tokens, hidden)
    whole = local_experts(ExpertWeights.of(module), x_sorted, r.offsets)
    first, stop = 4, 8  # the second half of the experts, on their rows alone
    begin, end = int(r.offsets[first - 1]), int(r.offsets[stop - 1])
    part = local_experts(ExpertWeights.of(module).local(first, stop), x_sorted[begin:end],
                         r.offsets[first:stop] - begin)
    torch.testing.assert_close(part, whole[begin:end])
    torch.testing.assert_close(combine(whole, r, weights, 2), eager(module, hidden, index, weights),
                               rtol=1e-5, atol=1e-5)


# -- Gaudi's fused op (fake runtime) -------------------------------------------------------------

def test_gaudi_inference_calls_the_fused_moe_op_as_documented(fake_hpu):
    from hputrain.accelerators.hpu import HPUAccelerator

    module = with_kernel(first_experts(build("mixtral")), HPUAccelerator("eager"))
    config = module.config
    hidden = torch.randn(TOKENS, config.hidden_size)
    index = routing("random", TOKENS, 2, module.num_experts)
    weights = torch.rand(TOKENS, 2)
    fake_hpu.calls.clear()
    with torch.no_grad():
        out = experts.experts_forward(module, hidden, index.int(), weights.double())
        expected = eager(module, hidden, index, weights)
    assert moe_calls(fake_hpu) == [("mixture_of_experts", {
        "routing_dtype": torch.int64, "weights_dtype": torch.float32, "experts": 8,
        "permuted_weights": True, "activation": "silu", "experts_min": 0, "experts_max": 7})]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # training (the op has no backward) and GPT-OSS's own gate run the grouped products
    fake_hpu.calls.clear()
    experts.experts_forward(module, hidden.requires_grad_(), index, weights)
    gpt_oss = with_kernel(first_experts(build("gpt_oss")), HPUAccelerator("eager"))
    with torch.no_grad():
        experts.experts_forward(gpt_oss, hidden, index, weights)
    assert moe_calls(fake_hpu) == []


def moe_calls(fake):
    return [call for call in fake.calls if call[0] == "mixture_of_experts"]


# -- lazy mode: one graph whatever the routing ----------------------------------------------------

@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "llama4_text"])
def test_lazy_graph_does_not_depend_on_the_routing(family):
    from torch._lazy import metrics

    accelerator = CPUAccelerator("lazy")
    device = accelerator.setup()
    model = build(family)
    kernels.substitute(model, accelerator, True)
    model.to(device)
    block = next(m for m in model.modules()
                 if hasattr(m, "has_gate") or isinstance(m, StaticLlama4TextMoe))
    config = model.config
    compiles = []
    for step, kind in enumerate(ROUTINGS * 2):
        hidden = torch.randn(TOKENS, config.hidden_size).to(device).requires_grad_()
        with accelerator.forward_context():
            if isinstance(block, StaticLlama4TextMoe):
                out = block(hidden)[0]
            else:
                index = routing(kind, TOKENS, config.num_experts_per_tok, block.num_experts, seed=step)
                weights = torch.rand(TOKENS, config.num_experts_per_tok)
                out = block(hidden, index.to(device), weights.to(device))
            out.sum().backward()
        accelerator.mark_step()
        compiles.append(accelerator.graph_compiles())
    assert compiles[1:] == [compiles[1]] * (len(compiles) - 1), compiles  # after the first step: none
    fallbacks = [name for name in metrics.counter_names() if name.startswith("aten::")]
    assert not [name for name in fallbacks if name.split("::")[1] in
                {"sort.stable", "index_add", "floor_divide", "histc", "nonzero", "bincount"}], fallbacks


# -- which of transformers' MoE families these tests cover ----------------------------------------

def moe_model_types():
    """transformers' model types whose modeling file defines an experts class (decorated with
    use_experts_implementation, or named *Experts), read as text (importing them all takes
    minutes): model type -> whether it uses the interface."""
    from pathlib import Path

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    models = Path(transformers.__file__).parent / "models"
    found = {}
    for model_type in CONFIG_MAPPING_NAMES:
        name = model_type_to_module_name(model_type)
        modeling = models / name / f"modeling_{name}.py"
        if not modeling.is_file():
            continue
        source = modeling.read_text()
        if "@use_experts_implementation" in source or re.search(r"^class \w+Experts\(", source, re.M):
            found[model_type] = "@use_experts_implementation" in source
    return found


# decoder MoE families whose experts do not go through the ExpertsInterface, and what becomes of them
OWN_EXPERTS = {
    "llama4": "served: its text model's Llama4TextMoe blocks are swapped (experts/llama4.py), "
              "tested as llama4_text",
    "dbrx": "not served: DbrxExperts runs its own per-expert loop outside the interface "
            "(routing-dependent shapes stay)",
    "jetmoe": "not served: JetMoe's ParallelExperts (and its mixture of attention heads) run "
              "their own ops outside the interface",
    "longcat_flash": "not served: LongcatFlashExperts has identity (zero-compute) experts and "
                     "its own loop outside the interface",
}


def test_transformers_moe_families_are_covered_or_named():
    """Every decoder MoE family of the installed transformers is tested here, or named with the
    reason; a new family whose experts bypass the interface fails until it is named."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = moe_model_types()
    assert set(FAMILIES) <= set(found)
    decoders = {t: interface for t, interface in found.items() if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}
    uncovered = {t: OWN_EXPERTS.get(t, "served through transformers' ExpertsInterface; no tiny folder "
                                      "of it is tested here") if interface or t in OWN_EXPERTS
                 else "NEW: its experts bypass the ExpertsInterface"
                 for t, interface in sorted(decoders.items()) if t not in FAMILIES}
    print(f"\n{len(decoders)} decoder MoE model types; not covered by tests/kinds/moe/test_experts.py:")
    for model_type, reason in uncovered.items():
        print(f"  {model_type}: {reason}")
    new = [t for t, reason in uncovered.items() if reason.startswith("NEW")]
    assert not new, f"decoder MoE families outside the ExpertsInterface, not named in OWN_EXPERTS: {new}"


# -- on an NVIDIA GPU: torch's grouped GEMM in bf16, the fixed-shape form in fp32 ------------------

@requires_cuda
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_experts_equal_transformers_eager(family, dtype):
    from hputrain.accelerators.cuda import CUDAAccelerator

    accelerator = CUDAAccelerator()
    device = accelerator.setup()
    module = with_kernel(first_experts(build(family, dtype=dtype).to(device)), accelerator)
    config = module.config
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(64, config.hidden_size, generator=g).to(device, dtype)
    index = routing("experts without a token", 64, config.num_experts_per_tok, module.num_experts).to(device)
    weights = torch.rand(64, config.num_experts_per_tok, generator=g).to(device, dtype)
    kernel = accelerator.grouped_mm_kernel(hidden, module.gate_up_proj)
    assert kernel is not None  # hidden 32 and intermediate 64 or 32: 16-byte strides
    theirs = outputs_and_grads(eager, module, hidden, index, weights)
    ours = outputs_and_grads(experts.experts_forward, module, hidden, index, weights)
    assert_same(ours, theirs, 1e-5 if dtype == torch.float32 else 2e-2)
