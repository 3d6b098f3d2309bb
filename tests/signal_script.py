"""A tiny worker for the launcher's signal and failure tests, started by `hputrain launch` (it
imports nothing heavy). Each rank writes MASTER_ADDR:MASTER_PORT to OUT/env-RANK and its
pid to OUT/pid-RANK, then waits.

    signal_script.py OUT wait              SIGTERM / SIGINT: pause (a stand-in for saving a
                                           checkpoint), write OUT/stopped-RANK, exit 128 + signal,
                                           as the Trainer does
    signal_script.py OUT fail RANK [CODE]  RANK prints an error line and exits CODE (default 3);
                                           the others wait
    signal_script.py OUT exit CODES        every rank R prints an error line and exits CODES[R]
                                           (comma-separated: 2,1), whatever signal comes
    signal_script.py OUT exit CODES alike  the same, every rank with the same line
"""
import os
import signal
import sys
import time


def main(out: str, mode: str, *how: str) -> int:
    rank = int(os.environ["RANK"])
    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: stop.append(signum))
    with open(os.path.join(out, f"env-{rank}"), "w") as f:
        f.write(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    with open(os.path.join(out, f"pid-{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(out, f"pid-{rank}.tmp"), os.path.join(out, f"pid-{rank}"))
    if mode == "exit" or (mode == "fail" and rank == int(how[0])):
        if mode == "exit":  # every rank's handlers are in place (its pid file written): none dies of SIGTERM
            world = int(os.environ["WORLD_SIZE"])
            while not all(os.path.exists(os.path.join(out, f"pid-{r}")) for r in range(world)):
                time.sleep(0.05)
        time.sleep(0.5)
        print("first line of the error", file=sys.stderr)
        print(("" if "alike" in how else f"rank {rank}: ") + "the data set is empty", file=sys.stderr)
        return int(how[0].split(",")[rank]) if mode == "exit" else int((how[1:] or ["3"])[0])
    deadline = time.monotonic() + 120
    while not stop and time.monotonic() < deadline:
        time.sleep(0.05)
    if not stop:
        return 1
    time.sleep(1)  # "saving"
    with open(os.path.join(out, f"stopped-{rank}"), "w") as f:
        f.write(str(stop[0]))
    return 128 + stop[0]


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
