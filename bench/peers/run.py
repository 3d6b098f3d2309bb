"""Peers: the same small language model, data and settings trained by a hand-written PyTorch loop,
hputrain's Trainer, the Hugging Face Trainer, Lightning's Trainer and Accelerate; median step time
after warm-up, interleaved repeats, ratios to the hand-written loop.

    python3 bench/peers/run.py [--steps 200] [--repeats 7] [--no-bf16] [--size tiny] [--update-docs]

One command on a fresh machine: unless it already runs there, the script makes its own virtual
environment, bench/peers/.venv, installs torch==2.13.0 first (alone, so that nothing pulls another
build), then the peers at pinned versions and hputrain itself (editable, with matplotlib for the
plot), and runs itself again inside it. The peers are never dependencies of hputrain.

Each framework trains in its own process, once per repeat, in the order loop, hputrain, hf,
lightning, accelerate, loop, ... so that drift in the machine hits all alike. Step times come from
inside the model (frameworks.Probe), so start-up and the end of the run do not count. What each
run actually did (autocast dtype, optimizer, learning rates, clipped gradient norms, forward calls)
is checked to be the same across frameworks before the table is printed.

Writes bench/peers/results/ (results.json, results.md, one log per run) and docs/peers.png;
--update-docs also puts results.md into docs/benchmarks.md between the peers markers.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENV = HERE / ".venv"
# Exactly the Makefile's pin, which our machines' pip resolves to the CPU build; a looser one lets
# pip fetch a newer CUDA build of several GB.
TORCH = "torch==2.13.0"
PEERS = ("transformers==5.23.0", "accelerate==1.15.0", "lightning==2.6.6")
ORDER = ("loop", "hputrain", "hf", "lightning", "accelerate")
DOCS = REPO / "docs" / "benchmarks.md"
MARKERS = ("<!-- peers-results:begin -->", "<!-- peers-results:end -->")
# What hputrain's CPU accelerator sets with mallopt; see --malloc.
SAME_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 * 1024**2), "MALLOC_TRIM_THRESHOLD_": str(256 * 1024**2)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=10, help="first steps left out of the timing")
    p.add_argument("--repeats", type=int, default=7, help="interleaved runs of every framework")
    p.add_argument("--size", default="tiny", help="built-in GPT size: tiny, small, base")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 autocast (default) or fp32")
    p.add_argument("--lr-warmup", type=int, default=10, help="steps of linear learning-rate warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--frameworks", nargs="+", choices=ORDER, default=list(ORDER))
    p.add_argument("--malloc", choices=("same", "as-is"), default="same",
                   help="same: every run gets the fixed glibc malloc thresholds that hputrain sets "
                        "for itself on the CPU, so the table compares frameworks, not heap layouts; "
                        "as-is: each process keeps its own malloc behaviour")
    p.add_argument("--out", type=Path, default=HERE / "results", help="results.json, results.md, logs")
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "peers.png")
    p.add_argument("--update-docs", action="store_true",
                   help=f"write results.md into {DOCS.relative_to(REPO)} between the peers markers")
    p.add_argument("--worker", choices=ORDER, help=argparse.SUPPRESS)  # one run, in a child process
    p.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.steps < opts.warmup + 3:
        p.error(f"--steps must leave at least 3 timed steps after --warmup {opts.warmup}")
    return opts


# -- the virtual environment ------------------------------------------------------------------------

def ensure_venv() -> None:
    """Run inside bench/peers/.venv, making it first if needed (or if the pins changed)."""
    if Path(sys.prefix).resolve() == VENV.resolve():
        return
    python = VENV / "bin" / "python"
    stamp = VENV / ".installed"
    wanted = "\n".join((TORCH, *PEERS, f"-e {REPO}[plot]")) + "\n"
    if not (python.exists() and stamp.exists() and stamp.read_text() == wanted):
        print(f"setting up {VENV.relative_to(REPO)}: {TORCH}, then {', '.join(PEERS)}, hputrain",
              flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, TORCH], check=True)
        # torch pinned again, so that no peer's requirement can swap the build installed above.
        subprocess.run([*pip, TORCH, *PEERS, "-e", f"{REPO}[plot]"], check=True)
        stamp.write_text(wanted)
    os.execv(python, [str(python), str(Path(__file__).resolve()), *sys.argv[1:]])


# -- one run (child process) ------------------------------------------------------------------------

def worker(opts) -> None:
    sys.path.insert(0, str(HERE.parent))  # bench/common.py
    from common import model_and_data

    from frameworks import measure

    _, data = model_and_data(opts)  # the first 4 MB of the standard library, windows of seq_len
    opts.record.write_text(json.dumps(measure(opts.worker, data, opts)))


def run_one(name: str, repeat: int, opts) -> dict:
    """Train with one framework in a child process; its output goes to a log file."""
    record = opts.out / f"{repeat}-{name}.json"
    log = opts.out / "logs" / f"{repeat}-{name}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if opts.malloc == "same":
        env.update(SAME_MALLOC)
    command = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--worker", name,
               "--record", str(record)]
    started = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        sys.exit(f"{name} failed (repeat {repeat + 1}, exit {done.returncode}); end of {log}:\n{tail}")
    result = json.loads(record.read_text())
    result["wall_seconds"] = time.perf_counter() - started
    record.unlink()
    return result


# -- the parent: repeats, checks, table, plot --------------------------------------------------------

def main() -> None:
    opts = parse_args()
    ensure_venv()
    if opts.worker:
        return worker(opts)
    fall_back_to_fp32(opts)
    runs = measure_all(opts)
    report = markdown(runs, opts, check_same_settings(runs, opts))
    print("\n" + report)
    (opts.out / "results.md").write_text(report)
    (opts.out / "results.json").write_text(json.dumps(
        {"machine": machine(), "command": command_line(), "settings": settings(opts), "runs": runs}))
    plot(runs, opts)
    if opts.update_docs:
        update_docs(report)
    print(f"wrote {opts.out / 'results.md'}, {opts.out / 'results.json'}, {opts.plot}"
          + (f", {DOCS}" if opts.update_docs else ""))


def fall_back_to_fp32(opts) -> None:
    """fp32 where the CPU only emulates bf16 (tens of times slower: the bf16 runs would not
    finish), saying so; the workers get --no-bf16 and the recorded command shows it."""
    if not opts.bf16 or opts.device != "cpu":
        return
    from hputrain.accelerators.cpu import CPUAccelerator

    cpu = CPUAccelerator()
    if not cpu.native_bf16():
        print(f"note: {cpu.bf16_shortfall()}: running in fp32 instead", flush=True)
        opts.bf16 = False
        sys.argv.append("--no-bf16")


def measure_all(opts) -> dict[str, list[dict]]:
    """Every framework once per repeat, interleaved; each run's record plus its median step."""
    sys.path.insert(0, str(HERE.parent))
    from common import median_step

    (opts.out / "logs").mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {n: [] for n in ORDER if n in opts.frameworks}
    for repeat in range(opts.repeats):
        for name, results in runs.items():
            result = run_one(name, repeat, opts)
            result["median_step"] = median_step(result["stamps"], opts.warmup)
            results.append(result)
            print(f"repeat {repeat + 1}/{opts.repeats}  {name:<10} "
                  f"{result['median_step'] * 1e3:7.2f} ms/step  loss {result['final_loss']:.3f}  "
                  f"{result['page_faults_per_step']:.0f} page faults/step  {result['wall_seconds']:.1f} s in all",
                  flush=True)
    return runs


