"""`hputrain report RUN_DIR`: PNG plots of loss, throughput and memory from RUN_DIR/metrics.jsonl.
A GRPO run's (its records have a reward) plots its reward instead of its loss, which is near 0 by
construction (the advantages of a group sum to 0), so says nothing of what it learns. A mixture
of experts' run (kinds/moe/router.py) also gets router.png: its router loss (aux_loss,
eval_aux_loss) and, per MoE layer, the busiest expert's load over the mean (router/max_load.layerN)
and the share of experts no token picked (router/dead_experts.layerN).

matplotlib is imported only when a plot is drawn (it is the optional `hputrain[plot]` extra), and
through `matplotlib.figure.Figure` rather than pyplot: a bare Figure renders with Agg, is never
registered with pyplot, and so needs no global backend switch and leaves nothing open to close.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..callbacks.writers import METRICS_FILE
from ..errors import InputError

# Which kind of record a line is, told by a key only that kind carries.
_KIND_KEYS = (("loss", "train"), ("eval_loss", "eval"), ("train_runtime", "summary"))

# Series name -> (record kind, key). The series name is the key, except where kinds share one.
_SERIES = {
    "loss": ("train", "loss"),
    "eval_loss": ("eval", "eval_loss"),
    "reward": ("train", "reward"),
    "eval_reward": ("eval", "eval_reward"),
    "tokens_per_second": ("train", "tokens_per_second"),
    "memory_allocated_gb": ("train", "memory_allocated_gb"),
    "max_memory_allocated_gb": ("train", "max_memory_allocated_gb"),
    "total_memory_available_gb": ("train", "total_memory_available_gb"),
    "aux_loss": ("train", "aux_loss"),
    "eval_aux_loss": ("eval", "eval_aux_loss"),
}

ROUTER_PREFIX = "router/"
"""Training series named by their key as it is (one per MoE layer: router/max_load.layer0, ...)."""


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl file, in file order; blank lines are skipped, and so is an
    unfinished last line (no newline, not valid JSON: a run killed while writing it)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file (is this a run directory?)") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc}") from None
    lines = text.split("\n")  # the last item is "" after a final newline, else an unfinished line
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                continue
            raise InputError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise InputError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def _kind(record: dict) -> str | None:
    return next((kind for key, kind in _KIND_KEYS if key in record), None)


def series(records: list[dict]) -> dict[str, tuple[list, list]]:
    """Name -> (steps, values), sorted by step, for every series with at least one value.

    A resumed run appends records after its restart, so a step can appear more than once: the last
    record of a kind for a step wins. Null, missing and non-numeric values are dropped (throughput
    is null during warm-up), so a series lists only the points that can be drawn."""
    latest: dict[str, dict[int, dict]] = {"train": {}, "eval": {}}
    for record in records:
        kind = _kind(record)
        if kind in latest and isinstance(record.get("step"), int):
            latest[kind][record["step"]] = record
    out = {}
    router = sorted({key for record in latest["train"].values() for key in record
                     if key.startswith(ROUTER_PREFIX)}, key=_layer_order)
    for name, (kind, key) in [*_SERIES.items(), *((key, ("train", key)) for key in router)]:
        points = [(step, record[key]) for step, record in sorted(latest[kind].items())
                  if isinstance(record.get(key), (int, float)) and not isinstance(record[key], bool)]
        if points:
            steps, values = zip(*points)
            out[name] = (list(steps), list(values))
    return out


def _layer_order(key: str) -> tuple:
    """router/max_load.layer10 after router/max_load.layer9."""
    name, _, layer = key.rpartition(".layer")
    return (name, int(layer)) if layer.isdigit() else (key, -1)


def _figure(title: str, ylabel: str):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _train_and_eval(data: dict, title: str, name: str, ylabel: str):
    """A figure of `name`'s training series (a line) and its eval_ one (points), the legend
    left to the caller."""
    fig, ax = _figure(f"{title}: {name}", ylabel)
    if name in data:
        ax.plot(*data[name], label=f"train {name}", linewidth=1)
    if f"eval_{name}" in data:
        ax.plot(*data[f"eval_{name}"], "o-", label=f"eval {name}", markersize=4)
    return fig, ax


def _plot_loss(data: dict, title: str):
    fig, ax = _train_and_eval(data, title, "loss", "loss")
    values = [v for name in ("loss", "eval_loss") for v in data.get(name, ((), ()))[1]]
    if all(v > 0 for v in values if math.isfinite(v)):
        from matplotlib.ticker import FuncFormatter, LogFormatter

        ax.set_yscale("log")  # plain numbers ("3", "0.1"), not the default "3x10^0"
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    ax.legend()
    return fig


def _plot_reward(data: dict, title: str):
    fig, ax = _train_and_eval(data, title, "reward",
                              "reward (weighted sum of the reward functions)")
    ax.legend()
    return fig


def _plot_throughput(data: dict, title: str):
    fig, ax = _figure(f"{title}: throughput", "tokens / s")
    ax.plot(*data["tokens_per_second"], linewidth=1)
    ax.set_ylim(bottom=0)
    return fig


def _plot_memory(data: dict, title: str):
    fig, ax = _figure(f"{title}: device memory", "GB")
    for name, label in (("memory_allocated_gb", "allocated"),
                        ("max_memory_allocated_gb", "max allocated")):
        if name in data:
            ax.plot(*data[name], label=label, linewidth=1)
    if "total_memory_available_gb" in data:
        total = data["total_memory_available_gb"][1][-1]
        ax.axhline(total, linestyle="--", color="gray", label=f"total ({total:g} GB)")
    ax.set_ylim(bottom=0)
    ax.legend()
    return fig


def _plot_router(data: dict, title: str):
    """Three panels: the router loss, the busiest expert's load per layer, the dead experts' share."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, 9), dpi=100, layout="constrained")
    loss, load, dead = fig.subplots(3, 1, sharex=True)
    loss.set_title(f"{title}: router")
    for name, style in (("aux_loss", "-"), ("eval_aux_loss", "o-")):
        if name in data:
            loss.plot(*data[name], style, label=name.replace("_", " "), linewidth=1, markersize=4)
    loss.set_ylabel("load-balancing loss")
    for ax, metric, ylabel in ((load, "max_load", "busiest expert / mean"),
                               (dead, "dead_experts", "experts with no token")):
        for name in (n for n in data if n.startswith(f"{ROUTER_PREFIX}{metric}.")):
            ax.plot(*data[name], label=name.rpartition(".")[2], linewidth=1)
        ax.set_ylabel(ylabel)
    load.axhline(1.0, linestyle="--", color="gray", linewidth=0.8)  # perfectly balanced
    dead.set_ylim(-0.02, 1.02)
    dead.set_xlabel("step")
    dead.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (loss, load, dead):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", ncol=4)
    return fig


