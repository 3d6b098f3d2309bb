"""The run `hputrain train`'s flags describe, planned (rehearsal/plan/__init__.py): for `hputrain plan`, and
for the one line a training run that runs out of device memory ends with."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

from ..errors import InputError


def plan_run(flags: dict, target: str, target_bytes: int, time_budget: float = 90.0):
    """(the plan, what was planned) of the run `flags` (train's flags, parsed) describe; the
    changes that would make it fit are traced within `time_budget` seconds."""
    from ..accelerators import detect_accelerator
    from ..rehearsal.plan import plan

    step, args = planned_step(flags, target)
    accelerator = detect_accelerator("cpu", "eager")  # the trace runs here, on fake tensors
    result = plan(step, args, target, target_bytes, accelerator=accelerator,
                  time_budget=time_budget)
    return result, step.name + "".join(f"; {note}" for note in result.notes)


def planned_step(flags: dict, target: str | None = None):
    """(rehearsal.plan's StepModel, TrainingArguments) of the step the run `flags` describe
    takes: DPO's on preference pairs, GRPO's on prompts with --reward-funcs, packed SFT blocks
    where the run packs examples, else the recipe's own; precision "auto" as it means on
    `target` (None: as given)."""
    from ..accelerators.registry import target_runs_bf16
    from ..recipes import chosen_recipe, hf
    from ..rehearsal.plan import StepModel, packed_step

    flags = {k: v for k, v in flags.items() if k not in ("target", "json")}  # plan's own
    dataset_given = bool(flags.get("dataset"))
    if "model" in flags and not dataset_given:
        flags["dataset"] = NO_DATASET
    recipe, options, args = chosen_recipe(flags)
    if args.precision == "auto" and target is not None:  # the planned device's, not this one's
        args = dataclasses.replace(args, precision="bf16-mixed" if target_runs_bf16(target) else "fp32")
    step = StepModel(**recipe.step_model(options))
    if step.vision is not None:  # an image-text-to-text model: its image blocks (kinds/vlm/plan.py)
        from ..kinds.vlm.plan import vlm_step

        return vlm_step(step), args
    if recipe is not hf:
        return step, args
    method = _method(options, dataset_given)
    step = method.plan_step(options, step, _reference_build(recipe, options))
    if method.trains_blocks and _packs_examples(options, dataset_given):
        step = packed_step(step)
    return step, args


NO_DATASET = "(not given to hputrain plan)"


def _method(options, dataset_given: bool):
    """The method whose step is planned (recipes/hf/methods.py), decided as `hputrain train`
    decides it: from the data's columns (read, not the rows), checked against --method and each
    method's flags; without --dataset, from --method, or a flag only one method takes (GRPO's
    --reward-funcs, --num-generations ...; DPO's --ref-model, --precompute-ref-log-probs ...)."""
    from ..recipes import hf
    from ..recipes.hf.methods import method_named, registered_methods

    if dataset_given:
        return method_named(hf.data_kind(options))
    if options.method != "auto":
        return method_named(options.method)
    methods = [m for m in registered_methods() if not m.loads_model]
    asked = [m for m in methods if m.flags_given(options, m.name)]  # its own flags
    if not asked and options.ref_model:  # a reference alone: the first method that takes one (DPO)
        asked = [m for m in methods if m.uses_reference]
    return asked[0] if asked else method_named("lm")


def _packs_examples(options, dataset_given: bool) -> bool:
    """Whether the run packs SFT examples into blocks (their lengths in `seq_lens`), as
    `hputrain train` decides it: packing on (the default), and chat or instruction rows in the
    data (its columns, read); without --dataset, --method sft. Text is cut into blocks as it
    comes: no examples to keep apart."""
    from ..recipes.hf.data import data_method

    if not options.packing:
        return False
    if not dataset_given:
        return options.method == "sft"
    return data_method(options.dataset, options.text_column) != "text"


def _reference_build(recipe, options):
    """--ref-model's build (its architecture from its config.json alone, as the policy's), or
    None without one."""
    from ..rehearsal.plan import StepModel

    if not options.ref_model:
        return None
    ref_options = dataclasses.replace(options, model=options.ref_model, lora_r=None,
                                      lora_alpha=None, lora_dropout=None, lora_target_modules=None)
    build = StepModel(**recipe.step_model(ref_options)).build
    return lambda: build(False)


PLAN_SECONDS = 15.0
"""How long the plan of an out-of-memory line may take (HPUTRAIN_OUT_OF_MEMORY_PLAN_SECONDS sets
another budget): its peers wait that long, at most, for rank 0 before they exit."""
_DONE_KEY = "hputrain/out-of-memory-plan-done"


def out_of_memory_line(flags: dict, training_args, accelerator) -> str:
    """What was asked, the peak the device saw, and the plan of the same step (rehearsal/plan/__init__.py):
    its parts and its cheapest change that fits the device, or why there is none. Checkpoints
    already written are whole (each is renamed into place only once complete).

    The plan is made once for the job, by global rank 0, in a process of its own: the fake
    process group of a plan cannot start beside the run's real one, and a separate process can
    be stopped at the time budget, which a trace running in this one could not. The other ranks
    make none and wait for rank 0 (on the launcher's store, at most the budget and a margin),
    so that their exit does not end rank 0 before its line is out."""
    stats = accelerator.memory_stats()
    total = int(stats["total_memory_available_gb"] * 2**30)
    ranks = training_args.devices * training_args.num_nodes
    asked = (f"{ranks} process{'es' if ranks > 1 else ''}, strategy {training_args.strategy}, "
             f"micro-batch {training_args.per_device_train_batch_size}"
             f"{', gradient checkpointing' if training_args.gradient_checkpointing else ''}")
    line = (f"out of memory on {accelerator.device_name()} ({_size(total)}) in a training step "
            f"({asked}); peak {_size(stats['max_memory_allocated_gb'] * 2**30)}")
    budget = _budget()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank != 0:
        line += "; " + _wait_for_rank_0(rank, budget)
    else:
        try:
            line += "; " + _planned(flags, accelerator.name, total, budget)
        finally:
            if world > 1:
                _tell_the_others()
    return line + "; the checkpoints written so far are whole: resume with --resume-from-checkpoint latest"


def _planned(flags: dict, target: str, total: int, budget: float) -> str:
    """The plan's part of the line, from a plan made in a child process within `budget` seconds;
    "no plan: why" when there is none."""
    again = "run `hputrain plan` with the same flags"
    values = {k: v for k, v in flags.items() if _is_json(v)}  # the parser's own callables out
    request = json.dumps({"flags": values, "target": target, "bytes": total,
                          "until": time.time() + budget})
    env = {k: v for k, v in os.environ.items() if k not in _PROCESS_GROUP_VARS
           and not k.startswith("TORCHELASTIC_")}
    try:
        proc = subprocess.run([sys.executable, "-m", "hputrain.cli.planning", str(os.getpid())],
                              input=request, capture_output=True, text=True, timeout=budget,
                              env=env)
    except subprocess.TimeoutExpired:
        return f"no plan: not made within the {budget:g} s allowed ({again})"
    except OSError as exc:
        return f"no plan: the planning process did not start ({exc.strerror}; {again})"
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return f"no plan: {why.removeprefix('hputrain: error: ')[:200]} ({again})"
    plan = json.loads(proc.stdout)
    parts = ", ".join(f"{k} {_size(v)}" for k, v in plan["breakdown"].items())
    text = f"planned {_size(plan['peak_bytes'])} a rank ({parts})"
    fitting = [s for s in plan["suggestions"] if s["fits"]]
    if fitting:
        best = fitting[0]
        text += (f"; fits with {best['change']} ({' '.join(best['flags'])}): planned "
                 f"{_size(best['peak_bytes'])}")
    return text


_PROCESS_GROUP_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                       "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
                       "HPUTRAIN_LAUNCHER_PID")
"""What makes a process a rank of the job: the planning process is none."""


def _wait_for_rank_0(rank: int, budget: float) -> str:
    """The line's part on a rank other than 0, after waiting (at most the budget and a margin)
    for rank 0 to finish its line."""
    store = _job_store(budget + 10)
    if store is not None:
        try:
            store.wait([_done_key()])
        except Exception:  # noqa: BLE001 (rank 0 did not run out of memory, or ended first)
            return (f"no plan on rank {rank}: rank 0 makes it, and gave none within "
                    f"{budget + 10:g} s (run `hputrain plan` with the same flags)")
        time.sleep(1)  # rank 0 prints its line as it says it is done: that line first, whole
    return f"no plan on rank {rank}: rank 0 makes it (its line carries it)"


def _tell_the_others() -> None:
    store = _job_store(5)
    if store is not None:
        try:
            store.set(_done_key(), "1")
        except Exception:  # noqa: BLE001 (the others stop waiting at their bound)
            pass


def _done_key() -> str:
    return f"{_DONE_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _job_store(seconds: float):
    """A client of the store every rank of the job reaches (the launcher's, at MASTER_ADDR and
    MASTER_PORT), whose waits end after `seconds`; None without one."""
    import datetime

    from torch.distributed import TCPStore

    try:
        return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                        is_master=False, timeout=datetime.timedelta(seconds=seconds))
    except (KeyError, ValueError, RuntimeError):
        return None


def _budget() -> float:
    value = os.environ.get("HPUTRAIN_OUT_OF_MEMORY_PLAN_SECONDS")
    try:
        return max(0.1, float(value)) if value else PLAN_SECONDS
    except ValueError:
        return PLAN_SECONDS


def _is_json(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _plan_for_parent(parent: int) -> int:
    """The planning process (`python -m hputrain.cli.planning PARENT_PID`): the request as JSON
    on stdin, the plan as JSON on stdout, or one line on stderr and exit 2. It dies with the
    rank that started it (Linux), which may be ended before its budget is spent."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            return 1  # the rank is gone already
    request = json.loads(sys.stdin.read())
    try:  # the changes that would fit are traced in what is left of the budget
        plan, _ = plan_run(request["flags"], request["target"], request["bytes"],
                           time_budget=request["until"] - time.time() - 1)
    except InputError as exc:
        print(f"hputrain: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 (tracing refused: the line says why, in one line)
        first = (str(exc).strip().splitlines() or [""])[0][:150]
        print(f"tracing failed ({type(exc).__name__}: {first})", file=sys.stderr)
        return 2
    print(json.dumps(plan.as_json()))
    return 0


if __name__ == "__main__":
    sys.exit(_plan_for_parent(int(sys.argv[1])))
