"""The small settings each subsystem takes, built once from the flat TrainingArguments.

Users keep the flat, Hugging Face-compatible names; the Trainer cuts them into sections once
(`Sections.of(args)`), as torchtitan hands its parallelism section to the parallel code only, and
each subsystem reads its own section and nothing else. A section's fields carry the names of the
TrainingArguments fields they come from (their meaning is documented there).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


class _Section:
    @classmethod
    def of(cls, args):
        """This section of `args` (TrainingArguments): its fields of the same names."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings(_Section):
    """AdamW and the learning-rate schedule (training/optim.py), and gradient clipping."""

    learning_rate: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float | None
    optim: str
    lr_scheduler_type: str
    warmup_steps: int
    warmup_ratio: float
    max_grad_norm: float


@dataclass(frozen=True, kw_only=True)
class ScheduleSettings(_Section):
    """When to log, evaluate and save, and which checkpoint is best (training/intervals.py)."""

    logging_steps: int
    eval_steps: int
    save_steps: int
    save_total_limit: int | None
    eval_strategy: str | None
    save_strategy: str | None
    logging_strategy: str | None
    load_best_model_at_end: bool
    metric_for_best_model: str | None
    greater_is_better: bool | None


@dataclass(frozen=True, kw_only=True)
class PrecisionSettings(_Section):
    """The precision plugin (execution/precision.py) and fp8 (execution/fp8.py)."""

    bf16: bool
    precision: str | None
    fp8: bool
    fp8_scaling: str
    fp8_amax_history_len: int
    minimize_memory: bool


@dataclass(frozen=True, kw_only=True)
class ExecutionSettings(_Section):
    """torch.compile and the lazy-mode step watch (execution/modes.py)."""

    torch_compile_backend: str | None
    throughput_warmup_steps: int


@dataclass(frozen=True, kw_only=True)
class DataSettings(_Section):
    """Collators and batch loading (data/)."""

    pad_to_multiple_of: int | None
    length_buckets: int | None
    remove_unused_columns: bool
    dataloader_num_workers: int
    dataloader_pin_memory: bool
    dataloader_prefetch_factor: int | None
    non_blocking_data_copy: bool


@dataclass(frozen=True, kw_only=True)
class ParallelismSettings(_Section):
    """The strategy and the process layout (distributed/): ddp, fast_ddp, fsdp, context parallel."""

    strategy: str
    num_nodes: int
    seed: int
    """fsdp_init_on_meta draws the initial weights shard by shard from it."""
    fsdp: str | None
    fsdp_reshard_after_forward: bool | None
    fsdp_cpu_offload: bool
    fsdp_init_on_meta: bool
    fsdp_block_classes: list[str] | None
    context_parallel_size: int
    expert_parallel_size: int
    expert_capacity_factor: float
    ddp_bucket_cap_mb: int | None
    ddp_find_unused_parameters: bool
    fast_ddp_bf16_gradients: bool


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointing(_Section):
    """Which blocks keep only their input for backward (distributed/activation_checkpointing.py)."""

    gradient_checkpointing: bool
    gradient_checkpointing_every: int
    fsdp_block_classes: list[str] | None


@dataclass(frozen=True, kw_only=True)
class ReportingSettings(_Section):
    """Where the records of a run go (callbacks/): metrics.jsonl, the bar, the trackers."""

    output_dir: str
    disable_tqdm: bool
    report_to: list[str] | None
    hyperparameters: dict
    """Every TrainingArguments field, for the trackers' run parameters."""

    @classmethod
    def of(cls, args):
        return cls(output_dir=args.output_dir, disable_tqdm=args.disable_tqdm,
                   report_to=args.report_to, hyperparameters=dataclasses.asdict(args))


@dataclass(frozen=True, kw_only=True)
class ProfilingSettings(_Section):
    """torch.profiler over a few training steps (callbacks/profiler.py)."""

    output_dir: str
    steps: tuple[int, int] | None
    """(first, last) training step; None profiles nothing."""
    record_shapes: bool
    with_stack: bool

    @classmethod
    def of(cls, args):
        return cls(output_dir=args.output_dir, steps=args.profile_range,
                   record_shapes=args.profiling_record_shapes, with_stack=args.profiling_with_stack)


@dataclass(frozen=True, kw_only=True)
class Sections:
    """Every subsystem's section of one TrainingArguments."""

    optimizer: OptimizerSettings
    schedule: ScheduleSettings
    precision: PrecisionSettings
    execution: ExecutionSettings
    data: DataSettings
    parallelism: ParallelismSettings
    activation_checkpointing: ActivationCheckpointing
    reporting: ReportingSettings
    profiling: ProfilingSettings

    @classmethod
    def of(cls, args) -> Sections:
        return cls(optimizer=OptimizerSettings.of(args), schedule=ScheduleSettings.of(args),
                   precision=PrecisionSettings.of(args), execution=ExecutionSettings.of(args),
                   data=DataSettings.of(args), parallelism=ParallelismSettings.of(args),
                   activation_checkpointing=ActivationCheckpointing.of(args),
                   reporting=ReportingSettings.of(args), profiling=ProfilingSettings.of(args))


# `hputrain train --help` lists TrainingArguments' flags in these groups, in this order: a field
# goes under the first group whose section declares it or whose extra names hold it; the fields
# left (Hugging Face's and Optimum's spellings, translated when the arguments are made) come last.
HELP_GROUPS = (
    ("the run: output, batch, length, seed, resume", None,
     ("output_dir", "per_device_train_batch_size", "per_device_eval_batch_size",
      "gradient_accumulation_steps", "num_train_epochs", "max_steps", "seed",
      "resume_from_checkpoint", "overwrite_output_dir")),
    ("optimizer: AdamW, learning-rate schedule, gradient clipping", OptimizerSettings, ()),
    ("when to log, evaluate and save", ScheduleSettings, ()),
    ("precision: bf16, fp8", PrecisionSettings, ()),
    ("execution: eager, lazy, compile, kernels, graphs", ExecutionSettings,
     ("execution_mode", "torch_compile", "pipelining_fwd_bwd", "use_graphs_for_inference",
      "use_graphs_for_training", "attention_recompute", "fused_kernels")),
    ("data loading and padding", DataSettings, ()),
    ("devices and parallelism: ddp, fast_ddp, fsdp, context and expert parallel", ParallelismSettings,
     ("accelerator", "devices", "ddp_backend", "ddp_timeout")),
    ("activation checkpointing", ActivationCheckpointing, ()),
    ("mixture of experts: balancing the router", None, ("router_aux_loss_coef",
                                                          "router_bias_update_rate")),
    ("reporting: progress bar, trackers", ReportingSettings, ()),
    ("profiling", None, ("profile_steps", "profiling_warmup_steps", "profiling_steps",
                         "profiling_record_shapes", "profiling_with_stack")),
)


def help_groups(titles=HELP_GROUPS) -> tuple[tuple[str, frozenset[str]], ...]:
    """(title, the field names listed under it) for each of `titles`' groups."""
    return tuple((title, frozenset(extra) | ({f.name for f in dataclasses.fields(section)}
                                             if section else set()))
                 for title, section, extra in titles)
