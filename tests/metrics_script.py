"""evaluate() with compute_metrics in every process of a launch: each rank evaluates its share of
an evaluation set that does not split evenly, and compute_metrics must see the whole set once
(tests/training/test_compute_metrics.py). Argument: OUTPUT_DIR; rank 0 writes metrics.json there."""
import json
import sys
from pathlib import Path

from hputrain import Trainer, TrainingArguments
from hputrain import metrics
from tests.training.test_compute_metrics import EVAL_SIZE, Classifier, classes


def counted_accuracy(eval_pred) -> dict:
    return {"samples": len(eval_pred.label_ids), **metrics.accuracy(eval_pred)}


out = Path(sys.argv[1])
args = TrainingArguments(output_dir=str(out / "run"), per_device_eval_batch_size=4, disable_tqdm=True,
                         report_to="none")
trainer = Trainer(Classifier(), args, compute_metrics=counted_accuracy)
result = trainer.evaluate(classes(EVAL_SIZE, seed=2))
if trainer.group.is_main:
    (out / "metrics.json").write_text(json.dumps(result))