def check_same_settings(runs: dict[str, list[dict]], opts) -> list[str]:
    """Differences between what the frameworks actually did (each compared with the first)."""
    first_name = next(iter(runs))
    first = runs[first_name][0]
    problems = []
    for name, results in runs.items():
        for r in results:
            if r["forward_calls"] != opts.steps:
                problems.append(f"{name}: {r['forward_calls']} forward calls for {opts.steps} steps")
            if max(r["clipped_norms"]) > 1.0 + 1e-3:
                problems.append(f"{name}: gradient norm {max(r['clipped_norms']):.3f} reached the optimizer")
        r = results[0]
        for key in ("autocast", "optimizer", "threads"):
            if r[key] != first[key]:
                problems.append(f"{name}: {key} {r[key]} differs from {first_name}'s {first[key]}")
        lrs, first_lrs = r["lrs"], first["lrs"]
        if len(lrs) != len(first_lrs) or any(abs(a - b) > 1e-9 for a, b in zip(lrs, first_lrs)):
            problems.append(f"{name}: learning rates differ from {first_name}'s")
    return sorted(set(problems))


def machine() -> str:
    import importlib.metadata as md

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no accelerator"
    from hputrain.accelerators.cpu import CPUAccelerator

    bf16 = CPUAccelerator().bf16_facts()  # what decides bf16 on this CPU
    cpu += (f" (native bf16 {'yes' if bf16['native_bf16'] else 'no'}; flags "
            f"{' '.join(bf16['cpu_flags'] or ['unknown'])}; torch capability {bf16['cpu_capability']})")
    versions = ", ".join(f"{p} {md.version(p)}" for p in ("torch", "transformers", "accelerate", "lightning",
                                                          "hputrain"))
    return (f"{cpu}, {os.cpu_count()} cores, {memory:.0f} GiB, {device}; {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}, {torch.get_num_threads()} "
            f"torch threads; {versions}")


