"""A plain training loop written for Gaudi, as Intel's docs teach it: habana_frameworks, the hpu
device, htcore.mark_step() after backward and after the optimizer step. `python gaudi_loop.py
MISTAKE` adds one classic mistake (see MISTAKES); no argument is the clean loop. The doctor tests
(tests/rehearsal/doctor/test_doctor_gaudi_loop.py) name lines of this file: keep the marked lines where they are,
or update LINES there."""
import sys

import torch
import torch.nn.functional as F

import habana_frameworks.torch.core as htcore
import habana_frameworks.torch.hpu as hthpu

MISTAKES = ("lengths", "item", "branch", "fallback", "no-mark-step")
mistake = sys.argv[1] if len(sys.argv) > 1 else "clean"
assert mistake in ("clean", *MISTAKES), mistake
device = torch.device("hpu")
assert hthpu.is_available() and torch.hpu.device_count() >= 1

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32), torch.nn.GELU(),
                            torch.nn.Linear(32, 64)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)


def batch(step):
    length = 16 + 3 * step if mistake == "lengths" else 16
    tokens = torch.randint(0, 64, (4, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


for step in range(50):
    inputs, targets = batch(step)
    inputs, targets = inputs.to(device), targets.to(device)  # LINE: inputs
    logits = model(inputs)
    losses = F.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1), reduction="none")
    if mistake == "fallback":
        loss = losses[targets.reshape(-1) > 3].mean()  # LINE: fallback
    else:
        loss = losses.mean()
    loss.backward()
    if mistake != "no-mark-step":
        htcore.mark_step()
    if mistake == "item":
        print(f"step {step} loss {loss.item():.3f}")  # LINE: item
    if mistake == "branch" and loss > 100.0:  # LINE: branch
        print("diverging")
    optimizer.step()  # LINE: step
    optimizer.zero_grad(set_to_none=True)
    if mistake != "no-mark-step":
        htcore.mark_step()
print("done", hthpu.max_memory_allocated() > 0)
