"""Peak memory of per-token log-probs: the model's full logits against training/logps.py's chunked,
checkpointed head. One forward and backward of a Llama-architecture model built from a config
(hidden 256, 4 layers, 8 heads, 4 key-value heads, intermediate 704, vocabulary 32000, float32,
random weights and tokens) on 8 rows of 512 tokens, in two shapes of batch:

- grpo: the last 64 positions scored (a completion after a prompt left-padded to 448), with the
  entropy, loss sum(logps * advantage) - 0.01 * entropy;
- dpo: every position scored, loss -sum(logps) (a row's completion log-prob summed).

Modes: `logits` is today's DPO (methods/dpo/trainer.py completion_logps: a float32 cross entropy over
the full logits); `full` is token_logps(chunk=None) (the model's full logits, scored a chunk at a
time: the fall-back path); `chunked` is token_logps with its default chunk of 1024 tokens, scoring
every position from 0; `chunked-start` (grpo) also passes start=448, so the prompt's columns never
reach the head.

Each measurement runs in a fresh process. The figure is what the step adds to the process's
resident memory: VmHWM (the peak, reset through /proc/self/clear_refs once the model and batch are
built) minus VmRSS at that moment. Median of --repeats processes per mode, run one after another.

    python bench/logps_memory.py [--repeats 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROWS, LENGTH, PROMPT = 8, 512, 448
MODES = {"grpo": ("logits", "full", "chunked", "chunked-start"),
         "dpo": ("logits", "full", "chunked")}


def status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def measure(shape: str, mode: str) -> dict:
    """One forward and backward in this process: the rise of resident memory and the time."""
    import torch
    import transformers

    from hputrain.methods.dpo.trainer import completion_logps
    from hputrain.training.logps import shifted_labels, token_logps

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=704,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=4, max_position_embeddings=LENGTH,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(4, config.vocab_size, (ROWS, LENGTH))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    scored = torch.ones_like(ids)
    if shape == "grpo":
        scored[:, :PROMPT + 1] = 0  # the completion's 64 tokens: predicted from position 448 on
    labels = shifted_labels(ids, scored)
    advantage = torch.randn(ROWS, 1)

    def call(module, batch):
        return module(**batch)

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_kb("VmRSS")
    start = time.perf_counter()
    if mode == "logits":
        logps = completion_logps(call(model, inputs).logits, ids, scored)
        loss = -logps.sum() if shape == "dpo" else -(logps * advantage[:, 0]).sum()
    else:
        options = {"chunk": None} if mode == "full" else {}
        if mode == "chunked-start":
            options["start"] = PROMPT
        out = token_logps(call, model, inputs, labels, entropy=shape == "grpo", **options)
        loss = (-out.logps.sum() if shape == "dpo"
                else -(out.logps * advantage).sum() - 0.01 * out.entropy.sum())
    loss.backward()
    seconds = time.perf_counter() - start
    return {"rise_mib": (status_kb("VmHWM") - before) / 1024, "rss_mib": before / 1024,
            "seconds": seconds}


def cpu_line() -> str:
    """The CPU's model name and flags, as lscpu says them."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "lscpu unavailable"
    facts = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return "; ".join(f"{key} {facts[key].strip()}" for key in ("Model name", "CPU(s)", "Flags")
                     if key in facts)


def run_child(shape: str, mode: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", shape, mode], check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--child", nargs=2, metavar=("SHAPE", "MODE"), help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.child:
        print(json.dumps(measure(*opts.child)))
        return
    import torch
    import transformers

    print(f"machine: {cpu_line()}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads, python {sys.version.split()[0]}")
    print(f"Llama hidden 256, 4 layers, vocab 32000, fp32; {ROWS} rows x {LENGTH} tokens; "
          f"median of {opts.repeats} fresh processes")
    print(f"{'shape':6} {'mode':14} {'peak rise MiB':>14} {'step s':>8}  (runs: MiB)")
    results = []
    for shape, modes in MODES.items():
        for mode in modes:
            runs = [run_child(shape, mode) for _ in range(opts.repeats)]
            rise = statistics.median(r["rise_mib"] for r in runs)
            seconds = statistics.median(r["seconds"] for r in runs)
            each = ", ".join(f"{r['rise_mib']:.0f}" for r in runs)
            print(f"{shape:6} {mode:14} {rise:14.0f} {seconds:8.2f}  ({each})", flush=True)
            results.append({"shape": shape, "mode": mode, "rise_mib": rise, "seconds": seconds,
                            "runs": runs})
    if opts.json:
        Path(opts.json).write_text(json.dumps({"machine": cpu_line(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
