"""A plain training loop written as Intel's Gaudi docs teach it: the hpex fused ops (FusedAdamW,
FusedClipNorm, FusedSDPA), htcore.mark_step() after backward and after the optimizer step, and the
running loss kept on the device and read only on logging steps, every LOG_EVERY steps.
`python gaudi_docs_loop.py` builds its attention on FusedSDPA; `python gaudi_docs_loop.py encoder`
uses torch's own nn.TransformerEncoderLayer instead. `hputrain doctor` finds nothing in either
(tests/rehearsal/doctor/test_doctor_gaudi_loop.py)."""
import sys

import torch
import torch.nn.functional as F

import habana_frameworks.torch.core as htcore
from habana_frameworks.torch.hpex.kernels import FusedSDPA
from habana_frameworks.torch.hpex.normalization import FusedClipNorm
from habana_frameworks.torch.hpex.optimizers import FusedAdamW

VOCAB, WIDTH, HEADS, LENGTH, LOG_EVERY = 64, 32, 4, 16, 4
layer = sys.argv[1] if len(sys.argv) > 1 else "fused"
assert layer in ("fused", "encoder"), layer
device = torch.device("hpu")


class FusedAttention(torch.nn.Module):
    """Causal self-attention on Gaudi's FusedSDPA."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        y = FusedSDPA.apply(q, k, v, None, 0.0, True)
        return x + self.out(y.transpose(1, 2).reshape(batch, length, WIDTH))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.block = (FusedAttention() if layer == "fused" else torch.nn.TransformerEncoderLayer(
            WIDTH, HEADS, dim_feedforward=2 * WIDTH, dropout=0.1, batch_first=True))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        if layer == "fused":
            return self.head(self.block(x))
        causal = torch.nn.Transformer.generate_square_subsequent_mask(tokens.size(1), device=tokens.device)
        return self.head(self.block(x, src_mask=causal, is_causal=True))


torch.manual_seed(0)
model = Model().to(device)
optimizer = FusedAdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
clip = FusedClipNorm(model.parameters(), max_norm=1.0)
g = torch.Generator().manual_seed(1)
running_loss = torch.zeros((), device=device)
model.train()
for step in range(1, 41):
    tokens = torch.randint(0, VOCAB, (4, LENGTH + 1), generator=g)
    inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    htcore.mark_step()
    clip.clip_norm(model.parameters())
    optimizer.step()  # LINE: step
    running_loss += loss.detach()
    htcore.mark_step()
    if step % LOG_EVERY == 0:
        print(f"step {step}: loss {running_loss.item() / LOG_EVERY:.4f}")  # LINE: read
        running_loss.zero_()
