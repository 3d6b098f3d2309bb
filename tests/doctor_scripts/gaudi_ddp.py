"""A data-parallel Gaudi loop, as started by a launcher (WORLD_SIZE, RANK, ... in the environment):
HCCL process group, DistributedDataParallel, torch.optim.AdamW, mark_step after backward and step."""
import os

import torch
import torch.distributed as dist

import habana_frameworks.torch.core as htcore
import habana_frameworks.torch.distributed.hccl  # noqa: F401  (registers the "hccl" backend)

dist.init_process_group(backend="hccl")
rank, world = dist.get_rank(), dist.get_world_size()
print(f"rank {rank} of {world}, launched as {os.environ.get('WORLD_SIZE')} ranks")
device = torch.device("hpu")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
model = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(20):
    x = torch.randn(8, 16).to(device)
    loss = model(x).pow(2).mean()
    loss.backward()
    htcore.mark_step()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    htcore.mark_step()
dist.destroy_process_group()
