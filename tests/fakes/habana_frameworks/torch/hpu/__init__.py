"""Fake habana_frameworks.torch.hpu."""
from habana_frameworks import fake

from . import ops, random  # noqa: F401


def is_available() -> bool:
    fake.record("is_available")
    return fake.available


def device_count() -> int:
    return fake.device_count if fake.available else 0


def get_device_name() -> str:
    return fake.device_name


def memory_stats(device=None) -> dict:
    fake.record("memory_stats")
    return dict(fake.memory)


def synchronize() -> None:
    fake.record("synchronize")


def wrap_in_hpu_graph(module, *args, **kwargs):
    fake.record("wrap_in_hpu_graph", type(module).__name__)
    module.hpu_graph_wrapped = True
    return module


class ModuleCacher:
    """Fake HPU graphs for training: records the wrap and returns the module itself."""

    def __init__(self, max_graphs=10):
        self.max_graphs = max_graphs

    def __call__(self, model, inplace=True, **kwargs):
        fake.record("ModuleCacher", {"max_graphs": self.max_graphs, "inplace": inplace})
        return model
