"""Context parallelism against unsplit attention, outputs and gradients; run by
test_context_parallel.py on 2 processes. Rank 0 writes the largest differences as JSON.

`cp_attention_script.py OUT`: context_parallel_attention against unsplit causal attention.
`cp_attention_script.py OUT hf`: a Hugging Face Llama with hputrain's registered attention
(kernels.py), its sequence split by the trainer's ContextParallel, against the unsplit model."""
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hputrain.distributed import context_parallel
from hputrain.distributed.context_parallel import ContextParallel, context_parallel_attention


def attention_diffs(rank, size, group):
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(2, 3, 16, 8, generator=g) for _ in range(4))

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*full, is_causal=True)
    (out * w).sum().backward()

    local_len = 16 // size
    piece = slice(rank * local_len, (rank + 1) * local_len)
    mine = [t[:, :, piece].clone().requires_grad_() for t in (q, k, v)]
    local_out = context_parallel_attention(*mine, group)
    (local_out * w[:, :, piece]).sum().backward()

    diffs = {"output": (local_out - out[:, :, piece]).abs().max().item()}
    for name, ours, ref in zip("qkv", mine, full):
        diffs[f"grad_{name}"] = (ours.grad - ref.grad[:, :, piece]).abs().max().item()
    return diffs


def hf_llama_diffs(rank, size, group):
    import transformers

    from hputrain.execution import kernels
    from hputrain.accelerators.cpu import CPUAccelerator

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    summary = kernels.substitute(model, CPUAccelerator(), True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 16), generator=g)
    w = torch.randn(2, 16, 64, generator=g)

    full = model(input_ids=ids).logits
    (full * w).sum().backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    routed = []  # calls of the context-parallel attention made by the registered attention
    attend = context_parallel.attend_in_group
    context_parallel.attend_in_group = lambda *a: routed.append(1) or attend(*a)
    cp = ContextParallel(group, rank, size)
    local = cp.shard({"input_ids": ids})
    with cp.forward_context():
        logits = model(**local).logits
    piece = slice(rank * (16 // size), (rank + 1) * (16 // size))
    (logits * w[:, piece]).sum().backward()
    diffs = {"logits": (logits - full[:, piece]).abs().max().item(), "routed": len(routed),
             "substituted": summary.get("attention: sdpa", 0)}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=group)  # each rank holds its slice's share of the gradient
        diffs["grad"] = max(diffs.get("grad", 0.0), (p.grad - reference[name]).abs().max().item())
    return diffs


dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
group = dist.new_group(list(range(size)))
diffs = hf_llama_diffs(rank, size, group) if sys.argv[2:] == ["hf"] else attention_diffs(rank, size, group)
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(diffs, f)
# Leave together and tear gloo down before exit: a rank that exits with the process group alive
# can abort in gloo's threads at interpreter shutdown ("terminate called without an active
# exception", seen about once in five runs).
dist.barrier()
dist.destroy_process_group()
