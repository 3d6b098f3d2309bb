"""A Gaudi script that uses a part of habana_frameworks the doctor's stand-in does not cover."""
import torch

import habana_frameworks.torch.hpu as hthpu

device = torch.device("hpu")
model = torch.nn.Linear(4, 4).to(device)
hthpu.enable_dynamic_shape()  # not covered by the stand-in
