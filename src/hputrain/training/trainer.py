"""The training loop, readable top to bottom.

`Trainer.train` is forward, backward, clip, step, log, in that order. Three things are visible
where they happen: the lazy-mode `mark_step()` calls, the gradient-accumulation sync, and the
throughput clock. The step reads nothing back to the host except at logging steps. Callbacks
(callbacks/) are called where the hooks' names say; what is written (metrics.jsonl, the
progress bar, TensorBoard) is written by callbacks. Evaluation and prediction: evaluation.py (an
Evaluator); when to log, evaluate and save, and the best checkpoint: intervals.py; SIGINT and
SIGTERM: signals.py.
"""
from __future__ import annotations

import contextlib
import inspect
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..accelerators import detect_accelerator
from ..callbacks import (Callback, CallbackHost, for_every_trainer, profiling_callbacks,
                         reporting_callbacks, show_message)
from ..callbacks.profiler import PROFILE_DIR
from ..callbacks.writers import METRICS_FILE, SUPERSEDED_FILE, TENSORBOARD_DIR, notice
from ..checkpoint import export
from ..checkpoint import saving as checkpoint
from ..checkpoint.folder import (FINAL_DIR, RECIPE_FILE, checkpoint_dir, drop_set_aside, method_files,
                                 lock_output_dir, rotate_checkpoints)
from ..checkpoint.start import Start, agree_on_start, load_start, reached_end
from ..config.accelerator_config import AcceleratorConfig
from ..config.arguments import TrainingArguments, as_training_arguments, check_trainer_kwargs
from ..config.sections import Sections
from ..data.batching import (LABEL_NAMES, DropUnusedColumns, LoaderOptions, MicroBatches,
                             default_collator_for, host_can_pin, to_device)
from ..distributed import ProcessGroup, select_strategy
from ..distributed.context_parallel import context_parallel_of
from ..distributed.fsdp import reshard
from ..distributed.launch import needs_launch, relaunch_current_program
from ..distributed.launchers import adopt_launcher_env
from ..distributed.placement import move_to_device
from ..distributed.selection import set_layout
from ..errors import InputError
from ..execution import kernels
from ..execution import modes as execution
from ..execution.precision import select_precision
from . import evaluation, failures
from .evaluation import PredictionOutput, loss_of, pad_and_concat  # noqa: F401  (imported from here too)
from .intervals import BestCheckpoint, Intervals, total_steps_of
from .objective import Loop, Objective
from .optim import create_optimizer, create_scheduler, resume_notes
from .packed import packing_keys
from .prepare import prepare_model
from .report import PLOT_FILES
from .extras import model_extras, token_mask
from .signals import StopSignals
from .telemetry import ThroughputClock, flops_per_token, job_peak_flops


@dataclass
class TrainOutput:
    global_step: int
    training_loss: float | None
    metrics: dict = field(default_factory=dict)
    interrupted_by: int | None = None  # the signal the ranks agreed to stop early for, if any
    already_done: bool = False  # the run had ended before (final/ written): nothing trained or written


