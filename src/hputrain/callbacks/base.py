"""The Callback interface, and the one documented way a tool reaches every Trainer a script makes
(added_to_every_trainer); see the package's docstring."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


class Callback:
    """The hooks, in the order a run reaches them. This base does nothing."""

    def rehearsal_dir(self) -> str | None:
        """A callback that rehearses the run instead of running it (the doctor) returns the
        folder to rehearse in: the Trainer then runs `args.for_rehearsal(folder)` (lazy mode on
        the CPU, nothing saved or evaluated). Asked once, at Trainer construction, before the
        device or the model is touched. The base rehearses nothing."""
        return None

    def on_train_begin(self, trainer) -> None:
        """After the optimizer, schedule and resumed state exist, before the first step
        (trainer.global_step is the step training starts from, trainer.total_steps its end)."""

    def on_step_begin(self, trainer) -> None:
        """Before the first micro-batch of each optimizer step."""

    def on_step_end(self, trainer) -> None:
        """After each optimizer step and its mark_step (trainer.global_step counts it;
        trainer.step_inputs is the step's last micro-batch, on the device)."""

    def on_log(self, trainer, record: dict) -> None:
        """A record for the logs: every logging step's, each evaluation's, and the summary at
        the end."""

    def on_evaluate(self, trainer, metrics: dict) -> None:
        """After evaluate() during training, with its metrics (eval_loss, ...)."""

    def on_save(self, trainer, folder) -> None:
        """After a checkpoint folder is complete (every rank, after the last barrier)."""

    def on_train_end(self, trainer) -> None:
        """At the end of train(), also when a signal or a callback stopped it, and when an error
        ended it (so that files and tracker runs are closed)."""


# -- callbacks added to every trainer --------------------------------------------------------------

_EVERY_TRAINER: list[Callable[[], Callback]] = []


@contextlib.contextmanager
def added_to_every_trainer(factory: Callable[[], Callback]) -> Iterator[None]:
    """Inside the block, every Trainer constructed appends `factory()` to its callbacks."""
    _EVERY_TRAINER.append(factory)
    try:
        yield
    finally:
        _EVERY_TRAINER.remove(factory)


def for_every_trainer() -> list[Callback]:
    """New callbacks from the factories of the enclosing `added_to_every_trainer` blocks."""
    return [factory() for factory in _EVERY_TRAINER]


class CallbackHost:
    """What owns `self.callbacks` (the Trainer): calls their hooks, and adds and removes them as
    the Hugging Face Trainer's add_callback / pop_callback / remove_callback do."""

    callbacks: list

    def _call(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def _end_callbacks(self, finished: bool) -> None:
        """on_train_end, also after an error (callbacks close their files and runs); then an
        error of a callback does not hide the one that ended training."""
        if finished:
            self._call("on_train_end")
            return
        with contextlib.suppress(Exception):
            self._call("on_train_end")

    def add_callback(self, callback: Callback | type) -> None:
        """Append a callback (an instance, or a class to make one of)."""
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def pop_callback(self, callback: Callback | type) -> Callback | None:
        """Remove and return the callback (that instance, or the first of that class), or None."""
        for found in self.callbacks:
            if found is callback or (isinstance(callback, type) and isinstance(found, callback)):
                self.callbacks.remove(found)
                return found
        return None

    def remove_callback(self, callback: Callback | type) -> None:
        self.pop_callback(callback)
