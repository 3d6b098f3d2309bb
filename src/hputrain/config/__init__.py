"""Settings, declared once: TrainingArguments (the flat, Hugging Face-compatible fields) and the
small section each subsystem takes from it (sections.py), AcceleratorConfig (GaudiConfig files),
the names they take (names.py), the Hugging Face / Optimum vocabulary hputrain refuses with one
line (vocabulary.py), saved launch defaults (defaults.py) and flags derived from the dataclasses
(flags.py). A leaf: imports nothing of hputrain but errors."""
from .accelerator_config import AcceleratorConfig
from .arguments import TrainingArguments
from .fields import ConfigError

__all__ = ["AcceleratorConfig", "ConfigError", "TrainingArguments"]
