"""Model calls that raised (``error.type`` on the model span) are left out of the cold-start
rule and the steady statistics, and counted apart; their spans stay in the tables."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
from torch import nn

import mltrace
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.coldstart import FAILED_ATTR, find_cold_start
from mltrace.analysis.report_data import build_report
from mltrace.run.events import Span, Track
from mltrace.run.levels import Level
from mltrace.run.store import Run

MS = 1_000_000


def _run(spans: list[Span]) -> Run:
    return Run(path=Path("."), meta={}, tracks={1: Track(1, "thread", "main", 1, 1)}, spans=spans)


def _calls(durations: list[int], raised: set[int]) -> list[Span]:
    """Model spans "Net" back to back with ``durations``; those at ``raised`` raised."""
    spans, start = [], 0
    for i, d in enumerate(durations):
        attrs = {FAILED_ATTR: "RuntimeError"} if i in raised else {}
        spans.append(Span(i + 1, None, Level.MODEL, "Net", start, start + d, 1, attrs))
        start += d + MS
    return spans


def test_calls_that_raised_are_neither_cold_nor_steady() -> None:
    # 3 real 30 ms calls, then a 90 ms call, among 12 calls that raised at once (0.04 ms): the
    # failed calls would make the median 0.04 ms and every real call "cold".
    durations = [30 * MS, 40_000, 40_000, 40_000, 30 * MS, 40_000, 40_000, 40_000, 30 * MS, 40_000, 40_000, 40_000, 40_000, 90 * MS]
    raised = {i for i, d in enumerate(durations) if d == 40_000}
    cold = find_cold_start(_run(_calls(durations, raised)))
    (model,) = cold.models
    assert model.failed == sorted(raised) and cold.failed_calls == 10
    assert model.cold == []  # the first call is 30 ms like the other real calls: steady
    assert model.steady == [30 * MS, 30 * MS, 30 * MS, 90 * MS] and model.steady_median_ns == 30 * MS
    assert cold.failed_text().startswith("10 model calls raised an exception (Net 10 of 14)")
    everything_ok = find_cold_start(_run(_calls(durations, set())))
    assert everything_ok.models[0].cold == [0] and everything_ok.models[0].steady_median_ns == 40_000  # before: the defect
    assert everything_ok.failed_calls == 0 and everything_ok.failed_text() == ""


def test_a_cold_first_call_is_found_among_the_calls_that_returned() -> None:
    durations = [200 * MS, 40_000, 10 * MS, 40_000, 10 * MS, 10 * MS, 40_000, 11 * MS]
    raised = {1, 3, 6}
    (model,) = find_cold_start(_run(_calls(durations, raised))).models
    assert model.cold == [0] and model.failed == [1, 3, 6]  # indices among every call, in start order
    assert model.steady == [10 * MS, 10 * MS, 10 * MS, 11 * MS]


class Flaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(512, 512)
        self.small = nn.Linear(512, 8)

    def forward(self, x: torch.Tensor, fail: bool) -> torch.Tensor:
        if fail:
            raise RuntimeError("rejected input")  # before any layer runs
        return self.small(torch.relu(self.big(x)))


def test_a_traced_model_whose_calls_raise_and_are_caught(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Flaky().eval()
    x = torch.randn(64, 512)
    failed = 0
    with torch.no_grad(), mltrace.profile(output=tmp_path / "run", summary=False, level="layer"):
        for i in range(24):
            try:
                model(x, fail=i % 3 != 0)
            except RuntimeError:
                failed += 1
    assert failed == 16
    run = mltrace.load_run(tmp_path / "run")
    spans = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert [FAILED_ATTR in s.attrs for s in spans] == [i % 3 != 0 for i in range(24)]  # the wrapper marks them
    analysis = analyze(run, include_cold=False)
    (calls,) = analysis.cold.models
    assert calls.failed == [i for i in range(24) if i % 3 != 0] and len(calls.durations) == 24
    returned = [s.duration_ns for s in spans if FAILED_ATTR not in s.attrs]
    assert set(calls.steady) <= set(returned) and len(calls.steady) == 8 - len(calls.cold)
    raised = [s.duration_ns for s in spans if FAILED_ATTR in s.attrs]
    assert calls.steady_median_ns is not None and min(returned) <= calls.steady_median_ns <= max(returned)
    assert calls.steady_median_ns > statistics.median(raised)  # a 64x512 Linear against a raise at entry
    assert any(n.startswith("16 model calls raised an exception (Flaky 16 of 24)") for n in analysis.findings.notes)
    # Their spans stay in the tables: a failed call was time the program spent.
    assert analysis.breakdown.model_calls == 24 - len(calls.cold)
    # The JSON report's model entry counts them and says which they were.
    (entry,) = build_report(run, analysis)["models"]
    assert entry["failed_calls"] == 16 and entry["failed_indices"] == calls.failed
