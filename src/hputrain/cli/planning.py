"""The run `hputrain train`'s flags describe, planned (rehearsal/plan.py): for `hputrain plan`, and
for the one line a training run that runs out of device memory ends with."""
from __future__ import annotations

import dataclasses


def plan_run(flags: dict, target: str, target_bytes: int):
    """(the plan, what was planned) of the run `flags` (train's flags, parsed) describe."""
    from ..accelerators import detect_accelerator
    from ..accelerators.registry import target_runs_bf16
    from ..recipes import chosen_recipe
    from ..rehearsal.plan import StepModel, plan

    flags = {k: v for k, v in flags.items() if k not in ("target", "json")}  # plan's own
    if "model" in flags and not flags.get("dataset"):
        flags["dataset"] = "(not read by hputrain plan)"
    recipe, options, args = chosen_recipe(flags)
    if args.precision == "auto":  # decided by the device planned for, not this one
        args = dataclasses.replace(args, precision="bf16-mixed" if target_runs_bf16(target) else "fp32")
    step = StepModel(**recipe.step_model(options))
    accelerator = detect_accelerator("cpu", "eager")  # the trace runs here, on fake tensors
    return plan(step, args, target, target_bytes, accelerator=accelerator), step.name


def out_of_memory_line(flags: dict, training_args, accelerator) -> str:
    """What was asked, the peak the device saw, and the plan of the same step (rehearsal/plan.py):
    its parts and its cheapest change that fits the device. Checkpoints already written are
    whole (each is renamed into place only once complete)."""
    stats = accelerator.memory_stats()
    total = int(stats["total_memory_available_gb"] * 2**30)
    ranks = training_args.devices * training_args.num_nodes
    asked = (f"{ranks} process{'es' if ranks > 1 else ''}, strategy {training_args.strategy}, "
             f"micro-batch {training_args.per_device_train_batch_size}"
             f"{', gradient checkpointing' if training_args.gradient_checkpointing else ''}")
    line = (f"out of memory on {accelerator.device_name()} ({_size(total)}) in a training step "
            f"({asked}); peak {_size(stats['max_memory_allocated_gb'] * 2**30)}")
    try:
        plan, _ = plan_run(flags, accelerator.name, total)
    except Exception as exc:  # the plan is advice: without it the line still says what happened
        return f"{line}; no plan ({type(exc).__name__}): run `hputrain plan` with the same flags"
    parts = ", ".join(f"{k} {_size(v)}" for k, v in plan.breakdown.items())
    line += f"; planned {_size(plan.peak_bytes)} a rank ({parts})"
    fitting = [s for s in plan.suggestions if s["fits"]]
    if fitting:
        best = fitting[0]
        line += (f"; fits with {best['change']} ({' '.join(best['flags'])}): planned "
                 f"{_size(best['peak_bytes'])}")
    return line + "; the checkpoints written so far are whole: resume with --resume-from-checkpoint latest"


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
