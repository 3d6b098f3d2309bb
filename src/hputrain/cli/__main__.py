"""`python -m hputrain.cli ...`: the same as the `hputrain` command."""
import sys

from . import main

sys.exit(main())
