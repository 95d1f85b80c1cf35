"""Builds 20,000 small tensors (a data set's worth of ops before any model call), then calls a
small model 300 times: the op level's first cycle holds the set-up and one call."""

import torch
from torch import nn

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).eval()
data = [torch.tensor([i, i + 1]) for i in range(20_000)]
x = torch.randn(4, 64)
with torch.no_grad():
    for _ in range(300):
        x = torch.tanh(model(x))
print(len(data), tuple(x.shape))
