"""`hputrain report RUN_DIR`: PNG plots of a run's loss, throughput and memory (training/report.py)."""
from __future__ import annotations

from pathlib import Path

from ..callbacks.writers import METRICS_FILE
from ..training.report import write_report


def cmd_report(args) -> int:
    written = write_report(args.run_dir)
    for path in written:
        print(path)
    if not written:
        print(f"nothing to plot: {Path(args.run_dir) / METRICS_FILE} has no training records yet")
    return 0


def add_report_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="plot loss, throughput and memory of a run as PNGs")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory holding metrics.jsonl")
    p.set_defaults(func=cmd_report)