def _has_router(data: dict) -> bool:
    return any(name.startswith(ROUTER_PREFIX) or name.endswith("aux_loss") for name in data)


# File name -> (series that must have data for the plot to be drawn, drawing function).
_PLOTS = (
    ("reward.png", ("reward", "eval_reward"), _plot_reward),
    ("loss.png", ("loss", "eval_loss"), _plot_loss),
    ("throughput.png", ("tokens_per_second",), _plot_throughput),
    ("memory.png", ("memory_allocated_gb", "max_memory_allocated_gb"), _plot_memory),
    ("router.png", ("aux_loss", "eval_aux_loss"), _plot_router),
)
PLOT_FILES = tuple(filename for filename, _, _ in _PLOTS)  # what write_report may write


def write_report(run_dir: str | Path) -> list[Path]:
    """Write loss.png (reward.png for a run that logs a reward: GRPO), throughput.png,
    memory.png and a mixture of experts' router.png into run_dir from its metrics.jsonl; a plot with no data is skipped. Returns the
    paths written."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run directory")
    data = series(read_metrics(run_dir / METRICS_FILE))
    try:
        import matplotlib  # noqa: F401  (only to fail early with a clear message)
    except ImportError:
        raise InputError("plots need matplotlib: pip install matplotlib "
                         "(or pip install 'hputrain[plot]')") from None
    title = run_dir.resolve().name
    written = []
    rewarded = "reward" in data or "eval_reward" in data
    for filename, needs, draw in _PLOTS:
        if filename == "loss.png" and rewarded:
            continue  # GRPO's loss is near 0 by construction: its reward is what it learns
        if any(name in data for name in needs) or (filename == "router.png" and _has_router(data)):
            path = run_dir / filename
            draw(data, title).savefig(path)
            written.append(path)
    return written
