"""Trains a tiny Hugging Face Llama (or the built-in GPT) on ragged, padded rows and saves its
weights: run in one process or through `hputrain launch` (tests/training/test_loss.py). Arguments:
OUTPUT_DIR BATCH ACCUMULATE [llama|gpt]."""
import sys

import torch

from hputrain import Trainer, TrainingArguments

VOCAB, ROWS, STEPS = 64, 48, 6


def ragged_rows(count: int = ROWS) -> list[dict]:
    """Rows of 5 to 16 tokens; the collator pads them (labels -100 on padding), so micro-batches
    hold very different numbers of counted tokens."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for i in range(count):
        length = 5 + (i * 7) % 12
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": ids})
    return rows


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":  # a mean loss that takes no num_items_in_batch: weighted by token share
        from hputrain.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=32, block_size=16, dropout=0.0))
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def gpt_rows() -> list[dict]:
    """The same ragged rows in the built-in GPT's form: labels already shifted, -100 at the end."""
    rows = []
    for row in ragged_rows():
        ids = row["input_ids"]
        rows.append({"input_ids": ids, "labels": ids[1:] + [-100]})
    return rows


def main(argv: list[str]) -> dict:
    output_dir, batch, accumulate = argv[0], int(argv[1]), int(argv[2])
    kind = argv[3] if len(argv) > 3 else "llama"
    model = build(kind)
    args = TrainingArguments(output_dir=output_dir, accelerator="cpu", max_steps=STEPS, logging_steps=1,
                             per_device_train_batch_size=batch, gradient_accumulation_steps=accumulate,
                             learning_rate=1e-2, max_grad_norm=0.0, save_steps=-1, disable_tqdm=True)
    trainer = Trainer(model, args, train_dataset=gpt_rows() if kind == "gpt" else ragged_rows())
    trainer.train()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if trainer.group.is_main:
        torch.save(state, f"{output_dir}/weights.pt")
    return state


if __name__ == "__main__":
    main(sys.argv[1:])