class Trainer(CallbackHost):
    def __init__(self, model: torch.nn.Module, args: TrainingArguments | dict | None = None,
                 train_dataset=None, eval_dataset=None, data_collator=None, compute_loss=None,
                 accelerator_config: AcceleratorConfig | None = None, accelerator=None,
                 compute_metrics=None, callbacks=None, processing_class=None, objective=None,
                 **unsupported) -> None:
        check_trainer_kwargs(unsupported, _KEYWORDS)  # Hugging Face's names: one line on what to use
        # those added to every trainer (callbacks.added_to_every_trainer), then the caller's
        self.callbacks: list[Callback] = [*for_every_trainer(), *(callbacks or [])]
        args = as_training_arguments(args)
        for callback in self.callbacks:  # the doctor rehearses a script's trainers lazily, elsewhere
            if (folder := callback.rehearsal_dir()) is not None:
                args = args.for_rehearsal(folder)
        self.args = args
        self.settings = Sections.of(args)  # each subsystem's own part of args, cut once
        adopt_launcher_env(self.args.devices, self.args.num_nodes)  # mpirun's or srun's ranks, as torchrun's
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
        set_layout(self.settings.parallelism, self.group)  # fsdp's shard dimension, before the processes join
        self.device = self.accelerator.setup(self.group.local_rank)
        self.group.init(self.args.ddp_timeout, self.device.type)
        self.precision = select_precision(self.settings.precision, self.config, self.accelerator)
        if self.precision.notice and self.group.is_main:  # bf16 asked for where it is emulated
            notice(self.precision.notice)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.collate = data_collator or default_collator_for(model, self.settings.data)  # length buckets
        self.compute_loss = compute_loss
        self.compute_metrics = compute_metrics  # eval_pred -> dict, for evaluate() (evaluation.py)
        if self.group.is_main:  # metrics.jsonl, the bar, the trackers: written by rank 0 only
            self.callbacks += reporting_callbacks(self.settings.reporting)
        # the profiler on every rank: each writes its own trace (callbacks/profiler.py)
        self.callbacks += profiling_callbacks(self.settings.profiling, self.accelerator,
                                              self.group.rank)
        self.processing_class = processing_class  # a tokenizer: saved beside the model by save_model
        self.strategy = select_strategy(self.settings.parallelism, self.group, self.accelerator,
                                        self.precision)
        # kernels, precision, placement, checkpointing, the strategy's wrap, graphs or compile:
        # in one place (prepare.py), which `hputrain plan` prepares its traced model with too
        prepared = prepare_model(model, self.args, self.settings, accelerator=self.accelerator,
                                 precision=self.precision, strategy=self.strategy, device=self.device)
        self.model, self.wrapped, self.kernels = prepared.model, prepared.wrapped, prepared.kernels
        self.inputs, self.packed, self._prepared = prepared.inputs, prepared.packed, prepared
        # the training method (objective.py): language modelling unless a method says otherwise
        self.objective = objective if objective is not None else Objective()
        self.count_tokens = self.objective.count_tokens(model)
        # the model kind's extra losses and metrics (a MoE's router: kinds/moe/router.py)
        self.router = model_extras(self.model, args, self.group, self.inputs, self.device)
        self.context_parallel = context_parallel_of(self.group, self.inputs)
        self.optimizer = self.scheduler = None
        self._device_users = 0  # train/evaluate/predict calls under way (see _model_on_device)
        self._step_tokens = self._step_seen = 0  # counted tokens of the step's global batch (loss.py)
        self._graphed = None  # the captured inference module, built on first use
        self.global_step = self.total_steps = 0
        self.should_stop = False  # set by a callback to end training after the current step
        self.step_inputs = None  # the current step's last micro-batch, for callbacks
        # Stopping (see _agree): what this process was asked, and what every rank agreed to do.
        self._signals = StopSignals()  # SIGINT / SIGTERM caught here, maybe not yet agreed
        self._stop_signal: int | None = None  # the signal the ranks agreed to stop for
        self._stopping = False  # the ranks agreed to stop after the current step
        self._data_failed = False  # ... because a rank's data failed (failures.py)
        self.saved_step = 0  # the step of the run's last checkpoint (0: none)
        self.best = BestCheckpoint(self.settings.schedule, {})
        self.objective.bind(self._loop())

    # -- the training loop ---------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | None = None) -> TrainOutput:
        # One run per output_dir: rank 0 holds its lock for the run (the kernel drops it on any
        # exit), clears what a killed save left, and decides where the run starts, for every rank.
        lock = lock_output_dir(self.args.output_dir) if self.group.is_main else None
        self.should_stop, self._stopping, self._stop_signal = False, False, None
        try:
            self.group.barrier()
            start = agree_on_start(self.group, self.args.output_dir, resume_from_checkpoint
                                   or self.args.resume_from_checkpoint,
                                   overwrite=self.args.overwrite_output_dir, files=_RUN_FILES + method_files(),
                                   metrics=METRICS_FILE)
            self._job = start.job  # recorded in this run's checkpoints: its restarts continue them
            if start.note is not None:  # starting from the beginning: what of an earlier run moved
                self.log_message(start.note)
            self._signals.install()  # after the barrier: see signals.py
            with self._model_on_device():
                # what the method prepares beside the model (DPO's precomputed reference)
                self.train_dataset, self.eval_dataset = self.objective.prepare(self.train_dataset,
                                                                               self.eval_dataset)
                # a forward with no backward there (DPO's precompute) leaves fsdp's root and last
                # block gathered, in place of the shards the optimizer, built next, must hold
                reshard(self.model)
                return self._train(start)
        finally:
            self._signals.restore()
            if lock is not None:
                lock.release()

    def _train(self, start: Start) -> TrainOutput:
        args, settings, accelerator = self.args, self.settings, self.accelerator
        checkpoint.seed_generators(args.seed)
        batches = self.train_batches()
        total_steps = self.total_steps = total_steps_of(batches, args.max_steps, args.num_train_epochs)
        intervals = Intervals(settings.schedule, batches.steps_per_epoch, total_steps)
        intervals.check_best_model(settings.schedule, self.eval_dataset is not None)
        self.optimizer = create_optimizer(self.model, settings.optimizer, self.config, accelerator)
        self.scheduler = create_scheduler(self.optimizer, settings.optimizer, total_steps)
        state = load_start(start, model=self.model, optimizer=self.optimizer,
                           scheduler=self.scheduler, accelerator=accelerator, rank=self.group.rank,
                           strategy=self.strategy, batches=batches)
        self.global_step = self.saved_step = state.get("step", 0)  # saved_step: the last checkpoint's
        if (done := reached_end(start, total_steps)) is not None:  # a finished run, run again: the
            self.log_message(done)  # model holds its checkpoint's weights (checked as it loaded)
            return TrainOutput(start.step, None, already_done=start.final)
        self.best = BestCheckpoint(settings.schedule, state)
        clock = ThroughputClock(args.throughput_warmup_steps, accelerator.synchronize)
        watch = execution.step_watch(settings.execution, accelerator)  # graph compiles in lazy mode
        micro_batches = batches.iterate(self.global_step)
        accumulate = args.gradient_accumulation_steps
        logged_loss = self._device_zero()  # summed on device between logs
        steps_since_log, grad_norm, last_loss = 0, None, None
        params = list(self.model.parameters())  # once: walking the modules every step costs ~0.25 ms
        self.model.train()
        finished = False
        try:
            self._call("on_train_begin")
            for line in resume_notes(state, batches.global_batch_size, self.scheduler, args.learning_rate,
                                     self.group.world_size) + self.objective.resume_notes(state):
                self.log_message(line)
            while self.global_step < total_steps:
                try:  # bad data is held, agreed on below, and saved from (failures.py)
                    step_batches, bad = [self._on_host(next(micro_batches)) for _ in range(accumulate)], None
                except InputError as error:
                    step_batches, bad = [], failures.held(error, self, batches)
                counts = [self.count_tokens(batch) for batch in step_batches]
                # Every rank leaves the loop here, at the same step: a signal, a callback's
                # should_stop or bad data on any rank, noted since the previous agreement, stops them all.
                if self._agree_to_stop(counts, self.count_tokens.seen(step_batches, counts), bad is not None):
                    if self._data_failed:  # every rank saves the steps done, then the run ends
                        failures.end_on_bad_data(self, bad, batches, intervals, logged_loss, steps_since_log)
                    break
                watch.step_begin(self.global_step + 1)
                self._call("on_step_begin")
                samples = 0
                for micro, (batch, count) in enumerate(zip(step_batches, counts)):
                    batch = to_device(batch, self.device, args.non_blocking_data_copy)
                    samples += self.count_tokens.samples(batch)  # rows, or DPO's pairs
                    # Gradients are all-reduced only on the last micro-batch of the step.
                    with self.strategy.gradient_sync(self.wrapped, micro == accumulate - 1):
                        with self._forward_context():
                            loss = self._micro_batch_loss(batch, count)  # the LM's, as logged
                            optimized = self.router.add_aux_loss(loss)  # + coef · a MoE's aux
                        if args.pipelining_fwd_bwd:
                            accelerator.mark_step()  # run the forward graph while building backward
                        optimized.backward()
                    accelerator.mark_step()
                    logged_loss += loss.detach()
                self.strategy.reduce_gradients(self.model)  # fast_ddp: one flat all-reduce
                if args.max_grad_norm > 0:
                    grad_norm = self.strategy.clip_grad_norm(accelerator, params, args.max_grad_norm,
                                                             fused=self.config.use_fused_clip_norm)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.router.step_done()  # DeepSeek-V3's bias update, when asked (router.py)
                accelerator.mark_step()
                self.global_step += 1
                watch.step_end(self.global_step, batch)
                self.step_inputs = batch
                self._call("on_step_end")
                steps_since_log += 1
                # samples are shared by a context-parallel group; tokens are counted globally
                clock.step_done(samples * self.group.dp_size, self._step_seen)

                if intervals.logs(self.global_step):
                    clock.pause()  # the read-back below is the only host sync of the loop
                    last_loss = self._log(clock, batches, logged_loss, steps_since_log, grad_norm)
                    logged_loss, steps_since_log = self._device_zero(), 0
                    clock.resume()
                if intervals.evaluates(self.global_step) and self.eval_dataset is not None:
                    clock.pause()
                    self._evaluate_during_training()
                    clock.resume()
                if intervals.saves(self.global_step):
                    clock.pause()
                    self._agree_before_save(logged_loss, steps_since_log)  # finite? the last save?
                    self._save(batches)
                    clock.resume()
            summary = self._finish(intervals, clock, batches, watch, logged_loss, steps_since_log)
            finished = True
        except Exception as error:
            failures.note_unsaved(self, error)  # what a crash inside a step leaves unsaved, and why
            raise
        finally:
            self.step_inputs = None
            self._end_callbacks(finished)
        return TrainOutput(self.global_step, last_loss, summary, self._stop_signal)

    def _finish(self, intervals: Intervals, clock: ThroughputClock, batches: MicroBatches,
                watch: execution.StepWatch, logged_loss: torch.Tensor, steps_since_log: int) -> dict:
        """After the last step (or a stop): evaluate and save unless the step just did, load the
        best checkpoint's weights (load_best_model_at_end), then write the summary record. Each
        branch follows what every rank agreed (_stop_signal), never this rank's own flags: the
        evaluation and the save are collectives."""
        step = self.global_step
        if self._stop_signal is not None:
            saves = intervals.saves_at_all
            self.log_message(f"signal {self._stop_signal} received: "
                             + (f"saving a checkpoint at step {step}" if saves else f"stopping at step {step}"))
        elif self.eval_dataset is not None and not intervals.evaluates(step):
            self._evaluate_during_training()
        if intervals.saves_at_all and not intervals.saves(step):
            self._agree_before_save(logged_loss, steps_since_log)
            self._save(batches)
        if self.best.folder is not None and self._stop_signal is None:
            self._load_best()
        peaks = job_peak_flops(self.accelerator, self.precision.compute_dtype, self.group.world_size)
        summary = {"step": step, **clock.summary(flops_per_token(self.model), *peaks),
                   **watch.summary()}
        if fallbacks := self.kernels.get(kernels.FALLBACK):  # calls a fused kernel could not take
            summary["attention_fallback_calls"] = fallbacks
        self._call("on_log", summary)
        return summary

    # -- callbacks -----------------------------------------------------------------------------
    def log_message(self, text: str) -> None:
        """A line for the user on rank 0 (resume notes, signals, early stopping): above the
        progress bar when there is one, else on stdout."""
        if self.group.is_main:
            show_message(self.callbacks, text)

    @property
    def _compute_loss(self):
        """The user's compute_loss, else the method's (None: the model's own loss)."""
        return self.compute_loss if self.compute_loss is not None else self.objective.compute_loss

    def _loss(self, batch, module=None, **loss_kwargs) -> torch.Tensor:
        module = self.wrapped if module is None else module
        if self._compute_loss is not None:
            return self._compute_loss(module, batch)
        return loss_of(self._forward(batch, module, **loss_kwargs))

    def _micro_batch_loss(self, batch, count: int) -> torch.Tensor:
        """This micro-batch's part of the step's loss (see loss.py): its share of the mean over
        the global batch's `_step_tokens` counted tokens, times the number of ranks, because the
        strategy averages gradients over ranks where the loss wants their sum."""
        total, ranks = max(self._step_tokens, 1), self.group.world_size
        takes_count = (self.count_tokens.takes_item_count and self._compute_loss is None
                       and isinstance(batch, dict) and "labels" in batch)
        if takes_count:  # the model divides its summed loss by the global count itself
            loss = self._loss(batch, num_items_in_batch=self._on_device_scalar(total, torch.int64))
            return loss * ranks if ranks > 1 else loss  # a constant of the run: no new graph
        # a mean over the micro-batch's own tokens, weighted by their share (changes every step)
        return self._loss(batch) * self._on_device_scalar(count * ranks / total)

    def _agree_to_stop(self, counts: list[int], seen: int, failed: bool = False) -> bool:
        """Before each step, one small host all-reduce (no device sync) that every rank reaches:
        the global batch's counted tokens (and the tokens the throughput counts: `seen`), and
        whether the ranks stop before this step (_agree; `failed`: this rank's data failed). A
        stop then ends the same step on every rank, which save one checkpoint together."""
        tokens, seen = self._agree([sum(counts), seen], failed)
        self._step_tokens, self._step_seen = int(tokens), int(seen)
        return self._stopping or self._data_failed

    def _agree(self, values: list[float], failed: bool = False) -> list[float]:
        """`values` summed over the ranks, in one host all-reduce that also carries each rank's
        stop requests: a signal it caught, a callback's should_stop, its data failing. Whatever a
        rank does about stopping follows from the result alone, the same on every rank
        (_stopping, _stop_signal, should_stop, _data_failed), never from its own flags: a signal
        that lands after this rank read its flag (during the all-reduce, or anywhere later in
        the step) is counted by the next agreement, on every rank alike."""
        received = self._signals.received  # read once: what the all-reduce carries is what counts
        *sums, interrupts, terminates, callback_stops, bad_data = self.group.host_sum(
            [*values, received == signal.SIGINT, received not in (None, signal.SIGINT), self.should_stop, failed])
        if interrupts or terminates:  # SIGTERM wins where ranks caught different signals
            self._stop_signal = signal.SIGTERM if terminates else signal.SIGINT
        self.should_stop = bool(callback_stops)  # a callback on one rank stops them all
        self._data_failed = bool(bad_data)  # a rank's data: every rank saves, then ends (failures.py)
        self._stopping = self._stop_signal is not None or self.should_stop
        return sums

    def _on_host(self, batch):
        """This rank's slice of each sequence under context parallelism, still on the host, where
        its tokens are counted before it is copied over. A Hugging Face collator's BatchEncoding
        becomes a plain dict."""
        return self.context_parallel.shard(dict(batch) if isinstance(batch, Mapping) else batch)

    @property
    def _collate(self) -> DropUnusedColumns:
        """The collator on samples without the columns the model does not take (a text column
        above all): the Hugging Face Trainer's remove_unused_columns. A data.py object, not a
        method of the Trainer, so that data workers started by spawn pickle the collator alone."""
        if self.objective.collate is not None:
            return self.objective.collate  # the method builds the model's inputs itself
        dropping = self.inputs is not None and self.args.remove_unused_columns
        keep = self.inputs | LABEL_NAMES | packing_keys() if dropping else None
        return DropUnusedColumns(self.collate, keep)

    def _on_device_scalar(self, value: float, dtype=torch.float32) -> torch.Tensor:
        """A number the step uses, made on the host and copied over: in lazy mode it is graph
        input data, so a value that changes every step compiles nothing new. Copied as one
        element and viewed as a scalar: the CPU lazy backend looks 0-d inputs up by value, and
        one that happened to equal another scalar of the graph would change its hash."""
        return torch.tensor([value], dtype=dtype).to(self.device).view(())

    @contextlib.contextmanager
    def _forward_context(self):
        """What the forward pass runs under: the device's needs, context-parallel attention,
        and the precision's autocast."""
        with (self.accelerator.forward_context(), self.context_parallel.forward_context(),
              self.precision.forward_context()):
            yield

    def _device_zero(self) -> torch.Tensor:
        """A zero made on the host and copied over: in lazy mode a copy is graph input data, where
        `zero_()` would be one more op in the next step's graph."""
        return torch.zeros(()).to(self.device)

    def _forward(self, batch, module=None, **loss_kwargs):
        """Call the model (or `module`) on a batch (Prepared.forward: a packed block's mask built,
        only the keys the forward takes), with `loss_kwargs` (num_items_in_batch)."""
        with self.router.recording(token_mask(batch)):  # a MoE's router logits, for its loss
            return self._prepared.forward(self.wrapped if module is None else module, batch,
                                          **self.router.forward_kwargs, **loss_kwargs)

    def _inference_module(self):
        """The module evaluate and predict call: captured graphs with use_graphs_for_inference."""
        if not self.args.use_graphs_for_inference:
            return self.wrapped
        if self._graphed is None:
            from ..execution.inference import wrap_for_inference

            self._graphed = wrap_for_inference(self.model, self.accelerator)
        return self._graphed

    def _log(self, clock, batches, logged_loss, steps, grad_norm) -> float:
        """One logging record; the host reads the loss and grad norm back only here. Nothing here
        adds an op to the device's graph, so in lazy mode the next step compiles nothing new."""
        loss = self.group.all_reduce_mean(logged_loss).item() / steps
        failures.stop_if_diverged(loss, self.global_step, steps, self.args.learning_rate)
        record = {
            "step": self.global_step,
            "epoch": round(batches.epoch_of(self.global_step), 4),
            "loss": loss,
            "learning_rate": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm.item() if grad_norm is not None else None,
            "tokens_per_second": clock.interval_rate(),
            **self.accelerator.memory_stats(),
            **self.objective.metrics(self.group),  # the method's own: DPO's rewards, GRPO's ...
            **self.router.metrics(self.group),  # aux_loss, router/max_load.layer0, ...
        }
        self._call("on_log", record)
        return record["loss"]

    def _agree_before_save(self, logged_loss: torch.Tensor, steps: int) -> None:
        """Before a save, one more agreement (_agree): the loss summed since the last log must be
        finite on every rank (never save diverged weights), and whether the run stops at this
        step, which makes this save its last (_save)."""
        (loss,) = self._agree([logged_loss.item() if steps else 0.0])
        if steps:
            failures.stop_if_diverged(loss, self.global_step, steps, self.args.learning_rate)

    # -- evaluation and prediction -------------------------------------------------------------
    def evaluate(self, eval_dataset=None) -> dict:
        """Mean loss over the evaluation set (every rank takes its share), its perplexity, and
        compute_metrics' results prefixed "eval_" (evaluation.py)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise InputError("evaluate() needs an eval_dataset")
        objective = self.objective
        dataset = objective.eval_dataset(dataset)  # DPO: pairs encoded, reference log-probs
        with objective.evaluating(), self.router.evaluating():  # training's sums kept aside
            metrics = evaluation.evaluate(self._evaluator(), dataset)
            if not objective.has_perplexity:
                metrics.pop("eval_perplexity", None)
            return {**metrics, **objective.metrics(self.group, prefix="eval_"),
                    **self.router.metrics(self.group, prefix="eval_")}

    def predict(self, test_dataset) -> PredictionOutput:
        """Model outputs on `test_dataset` (this rank's share), with the loss when labels exist
        (evaluation.py)."""
        return evaluation.predict(self._evaluator(), test_dataset)

    def _evaluator(self) -> evaluation.Evaluator:
        """Evaluation's collaborators, from this trainer (evaluation.py reads nothing else)."""
        return evaluation.Evaluator(
            model=self.model, module=self._inference_module, forward=self._forward,
            compute_loss=self._compute_loss, compute_metrics=self.compute_metrics,
            collate=self._collate, batch_size=self.args.per_device_eval_batch_size,
            seed=self.args.seed, group=self.group, lockstep=self.strategy.forward_is_collective,
            device=self.device, non_blocking=self.args.non_blocking_data_copy,
            on_host=self._on_host, count_tokens=self.count_tokens,
            device_scalar=self._on_device_scalar, forward_context=self._forward_context,
            mark_step=self.accelerator.mark_step, on_device=self._model_on_device,
            uncounted=lambda: self.router.uncounted(self.objective.uncounted()))

    def _evaluate_during_training(self) -> None:
        metrics = self.evaluate()
        self._call("on_log", {"step": self.global_step, **metrics})
        self.best.evaluated(self.global_step, metrics)
        self._call("on_evaluate", metrics)

    @contextlib.contextmanager
    def _model_on_device(self):
        """The model on this rank's device for the duration of train(), evaluate() or predict();
        afterwards handed back on the host where the accelerator says its tensors are no use to
        host code (lazy mode on the CPU), tied weights kept tied. Only the outermost call moves it
        (train() evaluates inside)."""
        host = self.accelerator.host_device_after_training()
        outermost = self._device_users == 0
        if host is not None and outermost:
            move_to_device(self.model, self.device)  # a no-op right after __init__
        self._device_users += 1
        try:
            yield
        finally:
            self._device_users -= 1
            if host is not None and outermost:
                self.accelerator.mark_step()  # run what is pending before the weights move
                move_to_device(self.model, host)

    # -- pieces of set-up ----------------------------------------------------------------------
    def _loop(self) -> Loop:
        """The handles the training method may use (objective.py), instead of this Trainer."""
        return Loop(model=self.model, module=self.wrapped, device=self.device, group=self.group,
                    args=self.args, accelerator=self.accelerator, precision=self.precision,
                    sharded=self.strategy.shards_state, inputs=self.inputs,
                    forward_context=self._forward_context, on_device=self._model_on_device,
                    place_frozen=self._place_frozen, device_scalar=self._on_device_scalar,
                    router=self.router)

    def _place_frozen(self, module: torch.nn.Module, like_trained: bool = False) -> torch.nn.Module:
        """A frozen module (a reference) on this rank's device, sharded like the policy under
        fsdp, stored in bf16 under bf16 unless `like_trained` (Precision.convert_frozen)."""
        return self.strategy.place_frozen(self.precision.convert_frozen(module, like_trained),
                                          self.device)

    def train_batches(self) -> MicroBatches:
        """The run's batch source, as train() iterates it (the doctor walks it without the model)."""
        if self.train_dataset is None:
            raise InputError("train() needs a train_dataset")
        batches = MicroBatches(self.train_dataset, self._collate, self.args.per_device_train_batch_size,
                               self.args.gradient_accumulation_steps, self.group.dp_rank,
                               self.group.dp_size, self.args.seed, loading=self._loading(),
                               agree=self.group.host_sum,  # a rank-local stream's passes end together
                               notify=notice if self.group.is_main else None)
        return self.objective.train_batches(batches)  # GRPO: rollouts made from these prompts

    def described_batches(self, batches, steps: int, walked: str):
        """The doctor's RunShapes of `steps` steps of `batches` (train_batches'), told without taking
        them where taking them runs the model (GRPOTrainer's rollouts); None: the doctor walks them."""
        return None

    def _loading(self) -> LoaderOptions:
        """How batches are loaded: worker processes, pinned memory (only where the device copies
        from it asynchronously), batches prepared ahead."""
        args = self.args
        return LoaderOptions(args.dataloader_num_workers,
                             args.dataloader_pin_memory and self.accelerator.pins_memory() and host_can_pin(),
                             args.dataloader_prefetch_factor)

    # -- output and checkpoints ----------------------------------------------------------------
    def save_model(self, output_dir: str | None = None) -> None:
        """What `save_pretrained` writes, into `output_dir` (default: args.output_dir/final):
        see checkpoint/export.py. Every rank calls it (a sharded model is gathered first)."""
        final = Path(self.args.output_dir) / FINAL_DIR
        folder = Path(output_dir) if output_dir is not None else final
        export.save_model(self.model, folder, tokenizer=self.processing_class, group=self.group)
        if self.group.is_main and folder.resolve() == final.resolve():  # complete on disk: what an
            drop_set_aside(self.args.output_dir)  # earlier run left is replaced (checkpoint/start.py)

    # -- checkpoints and signals ---------------------------------------------------------------
    def _state(self, batches: MicroBatches) -> dict:
        return {"global_step": self.global_step, "epoch": batches.epoch_of(self.global_step),
                "world_size": self.group.world_size, "seed": self.args.seed, "job": self._job,
                "global_batch_size": batches.global_batch_size, **self.best.state(),
                **self.objective.state()}  # the model's configuration: its config.json (full.py)

    def _save(self, batches: MicroBatches) -> Path:
        # the strategy decides how the state is written; the last save of a run that stops (at
        # its end, by a signal or a callback) also writes the whole model (model.safetensors) of
        # a sharded run, for generate and other tools: a collective, so decided by what every
        # rank agreed just before (_agree_before_save), never by this rank's own flags
        last = self._stopping or self.global_step >= self.total_steps
        folder = checkpoint_dir(self.args.output_dir, self.global_step)
        self.best.saving(self.global_step, folder)  # recorded in this checkpoint's state
        tracking = self.best.enabled  # then rotation, below, keeps the best checkpoint too
        folder = checkpoint.save_checkpoint(
            self.args.output_dir, self.global_step, model=self.model, optimizer=self.optimizer,
            scheduler=self.scheduler, state=self._state(batches), accelerator=self.accelerator,
            rank=self.group.rank, world_size=self.group.world_size,
            save_total_limit=None if tracking else self.args.save_total_limit,
            barrier=self.group.barrier, state_io=checkpoint.state_io_for(self.strategy),
            consolidate=last, data_state=batches.data_state(self.global_step))
        self.saved_step = self.global_step
        if tracking and self.group.is_main:  # only rank 0 touches the folders
            rotate_checkpoints(self.args.output_dir,
                               self.best.keep_limit(self.args.save_total_limit, folder),
                               keep=self.best.folder or folder)
        self._call("on_save", folder)
        return folder

    def _load_best(self) -> None:
        """load_best_model_at_end: the best checkpoint's model weights back into the model (every
        rank: a sharded checkpoint loads collectively); the optimizer and generators stay."""
        folder = self.best.folder
        checkpoint.load_checkpoint(folder, model=self.model, accelerator=self.accelerator,
                                   rank=self.group.rank, restore_rng=False,
                                   state_io=checkpoint.state_io_for(self.strategy))
        self.accelerator.mark_step()
        self.log_message(f"loaded the best checkpoint, {folder.name} ({self.best.key} "
                         f"{self.best.metric:g})")


# what a run writes into output_dir (recipes' too; the methods' own: checkpoint/folder.method_files): set
# aside by a run from the beginning (start.py)
_RUN_FILES = (METRICS_FILE, SUPERSEDED_FILE, TENSORBOARD_DIR, PROFILE_DIR, FINAL_DIR,
              RECIPE_FILE, *PLOT_FILES)

# the keywords Trainer takes, for the one line on another one (config.arguments.check_trainer_kwargs)
_KEYWORDS = [name for name, parameter in inspect.signature(Trainer.__init__).parameters.items()
             if name != "self" and parameter.kind is not inspect.Parameter.VAR_KEYWORD]

