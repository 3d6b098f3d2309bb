"""The `hputrain` command line. Bad input prints one line and exits 2, never a traceback; in a job of
several processes, one line for the whole job (distributed/failure.py)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .. import __version__
from ..errors import EveryRankError, InputError, did_you_mean

ENV_VARS = ("HPUTRAIN_ACCELERATOR", "HPUTRAIN_CPU_NATIVE_BF16", "PT_HPU_LAZY_MODE",
            "PT_ENABLE_INT64_SUPPORT", "PT_HPU_AUTOCAST_LOWER_PRECISION_OPS_LIST", "PT_HPU_AUTOCAST_FP32_OPS_LIST",
            "HABANA_VISIBLE_MODULES", "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT",
            "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK",
            # what mpirun and srun say instead (distributed/launchers.py)
            "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID",
            "SLURM_STEP_NUM_TASKS")


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (with the nearest flag when one is close)."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            known = _option_strings(self)
            for word in message.split(":", 1)[1].split():
                hint = did_you_mean(word.split("=")[0], known, cutoff=0.6, quote=False)
                if hint:
                    message += hint
                    break
        raise InputError(f"{message} (see {self.prog} --help)")


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of `parser` and of its subcommands, leaving out hidden ones (another project's
    names that are refused with advice: never a suggestion)."""
    found = []
    for action in parser._actions:
        if action.help != argparse.SUPPRESS:
            found += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _option_strings(sub)
    return found


def _force_cpu(args) -> None:
    if getattr(args, "cpu", False):
        os.environ["HPUTRAIN_ACCELERATOR"] = "cpu"


# -- hputrain env ----------------------------------------------------------------------------------

def cmd_env(args) -> int:
    import torch

    from ..accelerators import available_accelerators, detect_accelerator
    from ..execution import kernels

    accelerator = detect_accelerator(args.accelerator)
    report = {
        "accelerator": accelerator.name,
        "device_count": accelerator.device_count(),
        "device_name": accelerator.device_name(),
        "available": available_accelerators(),
        "execution_mode": accelerator.execution_mode,
        "dist_backend": accelerator.dist_backend(),
        "compile_backend": accelerator.compile_backend(),
        **accelerator.bf16_facts(),  # native_bf16 and what decided it (CPU: flags, measured rates)
        "native_fp8": accelerator.native_fp8(),  # fp8 matrix units; without them fp8 is emulated
        # what a Hugging Face model's attention and RMSNorm would run on here (execution/kernels.py)
        "fused_kernels": {**{k: v or "-" for k, v in kernels.available(accelerator).items()},
                          "auto": "on" if accelerator.prefers_fused_kernels() else "off"},
        "torch": torch.__version__,
        "hputrain": __version__,
        "python": sys.version.split()[0],
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    width = max(map(len, report))
    for key, value in report.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
        elif isinstance(value, list):
            value = " ".join(value) or "-"
        elif isinstance(value, bool):
            value = "yes" if value else "no"
        print(f"{key:<{width}}  {value}")
    return 0


def _env_parser(sub) -> None:
    p = sub.add_parser("env", help="what is detected: accelerators, counts, versions, env vars")
    p.add_argument("--accelerator", default="auto", help="check this kind (default: auto)")
    p.add_argument("--cpu", action="store_true", help="force the CPU")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_env)


# -- hputrain export -------------------------------------------------------------------------------

def cmd_export(args) -> int:
    from pathlib import Path

    if args.merge is not None:  # a PEFT adapter folder merged into its base: one model folder
        from ..recipes.hf.export import export_merged

        if not args.output:
            raise InputError("--merge needs --output DIR, the new model folder to write")
        print(export_merged(args.merge, args.output, args.base_model))
        return 0
    if args.base_model:
        raise InputError("--base-model is the base of the adapter folder given with --merge")
    from ..checkpoint.sharded import export_model

    output = export_model(Path(args.checkpoint), Path(args.output) if args.output else None)
    print(output)
    return 0


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="the whole model of a sharded (fsdp) checkpoint as one "
                                      "model.safetensors, in one process; or (--merge) a LoRA "
                                      "adapter folder merged into its base as one model folder")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR",
                        help="a checkpoint-STEP folder written by a sharded run")
    source.add_argument("--merge", metavar="ADAPTER",
                        help="a PEFT adapter folder (a LoRA run's output_dir/final): written "
                             "merged into its base model, as save_pretrained writes a model "
                             "(config.json, model.safetensors, the tokenizer), into --output DIR")
    p.add_argument("--output", metavar="PATH",
                   help="where to write it: with --checkpoint a file (default: "
                        "DIR/model.safetensors); with --merge a new folder (required)")
    p.add_argument("--base-model", "--base_model", dest="base_model", metavar="DIR",
                   help="with --merge: the base model folder (default: the one the adapter's "
                        "adapter_config.json names)")
    p.set_defaults(func=cmd_export)


# -- entry point -----------------------------------------------------------------------------------

def build_parser() -> Parser:
    parser = Parser(prog="hputrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hputrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    _env_parser(sub)
    _export_parser(sub)
    from .launch import add_launch_parser
    from .train import add_train_parser
    from .doctor import add_doctor_parser
    from .plan import add_plan_parser
    from .config import add_config_parser
    from .generate import add_generate_parser
    from .evaluate import add_evaluate_parser
    from .report import add_report_parser

    add_train_parser(sub)
    add_launch_parser(sub)
    add_config_parser(sub)
    add_generate_parser(sub)
    add_evaluate_parser(sub)
    add_report_parser(sub)
    add_doctor_parser(sub)
    add_plan_parser(sub)
    return parser


class _ClosedPipeQuiet:
    """A standard stream for `hputrain train | head -1`: once its reader has gone, output goes to
    /dev/null and the command runs on to its end (a training run trains and saves as usual),
    instead of dying of a BrokenPipeError traceback."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())  # what is still buffered drains into it
        finally:
            os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def run() -> None:
    """The `hputrain` command and `python -m hputrain.cli`: main(), then the process ends. A rank
    of a job that mpirun, srun or torchrun started (not `hputrain launch`, whose workers end in
    distributed/entry.py), having joined its process group here, ends as those workers do
    (entry.leave): without the interpreter's final teardown, where a Gloo thread finishing the
    last collective aborts a process now and then (SIGABRT, "terminate called without an active
    exception")."""
    status = main()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from ..distributed.launch import LAUNCHER_PID

        if LAUNCHER_PID not in os.environ:
            from ..distributed.entry import leave

            leave(status)
    sys.exit(status)


def main(argv: list[str] | None = None) -> int:
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _ClosedPipeQuiet(sys.stdout), _ClosedPipeQuiet(sys.stderr)
    try:
        args = build_parser().parse_args(argv)
        _force_cpu(args)
        return args.func(args)
    except InputError as exc:  # one line (said once for the whole job: distributed/failure.py)
        from ..distributed import failure

        peer = failure.said_by_rank_0() if isinstance(exc, EveryRankError) else None
        if peer is not None:
            return failure.end_quietly(peer)
        return failure.say(f"hputrain: error: {exc}", 2)
    except KeyboardInterrupt:
        print("hputrain: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # another rank failed first: this is only its echo, said by that rank
        from ..distributed import failure

        peer = failure.echo_of_peer(exc)
        if peer is not None:
            return failure.end_quietly(peer)
        failure.record_when_printed(exc)  # for the other ranks, once its traceback is out
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = streams
