"""An op that dispatches to itself (``aten::linear`` and ``aten::conv2d`` under
``torch.autocast``) is one call in the by-op table: its inner span is part of the outer call."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import mltrace
from mltrace.analysis.span_pass import gather
from mltrace.run.levels import Level


def test_autocast_ops_are_counted_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 14 * 14, 10)).eval()
    calls = 3
    with mltrace.profile(output=tmp_path / "run", summary=False, level="op"):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            for _ in range(calls):
                model(torch.randn(2, 3, 16, 16))
    run = mltrace.load_run(tmp_path / "run")
    linear = [s for s in run.spans if s.name == "aten::linear"]
    nested = [s for s in linear if run.span_by_id()[s.parent_id].name == "aten::linear"]
    assert nested, "autocast no longer re-dispatches aten::linear into itself: this test checks nothing"
    g = gather(run)
    model_ns = sum(s.end_ns - s.start_ns for s in run.spans if s.level == Level.MODEL)
    for op, inner in (("aten::linear", "aten::addmm"), ("aten::conv2d", "aten::convolution")):
        acc = g.ops[op]
        assert acc.calls == calls
        assert acc.total_ns <= model_ns
        assert acc.flops == g.ops[inner].flops  # the outer call's FLOPs, once
