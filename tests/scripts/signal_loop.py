"""Calls a small CNN in a loop until a signal stops it: prints "ready" after the first calls (for
the signal tests), then keeps calling, 100 calls a second at most. ``signal_loop.py _exit N``
leaves with ``os._exit(N)`` after 20 calls instead."""

import os
import sys
import time

import torch

torch.manual_seed(0)
cnn = torch.nn.Sequential(
    torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4)
).eval()
x = torch.randn(1, 3, 16, 16)
with torch.inference_mode():
    for i in range(1_000_000):
        cnn(x)
        if i == 5:
            print("ready", flush=True)
        if len(sys.argv) > 2 and sys.argv[1] == "_exit" and i == 20:
            print("leaving", flush=True)
            os._exit(int(sys.argv[2]))
        time.sleep(0.01)
