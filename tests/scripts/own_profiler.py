"""A program that runs torch.profiler itself, in the middle of its model calls: 3 calls, one
inside ``torch.profiler.profile()``, 3 more. It prints what its own profiler saw. Its profile
has a schedule and ``prof.step()``; given the argument ``stack``, it has ``with_stack=True``
and no schedule (torch 2.13's events() of a scheduled profile with stacks fails now and then
to decode a name, plain or traced), and it prints the module calls its profiler saw."""

import sys

import torch
from torch.profiler import profile, schedule

model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.ReLU())).eval()
x = torch.randn(2, 8)
traces = []
with torch.no_grad():
    for _ in range(3):
        model(x)
    if "stack" in sys.argv[1:]:
        with profile(with_stack=True) as prof:
            model(x)
        traces.append(prof)
    else:
        every = schedule(wait=0, warmup=0, active=1, repeat=1)
        with profile(schedule=every, on_trace_ready=traces.append) as prof:
            model(x)
            prof.step()
    print("linear ops the program's profiler saw:", sum(1 for e in traces[0].events() if e.name == "aten::linear"))
    if "stack" in sys.argv[1:]:
        print("module calls it saw:", sorted(e.name for e in traces[0].events() if e.name.startswith("nn.Module")))
    for _ in range(3):
        model(x)
print("done")
