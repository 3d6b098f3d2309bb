"""`hputrain ARGS` in a worker of `hputrain launch --max-restarts N` whose first attempt fails
before the run begins (exit 1, as a transient error would), so that the restart, not the first
attempt, decides where the run starts (test_run_start.py).

`fail_first_attempt_script.py ARGS...`"""
import os
import sys

from hputrain.cli import main

if __name__ == "__main__":
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        sys.exit("a transient failure before the run began")  # exit 1: restarted
    sys.exit(main(sys.argv[1:]))
