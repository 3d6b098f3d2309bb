"""Callbacks: code that runs at fixed points of training, as the Hugging Face Trainer's and
Lightning's callbacks do. The progress bar, metrics.jsonl and the trackers (TensorBoard, MLflow,
W&B) are callbacks too; `EarlyStopping` ships.

Every hook is called on every rank with the trainer, in the order of `trainer.callbacks`; a
callback that writes checks `trainer.group.is_main` (the built-in writers below are only given to
rank 0). A callback asks training to end by setting `trainer.should_stop = True`: the ranks agree
before the next step (one of them asking is enough), then the trainer evaluates and saves a
checkpoint as at the end of a run (unless save_steps is -1), calls on_train_end and returns from
train().

A Trainer's callbacks are, in order: those added to every trainer (below), those passed as
`callbacks=`, then on rank 0 the built-in writers (`reporting_callbacks`), then on every rank the
profiler when steps are asked for (`profiling_callbacks`).

Callbacks added to every trainer: a tool that runs a user's unmodified script and needs to
reach each Trainer it makes (`hputrain doctor`) wraps the run in

    with callbacks.added_to_every_trainer(make_callback):
        runpy.run_path(script)

and every Trainer constructed inside the block appends `make_callback()` to its callbacks. This
is the only process-wide input to a Trainer, and it exists only inside that block. The one setting
such a callback may change is named: a `rehearsal_dir()` moves the run to lazy mode on the CPU in
that folder (TrainingArguments.for_rehearsal), which is how the doctor rehearses a Gaudi run.
"""
from .base import Callback, CallbackHost, added_to_every_trainer, for_every_trainer
from .early_stopping import EarlyStopping
from .profiler import profiling_callbacks
from .writers import reporting_callbacks, show_message

__all__ = ["Callback", "CallbackHost", "EarlyStopping", "added_to_every_trainer", "for_every_trainer",
           "profiling_callbacks", "reporting_callbacks", "show_message"]
