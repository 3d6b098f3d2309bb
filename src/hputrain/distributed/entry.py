"""What `hputrain launch` runs in each process: the user's script (or `-m module`), under
torchelastic's error recording, so that a rank that raises is reported by the launcher with its
rank and its exception, not only an exit code."""
from __future__ import annotations

import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
