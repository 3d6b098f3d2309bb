"""Fake habana_frameworks.torch: the real one reads its environment once, here, at first import."""
import os

from habana_frameworks import fake

fake.record("import", {key: os.environ.get(key) for key in ("PT_HPU_LAZY_MODE", "PT_ENABLE_INT64_SUPPORT")})
fake.import_env = {key: value for key, value in os.environ.items() if key.startswith("PT_HPU_")}

from . import core, hpu  # noqa: E402,F401  (the real package imports these too)
