"""A user's GRPO script with hputrain's Python API, for `hputrain doctor`: a tiny Llama folder
(argv[1]) fine-tuned on prompts of 2 to 13 tokens, rewarded by a function of the completions'
texts. `python grpo_script.py FOLDER [exact]`:

- (no second argument) the default prompt_buckets: every prompt is left-padded to 16 tokens, so
  generation and training see one shape, [4, 16 + 8], whatever the prompt's length;
- `exact`: a bucket for every prompt length (prompt_buckets=range(1, 64)), the mistake: each
  generation batch is padded to its own longest prompt, and each new length compiles new graphs.
"""
import sys

import transformers

import hputrain

SENTENCES = ["the quick brown fox jumps over the lazy dog",
             "a stitch in time saves nine and a penny saved is a penny earned",
             "to be or not to be, that is the question"]


def prompts(n=40):
    """Openings of 2 to 21 characters (2 to 13 tokens of the tiny tokenizer), in a mixed order."""
    return [{"prompt": SENTENCES[i % 3][:2 + (7 * i) % 20]} for i in range(n)]


def brevity(completions, **kwargs):
    """A verifiable reward: shorter completions score higher (computed on the host strings)."""
    return [1.0 / (1 + len(text)) for text in completions]


def main(folder, exact):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    shapes = {"prompt_buckets": list(range(1, 64))} if exact else {}  # else (16, 32, 64, ...)
    args = hputrain.GRPOConfig(output_dir="doctor-should-not-write-here", max_steps=40,
                               per_device_train_batch_size=4, num_generations=2,
                               max_completion_length=8, learning_rate=1e-3, logging_steps=1,
                               save_steps=10, report_to=[], **shapes)
    trainer = hputrain.GRPOTrainer(model, args, reward_funcs=[brevity], train_dataset=prompts(),
                                   processing_class=tokenizer)
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["exact"])
