"""`hputrain evaluate --model DIR --dataset PATH`: the loss of a local Hugging Face model over a
whole data set, read as `hputrain train` reads it (text, or SFT rows by their columns): every
counted token of it, none held out; of a data set with splits (a folder of train.jsonl and
test.jsonl, a Hub snapshot's data/test-*.parquet, a DatasetDict), the split --split names
(train by default); preference pairs give DPO's loss and rewards against --ref-model DIR.
Works on a run's output_dir/final, a LoRA run's adapter folder included (on the base model its
adapter_config.json names, or --base-model DIR). Examples longer than --block-size are cut to
it, and said so. The tokenized data is cached in --cache-dir when given,
else in a temporary folder removed at the end."""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import InputError
from ..recipes.hf import HFOptions
from ..recipes.hf.data import splits_line
from ..recipes.hf.evaluate import evaluate


def add_evaluate_parser(sub) -> None:
    p = sub.add_parser("evaluate", help="the loss of a Hugging Face model (--model DIR) over a whole "
                                        "data set (--dataset PATH)", description=__doc__)
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a local Hugging Face model folder, or a PEFT adapter folder (a run's "
                        "output_dir/final)")
    p.add_argument("--base-model", "--base_model", dest="base_model", metavar="DIR",
                   help="the base model of an adapter folder given as --model or --ref-model "
                        "(default: the one its adapter_config.json names)")
    p.add_argument("--dataset", required=True, metavar="PATH", help="the data, as hputrain train takes it")
    p.add_argument("--split", default="train", metavar="NAME",
                   help="the split of a data set with splits to evaluate: train (default; the whole "
                        "data set where it names none), validation or test (files named as "
                        "datasets' load_dataset splits them: test.jsonl, data/test-*.parquet, dev/), "
                        "or a DatasetDict's split")
    p.add_argument("--block-size", "--block_size", dest="block_size", type=int,
                   help="tokens per block (default: as hputrain train chooses)")
    p.add_argument("--no-packing", "--no_packing", dest="packing", action="store_false",
                   help="SFT data: one example a row instead of packed blocks (same loss)")
    p.add_argument("--no-assistant-only-loss", dest="assistant_only_loss", action="store_false",
                   help="conversations: count every token, not only the assistant turns")
    p.add_argument("--no-completion-only-loss", dest="completion_only_loss", action="store_false",
                   help="prompt + completion: count the prompt's tokens too")
    p.add_argument("--text-column", "--text_column", dest="text_column", default="text",
                   help="the text field of text data (default: text)")
    p.add_argument("--chat-template", "--chat_template", dest="chat_template", metavar="FILE",
                   help="a Jinja chat template that replaces the tokenizer's")
    p.add_argument("--cache-dir", "--cache_dir", dest="cache_dir", metavar="DIR",
                   help="where the tokenized data set is cached, to be reused by later runs "
                        "(hputrain train's cache folder works); default: a temporary folder, "
                        "removed afterwards (nothing is ever written into the model folder)")
    p.add_argument("--ref-model", "--ref_model", dest="ref_model", metavar="DIR",
                   help="preference pairs: the reference model folder DPO's rewards are measured "
                        "against")
    p.add_argument("--beta", type=float, help="preference pairs: DPO's beta (0.1)")
    p.add_argument("--loss-type", "--loss_type", dest="loss_type",
                   help="preference pairs: sigmoid (default), ipo, hinge or robust")
    p.add_argument("--label-smoothing", "--label_smoothing", dest="label_smoothing", type=float,
                   default=0.0, help="preference pairs: as hputrain train takes it")
    p.add_argument("--max-prompt-length", "--max_prompt_length", dest="max_prompt_length",
                   type=int, help="preference pairs: as hputrain train takes it")
    p.add_argument("--image-buckets", "--image_buckets", dest="image_buckets", nargs="+", metavar="WxH",
                   help="image data: the pixel buckets, as hputrain train takes them")
    p.add_argument("--image-slots", "--image_slots", dest="image_slots", type=int,
                   help="image data: images per block, as hputrain train takes it")
    p.add_argument("--batch-size", "--batch_size", dest="batch_size", type=int, default=8,
                   help="blocks or rows per forward (default: 8)")
    p.add_argument("--precision", help="fp32 (default), bf16 or auto; decides over --bf16")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bfloat16 mixed precision, as hputrain train takes it (--no-bf16: fp32)")
    p.add_argument("--cpu", action="store_true", help="force the CPU")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_evaluate)


def cmd_evaluate(args) -> int:
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be at least 1, got {args.batch_size}")
    options = HFOptions(model=args.model, dataset=args.dataset, block_size=args.block_size,
                        packing=args.packing, text_column=args.text_column,
                        assistant_only_loss=args.assistant_only_loss,
                        completion_only_loss=args.completion_only_loss,
                        chat_template=args.chat_template, cache_dir=args.cache_dir,
                        ref_model=args.ref_model, base_model=args.base_model,
                        beta=args.beta, loss_type=args.loss_type,
                        label_smoothing=args.label_smoothing,
                        max_prompt_length=args.max_prompt_length, image_buckets=args.image_buckets,
                        image_slots=args.image_slots)  # a bad value: one line
    # train's rule: --precision, when given, decides; else --bf16 / --no-bf16; else fp32
    precision = args.precision or ("bf16-mixed" if args.bf16 else "fp32")
    result = evaluate(options, batch_size=args.batch_size, precision=precision, split=args.split)
    print(splits_line(args.dataset, evaluated=args.split), end="", file=sys.stderr)
    if "images" in result:  # image data: what the blocks hold
        print(f"hputrain: {result['examples']} examples with {result['images']} images, "
              f"{result['image_slots']} image slots a block, {result['examples_cut']} cut to "
              f"--block-size {result['block_size']}", file=sys.stderr)
    if result.get("examples_cut"):
        print(cut_note(result), file=sys.stderr)
    if args.json:
        print(json.dumps(result))
        return 0
    for key, value in result.items():
        print(f"{key} {value:.6f}" if isinstance(value, float) else f"{key} {value}")
    return 0


def cut_note(result: dict) -> str:
    """What cutting examples to the block size left out of the loss, in a line."""
    if "tokens_cut" not in result:  # preference pairs
        return (f"hputrain: {result['examples_cut']} of {result['eval_pairs']} pairs were longer "
                f"than --block-size {result['block_size']} and cut to it")
    counted = result["eval_tokens"] + result["tokens_cut"]
    return (f"hputrain: {result['examples_cut']} examples were longer than --block-size "
            f"{result['block_size']} and cut to it: {result['tokens_cut']:,} of {counted:,} counted "
            "tokens left out of the loss (a larger --block-size keeps them)")
