"""A model whose first forward calibrates a scale once with many large matrix products (one-time
work inside the first call, as lazy init, JIT or autotune would be); later calls are cheap.
Usage: calibrated_model.py CALLS [TIMES_JSON]: makes CALLS calls and, given TIMES_JSON, writes
the program's own timing of each call there (ns)."""

import json
import sys
import time

import torch
from torch import nn


class Calibrated(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))
        self.register_buffer("scale", torch.zeros(()))
        self.ready = False

    def forward(self, x):
        if not self.ready:
            a = torch.randn(384, 384)
            for _ in range(60):
                a = torch.tanh(a @ a.T / 384)
            self.scale = a.abs().mean()
            self.ready = True
        return self.body(x) * self.scale


torch.manual_seed(0)
model = Calibrated().eval()
x = torch.randn(32, 256)
times = []
with torch.inference_mode():
    for _ in range(int(sys.argv[1])):
        t0 = time.perf_counter_ns()
        model(x)
        times.append(time.perf_counter_ns() - t0)
if len(sys.argv) > 2:
    with open(sys.argv[2], "w") as out:
        json.dump(times, out)
