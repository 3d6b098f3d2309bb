"""The end of every recipe's run (gpt.py, hf.py): the final model written with save_pretrained's
layout, the recipe beside the checkpoints, the run's files listed and plotted. A run that had
already ended (TrainOutput.already_done) ends at train(), writing none of them; one that reached its
last step but ended before writing final/ writes them now, from its last checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint.folder import FINAL_DIR, RECIPE_FILE, SET_ASIDE_DIR
from ..checkpoint.saving import latest_checkpoint
from ..config.fields import ConfigError
from ..execution.kernels import describe
from ..training.report import write_report


def train_and_finish(trainer, header, record: dict, after=None, end: str = "\n") -> int:
    """What every Hugging Face recipe does once its trainer is made: `header()` printed on rank 0,
    the run trained, final/ written (every rank: a sharded model is gathered first), then on rank
    0 the recipe `record` and the run's files, and `after(final)`'s lines (what to load, the
    method's own counts) when final/ was written. The run's exit status."""
    if trainer.group.is_main:
        print(header(), end=end)
    output = trainer.train()
    if output.already_done:  # a finished run, run again: said by the trainer, nothing written
        return 0
    final = save_final(trainer, output)
    if not trainer.group.is_main:
        return 0
    write_recipe(trainer.args.output_dir, record)
    status = report_outputs(trainer, output)
    if status is None and final is not None and after is not None:
        print(after(final))
    return status or 0


def kernels_line(trainer) -> str:
    """", kernels: attention: sdpa ×2, ..." when the trainer swapped in device kernels, else ""."""
    return f", kernels: {describe(trainer.kernels)}" if trainer.kernels else ""


def save_final(trainer, output) -> Path | None:
    """The trained model as `save_pretrained` writes it, in output_dir/final; None when the run
    was stopped by a signal (its checkpoint is what to resume from) or the model's kind cannot
    be exported (said on the main rank: the run and its checkpoints are fine). Once written,
    what an earlier run left set aside is deleted (Trainer.save_model)."""
    if output.interrupted_by is not None:
        return None
    folder = Path(trainer.args.output_dir) / FINAL_DIR
    try:
        trainer.save_model(str(folder))
    except NotImplementedError as exc:
        if trainer.group.is_main:
            print(f"final model not written: {exc or 'export is not available in this build'}")
        return None
    return folder


def report_outputs(trainer, output) -> int | None:
    """Print where the run's files are (main rank); the exit status when a signal stopped it."""
    out = Path(trainer.args.output_dir)
    checkpoint = latest_checkpoint(out)
    if checkpoint is not None:  # none when save_steps is -1
        print(f"checkpoint: {checkpoint}")
    print(f"metrics:    {out / 'metrics.jsonl'}")
    try:
        for path in write_report(out):
            print(f"plot:       {path}")
    except ValueError as exc:  # matplotlib missing: the run itself is fine
        print(f"no plots: {exc}")
    if output.interrupted_by is not None:
        print(stopped_line(out, output, checkpoint))
        return 128 + output.interrupted_by
    if (out / FINAL_DIR).is_dir():
        print(f"final:      {out / FINAL_DIR}")
    return None


def stopped_line(out: Path, output, checkpoint: Path | None) -> str:
    """What a run stopped by a signal leaves: a checkpoint to resume, or, where it saved none
    (--save-steps -1, or a stop before its first save), what there is instead: no advice to
    resume what cannot be resumed."""
    said = f"stopped by signal {output.interrupted_by} at step {output.global_step}"
    if checkpoint is not None:
        return f"{said}; resume with --resume-from-checkpoint latest"
    aside = out / SET_ASIDE_DIR
    kept = f"; the earlier run set aside is kept whole in {aside}" if aside.is_dir() else ""
    return (f"{said} with no checkpoint saved, so there is nothing to resume: this run left only "
            f"its logs (metrics.jsonl){kept}")


def write_recipe(output_dir: str, record: dict) -> None:
    """The recipe (and model shape) beside the checkpoints, so a run can be rebuilt from them;
    written once the run has ended (train() holds output_dir's lock while it runs)."""
    out = Path(output_dir)
    try:
        (out / RECIPE_FILE).write_text(json.dumps(record, indent=2))
    except OSError as exc:
        raise ConfigError(f"output_dir {out} cannot be written: {exc.strerror} ({exc.filename})") from None
