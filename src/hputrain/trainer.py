"""The training and evaluation loop, readable top to bottom.

`Trainer.train` is forward, backward, clip, step, log, in that order. Three things are visible
where they happen: the lazy-mode `mark_step()` calls, the gradient-accumulation sync, and the
throughput clock. The step reads nothing back to the host except at logging steps.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import signal
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

from . import checkpoint, execution
from .accelerators import detect_accelerator
from .config import AcceleratorConfig, TrainingArguments
from .data import MicroBatches, default_collate, model_input_names, to_device
from .distributed import ProcessGroup, select_strategy
from .distributed.context_parallel import ContextParallel, NoContextParallel
from .distributed.launch import needs_launch, relaunch_current_program
from .errors import InputError
from .optim import create_optimizer, create_scheduler
from .precision import select_precision
from .telemetry import MetricSinks, ThroughputClock


@dataclass
class TrainOutput:
    global_step: int
    training_loss: float | None
    metrics: dict = field(default_factory=dict)
    interrupted_by: int | None = None  # the signal that stopped training early, if any


@dataclass
class PredictionOutput:
    predictions: torch.Tensor | list
    label_ids: torch.Tensor | list | None
    metrics: dict


def loss_of(output) -> torch.Tensor:
    """The loss from a model's output: a tensor, a dict with "loss", or an object with `.loss`."""
    if isinstance(output, torch.Tensor):
        return output
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if loss is None:
        raise InputError("the model returned no loss: return a tensor, a dict with 'loss' or an "
                         "object with .loss, or pass compute_loss=")
    return loss


