"""A torch.compile'd function that calls a model whose forward breaks the graph, four times: the
repro of an open crash. Under `mltrace python --level op` it crashes now and then (SIGSEGV in
torch.profiler's stop, in a cycle switch or at the session's stop; about 1 run in 6 here), and in
most runs where mltrace's per-call work was marked for TorchDynamo to skip with every frame it
calls (FrameExecStrategy(SKIP, SKIP), taken out for that)."""

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
