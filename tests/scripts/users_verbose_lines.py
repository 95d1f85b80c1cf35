"""Runs oneDNN and MKL work between lines of its own, for a user who asked for the libraries'
verbose lines (``MKL_VERBOSE``, ``ONEDNN_VERBOSE``): they are part of its stdout.

Used by tests/tracer/test_cpu_library.py, plainly and under ``mltrace python``.
"""

import torch

torch.manual_seed(0)
conv = torch.nn.Conv2d(3, 8, 7, stride=2, padding=3).eval()
linear = torch.nn.Linear(64, 64).eval()
print("start")
with torch.no_grad():
    for i in range(2):
        conv(torch.randn(1, 3, 32, 32))
        print(f"step {i}", end=" ")
        y = linear(torch.randn(32, 64))
        print(f"sum {y.sum().item():.4f}")
print("end")
