"""`--overwrite-output-dir` stopped by SIGTERM, again and again, at a moment that moves from run to
run (issue 46, item 2): an earlier run (checkpoints, final/, logs, plots) lies in output_dir, and a
new run that starts over in it is stopped during start-up, after it set the earlier run aside but
before its first step, or while training (the stop then saves a checkpoint). Whatever the moment,
each run must exit 143 and leave one of:

- untouched: output_dir byte for byte as the earlier run left it (stopped before it was read);
- kept: the earlier run whole, byte for byte, in .overwritten/run-1, and no advice to resume;
- saved: a checkpoint of the new run, the earlier run gone, and the advice to resume.

    python bench/overwrite_loop.py [--runs 20] [--first 1.6] [--last 3.9] [--out DIR]

The n-th SIGTERM goes `first + (last - first) * n / (runs - 1)` seconds after the start; the
defaults span the three outcomes on a 2-core machine. Every run's output is kept in
OUT/run-NN.log. Prints one line per run and the tally; exits 1 if any run failed.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--cpu", "--seq-len", "32", "--max-corpus-bytes", "20000", "--per-device-train-batch-size",
        "4", "--logging-steps", "5", "--disable-tqdm"]
RESUME = "resume with --resume-from-checkpoint latest"


def hputrain(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hputrain.cli", *args], cwd=ROOT, **popen)


def files(folder: Path) -> dict[str, str]:
    """The run's files by path, with a hash of each (the lock and the data cache left out)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".hputrain.lock"
            and ".cache" not in p.relative_to(folder).parts}


def outcome(out: Path, earlier: dict, log: str) -> str | None:
    """"untouched", "kept" or "saved ..." (see the docstring); None: the run lost something."""
    aside = out / ".overwritten"
    if files(out) == earlier:
        return "untouched"
    if aside.is_dir():
        whole = files(aside / "run-1") == earlier and [p.name for p in aside.iterdir()] == ["run-1"]
        return "kept" if whole and RESUME not in log else None
    saved = sorted(p.name for p in out.glob("checkpoint-*"))
    return f"saved {' '.join(saved)}" if saved and RESUME in log else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--first", type=float, default=1.6)
    parser.add_argument("--last", type=float, default=3.9)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out_root = args.out or Path(tempfile.mkdtemp(prefix="overwrite-loop-"))
    out_root.mkdir(parents=True, exist_ok=True)
    base = out_root / "earlier"
    shutil.rmtree(base, ignore_errors=True)
    assert hputrain("train", *TINY, "--max-steps", "4", "--save-steps", "2", "--output-dir",
                    str(base), stdout=subprocess.DEVNULL).wait() == 0, "the earlier run failed"
    earlier, failed = files(base), 0
    for n in range(args.runs):
        delay = args.first + (args.last - args.first) * n / max(1, args.runs - 1)
        run = out_root / "run"
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(base, run)
        log_file = out_root / f"run-{n:02d}.log"
        with open(log_file, "w") as log:
            process = hputrain("train", *TINY, "--max-steps", "100000", "--save-steps", "50",
                               "--overwrite-output-dir", "--output-dir", str(run), stdout=log,
                               stderr=subprocess.STDOUT)
            time.sleep(delay)
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=120)
        said = outcome(run, earlier, log_file.read_text())
        ok = code in (143, -signal.SIGTERM) and said is not None
        failed += not ok
        print(f"run {n:2d}: SIGTERM after {delay:.2f} s, exit {code}: "
              f"{said or 'the earlier run is not whole'}{'' if ok else '  FAILED'}", flush=True)
    print(f"{args.runs - failed}/{args.runs} runs kept or replaced the earlier run whole "
          f"(logs in {out_root})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
