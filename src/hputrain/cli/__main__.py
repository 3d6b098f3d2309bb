"""`python -m hputrain.cli ...`: the same as the `hputrain` command."""
from . import run

run()
