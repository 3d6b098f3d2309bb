"""An error that ends a run after its first step: a checkpoint of the steps done is saved first
where that is safe, and the run says which, or why not (docs/reliability.md, "An error mid-run").

- Bad input met while reading the step's batches (a row, an image, a shard that cannot be read:
  an InputError from the data), on any rank: the rank holds it and joins the agreement every
  rank makes before each step (Trainer._agree), so that every rank learns of it at the same
  place, outside any collective; all then save a checkpoint of the steps done (a collective
  under ddp and fsdp) and end with the first failing rank's line, which names the checkpoint:
  that rank says it, the others end quietly once it has (distributed/failure.py). Where reading a batch is itself a collective (a rank-local stream's
  agreement at a pass's end, a GRPO rollout) on several processes, the other ranks may be
  inside it, where a save would hang: the line says so instead, and names the last checkpoint.
- A loss that is no longer finite: never saved (`stop_if_diverged` says so).
- Any other error inside a step (an exception in the forward, the backward or the optimizer,
  a peer's failure in a collective): no save, since the ranks may be inside a collective or
  the step half done; rank 0 says which checkpoint is the last before the traceback (running
  out of memory is one line of its own, cli/train.py's, which says the same).
- Other bad input mid-run (evaluation's data, a save that fails) ends with its own line.
"""
from __future__ import annotations

import math

from ..callbacks.writers import notice
from ..data.batching import MicroBatches
from ..distributed import failure
from ..errors import EveryRankError, InputError

RESUME = "resume with --resume-from-checkpoint latest"


def held(error: InputError, trainer, batches) -> InputError:
    """`error`, met while reading this rank's batches of the next step, to be agreed on and
    saved from (`end_on_bad_data`); raised at once, saying why nothing is saved, where reading
    a batch can be a collective of several processes."""
    local = isinstance(batches, MicroBatches) and not batches.own_shards
    if local or trainer.group.world_size == 1:
        return error
    if trainer.global_step == trainer.saved_step:
        raise error
    raise InputError(f"{error}; no checkpoint of steps {trainer.saved_step + 1}-{trainer.global_step} "
                     "is saved: reading a batch is a collective here (a stream's pass end, a "
                     "rollout), where the other ranks may wait and a save would hang; "
                     f"{_last(trainer.saved_step)}") from None


def end_on_bad_data(trainer, error: InputError | None, batches, intervals, logged_loss, steps: int):
    """Every rank, once the agreement said a rank's data failed (`error`: this rank's, or None):
    a checkpoint of the steps done, unless there is nothing new to save, checkpoints are off or
    the loss is no longer finite; then the first failing rank's line with what was saved, which
    that rank raises (and says); every other rank waits until it has said it, and raises the
    same line as an EveryRankError, which ends it quietly (said once)."""
    lines = trainer.group.gather_objects(None if error is None else str(error))
    first = next(rank for rank, line in enumerate(lines) if line is not None)
    (loss,) = trainer.group.host_sum([logged_loss.item() if steps else 0.0])
    step = trainer.global_step
    if step == trainer.saved_step:
        saved = (f"the run's steps are in checkpoint-{step}; {RESUME} once the data is fixed" if step
                 else "no step was trained")
    elif not intervals.saves_at_all:
        saved = f"no checkpoint is saved at step {step} (checkpoints are off: --save-strategy no)"
    elif not math.isfinite(loss):
        saved = (f"no checkpoint is saved at step {step}: the training loss since the last log is "
                 f"{loss}; {_last(trainer.saved_step)}")
    else:
        trainer._stopping = True  # agreed on every rank: this save is the run's last (consolidated)
        folder = trainer._save(batches)
        saved = f"{folder.name} was saved first; {RESUME} once the data is fixed"
    line = f"{lines[first]}; {saved}"
    if trainer.group.rank == first:
        raise InputError(line)
    failure.wait_for_peer()  # the failing rank's line is out and recorded: this one ends after it
    raise EveryRankError(line)


def note_unsaved(trainer, error: BaseException) -> None:
    """Rank 0's line before an error other than bad input ends the run inside a step: no
    checkpoint of the steps since the last one is saved, and why."""
    step, last = trainer.global_step, trainer.saved_step
    if isinstance(error, InputError) or step == last or not trainer.group.is_main:
        return
    if trainer.accelerator.is_out_of_memory(error):  # its one line says it (cli/train.py)
        return
    notice(f"the run ended at step {step} by {type(error).__name__} inside a step: no checkpoint of "
           f"steps {last + 1}-{step} is saved (the step is half done, and other ranks may be inside "
           f"a collective, where a save would hang); {_last(last)}")


def _last(step: int) -> str:
    return f"checkpoint-{step} is the last ({RESUME})" if step else "no checkpoint was saved yet"


def stop_if_diverged(loss: float, step: int, steps: int, learning_rate: float) -> None:
    """A loss that is no longer finite (the mean over the `steps` steps up to `step`) ends
    training at once, saving nothing new: the last checkpoint holds the last finite weights."""
    if not math.isfinite(loss):
        first = step - steps + 1
        where = f"at step {first}" if steps == 1 else f"between steps {first} and {step}"
        raise InputError(f"the training loss became {loss} {where} (learning_rate {learning_rate:g}): "
                         "stopped without saving; lower the learning rate or resume from the last "
                         "checkpoint")
