"""A module of a model library that calls an activation function itself (transformers'
``GELUActivation`` and ``SiLUActivation``) has no layer formula: its work is its op's, which
``aten_flops`` counts as the formula counts ``nn.GELU``, so the layer gets a verdict."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mltrace
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.peaks import Peaks, PeakSet
from mltrace.analysis.report_data import build_report

#: Roofs to judge by (without them no row has a verdict).
PEAKS = PeakSet(Peaks("cpu", "test CPU", 100e9, 10e9, "assumed"))
KNOWN = ("compute-bound", "memory-bound", "overhead-bound")


class GELUActivation(nn.Module):
    """As transformers defines it: a module that calls the function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)


class SiLUActivation(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.act = GELUActivation()
        self.gate = SiLUActivation()
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate(self.act(self.up(x))))


def test_an_activation_wrapper_has_its_ops_flops_and_a_verdict(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, calls = MLP().eval(), 6
    with torch.no_grad(), mltrace.profile(output=tmp_path / "run", summary=False, level="op"):
        for _ in range(calls):
            model(torch.randn(8, 32))
    run = mltrace.load_run(tmp_path / "run")
    data = build_report(run, analyze(run, PEAKS))
    rows = {r["name"]: r for r in data["layers"]}
    for name in ("act", "gate"):
        row = rows[name]
        assert row["calls"] == calls
        assert row["flops"] == calls * 8 * 64, row  # 1 per element of its [8, 64] input
        assert row["verdict"] in KNOWN, row["why"]
