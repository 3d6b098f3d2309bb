"""LoRA runs of a tiny Hugging Face Llama under strategy="fsdp", for tests/checkpoint/test_lora_checkpoint.py,
started by `hputrain launch`, one after the other in the same processes:

    fsdp_lora_script.py BASE_MODEL_DIR RUN [RUN ...]    RUN: OUTPUT_DIR,MAX_STEPS[,RESUME_FROM]

Every run builds the LoRA model again from the base folder (adapters drawn under one seed), trains
at a constant learning rate with LoRA dropout (so each rank's RNG must come back on resume) and
saves a sharded checkpoint every 4 steps. Global rank 0 then writes OUTPUT_DIR/adapter.pt: the
trainable parameters, gathered whole from the shards.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hputrain import Trainer, TrainingArguments  # noqa: E402


def lora_llama(base: str):
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(11)
    config = peft.LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(model, config)


def rows(vocab: int) -> list[dict]:
    ids = torch.randint(4, vocab, (16, 12), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": row, "labels": row} for row in ids]


def run(base: str, output_dir: str, max_steps: int, resume: str | None = None) -> None:
    model = lora_llama(base)
    args = TrainingArguments(output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=2,
                             learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1,
                             save_steps=4, disable_tqdm=True, throughput_warmup_steps=0, seed=0,
                             accelerator="cpu", strategy="fsdp", ddp_timeout=60, report_to="none")
    trainer = Trainer(model, args, train_dataset=rows(model.config.vocab_size))
    trainer.train(resume_from_checkpoint=resume)
    adapter = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for name, p in model.named_parameters() if p.requires_grad}  # every rank: a collective
    if trainer.group.is_main:
        torch.save(adapter, os.path.join(output_dir, "adapter.pt"))


if __name__ == "__main__":
    for spec in sys.argv[2:]:
        output_dir, steps, *resume = spec.split(",")
        run(sys.argv[1], output_dir, int(steps), *resume)