class Trainer:
    def __init__(self, model: torch.nn.Module, args: TrainingArguments | None = None,
                 train_dataset=None, eval_dataset=None, data_collator=None, compute_loss=None,
                 accelerator_config: AcceleratorConfig | None = None, accelerator=None) -> None:
        self.args = execution.adjust_args(args or TrainingArguments())
        if needs_launch(self.args.devices, self.args.num_nodes):
            # Lightning's way: run this program again, one process per device, and end here.
            sys.exit(relaunch_current_program(self.args.devices, self.args.num_nodes))
        self.config = accelerator_config or AcceleratorConfig()
        op_lists = (self.config.autocast_bf16_ops, self.config.autocast_fp32_ops)
        self.accelerator = accelerator or detect_accelerator(
            self.args.accelerator, self.args.execution_mode,
            op_lists if self.config.mixed_precision else None, self.args.minimize_memory)
        if self.args.minimize_memory:  # also on an accelerator passed in: Gaudi's runtime reads it
            self.accelerator.fp8_minimize_memory = True  # at import, and setup() checks it
        self.group = ProcessGroup.from_env(self.args.ddp_backend or self.accelerator.dist_backend)
        self.group.set_context_parallel(self.args.context_parallel_size)
        self.device = self.accelerator.setup(self.group.local_rank)
        self.group.init(self.args.ddp_timeout)
        self.precision = select_precision(self.args, self.config, self.accelerator)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.collate = data_collator or default_collate
        self.compute_loss = compute_loss
        self.model = execution.move_to_device(self.precision.convert_module(model), self.device)
        self.inputs = model_input_names(model)
        self.context_parallel = self._context_parallel()
        self.strategy = select_strategy(self.args, self.group, self.accelerator)
        self.wrapped = self.strategy.wrap(self.model)  # DDP's wrapper; fast_ddp broadcasts weights
        if self.args.use_graphs_for_training:
            self.wrapped = self.accelerator.wrap_graph_training(self.wrapped)
        elif self.accelerator.execution_mode == "compile":
            self.wrapped = execution.compile_model(self.wrapped, self.args, self.accelerator)
        self.optimizer = self.scheduler = None
        self._graphed = None  # the captured inference module, built on first use
        self.global_step = 0
        self._stop_signal: int | None = None

    # -- the training loop ---------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | None = None) -> TrainOutput:
        args, accelerator = self.args, self.accelerator
        _seed_everything(args.seed)
        batches = self._train_batches()
        total_steps = self._total_steps(batches)
        self.optimizer = create_optimizer(self.model, args, self.config, accelerator)
        self.scheduler = create_scheduler(self.optimizer, args, total_steps)
        state = self._resume(resume_from_checkpoint or args.resume_from_checkpoint)
        start_step = self.global_step = state.get("global_step", 0)
        sinks = self._sinks(total_steps, start_step)
        clock = ThroughputClock(args.throughput_warmup_steps, accelerator.synchronize)
        watch = execution.step_watch(args, accelerator)  # graph compiles in lazy mode
        micro_batches = batches.iterate(start_step)
        accumulate = args.gradient_accumulation_steps
        logged_loss = self._device_zero()  # summed on device between logs
        steps_since_log, grad_norm, last_loss = 0, None, None
        params = list(self.model.parameters())  # once: walking the modules every step costs ~0.25 ms
        self.model.train()
        previous_handlers = self._catch_stop_signals()
        try:
            while self.global_step < total_steps and self._stop_signal is None:
                watch.step_begin(self.global_step + 1)
                samples = tokens = 0
                for micro in range(accumulate):
                    batch = self._on_device(next(micro_batches))
                    samples, tokens = samples + _batch_size(batch), tokens + _token_count(batch)
                    # Gradients are all-reduced only on the last micro-batch of the step.
                    with self.strategy.gradient_sync(self.wrapped, micro == accumulate - 1):
                        with self._forward_context():
                            loss = self._loss(batch) / accumulate
                        if args.pipelining_fwd_bwd:
                            accelerator.mark_step()  # run the forward graph while building backward
                        loss.backward()
                    accelerator.mark_step()
                    logged_loss += loss.detach()
                self.strategy.reduce_gradients(self.model)  # fast_ddp: one flat all-reduce
                if args.max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm(params, args.max_grad_norm,
                                                           fused=self.config.use_fused_clip_norm)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                accelerator.mark_step()
                self.global_step += 1
                watch.step_end(self.global_step, batch)
                steps_since_log += 1
                # samples are shared by a context-parallel group; tokens are split across it
                clock.step_done(samples * self.group.dp_size, tokens * self.group.world_size)
                sinks.advance()

                if self.global_step % args.logging_steps == 0 or self.global_step == total_steps:
                    clock.pause()  # the read-back below is the only host sync of the loop
                    last_loss = self._log(sinks, clock, batches, logged_loss, steps_since_log, grad_norm)
                    logged_loss, steps_since_log = self._device_zero(), 0
                    clock.resume()
                if args.eval_steps and self.global_step % args.eval_steps == 0 and self.eval_dataset is not None:
                    clock.pause()
                    self.evaluate(sinks=sinks)
                    clock.resume()
                if args.save_steps > 0 and self.global_step % args.save_steps == 0:
                    clock.pause()
                    self._save(batches)
                    clock.resume()
            summary = self._finish(sinks, clock, batches, watch)
        finally:
            self._restore_signal_handlers(previous_handlers)
            sinks.close()
        return TrainOutput(self.global_step, last_loss, summary, self._stop_signal)

    def _finish(self, sinks: MetricSinks, clock: ThroughputClock, batches: MicroBatches,
                watch: execution.StepWatch) -> dict:
        """After the last step (or a stop signal): evaluate and save unless the step just did,
        then write the summary record."""
        args, step = self.args, self.global_step
        saves = args.save_steps >= 0  # -1: never
        if self._stop_signal is not None:
            sinks.message(f"signal {self._stop_signal} received: "
                          + (f"saving a checkpoint at step {step}" if saves else f"stopping at step {step}"))
        elif self.eval_dataset is not None and not (args.eval_steps and step % args.eval_steps == 0):
            self.evaluate(sinks=sinks)
        if saves and not (args.save_steps > 0 and step % args.save_steps == 0):
            self._save(batches)
        summary = {"step": step, **clock.summary(self._flops_per_token(), self._peak_flops()),
                   **watch.summary()}
        sinks.write(summary)
        return summary

    def _loss(self, batch, module=None) -> torch.Tensor:
        module = self.wrapped if module is None else module
        if self.compute_loss is not None:
            return self.compute_loss(module, batch)
        return loss_of(self._forward(batch, module))

    def _on_device(self, batch):
        """The batch on this rank's device, cut to this rank's slice of the sequence under
        context parallelism."""
        return self.context_parallel.shard(to_device(batch, self.device, self.args.non_blocking_data_copy))

    @contextlib.contextmanager
    def _forward_context(self):
        """What the forward pass runs under: the device's needs, context-parallel attention,
        and the precision's autocast."""
        with (self.accelerator.forward_context(), self.context_parallel.forward_context(),
              self.precision.forward_context()):
            yield

    def _context_parallel(self):
        if self.group.cp_size == 1:
            return NoContextParallel()
        if self.inputs is not None and "position_ids" not in self.inputs:
            raise InputError("context parallelism needs a model whose forward takes position_ids "
                             "(each rank holds a slice of the sequence at an offset)")
        return ContextParallel(self.group.cp_group, self.group.cp_rank, self.group.cp_size)

    def _device_zero(self) -> torch.Tensor:
        """A zero made on the host and copied over: in lazy mode a copy is graph input data, where
        `zero_()` would be one more op in the next step's graph."""
        return torch.zeros(()).to(self.device)

    def _forward(self, batch, module=None):
        """Call the model (or `module`) on a batch: a dict by keyword (only the keys its forward
        accepts)."""
        module = self.wrapped if module is None else module
        if isinstance(batch, dict):
            inputs = self.inputs
            return module(**{k: v for k, v in batch.items() if inputs is None or k in inputs})
        if isinstance(batch, (list, tuple)):
            return module(*batch)
        return module(batch)

    def _inference_module(self):
        """The module evaluate and predict call: captured graphs with use_graphs_for_inference."""
        if not self.args.use_graphs_for_inference:
            return self.wrapped
        if self._graphed is None:
            from .inference import wrap_for_inference

            self._graphed = wrap_for_inference(self.model, self.accelerator)
        return self._graphed

    def _log(self, sinks, clock, batches, logged_loss, steps, grad_norm) -> float:
        """One logging record; the host reads the loss and grad norm back only here. Nothing here
        adds an op to the device's graph, so in lazy mode the next step compiles nothing new."""
        loss = self.group.all_reduce_mean(logged_loss, self.accelerator)
        record = {
            "step": self.global_step,
            "epoch": round(batches.epoch_of(self.global_step), 4),
            "loss": loss.item() / steps,
            "learning_rate": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm.item() if grad_norm is not None else None,
            "tokens_per_second": clock.interval_rate(),
            **self.accelerator.memory_stats(),
        }
        sinks.write(record)  # a no-op except on global rank 0
        return record["loss"]

    # -- evaluation and prediction -------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, eval_dataset=None, sinks: MetricSinks | None = None) -> dict:
        """Mean loss over the evaluation set (every rank takes its share) and its perplexity."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise InputError("evaluate() needs an eval_dataset")
        was_training = self.model.training
        self.model.eval()
        module = self._inference_module()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # (sum of losses, samples)
        for batch in self._eval_batches(dataset):
            batch = self._on_device(batch)
            with self._forward_context():
                loss = self._loss(batch, module)
            size = _batch_size(batch)
            total += torch.stack([loss.detach().double() * size, torch.tensor(size, device=self.device).double()])
            self.accelerator.mark_step()
        self.group.all_reduce_sum(total)
        loss_sum, count = total.tolist()
        self.model.train(was_training)
        eval_loss = loss_sum / max(count, 1)
        metrics = {"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 50.0))}
        if sinks is not None:
            sinks.write({"step": self.global_step, **metrics})
        return metrics

    @torch.no_grad()
    def predict(self, test_dataset) -> PredictionOutput:
        """Model outputs on `test_dataset` (this rank's share), with the loss when labels exist."""
        self.model.eval()
        module = self._inference_module()
        predictions, labels, losses = [], [], []
        for batch in self._eval_batches(test_dataset):
            batch = self._on_device(batch)
            with self._forward_context():
                output = self._forward(batch, module)
            logits = output["logits"] if isinstance(output, dict) else getattr(output, "logits", output)
            predictions.append(logits.float().cpu())
            if isinstance(batch, dict) and "labels" in batch:
                labels.append(batch["labels"].cpu())
                if (loss := _maybe_loss(output)) is not None:
                    losses.append(float(loss))
            self.accelerator.mark_step()
        metrics = {"test_loss": sum(losses) / len(losses)} if losses else {}
        return PredictionOutput(_concat(predictions), _concat(labels) if labels else None, metrics)

    # -- pieces of set-up ----------------------------------------------------------------------
    def _train_batches(self) -> MicroBatches:
        if self.train_dataset is None:
            raise InputError("train() needs a train_dataset")
        return MicroBatches(self.train_dataset, self.collate, self.args.per_device_train_batch_size,
                            self.args.gradient_accumulation_steps, self.group.dp_rank,
                            self.group.dp_size, self.args.seed)

    def _eval_batches(self, dataset):
        return MicroBatches(dataset, self.collate, self.args.per_device_eval_batch_size, 1,
                            self.group.dp_rank, self.group.dp_size, self.args.seed,
                            shuffle=False, drop_last=False).iterate(0, epochs=1)

    def _total_steps(self, batches: MicroBatches) -> int:
        if self.args.max_steps > 0:
            return self.args.max_steps
        if batches.steps_per_epoch is None:
            raise InputError("an iterable train_dataset has no length: set max_steps")
        if batches.steps_per_epoch == 0:
            raise InputError(f"the training set ({batches.num_samples} samples) is smaller than "
                             f"one global batch ({batches.global_batch_size} samples)")
        return math.ceil(self.args.num_train_epochs * batches.steps_per_epoch)

    def _sinks(self, total_steps: int, start_step: int) -> MetricSinks:
        if not self.group.is_main:
            return MetricSinks(None)
        return MetricSinks(self.args.output_dir, total_steps, start_step,
                           progress=not self.args.disable_tqdm)

    def _flops_per_token(self) -> float:
        if hasattr(self.model, "flops_per_token"):
            return self.model.flops_per_token()
        return 6 * sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def _peak_flops(self) -> float | None:
        peak = self.accelerator.peak_flops(self.precision.compute_dtype)
        return peak * self.group.world_size if peak else None

    # -- checkpoints and signals ---------------------------------------------------------------
    def _state(self, batches: MicroBatches) -> dict:
        state = {"global_step": self.global_step, "epoch": batches.epoch_of(self.global_step),
                 "world_size": self.group.world_size, "seed": self.args.seed,
                 "global_batch_size": batches.global_batch_size}
        config = getattr(self.model, "config", None)
        if dataclasses.is_dataclass(config):  # the built-in GPT's shape, for `hputrain generate`
            state["model_config"] = dataclasses.asdict(config)
        return state

    def _save(self, batches: MicroBatches):
        return checkpoint.save_checkpoint(
            self.args.output_dir, self.global_step, model=self.model, optimizer=self.optimizer,
            scheduler=self.scheduler, state=self._state(batches), accelerator=self.accelerator,
            rank=self.group.rank, world_size=self.group.world_size,
            save_total_limit=self.args.save_total_limit, barrier=self.group.barrier)

    def _resume(self, spec: str | None) -> dict:
        if not spec and self.group.restarts and checkpoint.latest_checkpoint(self.args.output_dir):
            spec = "latest"  # torchrun restarted the job after a failure: pick up where it was
        if not spec:
            return {}
        folder = checkpoint.resolve_checkpoint(self.args.output_dir, spec)
        state = checkpoint.load_checkpoint(folder, model=self.model, optimizer=self.optimizer,
                                           scheduler=self.scheduler, accelerator=self.accelerator,
                                           rank=self.group.rank)
        self.accelerator.mark_step()
        return state

    def _catch_stop_signals(self) -> dict:
        """SIGINT and SIGTERM end the current step, save a checkpoint and return from train()."""
        def stop(signum, frame):
            self._stop_signal = signum
        previous = {}
        if _in_main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous[signum] = signal.signal(signum, stop)
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# -- small helpers ---------------------------------------------------------------------------------

def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _batch_size(batch) -> int:
    first = next(iter(batch.values())) if isinstance(batch, dict) else (
        batch[0] if isinstance(batch, (list, tuple)) else batch)
    return int(first.shape[0])


def _token_count(batch) -> int:
    """Tokens in a batch: the size of input_ids when there is one, else one per sample."""
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"].numel()
    return _batch_size(batch)


def _maybe_loss(output):
    try:
        return loss_of(output)
    except InputError:
        return None


def _concat(tensors: list):
    if tensors and all(t.shape[1:] == tensors[0].shape[1:] for t in tensors):
        return torch.cat(tensors)
    return tensors
