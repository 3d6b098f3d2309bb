"""TrainingArguments: everything a training run needs to know, declared once.

A kw_only dataclass with a docstring under every field and validation in __post_init__. Files (JSON,
TOML) and command-line flags (flags.py) are both derived from it, so they never drift. Users keep
the flat, Hugging Face-compatible names; each subsystem gets its own small section of them
(sections.py).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

from . import vocabulary
from .fields import (ConfigError, check, check_choice, check_finite, checked_values, read_mapping,
                     unknown_key)
from .names import (ACCELERATOR_NAMES, AUTO, EXECUTION_MODES, FSDP_MODES, INTERVAL_STRATEGIES,
                    OPTIMIZERS, REPORT_TARGETS, SCHEDULES, STRATEGIES, parse_precision)


def _refuse_unknown_keywords(cls):
    """An unknown keyword becomes one line saying what to use instead (for Hugging Face's names)
    or naming the nearest field, instead of a bare TypeError."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, **kwargs):
        for key in kwargs:
            if key not in cls.__dataclass_fields__:
                raise unknown_key(key, cls.__dataclass_fields__, cls.__name__,
                                  vocabulary.FOREIGN_NAMES.get(cls.__name__), kind="argument")
        init(self, **kwargs)

    cls.__init__ = __init__
    return cls


@_refuse_unknown_keywords
@dataclass(kw_only=True)
class TrainingArguments:
    """Everything a training run needs to know, by the names users already know: Hugging Face's
    for hyper-parameters, Lightning's for device and scale, Optimum for Intel Gaudi's for Gaudi."""

    output_dir: str = "output"
    """Where checkpoints, metrics.jsonl and plots are written."""
    per_device_train_batch_size: int = 8
    """Sequences per device per micro-batch in training."""
    per_device_eval_batch_size: int = 8
    """Sequences per device per batch in evaluation."""
    gradient_accumulation_steps: int = 1
    """Micro-batches accumulated into one optimizer step."""
    learning_rate: float = 5e-5
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float | None = None
    """AdamW epsilon; unset means the optimizer's default (1e-8 torch AdamW, 1e-6 Gaudi FusedAdamW)."""
    optim: str = "auto"
    """AdamW kernel: auto (the device's default), adamw_torch (unfused), adamw_torch_fused or
    adamw_hpu (the device's fused AdamW: Gaudi's FusedAdamW, torch's fused kernel elsewhere).
    An AcceleratorConfig's use_fused_adam, when set, wins (as in Optimum for Intel Gaudi)."""
    max_grad_norm: float = 1.0
    """Clip gradients to this total norm; 0 disables clipping."""
    num_train_epochs: float = 3.0
    """Passes over the training data, when max_steps is not set."""
    max_steps: int = -1
    """Optimizer steps to train for; -1 means use num_train_epochs."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up from 0."""
    warmup_ratio: float = 0.0
    """Warm-up as a fraction of the total steps (rounded up), when warmup_steps is 0."""
    lr_scheduler_type: str = "linear"
    """Learning-rate schedule after warm-up: linear, cosine or constant."""
    logging_steps: int = 10
    """Log loss, learning rate, grad norm and memory every this many steps."""
    eval_steps: int = 0
    """Evaluate every this many steps; 0 evaluates only at the end."""
    save_steps: int = 500
    """Save a checkpoint every this many steps; 0 saves only at the end, -1 never."""
    save_total_limit: int | None = None
    """Keep at most this many checkpoints, deleting the oldest."""
    seed: int = 42
    """Seed for model initialisation, data order and dropout: 0 to 2**63 - 1 (torch's generators
    take 64 bits, and each epoch reseeds the data order with seed + epoch)."""
    bf16: bool = False
    """Mixed precision with bfloat16 autocast."""
    precision: str | None = None
    """The same in Lightning's spelling (bf16-mixed, bf16, 32-true, 32), or auto: bf16 where the
    device runs it natively (Gaudi, recent NVIDIA GPUs, CPUs with AVX512-BF16/AMX), else fp32.
    When set, it decides bf16; with auto, bf16=True still asks for bf16 everywhere."""
    torch_compile: bool = False
    """Compile the model with torch.compile (same as execution_mode="compile")."""
    torch_compile_backend: str | None = None
    """torch.compile backend; unset means the accelerator's (inductor, or hpu_backend on Gaudi)."""
    ddp_backend: str | None = None
    """torch.distributed backend; unset means the accelerator's (gloo, nccl, hccl)."""
    ddp_bucket_cap_mb: int | None = None
    """DistributedDataParallel's gradient bucket size in MB; unset means torch's default (25)."""
    ddp_find_unused_parameters: bool = False
    """Let DistributedDataParallel handle parameters that get no gradient (slower)."""
    ddp_timeout: int = 1800
    """Seconds a collective may wait before it fails instead of hanging."""
    fast_ddp_bf16_gradients: bool = False
    """With fast_ddp, all-reduce the gradients in bfloat16 (half the traffic)."""
    resume_from_checkpoint: str | None = None
    """A checkpoint folder to resume from, or "latest" for the newest in output_dir (from the
    beginning while it has none: one command for a job's first run and its reruns). Without it,
    an output_dir holding checkpoints is refused unless overwrite_output_dir."""
    accelerator: str = "auto"
    """Device kind: auto, hpu, cuda, mps or cpu."""
    devices: int = 1
    """Processes (one device each) per node."""
    num_nodes: int = 1
    """Number of nodes."""
    strategy: str = "auto"
    """auto, single, ddp, fast_ddp or fsdp (FSDP2: parameters, gradients and optimizer state
    sharded over the processes, one fully_shard per transformer block)."""
    fsdp: list[str] | str | None = None
    """The Hugging Face spelling of strategy="fsdp", naming how to shard: full_shard (the
    default), shard_grad_op (gradients and optimizer state only: fsdp_reshard_after_forward=False)
    or hybrid_shard (shard within a node, replicate across nodes). Hugging Face's extra words
    "auto_wrap" (always so here) and "offload" (fsdp_cpu_offload) are taken too."""
    fsdp_reshard_after_forward: bool | None = None
    """With fsdp, free each block's gathered parameters after its forward (True) or keep them
    for backward (False); unset: False for shard_grad_op, else True."""
    fsdp_cpu_offload: bool = False
    """With fsdp, keep the parameter, gradient and optimizer-state shards in CPU memory
    (FSDP2's CPUOffloadPolicy); the optimizer steps on the CPU."""
    fsdp_init_on_meta: bool = False
    """With fsdp, shard the model before giving it storage and draw its initial weights shard by
    shard (as an eager build after torch.manual_seed(seed) draws them), so that no process holds
    the whole model. Replaces the weights a model already has; a model built under
    torch.device("meta") is always initialised this way. hputrain train builds its GPT on meta."""
    execution_mode: str = "auto"
    """auto (lazy on Gaudi, eager elsewhere), eager, lazy or compile."""
    throughput_warmup_steps: int = 3
    """Steps left out of the throughput figures (graph compilation, allocator warm-up)."""
    pipelining_fwd_bwd: bool = False
    """In lazy mode, also run the graph between forward and backward."""
    non_blocking_data_copy: bool = False
    """Copy batches to the device asynchronously (pinned memory)."""
    use_graphs_for_inference: bool = False
    """Capture graphs (HPU graphs, CUDA graphs, torch.compile) for evaluate and predict, and for
    GRPO's decode step (one graph per prompt bucket)."""
    use_graphs_for_training: bool = False
    """Capture the training step in graphs where the device supports it."""
    context_parallel_size: int = 1
    """Processes that split each sequence between them."""
    expert_parallel_size: int = 1
    """Processes of the data-parallel group that split a mixture-of-experts model's experts between
    them, exchanging tokens by all-to-all (docs/moe.md); it must divide the number of processes and
    the number of experts. 1: every process holds every expert."""
    expert_capacity_factor: float = 1.25
    """Under expert parallelism, the rows each process sends each peer per MoE layer, over the
    average (tokens × top-k / expert_parallel_size). Routing that overflows them is not dropped:
    the forward runs again (counted, said on stderr). From expert_parallel_size × min(top-k,
    local experts) / top-k up, the buffers hold any routing and the forward reads nothing back."""
    router_aux_loss_coef: float | None = None
    """A mixture-of-experts model's load-balancing loss weight, trained beside the language-model
    loss (and logged as aux_loss); unset: the model config's router_aux_loss_coef, trained when the
    config sets output_router_logits. 0 turns the router's loss off."""
    router_bias_update_rate: float = 0.0
    """DeepSeek-V3's aux-loss-free balancing, for a router that picks its experts with a correction
    bias (e_score_correction_bias): after each optimizer step every MoE layer's bias moves by this
    much towards balance (+rate for an expert under the mean load of the step's global batch,
    -rate over it; DeepSeek-V3 trained with 0.001). 0: the bias stays as loaded (docs/moe.md)."""
    minimize_memory: bool = False
    """With fp8, keep fp8 weights between forward and backward instead of a wider copy."""
    fp8: bool = False
    """Linear layers compute in fp8 (E4M3 forward, E5M2 gradients), the rest in bf16."""
    fp8_scaling: str = "delayed"
    """fp8 scales: delayed (from the amax history) or dynamic (from the current amax)."""
    fp8_amax_history_len: int = 16
    """Forward passes of amax history that delayed fp8 scaling takes the largest from."""
    gradient_checkpointing: bool = False
    """Activation checkpointing: each transformer block keeps only its input for backward and
    recomputes the rest there (torch.utils.checkpoint, non-reentrant): less memory, more compute.
    Hugging Face models use their own gradient_checkpointing_enable()."""
    gradient_checkpointing_every: int = 1
    """With gradient_checkpointing, checkpoint every this many blocks only (the first, then every
    K-th): trades memory back for speed."""
    fsdp_block_classes: list[str] | None = None
    """Class names of the model's transformer blocks (what gradient_checkpointing checkpoints and
    fsdp shards one by one); unset: a Hugging Face model's _no_split_modules, or the built-in
    GPT's blocks."""
    disable_tqdm: bool = False
    """Hide the progress bar."""
    remove_unused_columns: bool = True
    """Drop the dataset columns the model's forward does not take (a text column) before the
    data_collator sees them; labels are kept."""
    report_to: list[str] | str | None = None
    """Where metrics go besides metrics.jsonl: "tensorboard", "mlflow", "wandb" (a list for
    several), "all" (those installed) or "none"; unset means TensorBoard when it is installed.
    Read as a list."""
    load_best_model_at_end: bool = False
    """At the end of training, load the checkpoint with the best metric_for_best_model (needs
    evaluation at every save: eval_steps dividing save_steps, or both strategies "epoch")."""
    metric_for_best_model: str | None = None
    """The evaluation metric that ranks checkpoints ("eval_loss" when unset); the "eval_" prefix
    may be left out."""
    greater_is_better: bool | None = None
    """Whether a larger metric_for_best_model is better; unset: False for a loss, else True."""
    dataloader_num_workers: int = 0
    """Worker processes that load and collate batches ahead of the step (0: in the training
    process). Resume stays exact with workers."""
    dataloader_pin_memory: bool = True
    """Put batches in pinned host memory when the device can copy from it asynchronously."""
    dataloader_prefetch_factor: int | None = None
    """Batches each worker prepares ahead; unset: torch's default (2) with workers."""
    pad_to_multiple_of: int | None = None
    """The default collator pads ragged sequences to a multiple of this many tokens."""
    length_buckets: int | None = None
    """The default collator pads ragged sequences up to the nearest of this many lengths, spaced
    evenly up to the model's maximum length, so lazy mode and graphs see a bounded number of
    shapes (Optimum for Intel Gaudi pads for the same reason)."""
    attention_recompute: bool | None = None
    """With fused_kernels on Gaudi, FusedSDPA recomputes attention in backward instead of keeping
    it (Optimum's flash_attention_recompute); unset: from 8192 keys on."""
    fused_kernels: bool | str = "auto"
    """The device's fused kernels in Hugging Face models (attention through transformers'
    AttentionInterface, RMSNorm by a module swap): "auto" (on where not slower), True or False."""
    profile_steps: str | None = None
    """Run torch.profiler over these training steps ("3-4", or one step "5"; global steps,
    counted from 1, so a resumed run profiles those it runs) with the device's activities: one
    trace per rank in output_dir/profile/, the top operations in top_ops.txt and the summary."""
    profiling_warmup_steps: int = 0
    """Optimum's spelling, with profiling_steps: skip this many steps, then profile. Both are
    translated into profile_steps when the arguments are made (they then read 0)."""
    profiling_steps: int = 0
    """Optimum's spelling: profile this many steps after profiling_warmup_steps (0: none); the
    same as profile_steps "{warmup + 1}-{warmup + steps}", so not given with profile_steps."""
    profiling_record_shapes: bool = True
    """Optimum's name: record the operators' input shapes in the profile (the table and the
    trace then tell a matmul's sizes apart)."""
    profiling_with_stack: bool = False
    """Optimum's name: record each operator's Python stack in the profile (slower; the trace
    then leads from an operator to the line that ran it)."""

    # Hugging Face's and Optimum for Intel Gaudi's spellings, translated into the fields above
    # when the arguments are made (they then read as unset), so that their scripts run as written.
    use_cpu: bool = False
    """Hugging Face's spelling of accelerator="cpu"."""
    no_cuda: bool = False
    """Hugging Face's older spelling of accelerator="cpu"."""
    use_habana: bool = False
    """Optimum for Intel Gaudi's spelling of accelerator="hpu" (False leaves accelerator alone)."""
    use_lazy_mode: bool | None = None
    """Optimum for Intel Gaudi's spelling of execution_mode: True is lazy, False eager (compile
    with torch_compile)."""
    eval_strategy: str | None = None
    """Hugging Face's: "steps" evaluates every eval_steps (logging_steps when eval_steps is 0);
    "epoch" at the end of every epoch; "no" is eval_steps=0 (evaluate only at the end, and only
    given an eval_dataset)."""
    save_strategy: str | None = None
    """Hugging Face's: "steps" saves every save_steps; "epoch" at the end of every epoch; "no" is
    save_steps=-1."""
    logging_strategy: str | None = None
    """Hugging Face's: "steps" logs every logging_steps; "epoch" at the end of every epoch."""
    fsdp_transformer_layer_cls_to_wrap: list[str] | str | None = None
    """Hugging Face's spelling of fsdp_block_classes."""
    overwrite_output_dir: bool = False
    """Start over in an output_dir that holds an earlier run's checkpoints or final/: they and
    its logs (metrics.jsonl ...) are set aside in output_dir/.overwritten/run-N, deleted once
    this run has a checkpoint or its final/ on disk."""
    do_train: bool = False
    """Accepted from Hugging Face scripts, no effect: the script calls train()."""
    do_eval: bool = False
    """Accepted from Hugging Face scripts, no effect: the script calls evaluate()."""
    do_predict: bool = False
    """Accepted from Hugging Face scripts, no effect: the script calls predict()."""

    def __post_init__(self) -> None:
        self._translate_hf_spellings()
        check_finite(self)
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size",
                     "gradient_accumulation_steps", "logging_steps", "devices", "num_nodes",
                     "context_parallel_size", "expert_parallel_size", "ddp_timeout"):
            check(getattr(self, name) >= 1, f"{name} must be at least 1, got {getattr(self, name)}")
        check(self.save_steps >= -1,
              f"save_steps must be -1 (never), 0 (at the end) or more, got {self.save_steps}")
        for name in ("warmup_steps", "eval_steps", "throughput_warmup_steps",
                     "weight_decay", "max_grad_norm"):
            check(getattr(self, name) >= 0, f"{name} must not be negative, got {getattr(self, name)}")
        check(self.learning_rate > 0, f"learning_rate must be positive, got {self.learning_rate}")
        check(self.router_aux_loss_coef is None or self.router_aux_loss_coef >= 0,
              f"router_aux_loss_coef must not be negative, got {self.router_aux_loss_coef}")
        check(self.expert_capacity_factor > 0,
              f"expert_capacity_factor must be positive, got {self.expert_capacity_factor}")
        check(self.router_bias_update_rate >= 0,
              f"router_bias_update_rate must not be negative, got {self.router_bias_update_rate}")
        check(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1,
              "adam_beta1 and adam_beta2 must lie in [0, 1)")
        check(self.adam_epsilon is None or self.adam_epsilon > 0, "adam_epsilon must be positive")
        check(self.max_steps == -1 or self.max_steps > 0,
              f"max_steps must be positive or -1, got {self.max_steps}")
        check(self.max_steps > 0 or self.num_train_epochs > 0,
              "num_train_epochs must be positive when max_steps is -1")
        check(self.save_total_limit is None or self.save_total_limit >= 1,
              "save_total_limit must be at least 1")
        check_choice("lr_scheduler_type", self.lr_scheduler_type, SCHEDULES)
        check_choice("strategy", self.strategy, STRATEGIES)
        self._check_fsdp()
        check_choice("execution_mode", self.execution_mode, EXECUTION_MODES)
        check_choice("accelerator", self.accelerator, ACCELERATOR_NAMES)
        if self.precision is not None:
            choice = parse_precision(self.precision)
            if choice == AUTO:  # decided by the device, when the Trainer starts
                self.precision = AUTO
            else:
                self.bf16 = choice == "bf16-mixed"
        if self.torch_compile:
            check(self.execution_mode in ("auto", "compile"),
                  f"torch_compile=True conflicts with execution_mode={self.execution_mode!r}")
            self.execution_mode = "compile"
        check(not self.minimize_memory or self.fp8, "minimize_memory needs fp8=True")
        check_choice("fp8_scaling", self.fp8_scaling, ("delayed", "dynamic"))
        check(self.fp8_amax_history_len >= 1,
              f"fp8_amax_history_len must be at least 1, got {self.fp8_amax_history_len}")
        self._check_profiling()
        check(self.gradient_checkpointing_every >= 1, "gradient_checkpointing_every must be at "
              f"least 1, got {self.gradient_checkpointing_every}")
        check(self.gradient_checkpointing_every == 1 or self.gradient_checkpointing,
              "gradient_checkpointing_every needs gradient_checkpointing=True")
        if self.fsdp_transformer_layer_cls_to_wrap is not None:
            check(self.fsdp_block_classes is None, "fsdp_transformer_layer_cls_to_wrap and "
                  "fsdp_block_classes are both set: keep fsdp_block_classes")
            self.fsdp_block_classes, self.fsdp_transformer_layer_cls_to_wrap = (
                self.fsdp_transformer_layer_cls_to_wrap, None)
        if isinstance(self.fsdp_block_classes, (str, tuple)):  # one name, as Hugging Face takes it
            self.fsdp_block_classes = ([self.fsdp_block_classes] if isinstance(self.fsdp_block_classes, str)
                                       else list(self.fsdp_block_classes))
        check(self.fsdp_block_classes is None or (
            isinstance(self.fsdp_block_classes, list) and self.fsdp_block_classes
            and all(isinstance(n, str) and n.strip() for n in self.fsdp_block_classes)),
            f"fsdp_block_classes must be a non-empty list of class names, got {self.fsdp_block_classes!r}")
        check(0 <= self.seed < 2**63, f"seed must be a whole number from 0 to 2**63 - 1, got {self.seed}")
        check(0 <= self.warmup_ratio <= 1, f"warmup_ratio must lie in [0, 1], got {self.warmup_ratio}")
        check(isinstance(self.warmup_steps, int),  # transformers 5 reads warmup_steps=0.1 as a ratio
              f"warmup_steps must be a whole number, got {self.warmup_steps!r}: "
              "for a fraction of the total steps use warmup_ratio")
        check(not (self.warmup_steps and self.warmup_ratio),
              f"warmup_steps={self.warmup_steps} and warmup_ratio={self.warmup_ratio} are both set: "
              "keep one (warmup_steps=0 to use the ratio)")
        check_choice("optim", self.optim, OPTIMIZERS, foreign=vocabulary.OPTIMIZERS)
        self.report_to = report_targets(self.report_to)
        self._check_data_loading()
        self.fused_kernels = {"true": True, "false": False}.get(str(self.fused_kernels).lower(),
                                                                 self.fused_kernels)
        check_choice("fused_kernels", self.fused_kernels, ("auto", True, False))

    def _check_data_loading(self) -> None:
        check(self.dataloader_num_workers >= 0,
              f"dataloader_num_workers must not be negative, got {self.dataloader_num_workers}")
        check(self.dataloader_prefetch_factor is None or self.dataloader_prefetch_factor >= 1,
              f"dataloader_prefetch_factor must be at least 1, got {self.dataloader_prefetch_factor}")
        check(self.dataloader_prefetch_factor is None or self.dataloader_num_workers > 0,
              "dataloader_prefetch_factor needs dataloader_num_workers > 0")
        check(self.pad_to_multiple_of is None or self.pad_to_multiple_of >= 1,
              f"pad_to_multiple_of must be at least 1, got {self.pad_to_multiple_of}")
        check(self.length_buckets is None or self.length_buckets >= 1,
              f"length_buckets must be at least 1, got {self.length_buckets}")

    def _check_fsdp(self) -> None:
        """fsdp (Hugging Face's words) becomes strategy="fsdp" and one of FSDP_MODES; the fsdp
        options need it, and lazy mode, fast_ddp and context parallelism do not combine with it."""
        if isinstance(self.fsdp, bool):
            self.fsdp = "full_shard" if self.fsdp else None
        words = self.fsdp.split() if isinstance(self.fsdp, str) else list(self.fsdp or [])
        modes = [w for w in words if w not in ("auto_wrap", "offload")]
        for word in modes:
            check_choice("fsdp", word, FSDP_MODES)
        check(len(modes) <= 1, f"fsdp names more than one way to shard: {' '.join(modes)}")
        if words:
            check(self.strategy in ("auto", "fsdp"),
                  f"fsdp={self.fsdp!r} conflicts with strategy={self.strategy!r}: keep one")
            self.strategy = "fsdp"
            self.fsdp_cpu_offload = self.fsdp_cpu_offload or "offload" in words
        self.fsdp = modes[0] if modes else ("full_shard" if self.strategy == "fsdp" else None)
        if self.strategy != "fsdp":
            for name in ("fsdp_reshard_after_forward", "fsdp_cpu_offload", "fsdp_init_on_meta"):
                check(getattr(self, name) in (None, False), f"{name} needs strategy='fsdp'")
            return
        check(not (self.fsdp == "shard_grad_op" and self.fsdp_reshard_after_forward),
              "fsdp='shard_grad_op' keeps parameters gathered after forward: it conflicts with "
              "fsdp_reshard_after_forward=True")
        check(self.execution_mode != "lazy", "strategy='fsdp' runs in eager or compile mode, not "
              "lazy: set execution_mode='eager' or 'compile'")
        check(not self.fast_ddp_bf16_gradients, "fast_ddp_bf16_gradients is fast_ddp's: with fsdp, "
              "bf16=True reduces gradients in fp32 from bf16 compute")
        check(self.context_parallel_size == 1, "strategy='fsdp' with context_parallel_size > 1 is "
              "not supported yet: use ddp or fast_ddp with context parallelism")
        check(not self.use_graphs_for_training, "use_graphs_for_training needs lazy mode, which "
              "strategy='fsdp' does not run in")

    def _translate_hf_spellings(self) -> None:
        """Hugging Face's and Optimum for Intel Gaudi's switches become accelerator, execution_mode,
        eval_steps and save_steps, then read as unset; one that contradicts a setting is an error."""
        if self.use_cpu or self.no_cuda:
            self._set("accelerator", "cpu", "use_cpu=True" if self.use_cpu else "no_cuda=True")
        if self.use_habana:
            self._set("accelerator", "hpu", "use_habana=True")
        if self.use_lazy_mode is not None:
            mode = "lazy" if self.use_lazy_mode else ("compile" if self.torch_compile else "eager")
            self._set("execution_mode", mode, f"use_lazy_mode={self.use_lazy_mode}")
        for name, strategy in (("eval", self.eval_strategy), ("save", self.save_strategy),
                               ("logging", self.logging_strategy)):
            if strategy is not None:
                check_choice(f"{name}_strategy", strategy, INTERVAL_STRATEGIES,
                             foreign=vocabulary.INTERVAL_STRATEGIES)
        # As in the Hugging Face Trainer, the strategy decides and *_steps only sets the interval.
        # "epoch" stays: the steps of an epoch are known when training starts (trainer.py).
        if self.eval_strategy == "steps" and self.eval_steps == 0:
            self.eval_steps = self.logging_steps
        if self.eval_strategy == "no":
            self.eval_steps = 0
        if self.save_strategy == "no":
            self.save_steps = -1
        check(self.logging_strategy != "no",
              "logging_strategy='no' is not supported: hputrain always logs; raise logging_steps")
        self.use_cpu = self.no_cuda = self.use_habana = False
        self.use_lazy_mode = None
        self.eval_strategy, self.save_strategy, self.logging_strategy = (
            None if s != "epoch" else s
            for s in (self.eval_strategy, self.save_strategy, self.logging_strategy))

    def _set(self, name: str, value: str, because: str) -> None:
        current = getattr(self, name)
        check(current in ("auto", value), f"{because} conflicts with {name}={current!r}")
        setattr(self, name, value)

    def _check_profiling(self) -> None:
        check(self.profiling_warmup_steps >= 0 and self.profiling_steps >= 0,
              "profiling_warmup_steps and profiling_steps must not be negative")
        if self.profiling_steps:
            check(self.profile_steps is None, "profile_steps and profiling_steps are both set: "
                  "keep one (profile_steps '3-4' is profiling_warmup_steps 2, profiling_steps 2)")
            first = self.profiling_warmup_steps + 1
            self.profile_steps = f"{first}-{first + self.profiling_steps - 1}"
            # read as unset from here on, so that a copy (dataclasses.replace) is not both
            self.profiling_warmup_steps = self.profiling_steps = 0
        else:
            check(not self.profiling_warmup_steps, "profiling_warmup_steps needs profiling_steps")
        if self.profile_steps is None:
            return
        first, last = self.profile_range
        if self.max_steps > 0:
            check(last <= self.max_steps, f"profile_steps {self.profile_steps} ends after "
                  f"max_steps {self.max_steps}: profile steps the run reaches")

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """(first, last) training step to profile, from profile_steps; None for none."""
        if self.profile_steps is None:
            return None
        text = str(self.profile_steps).strip()
        first, dash, last = text.partition("-")
        try:
            first, last = int(first), int(last if dash else first)
        except ValueError:
            raise ConfigError(f"profile_steps must be steps A-B (3-4) or one step (5), got "
                              f"{self.profile_steps!r}") from None
        check(1 <= first <= last, f"profile_steps must be A-B with 1 <= A <= B, got {text!r} "
              "(training steps count from 1)")
        return first, last

    def for_rehearsal(self, output_dir: str) -> "TrainingArguments":
        """These arguments for a dry run of the step (`hputrain doctor`): lazy mode on the CPU, in
        `output_dir`, with no checkpoint, evaluation, resume or progress bar."""
        return dataclasses.replace(self, accelerator="cpu", execution_mode="lazy", torch_compile=False,
                                   use_graphs_for_training=False, output_dir=output_dir,
                                   save_steps=0, eval_steps=0, disable_tqdm=True,
                                   resume_from_checkpoint=None, load_best_model_at_end=False,
                                   eval_strategy=None, save_strategy=None, logging_strategy=None,
                                   profile_steps=None, profiling_steps=0, profiling_warmup_steps=0)

    @classmethod
    def from_file(cls, path: str | Path, **overrides) -> "TrainingArguments":
        """Load from a JSON or TOML file; `overrides` win over the file."""
        return cls(**checked_values(cls, read_mapping(path) | overrides, f"config file {path}"))


