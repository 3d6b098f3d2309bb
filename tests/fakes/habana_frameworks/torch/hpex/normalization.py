"""Fake FusedClipNorm: same contract as the real one (clip in place, return the total norm)."""
import torch

from habana_frameworks import fake


class FusedClipNorm:
    def __init__(self, parameters, max_norm):
        fake.record("FusedClipNorm", {"max_norm": max_norm})
        self.max_norm = max_norm

    def clip_norm(self, parameters):
        fake.record("clip_norm")
        return torch.nn.utils.clip_grad_norm_(list(parameters), self.max_norm)
