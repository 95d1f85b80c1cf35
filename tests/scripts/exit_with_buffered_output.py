"""Leaves through ``os._exit`` with output still in Python's and C's stdout buffers.

Used by tests/tracer/test_fdtap.py, with stdout a file (block-buffered): a plain run loses the
buffered output, so the traced run must too; what was flushed comes out in both.
"""

import ctypes
import os
import sys

import torch

with torch.no_grad():  # oneDNN and MKL work, so the library level has verbose lines to capture
    model = torch.nn.Linear(8, 8).eval()
    for _ in range(3):
        y = model(torch.randn(2, 8))
print("flushed line", flush=True)
libc = ctypes.CDLL(None)
libc.printf(b"C printf line, left in C's buffer\n")
print(f"buffered line, lost at os._exit: {y.sum().item():.5f}")
sys.stderr.write("stderr line\n")
os._exit(5)
