"""`hputrain generate`: text from a trained checkpoint of the built-in GPT through graph-captured
inference (execution/inference.py), or, with `--model DIR --chat QUESTION`, a Hugging Face model's
answer through its chat template and the static-shape generator of GRPO's rollouts
(execution/generation.py, recipes/hf/chat.py); the model folder may be a LoRA run's adapter folder
(on its base, or --base-model DIR). With `--image FILE` (repeatable) the folder is an
image-text-to-text model's and the question is about the images (kinds/vlm/chat.py):
through the same static-shape generator, the images in its prefill; such a folder answers a
question without --image too, encoded as its text rows train."""
from __future__ import annotations

import json
import sys
import time

import torch

from ..accelerators import detect_accelerator
from ..errors import InputError
from ..execution.inference import Generation, Generator, load_for_generation
from ..models.gpt import check_sampling


GPT_TEMPERATURE = 0.8
"""--temperature for a --checkpoint when none is given (--chat answers greedily by default)."""


def cmd_generate(args) -> int:
    _check_source(args)
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature is None:
        args.temperature = 0.0 if args.model else GPT_TEMPERATURE
    check_sampling(args.temperature, args.top_k)  # before the checkpoint loads
    if args.seed is not None and not 0 <= args.seed < 2**64:
        raise InputError(f"--seed must be in 0..2**64-1, got {args.seed}")
    accelerator = detect_accelerator("cpu" if args.cpu else args.accelerator)
    if args.model:
        return _chat(args, accelerator)
    model = load_for_generation(args.checkpoint, accelerator)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    prompts = [list(p.encode()) for p in (args.prompt or ["\n"])]
    generator = Generator(model, accelerator, graphs=not args.no_graphs)
    capture = time.perf_counter()
    if not args.no_graphs:  # capture the prompt's bucket and the decode step before the clock runs
        generator.generate(prompts, min(2, args.max_new_tokens))
    capture = time.perf_counter() - capture
    result = generator.generate(prompts, args.max_new_tokens, args.temperature, args.top_k)
    _print_generation(prompts, result, capture, args.json)
    return 0


def _check_source(args) -> None:
    """Exactly one model: a --checkpoint (the built-in GPT, --prompt) or a --model folder (a
    Hugging Face model, --chat)."""
    if args.model and args.checkpoint:
        raise InputError("give --checkpoint (the built-in GPT) or --model DIR (a Hugging Face "
                         "model folder), not both")
    if not args.model and not args.checkpoint:
        raise InputError("generate needs --checkpoint DIR (the built-in GPT, with --prompt) or "
                         "--model DIR --chat QUESTION (a Hugging Face model folder)")
    if args.image and (not args.model or args.chat is None):
        raise InputError("--image needs --model DIR (an image-text-to-text model folder) and "
                         "--chat QUESTION about the image")
    if args.model and args.chat is None:
        raise InputError("--model needs --chat QUESTION: the question is rendered through the "
                         "model's chat template")
    if args.model and args.prompt:
        raise InputError("--prompt is for --checkpoint; with --model ask with --chat QUESTION")
    if args.chat is not None and not args.model:
        raise InputError("--chat needs --model DIR (a Hugging Face model folder with a chat "
                         "template); a --checkpoint takes --prompt")
    if args.base_model and not args.model:
        raise InputError("--base-model is the base of an adapter folder given as --model DIR")
    if args.model and args.no_graphs:
        raise InputError("--no-graphs is for --checkpoint: --chat always runs eagerly (for one "
                         "answer a graph capture costs more than it saves)")


def _chat(args, accelerator) -> int:
    from ..recipes.hf.folders import model_folder
    from ..recipes.hf.chat import chat_answer
    from ..kinds.vlm.chat import answers_as_vision_model, vision_answer

    folder = model_folder(args.model, base_model=args.base_model)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    start = time.perf_counter()
    # an image-text-to-text folder answers text-only questions too, as it trains on text rows
    if args.image or answers_as_vision_model(folder, args.base_model):
        answer = vision_answer(folder, args.chat, args.image or [], accelerator,
                               max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               top_k=args.top_k, base_model=args.base_model)
    else:
        answer = chat_answer(folder, args.chat, accelerator, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_k=args.top_k,
                             base_model=args.base_model)
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({"text": answer.text, "tokens": answer.tokens,
                          "prompt_tokens": answer.prompt_tokens,
                          "stop_token_ids": answer.stop_token_ids}, indent=2))
    else:
        print(answer.text)
        print(f"({answer.tokens} tokens in {seconds:.1f} s, model loading included)",
              file=sys.stderr)
    return 0


def _print_generation(prompts, result: Generation, capture: float, as_json: bool) -> None:
    records = []
    for prompt, new in zip(prompts, result.tokens):
        records.append({
            "text": bytes(prompt + new).decode("utf-8", errors="replace"),
            "tokens": len(new),
            "tokens_per_second": len(new) / result.seconds,
            "time_to_first_token_ms": result.time_to_first_token * 1e3,
        })
    if as_json:
        print(json.dumps(records[0] if len(records) == 1 else records, indent=2))
    else:
        for record in records:
            print(record["text"])
        print(f"({sum(r['tokens'] for r in records)} tokens, {records[0]['tokens_per_second']:.1f} "
              f"tokens/s per prompt, first token after {records[0]['time_to_first_token_ms']:.1f} ms; "
              f"graph capture before that: {capture:.1f} s)", file=sys.stderr)


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="text from a trained checkpoint (graph-captured), or a "
                                        "Hugging Face model's answer to --chat QUESTION",
                       description=__doc__)
    p.add_argument("--checkpoint", help="a checkpoint folder of the built-in GPT written by "
                                        "hputrain train")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch; --checkpoint)")
    p.add_argument("--model", metavar="DIR",
                   help="a local Hugging Face model folder whose tokenizer has a chat template, or "
                        "a PEFT adapter folder (a run's output_dir/final)")
    p.add_argument("--base-model", "--base_model", dest="base_model", metavar="DIR",
                   help="the base model of an adapter folder given as --model (default: the one "
                        "its adapter_config.json names)")
    p.add_argument("--chat", metavar="QUESTION",
                   help="with --model: the user's message, rendered through the chat template with "
                        "the generation prompt; prints only the answer, which stops at the end of "
                        "the turn (eos or the template's end-of-turn token)")
    p.add_argument("--image", action="append", metavar="FILE",
                   help="with --model and --chat: an image the question is about (repeat for "
                        "several, in the order the question names them); the model folder is an "
                        "image-text-to-text model's (LLaVA, Gemma 3, Qwen2.5-VL)")
    p.add_argument("--max-new-tokens", "--max_new_tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy; otherwise at least 1e-4 (MIN_TEMPERATURE). Default: 0 with "
                        f"--chat, {GPT_TEMPERATURE} with --checkpoint")
    p.add_argument("--top-k", "--top_k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-graphs", action="store_true", help="run eagerly, without graph capture")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--cpu", action="store_true", help="force the CPU")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_generate)
