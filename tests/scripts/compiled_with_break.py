"""A torch.compile'd function that calls a model whose forward breaks the graph, four times, so
each model call returns inside the function's "Torch-Compiled Region" range. Under
`mltrace python --level op` it crashed now and then (SIGSEGV in torch.profiler's stop): the op
level's cycle switch stopped and restarted the profiler inside that range
(tests/tracer/test_op_cycle_ranges.py)."""

import torch
from torch import nn


class Breaking(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        torch._dynamo.graph_break()
        return torch.relu(y)


net = nn.Sequential(Breaking(), nn.Linear(8, 2)).eval()
compiled = torch.compile(lambda t: net(t) * 2, backend="eager")
with torch.no_grad():
    for i in range(4):
        compiled(torch.full((2, 8), float(i)))
print("ok")
