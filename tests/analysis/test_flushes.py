"""mltrace's own flushes beside the program's model calls (run.json ``flushes``,
``analysis/flushes.py``): the steady calls that overlapped a flush are counted and compared
with the others; cold calls, calls between flushes and malformed rows are not."""

from __future__ import annotations

from pathlib import Path

from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.coldstart import ModelCalls
from mltrace.analysis.flushes import flush_intervals, flushes_of
from mltrace.analysis.peaks import Peaks, PeakSet
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run

CPU = PeakSet(Peaks("cpu", "test CPU", 100e9, 10e9, "assumed"))
CALL_NS, SLOW_NS, STEP_NS = 1_000_000, 1_800_000, 10_000_000


def flushed_run(flushed: set[int], calls: int = 30) -> Run:
    """``calls`` calls of Net, one every 10 ms, 1 ms each; the calls in ``flushed`` take 1.8 ms
    and a 0.5 ms flush begins 0.2 ms into each of them."""
    spans, kept = [], []
    for c in range(calls):
        t = c * STEP_NS
        duration = SLOW_NS if c in flushed else CALL_NS
        spans.append(Span(2 * c + 1, None, Level.MODEL, "Net", t, t + duration, 1, {"ml.layer.type": "Net"}))
        spans.append(Span(2 * c + 2, 2 * c + 1, Level.LAYER, "fc", t + 100, t + duration - 100, 1, {"ml.layer.type": "Linear"}))
        if c in flushed:
            kept.append([t + 200_000, t + 700_000, 400_000])
    kept.append([calls * STEP_NS, calls * STEP_NS + 500_000, 300_000])  # after the last call
    meta = {"name": "hand-made", "complete": True, "pid": 5, "flushes": {"count": len(kept) + 3, "cpu_ns": 9_000_000, "kept": kept}}
    return Run(path=Path("hand-made"), meta=meta, tracks={1: Track(1, TrackKind.THREAD, "MainThread", 5, 10)}, spans=spans)


def test_steady_calls_that_overlapped_a_flush_are_counted_and_compared() -> None:
    run = flushed_run({0, 7, 12, 20})
    calls = ModelCalls("Net", [SLOW_NS if c in {0, 7, 12, 20} else CALL_NS for c in range(30)], cold=[0])
    found = flushes_of(run, [calls])
    assert found is not None and found.count == 8 and found.cpu_ns == 9_000_000
    (net,) = found.models
    assert (net.steady, net.overlapped, net.overlapped_median_ns, net.other_median_ns) == (29, 3, SLOW_NS, CALL_NS)
    assert net.text() == "3 of 29 steady Net calls (median 1.80 ms against 1.00 ms for the rest)"


def test_too_few_calls_on_one_side_are_counted_not_compared() -> None:
    found = flushes_of(flushed_run({5, 9}), [ModelCalls("Net", [CALL_NS] * 30)])
    assert found is not None
    (net,) = found.models
    assert (net.overlapped, net.overlapped_median_ns, net.other_median_ns) == (2, None, None)
    assert net.text() == "2 of 30 steady Net calls"


def test_no_overlap_no_flushes_or_other_calls_say_nothing() -> None:
    assert flushes_of(flushed_run(set()), [ModelCalls("Net", [CALL_NS] * 30)]) is None  # a flush after the calls only
    run = flushed_run({3})
    assert flushes_of(run, [ModelCalls("Net", [CALL_NS] * 30, cold=[3])]) is None  # the one overlapped call is cold
    assert flushes_of(run, [ModelCalls("Net", [CALL_NS] * 29)]) is None  # not the calls the run holds
    run.meta["flushes"]["kept"] = [[1, 2], "x", [5, 3, 1], [1.5, 2, 3]]
    assert flush_intervals(run.meta) == [] and flushes_of(run, [ModelCalls("Net", [CALL_NS] * 30)]) is None


def test_the_report_says_it_among_its_notes() -> None:
    a = analyze(flushed_run({4, 8, 15, 22}), CPU, include_cold=True)
    notes = [n for n in a.findings.notes if n.startswith("mltrace's own flushes")]
    assert len(notes) == 1 and "overlapped 4 of 30 steady Net calls (median 1.80 ms against 1.00 ms for the rest)" in notes[0]
