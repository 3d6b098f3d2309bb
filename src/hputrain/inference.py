"""Graph-captured inference and generation for your own code: the public path of
execution/inference.py (the mechanism) that `hputrain generate` and Trainer's
use_graphs_for_inference use."""
from .execution.inference import Generator, GraphedModel, wrap_for_inference

__all__ = ["GraphedModel", "Generator", "wrap_for_inference"]
