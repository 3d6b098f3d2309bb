"""A tiny vision-language model (a local folder, tests/vlm_fixtures.py) trained with hputrain's
Trainer on packed image blocks, for `hputrain doctor`.

`python vlm.py FOLDER DATA`: DATA a `messages` JSONL file with images beside it, encoded and packed
by hputrain's image data path (kinds/vlm/data/: buckets, blocks of 96 tokens with a fixed number of
image slots, the collator that puts the batch's real images first). Blocks hold 0 to K real images
at places that change from step to step; the shapes do not.
"""
import sys

import torch
from transformers import AutoModelForImageTextToText

from hputrain import Trainer, TrainingArguments
from hputrain.kinds.vlm.data.encode import Processing
from hputrain.kinds.vlm.data.loading import load_image_data
from hputrain.kinds.vlm.data.rows import split_rows
from hputrain.recipes.hf import data as hf_data
from hputrain.recipes.hf import HFOptions


def main(folder, data):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(folder)
    options = HFOptions(model=folder, dataset=data, dataset_num_proc=1, validation_split_percentage=0)
    blocks = load_image_data(data, "messages", Processing.load(folder), 96, options,
                             rows=lambda split: split_rows(data, split, hf_data.records, hf_data.source_files))
    args = TrainingArguments(output_dir="doctor-should-not-write-here", max_steps=20, logging_steps=2,
                             per_device_train_batch_size=2, learning_rate=1e-3, save_steps=5,
                             remove_unused_columns=False)  # the collator reads image_count
    Trainer(model, args, train_dataset=blocks.train, data_collator=blocks.collator).train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
