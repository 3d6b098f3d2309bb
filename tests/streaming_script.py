"""A streaming run used by test_streaming.py, in-process and as a subprocess that gets killed:
a tiny Llama trained on a folder of text shards read as a stream (recipes/hf/stream.py)."""
import sys
import time
from types import SimpleNamespace

import torch

from hputrain import Callback, Trainer, TrainingArguments


class SlowAfter(Callback):
    """A pause after each step past `after` (so a test can kill the run mid-way at a known place).
    The pause changes no number."""

    def __init__(self, after):
        self.after = after

    def on_step_end(self, trainer):
        if self.after is not None and trainer.global_step > self.after:
            time.sleep(0.5)


def main(output_dir, model_folder, shards, resume=None, slow_after=None, max_steps=12, workers=0):
    import transformers

    from hputrain.recipes.hf.stream import stream_data

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_folder)
    options = SimpleNamespace(dataset=shards, text_column="text", method="auto", packing=True,
                              chat_template=None, assistant_only_loss=True, completion_only_loss=True)
    data = stream_data(options, tokenizer, 32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    args = TrainingArguments(output_dir=output_dir, max_steps=max_steps, save_steps=6, logging_steps=1,
                             learning_rate=3e-3, per_device_train_batch_size=4, disable_tqdm=True,
                             resume_from_checkpoint=resume, throughput_warmup_steps=0,
                             accelerator="cpu", dataloader_num_workers=workers, report_to=[])
    Trainer(model, args, train_dataset=data.train, callbacks=[SlowAfter(slow_after)]).train()
    return model


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], slow_after=int(sys.argv[4]))