def report_targets(value) -> list[str] | None:
    """report_to as a list of trackers: [] for "none"; "all" stays ["all"] (every tracker that
    is installed, decided when training starts); None stays None (TensorBoard when installed)."""
    if value is None:
        return None
    names = list(value) if isinstance(value, (list, tuple)) else [value]
    for name in names:
        check_choice("report_to", name, REPORT_TARGETS, foreign=vocabulary.REPORTERS)
    if not names or "none" in names:
        return []
    return ["all"] if "all" in names else list(dict.fromkeys(names))


def check_trainer_kwargs(kwargs: dict, valid: list[str]) -> None:
    """One line for the first keyword the Trainer does not take (`valid`: the ones it does): what
    to use instead for the Hugging Face Trainer's names, the nearest argument for a typo."""
    for key in kwargs:
        raise unknown_key(key, valid, "Trainer", vocabulary.TRAINER_KWARGS, kind="argument")


def as_training_arguments(args) -> TrainingArguments:
    """The Trainer's `args`: TrainingArguments, None (the defaults) or a dict of its fields;
    anything else (transformers' TrainingArguments above all) is one line."""
    if args is None:
        return TrainingArguments()
    if isinstance(args, TrainingArguments):
        return args
    if isinstance(args, dict):
        return TrainingArguments(**checked_values(TrainingArguments, args, "Trainer args"))
    kind = f"{type(args).__module__.split('.')[0]}.{type(args).__qualname__}"
    raise ConfigError(f"Trainer args must be hputrain.TrainingArguments or a dict of its fields, "
                      f"got {kind}: make hputrain.TrainingArguments from the same values "
                      "(it takes the Hugging Face names)")
