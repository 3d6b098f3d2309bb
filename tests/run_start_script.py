"""`hputrain ARGS` in a worker of `hputrain launch`, with one timing forced (test_run_start.py):
rank 0's error line is recorded only SECONDS after its refusal, so every other rank reaches the
same refusal first and must wait for it instead of ending the job with its own line.

`run_start_script.py SECONDS ARGS...`"""
import os
import sys
import time

from hputrain.cli import main
from hputrain.distributed import failure

if __name__ == "__main__":
    seconds = float(sys.argv[1])
    if os.environ.get("RANK") == "0":
        said = failure.say

        def late(line: str, status: int) -> None:
            time.sleep(seconds)
            said(line, status)

        failure.say = late
    sys.exit(main(sys.argv[2:]))
