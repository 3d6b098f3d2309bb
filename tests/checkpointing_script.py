"""Trains the built-in GPT or a tiny Hugging Face Llama with or without activation checkpointing
and writes its losses: run in one process or through `hputrain launch` (tests/
test_activation_checkpointing.py). Arguments: OUTPUT_DIR gpt|llama [TRAINING_ARGUMENT=VALUE ...],
values as JSON (gradient_checkpointing=true, strategy="ddp")."""
import json
import sys

import torch

from hputrain import Trainer, TrainingArguments

VOCAB, ROWS = 64, 32


def build(kind: str, layers: int = 4, fp8: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        from hputrain.models.gpt import GPT, GPTConfig

        width = 64 if fp8 else 32  # fp8 takes Linear layers of at least 64
        return GPT(GPTConfig(vocab_size=VOCAB, n_layer=layers, n_head=2, n_embd=width, block_size=16))
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def rows(kind: str) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, VOCAB, (ROWS, 17), generator=generator)
    if kind == "gpt":  # labels already shifted
        return [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]
    return [{"input_ids": t[:-1], "labels": t[:-1]} for t in tokens]


def train(output_dir: str, kind: str, layers: int = 4, **overrides) -> list[float]:
    """The logged losses of 4 steps."""
    settings = dict(output_dir=output_dir, accelerator="cpu", max_steps=4, logging_steps=1,
                    per_device_train_batch_size=4, learning_rate=1e-2, save_steps=-1,
                    disable_tqdm=True, report_to="none", throughput_warmup_steps=0)
    model = build(kind, layers, overrides.get("fp8", False))
    trainer = Trainer(model, TrainingArguments(**settings | overrides),
                      train_dataset=rows(kind))
    trainer.train()
    with open(f"{output_dir}/metrics.jsonl") as metrics:
        return [r["loss"] for r in map(json.loads, metrics) if "loss" in r]


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2],
          **{key: json.loads(value) for key, value in (a.split("=", 1) for a in sys.argv[3:])})