def command_line() -> str:
    args = " ".join(a for a in sys.argv[1:])
    return f"python3 bench/peers/run.py {args}".strip()


def settings(opts) -> str:
    from frameworks import CLIP, EPS, LOG_EVERY, LR, WEIGHT_DECAY

    return (f"built-in GPT {opts.size}, sequence {opts.seq_len}, batch {opts.batch}, "
            f"{'bf16 autocast' if opts.bf16 else 'fp32'} on {opts.device}, fused AdamW (lr {LR:g}, "
            f"eps {EPS:g}, weight decay {WEIGHT_DECAY:g}), clip {CLIP:g}, linear schedule with "
            f"{opts.lr_warmup} warm-up steps, loss logged every {LOG_EVERY} steps, no checkpoints, no "
            f"evaluation, data in the main process; {opts.steps} steps, first {opts.warmup} left "
            f"out, {opts.repeats} interleaved repeats; malloc {opts.malloc}")


def markdown(runs: dict[str, list[dict]], opts, problems: list[str]) -> str:
    from frameworks import NAMES, WORKAROUNDS

    medians = {n: statistics.median(r["median_step"] for r in rs) for n, rs in runs.items()}
    base = medians.get("loop")
    lines = [f"Machine: {machine()}.", "", f"Settings: {settings(opts)}.", "", "```",
             command_line(), "```", "",
             "| framework | median step (ms) | time vs hand-written loop | every repeat (ms) | final loss "
             "| page faults per step |",
             "|---|---|---|---|---|---|"]
    for name, results in runs.items():
        ratio = f"{medians[name] / base:.3f}x" if base else "-"
        each = ", ".join(f"{r['median_step'] * 1e3:.2f}" for r in results)
        loss = statistics.median(r["final_loss"] for r in results)
        faults = statistics.median(r["page_faults_per_step"] for r in results)
        lines.append(f"| {NAMES[name]} | {medians[name] * 1e3:.2f} | {ratio} | {each} | {loss:.3f} | {faults:.0f} |")
    first = next(iter(runs.values()))[0]
    norms = first["clipped_norms"]
    lines += ["", f"Checked in every run, from inside the model and the optimizer: autocast "
              f"{first['autocast']} in the forward pass; optimizer {json.dumps(first['optimizer'])}; "
              f"{first['threads']} torch threads; the learning rate of every step; one forward pass "
              f"per step; the gradient norm reaching the optimizer in steps 1-{len(norms)} at most "
              f"{max(norms):.4f} (clipped in {sum(abs(n - 1.0) < 1e-3 for n in norms)} of them). "
              + ("**Differences:** " + "; ".join(problems) if problems else "The same in every framework.")]
    lines += ["", "Workarounds:"] + [f"- {NAMES[n]}: {w}" for n, w in WORKAROUNDS.items() if n in runs]
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, list[dict]], opts) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from frameworks import NAMES

    names = list(runs)
    each = [[r["median_step"] * 1e3 for r in runs[n]] for n in names]
    medians = [statistics.median(values) for values in each]
    base = medians[names.index("loop")] if "loop" in names else None
    fig, ax = plt.subplots(figsize=(7.5, 0.6 * len(names) + 1.4))
    ax.barh(range(len(names)), medians, color="#7aa6c2")
    for i, values in enumerate(each):
        ax.plot(values, [i] * len(values), "k.", ms=4)
        ratio = f"  ({medians[i] / base:.3f}x)" if base else ""
        ax.text(max(values), i, f"  {medians[i]:.1f} ms{ratio}", va="center", fontsize=9)
    ax.set_xlim(0, max(max(v) for v in each) * 1.35)
    ax.set_yticks(range(len(names)), [NAMES[n] for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("median step time (ms; dots: each repeat)")
    ax.set_title(f"GPT {opts.size}, seq {opts.seq_len}, batch {opts.batch}, "
                 f"{'bf16' if opts.bf16 else 'fp32'}, {opts.device}", fontsize=10)
    fig.tight_layout()
    opts.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(opts.plot, dpi=120)


def update_docs(report: str) -> None:
    text = DOCS.read_text()
    begin, end = MARKERS
    if begin not in text or end not in text:
        sys.exit(f"{DOCS}: the markers {begin} and {end} are missing")
    head, rest = text.split(begin, 1)
    DOCS.write_text(f"{head}{begin}\n{report}{end}{rest.split(end, 1)[1]}")


if __name__ == "__main__":
    main()
