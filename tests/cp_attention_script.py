"""context_parallel_attention against unsplit causal attention, outputs and gradients; run by
test_context_parallel.py on 2 processes. Rank 0 writes the largest differences as JSON."""
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hputrain.distributed.context_parallel import context_parallel_attention

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
group = dist.new_group(list(range(size)))
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
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(diffs, f)
# Leave together and tear gloo down before exit: a rank that exits with the process group alive
# can abort in gloo's threads at interpreter shutdown ("terminate called without an active
# exception", seen about once in five runs).
dist.barrier()
dist.destroy_process_group()
