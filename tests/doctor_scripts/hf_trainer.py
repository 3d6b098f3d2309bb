"""A transformers Trainer script as transformers' Gaudi page shows one (Trainer + TrainingArguments,
nothing Gaudi-specific in it), fine-tuning a local causal LM folder on short texts, for
`hputrain doctor`.

`python hf_trainer.py MODEL_DIR longest|multiple|max_length [--group-by-length]`: the texts are
tokenized without padding and DataCollatorForLanguageModeling pads each batch to its longest row
(`longest`), or to a multiple of 16 (`multiple`, pad_to_multiple_of=16); or the tokenizer pads
every row to 48 tokens (`max_length`). It prints the device transformers chose (the
stand-in's hpu reads "lazy").
"""
import sys

from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling,
                          Trainer, TrainingArguments)
from transformers.utils import is_torch_hpu_available

WORDS = "the quick brown fox jumps over the lazy dog while a stitch in time saves nine".split()


def texts(n=96):
    """Texts of 2 to 20 words (up to about 30 tokens), a different length almost every row."""
    return [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + (i * 7) % 19)) for i in range(n)]


def main(folder, padding, group_by_length):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    fixed = dict(padding="max_length") if padding == "max_length" else {}
    rows = [dict(tokenizer(text, truncation=True, max_length=48, **fixed)) for text in texts()]
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False,
                                               pad_to_multiple_of=16 if padding == "multiple" else None)
    args = TrainingArguments(output_dir="doctor-should-not-write-here", max_steps=30, logging_steps=5,
                             per_device_train_batch_size=4, learning_rate=1e-3, save_steps=10,
                             train_sampling_strategy="group_by_length" if group_by_length else "random")
    print(f"device: {args.device.type}, hpu available: {is_torch_hpu_available()}")
    model = AutoModelForCausalLM.from_pretrained(folder)
    Trainer(model=model, args=args, train_dataset=rows, data_collator=collator).train()
    print("the doctor should have stopped the run before this line")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--group-by-length" in sys.argv[3:])
