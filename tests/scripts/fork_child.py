"""Calls a model, forks a child that calls it again and exits through sys.exit, then calls it
in the parent (for the test of a forked child under `mltrace python`)."""

import os
import sys

import torch

model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
model(torch.randn(1, 4))
pid = os.fork()
if pid == 0:
    model(torch.randn(1, 4))
    with_wrapper = type(torch.nn.Module.__call__).__name__
    print(f"child done, Module.__call__ is a {with_wrapper}", flush=True)
    sys.exit(0)
_, status = os.waitpid(pid, 0)
model(torch.randn(1, 4))
print(f"parent done, child status {os.waitstatus_to_exitcode(status)}", flush=True)
