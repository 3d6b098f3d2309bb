"""The static-shape experts on an NVIDIA GPU (skipped elsewhere): torch's grouped GEMM is the kernel
in bf16, and it and the fixed-shape form give transformers' eager numbers; a whole model's step
equals the eager experts' on the GPU; torch.compile builds the experts' graph once whatever the
routing. Run where a GPU is lent (docs/moe.md has the figures of the last such run)."""
import copy

import pytest
import torch

from ...conftest import requires_cuda
from ...kinds.moe.test_experts import (ROUTINGS, TOKENS, assert_same, assert_same_step, build, eager, first_experts,
                           outputs_and_grads, routing)

pytestmark = requires_cuda

transformers = pytest.importorskip("transformers")


def accelerator():
    from hputrain.accelerators.cuda import CUDAAccelerator

    return CUDAAccelerator()


def on_gpu(module, dtype):
    from hputrain.execution import kernels

    module = module.to("cuda", dtype)
    module._hputrain_kernels = kernels._Kernels(accelerator(), {})
    return module


def randomised(module, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return module


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_experts_equal_eager_on_the_gpu(family, dtype, kind):
    from hputrain.kinds.moe import experts

    module = on_gpu(randomised(first_experts(build(family))), dtype)
    k = module.config.num_experts_per_tok
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(TOKENS * 8, module.config.hidden_size, generator=g).to("cuda", dtype)
    index = routing(kind, TOKENS * 8, k, module.num_experts).cuda()
    weights = torch.rand(TOKENS * 8, k, generator=g).to("cuda", dtype)
    theirs = outputs_and_grads(eager, module, hidden, index, weights)
    ours = outputs_and_grads(experts.experts_forward, module, hidden, index, weights)
    assert ours[0].dtype == dtype
    assert_same(ours, theirs, 1e-5 if dtype == torch.float32 else 3e-2)


def test_bf16_runs_torchs_grouped_gemm_on_the_gpu():
    x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(8, 32, 64, device="cuda", dtype=torch.bfloat16)
    assert accelerator().grouped_mm_kernel(x, weight) is not None
    # fp32 too where torch has F.grouped_mm (2.10 on); never for an unaligned operand
    fp32 = accelerator().grouped_mm_kernel(x.float(), weight.float())
    assert (fp32 is not None) == hasattr(torch.nn.functional, "grouped_mm")
    assert accelerator().grouped_mm_kernel(x[:, 1:], weight[:, 1:]) is None


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss"])
def test_a_whole_model_step_equals_eager_experts_on_the_gpu(family):
    from hputrain.execution import kernels

    theirs = build(family).cuda()
    ours = copy.deepcopy(theirs)
    theirs.set_experts_implementation("eager")
    assert kernels.substitute(ours, accelerator(), True)["experts: static"] > 0
    ids = torch.randint(0, theirs.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    assert_same_step(theirs, ours, ids.cuda(), grad_rtol=1e-4)


def test_compile_builds_the_experts_graph_once_whatever_the_routing():
    from torch._dynamo.utils import counters

    from hputrain.kinds.moe import experts

    module = on_gpu(randomised(first_experts(build("mixtral"))), torch.bfloat16)
    k = module.config.num_experts_per_tok
    compiled = torch.compile(lambda h, i, w: experts.experts_forward(module, h, i, w), fullgraph=True)
    torch._dynamo.reset()
    counters.clear()
    for step, kind in enumerate(ROUTINGS * 2):
        hidden = torch.randn(TOKENS * 8, module.config.hidden_size, device="cuda", dtype=torch.bfloat16)
        index = routing(kind, TOKENS * 8, k, module.num_experts, seed=step).cuda()
        weights = torch.rand(TOKENS * 8, k, device="cuda", dtype=torch.bfloat16)
        compiled(hidden, index, weights).float().sum().item()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ["random", "one peer"])
def test_gpt_oss_under_expert_parallelism_through_the_cuda_kernel(monkeypatch, dtype, routing):
    """Issue 47 item 2 on the GPU: GPT-OSS's biased experts split over 2 ranks (threads), each
    computing its received rows with hputrain's static experts on torch's CUDA grouped GEMM,
    which leaves the rows past the last offset (the empty receive slots) uninitialised in its
    output and in backward's input gradient: no NaN anywhere, and the outputs and every gradient
    (the last local expert's gate_up_proj_bias included) equal the whole module's: in fp32 within
    1e-5, in bf16 within 2% of each tensor's norm of the fp32 module's (bf16 sums the ranks' rows
    in another grouping than one module does)."""
    from hputrain.execution import kernels

    from ...kinds.moe.test_expert_parallel import Case, assert_equals_the_whole, in_threads, whole_experts

    whole = whole_experts("gpt_oss", dtype=dtype).cuda()
    case = Case.random(whole, (48, 32), routing)
    results = in_threads(monkeypatch, whole, case, "hputrain", device="cuda",
                         kernels=lambda: kernels._Kernels(accelerator(), {}))
    x = case.inputs[0].to("cuda", dtype)
    assert accelerator().grouped_mm_kernel(x, whole.gate_up_proj) is not None  # torch's kernel ran
    for result in results:
        assert all(torch.isfinite(g).all() for g in (result.out, result.x, result.w, *result.params.values()))
    if dtype == torch.float32:
        return assert_equals_the_whole(whole, case, results)
    reference = whole_experts("gpt_oss").cuda()
    reference.config._experts_implementation = "grouped_mm"
    for rank, result in enumerate(results):
        x = case.inputs[rank].cuda().requires_grad_()
        w = case.weights[rank].cuda().requires_grad_()
        out = reference(x, case.index[rank].cuda(), w)
        out.backward(torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out))
        for ours, theirs in ((result.out, out), (result.x, x.grad), (result.w, w.grad)):
            assert (ours.float() - theirs).norm() <= 0.02 * theirs.norm()
    for name, param in reference.named_parameters():
        split = torch.cat([result.params[name] for result in results]).float()
        assert (split - param.grad).norm() <= 0.02 * param.grad.norm(), name
