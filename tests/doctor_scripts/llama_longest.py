"""The pad-to-longest Llama of issue 22: a fine-tune whose collator pads each batch of 4 to its
longest row, rows truncated at 48 tokens, for `hputrain doctor`.

`python llama_longest.py [longest|multiple]`: 256 rows of ragged lengths (6 plus an exponential
draw of mean 14, so most rows are short and a few reach the cut at 48), trained for 3 epochs of 64
steps. `longest` (llama.py's "ragged" collator) pads each batch to its longest row: the first 8
steps bring 5 shapes, at steps 1 to 5, and none after (the data's seed was picked for it, as in
the report: a short window that looks bounded), while an epoch brings 29. `multiple` leaves the
collator out and sets pad_to_multiple_of=16: the default collator pads to 16, 32 or 48.
"""
import sys

import torch

from hputrain import Trainer, TrainingArguments

from llama import VOCAB, collator, model  # noqa: E402  (doctor_scripts/ is on sys.path)

TRUNCATE, ROWS, SEED = 48, 256, 2701


def lengths(n=ROWS):
    g = torch.Generator().manual_seed(SEED)
    return (6 + torch.empty(n).exponential_(1 / 14, generator=g)).long().clamp(max=TRUNCATE).tolist()


def rows(n=ROWS):
    g = torch.Generator().manual_seed(0)
    out = []
    for length in lengths(n):
        ids = torch.randint(1, VOCAB, (length,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def main(layout):
    settings = dict(output_dir="doctor-should-not-write-here", num_train_epochs=3, logging_steps=2,
                    per_device_train_batch_size=4, learning_rate=1e-3, save_steps=50)
    if layout == "multiple":
        args, collate = TrainingArguments(**settings, pad_to_multiple_of=16), None
    else:
        args, collate = TrainingArguments(**settings), collator("ragged", mask=False)
    Trainer(model(positions=64), args, train_dataset=rows(), data_collator=collate).train()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "longest")
