"""A model call made while ``torch.jit.trace`` records a graph is one-time work, as a compile
is: cold whatever its time, so neither its time nor its layers count among the steady calls
(a traced call under the tracer costs many eager calls' time)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

import mltrace
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.report_data import build_report
from mltrace.run.levels import Level


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


def test_the_calls_a_jit_trace_makes_are_cold(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net, x = Net().eval(), torch.randn(4, 16)
    with torch.no_grad(), mltrace.profile(output=tmp_path / "run", summary=False, level="layer"):
        for _ in range(6):  # warm eager calls first: the trace's calls are later ones
            net(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.trace's deprecation
            traced = torch.jit.trace(net, x)  # a trace, and its check's trace and runs
        for _ in range(6):
            traced(x)
    run = mltrace.load_run(tmp_path / "run")
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    tracing = [i for i, s in enumerate(models) if s.attrs.get("ml.jit.trace") is True]
    assert len(tracing) == 2, [s.attrs for s in models]  # the trace and its check's trace
    assert all(6 <= i < 9 for i in tracing)
    rows = {r["name"]: r for r in build_report(run, analyze(run, include_cold=False))["models"]}
    assert sorted(rows) == ["Net", "Net (TorchScript, traced)"]  # the trace records eager calls of net
    row = rows["Net"]
    assert set(tracing) <= set(row["cold_indices"])
    assert {"category": "compile", "names": ["torch.jit.trace"]} in row["one_time"]
