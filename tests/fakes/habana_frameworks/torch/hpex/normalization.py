"""Fake hpex.normalization: FusedClipNorm (same contract as the real one: clip in place, return
the total norm) and FusedRMSNorm (apply(x, weight, eps), computed on the CPU as transformers'
RMSNorm computes it)."""
import torch

from habana_frameworks import fake


class FusedClipNorm:
    def __init__(self, parameters, max_norm):
        fake.record("FusedClipNorm", {"max_norm": max_norm})
        self.max_norm = max_norm

    def clip_norm(self, parameters):
        fake.record("clip_norm")
        return torch.nn.utils.clip_grad_norm_(list(parameters), self.max_norm)


class FusedRMSNorm:
    @staticmethod
    def apply(x, weight, eps):
        fake.record("FusedRMSNorm", {"eps": eps, "dtypes": (x.dtype, weight.dtype)})
        if x.dtype != weight.dtype:
            raise RuntimeError("fake FusedRMSNorm: input and weight dtypes differ")
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(x.dtype)
