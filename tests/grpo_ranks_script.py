"""GRPO runs with fixed completions for tests/methods/grpo/test_grpo_ranks.py, started by `hputrain launch` on
two ranks, or in-process as the one-process reference with the same global batch.

    grpo_ranks_script.py MODEL_DIR OUTPUT_DIR STRATEGY CASE [CASE ...]

Each CASE (a name in CASES) trains the tiny Llama in MODEL_DIR for STEPS steps into
OUTPUT_DIR/CASE, one after the other in the same processes (on two shared cores, starting the
processes costs more than a run). per_device_train_batch_size is GLOBAL_BATCH over the ranks, so
every world size sees the same global batch. Global rank 0 writes OUTPUT_DIR/CASE/weights.pt,
the full weights after training (gathered from the shards under fsdp).

The rollout is the trainer's `complete` hook: completion j of a prompt's group depends only on
the prompt's tokens, j and the generation's index, never on which rank holds it, so that any
split of the generation batch over ranks sees the same completions and rewards.

Adam's epsilon is 1e-6 (torch's 1e-8 otherwise): some gradient entries are sums that cancel
within a group (advantages sum to zero) and come out at rounding-noise size, about 1e-9, which
Adam at 1e-8 turns into a step of a tenth of the learning rate whose size depends on the
summation order; one process and two then drift 1e-4 apart in four steps, a matter of
conditioning and not of the property under test. The learning rate (1e-2) is still large
enough for the second iteration to clip.
"""
from __future__ import annotations

import os
import sys

import torch

GLOBAL_BATCH = 8  # completions per micro-batch over every rank
STEPS = 4
MAX_COMPLETION = 16
PROMPTS = ["the quick", "to be or", "a stitch", "def add", "that is", "a penny", "one two", "x y z"]

CASES = {
    "groups": dict(num_generations=4),  # two prompts: each group on one rank
    "split": dict(num_generations=8),  # one prompt: its group split over the two ranks
    # 16 rows per step in two micro-batches: one group over both ranks and both micro-batches
    "accumulate": dict(num_generations=16, gradient_accumulation_steps=2),
    # each generation trained on twice: old log-probs, ratios away from 1, clipping
    "iterations": dict(num_generations=8, num_iterations=2),
}


def tens(prompts, completions, completion_ids, **columns):
    """The share of a completion's tokens whose id is a multiple of ten."""
    return [sum(t % 10 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def fixed_completions(num_generations: int, vocab: int, eos: int):
    """The `complete` hook: this rank's rows are a contiguous share of the generation batch
    (rollout.py, Rollouts.rows_of), so its row i is row RANK × rows + i of the batch, completion
    (that row mod num_generations) of its group. Every third completion of a group runs to
    max_completion_length without an end of sequence (truncated); the others end early."""
    rank = int(os.environ.get("RANK", "0"))

    def complete(generation: int, prompts: list[list[int]]) -> list[list[int]]:
        out = []
        for i, prompt in enumerate(prompts):
            j = (rank * len(prompts) + i) % num_generations
            base = sum(prompt) * 31 + generation * 17 + j * 101
            if j % 3 == 2:
                length, end = MAX_COMPLETION, []
            else:
                length, end = 2 + base % (MAX_COMPLETION - 3), [eos]
            body = [4 + (base + 7 * k * (j + 1)) % (vocab - 4) for k in range(length)]
            out.append(body + end)
        return out

    return complete


def full_weights(model) -> dict:
    """The model's weights, each tensor whole (a collective under fsdp: every rank calls it)."""
    return {key: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            for key, value in model.state_dict().items()}


def run(model_dir: str, out: str, strategy: str, case: str) -> None:
    """One case's run into `out`; rank 0 saves the final weights there."""
    import transformers

    from hputrain import GRPOConfig, GRPOTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    options = CASES[case]
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // world,
                      max_completion_length=MAX_COMPLETION, learning_rate=1e-2, adam_epsilon=1e-6,
                      max_steps=STEPS, logging_steps=1, disable_tqdm=True, save_steps=0,
                      report_to=[], seed=0,
                      accelerator="cpu", strategy=strategy, ddp_timeout=60,
                      throughput_warmup_steps=0, **options)
    complete = fixed_completions(options["num_generations"], len(tokenizer), tokenizer.eos_token_id)
    trainer = GRPOTrainer(model, args, reward_funcs=[tens],
                          train_dataset=[{"prompt": p} for p in PROMPTS],
                          processing_class=tokenizer, complete=complete)
    trainer.train()
    weights = full_weights(model)
    if trainer.group.rank == 0:
        torch.save(weights, os.path.join(out, "weights.pt"))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    model_dir, output_dir, strategy, *cases = argv
    for case in cases:
        run(model_dir, os.path.join(output_dir, case), strategy, case)


if __name__ == "__main__":
    main()
