"""The stand-in's habana_frameworks.torch.hpex (rehearsal/standin_hpex.py): each fused op, run on
the hpu device of the rehearsal (the CPU's lazy backend), computes what torch computes on the CPU:
FusedAdamW torch's AdamW with the same eps, FusedClipNorm clip_grad_norm_, FusedSDPA
scaled_dot_product_attention."""
import pytest
import torch
import torch.nn.functional as F

from hputrain.rehearsal.standin import NOT_COVERED, StandIn


@pytest.fixture
def hpex():
    with StandIn():
        import habana_frameworks.torch.hpex.kernels as kernels
        import habana_frameworks.torch.hpex.normalization as normalization
        import habana_frameworks.torch.hpex.optimizers as optimizers

        yield optimizers, normalization, kernels


def grads_of(model, step):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=g) * 10 ** (step % 3) for p in model.parameters()]


def test_fused_adamw_is_torch_s_adamw_with_gaudi_s_eps(hpex):
    optimizers, _, _ = hpex
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    model.load_state_dict(reference.state_dict())
    model.to("hpu")
    fused = optimizers.FusedAdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)
    assert fused.defaults["eps"] == 1e-6  # Gaudi's default, not torch's 1e-8
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    for step in range(1, 6):
        for p, q, g in zip(model.parameters(), reference.parameters(), grads_of(reference, step)):
            p.grad, q.grad = g.to("hpu"), g.clone()
        fused.step()
        torch_adamw.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-6, atol=1e-7)
    with pytest.raises(NotImplementedError, match=NOT_COVERED):
        optimizers.FusedAdamW(model.parameters(), moments_dtype=torch.bfloat16)


def test_fused_clip_norm_is_clip_grad_norm(hpex):
    _, normalization, _ = hpex
    for max_norm in (0.5, 1e6):  # clipped, and left alone
        reference = torch.nn.Linear(7, 4)
        model = torch.nn.Linear(7, 4).to("hpu")
        for p, q, g in zip(model.parameters(), reference.parameters(), grads_of(reference, 2)):
            p.grad, q.grad = g.to("hpu"), g.clone()
        norm = normalization.FusedClipNorm(model.parameters(), max_norm).clip_norm(model.parameters())
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        torch.testing.assert_close(norm.cpu(), expected)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad)


@pytest.mark.parametrize("case", ["causal", "boolean mask", "additive mask", "scale and fast softmax"])
def test_fused_sdpa_is_scaled_dot_product_attention(hpex, case):
    _, _, kernels = hpex
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g) for _ in range(3))
    mask = torch.rand(2, 1, 5, 5, generator=g) > 0.4
    mask[..., 0] = True
    args = {"causal": (None, 0.0, True), "boolean mask": (mask, 0.0, False),
            "additive mask": (torch.randn(2, 1, 5, 5, generator=g), 0.0, False),
            "scale and fast softmax": (None, 0.0, False, 0.3, "fast")}[case]
    out = kernels.FusedSDPA.apply(q.to("hpu"), k.to("hpu"), v.to("hpu"),
                                  *(a.to("hpu") if isinstance(a, torch.Tensor) else a for a in args))
    mask, dropout, causal, *scale = args
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                              scale=scale[0] if scale else None)
    torch.testing.assert_close(out.cpu(), expected)
