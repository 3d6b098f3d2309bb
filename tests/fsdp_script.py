"""A small GPT run under strategy="fsdp" for tests/distributed/test_fsdp.py, started by `hputrain launch`, by
plain python (the Trainer then launches itself, devices × num_nodes), or in-process as the
single-process reference.

    fsdp_script.py OUTPUT_DIR PER_DEVICE_BATCH STRATEGY [--fsdp MODE] [--accumulate K]
        [--checkpointing] [--meta] [--bf16] [--fp8 --width 64] [--text] [--compile] [--offload]
        [--devices N] [--num-nodes M] [--llama untied|tied]

Global rank 0 writes OUTPUT_DIR/weights.pt (the full weights after training, gathered from the
shards), OUTPUT_DIR/initial.pt (the full weights before the first step) and OUTPUT_DIR/layout.json
(how the first block's MLP weight is placed, which layers compute in fp8, whether the model ran
compiled, which modules are FSDP units of their own). --llama trains a tiny Hugging Face Llama
(tests/hf_fixtures.py's shape, 256 tokens) with untied or tied embeddings instead of the GPT.
"""
import argparse
import contextlib
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hputrain import AcceleratorConfig, Trainer, TrainingArguments  # noqa: E402
from hputrain.models.gpt import GPT, GPTConfig  # noqa: E402
from tests.dist_script import data  # noqa: E402

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)


def full_weights(model) -> dict:
    """The model's state, each tensor whole (a collective under fsdp: every rank calls it); an fp8
    layer's scaling state (`_extra_state`, a dict of this rank's tensors) as it is."""
    return {key: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            if torch.is_tensor(value) else value for key, value in model.state_dict().items()}


def text():
    """Windows of the standard library's source: text a GPT learns from within 20 steps."""
    from hputrain.data.batching import load_corpus

    return load_corpus(seq_len=16, max_bytes=100_000)[0]


def llama(tied: bool, meta: bool):
    """A tiny LlamaForCausalLM (vocabulary 256, as data() draws), drawn under the current seed."""
    import transformers

    from tests.hf_fixtures import tiny_llama_config

    config = tiny_llama_config(256, tie_word_embeddings=tied)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return transformers.LlamaForCausalLM(config)


def fsdp_units(model) -> list[str]:
    """The names of the modules fully_shard made units of ("" the root)."""
    from torch.distributed.fsdp import FSDPModule

    return [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("batch", type=int)
    p.add_argument("strategy")
    p.add_argument("--fsdp")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--meta", action="store_true", help="build the model on the meta device")
    p.add_argument("--init-on-meta", action="store_true", help="fsdp_init_on_meta=True")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp8", action="store_true", help="fp8=True (give --width 64 or more)")
    p.add_argument("--text", action="store_true", help="train on text, not random tokens")
    p.add_argument("--width", type=int, default=CONFIG.n_embd, help="n_embd of the GPT")
    p.add_argument("--compile", action="store_true", help='execution_mode="compile"')
    p.add_argument("--op-lists", action="store_true", help="bf16 with Gaudi-style op lists")
    p.add_argument("--offload", action="store_true")
    p.add_argument("--eval", action="store_true", help="evaluate at the end")
    p.add_argument("--reshard", choices=["true", "false"])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--llama", choices=["untied", "tied"])
    opts = p.parse_args(argv)
    torch.manual_seed(0)
    gpt_config = dataclasses.replace(CONFIG, n_embd=opts.width)  # fp8 takes Linear layers of 64 and up
    if opts.llama:
        model = llama(opts.llama == "tied", opts.meta)
    elif opts.meta:
        with torch.device("meta"):
            model = GPT(gpt_config)
    else:
        model = GPT(gpt_config)
    fsdp_options = {}
    if opts.strategy == "fsdp":
        fsdp_options = {"fsdp": opts.fsdp, "fsdp_cpu_offload": opts.offload,
                        "fsdp_init_on_meta": opts.init_on_meta,
                        "fsdp_reshard_after_forward": None if opts.reshard is None else opts.reshard == "true"}
    args = TrainingArguments(output_dir=opts.output_dir, max_steps=opts.steps, learning_rate=3e-3,
                             logging_steps=1, per_device_train_batch_size=opts.batch, save_steps=-1,
                             gradient_accumulation_steps=opts.accumulate, seed=0,
                             disable_tqdm=True, throughput_warmup_steps=0, accelerator="cpu",
                             strategy=opts.strategy, devices=opts.devices, num_nodes=opts.num_nodes,
                             ddp_timeout=60, bf16=opts.bf16 and not opts.op_lists,
                             gradient_checkpointing=opts.checkpointing, report_to="none",
                             fp8=opts.fp8, execution_mode="compile" if opts.compile else "auto",
                             **fsdp_options)
    config = (AcceleratorConfig(use_torch_autocast=True, autocast_bf16_ops=["linear", "matmul"],
                                autocast_fp32_ops=["softmax", "cross_entropy", "layer_norm"])
              if opts.op_lists else None)
    trainer = Trainer(model, args, train_dataset=text() if opts.text else data(), accelerator_config=config,
                      eval_dataset=data(16) if opts.eval else None)
    initial = full_weights(model)
    trainer.train()
    final = full_weights(model)
    if trainer.group.is_main:
        weight = model.model.layers[0].mlp.up_proj.weight if opts.llama else model.blocks[0].mlp.fc.weight
        layout = {"placements": [str(p) for p in getattr(weight, "placements", ())],
                  "local_rows": weight.to_local().shape[0] if hasattr(weight, "to_local") else None,
                  "dtype": str(weight.dtype), "fp8_layers": getattr(trainer.precision, "layers", []),
                  "wrapper": type(trainer.wrapped).__name__, "graphs": compiled_graphs(),
                  "units": fsdp_units(model)}
        with open(os.path.join(opts.output_dir, "layout.json"), "w") as f:
            json.dump(layout, f)
        torch.save(initial, os.path.join(opts.output_dir, "initial.pt"))
        torch.save(final, os.path.join(opts.output_dir, "weights.pt"))
    return model


if __name__ == "__main__":
    main()
