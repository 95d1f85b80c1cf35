"""A plain script that marks each request with ``mltrace.span("request")``: make the input
(``torch.randn``), run a small MLP, take the ``argmax``; five requests, one after another."""

import torch
from torch import nn

import mltrace

torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
for i in range(5):
    with mltrace.span("request", request_id=f"q{i}"):
        x = torch.randn(2, 16)
        with torch.no_grad():
            y = model(x)
        label = int(torch.argmax(y[0]))
print("done")
