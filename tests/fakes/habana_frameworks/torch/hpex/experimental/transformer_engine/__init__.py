"""Fake Intel Gaudi Transformer Engine: te.Linear is an nn.Linear that records whether it ran
inside fp8_autocast, and fp8_autocast records the recipe it was given."""
import contextlib

import torch

from habana_frameworks import fake

from . import recipe  # noqa: F401  (the real package exposes it as te.recipe)

_active: list = []  # the recipes of the fp8_autocast blocks entered and not yet left


class Linear(torch.nn.Linear):
    def __init__(self, in_features, out_features, bias=True, **kw):
        fake.record("te.Linear", {"in_features": in_features, "out_features": out_features, "bias": bias})
        super().__init__(in_features, out_features, bias=bias)

    def forward(self, x):
        fake.record("te.Linear.forward", {"fp8": bool(_active)})
        return super().forward(x)


@contextlib.contextmanager
def fp8_autocast(enabled=True, fp8_recipe=None, **kw):
    fake.record("fp8_autocast", {"enabled": enabled, "recipe": fp8_recipe})
    _active.append(fp8_recipe)
    try:
        yield
    finally:
        _active.pop()
