"""The layers of an exported program (``torch.export``'s ``.module()``) carry no shapes, so no
layer formula applies to them: their work is their ops'. A normalization's op counts 5 FLOP per
element, as the formula counts the module, so a BatchNorm of the exported program has its work
in every call, not only in the eager module's calls."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import mltrace
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.report_data import build_report


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.softmax(self.bn(self.conv(x)), dim=1).flatten(1))


def test_an_exported_programs_norm_has_its_ops_flops_in_every_call(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    exported = torch.export.export(Net().eval(), (x,)).module()
    calls = 4
    with torch.no_grad(), mltrace.profile(output=tmp_path / "run", summary=False, level="op"):
        for _ in range(calls):
            exported(x)
    run = mltrace.load_run(tmp_path / "run")
    rows = {r["name"]: r for r in build_report(run, analyze(run))["layers"]}
    assert "ml.input.shapes" not in next(s for s in run.spans if s.name == "bn").attrs, (
        "exported layers carry shapes: this test checks nothing"
    )
    assert rows["bn"]["calls"] == calls
    assert rows["bn"]["flops"] == calls * 5 * 2 * 8 * 8 * 8
