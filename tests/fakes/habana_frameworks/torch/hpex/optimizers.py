"""Fake FusedAdamW: torch's AdamW underneath, with Gaudi's eps default of 1e-6."""
import torch

from habana_frameworks import fake


class FusedAdamW(torch.optim.AdamW):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, **kw):
        fake.record("FusedAdamW", {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
