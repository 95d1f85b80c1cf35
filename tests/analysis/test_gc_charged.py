"""The program's garbage collections in the report (run.json ``gc.pauses``, ``analysis/gcpauses.py``):
a collection is charged to the innermost layer or model call running on its thread, counted in
the time of every call around it, left out of verdicts and of the self-time ranking, and said."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mltrace.analysis.bottleneck import Bound, analyze
from mltrace.analysis.gcpauses import GcTime, gc_by_row, gc_note
from mltrace.analysis.peaks import Peaks, PeakSet
from mltrace.analysis.report_data import build_report
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run

CPU = PeakSet(Peaks("cpu", "test CPU", 100e9, 10e9, "assumed"))
M, L = Level.MODEL, Level.LAYER
CALLS = 20
TID, OTHER_TID = 10, 11
FULL_NS = 200_000_000  # one full collection, in the fifth call's fc
YOUNG_NS = 50_000  # one young collection, in the third call's block.relu
FC_NS, RELU_NS = 200_000, 300_000


def linear_attrs(m: int, k: int, n: int) -> dict[str, Any]:
    return {
        "ml.layer.type": "Linear",
        "ml.input.shapes": [[m, k]],
        "ml.input.dtypes": ["float32"],
        "ml.output.shapes": [[m, n]],
        "ml.output.dtypes": ["float32"],
        "ml.flops": 2 * m * k * n,
    }


def gc_run() -> Run:
    """``CALLS`` calls of Net: ``fc`` (a 64×256×256 Linear, 84 µs at the roofline, 200 µs a call)
    and ``block`` around ``block.relu`` (300 µs a call). The fifth call's fc holds a 200 ms full
    collection; the third call's relu a young one; a collection on another thread and one
    between calls are charged to nothing."""
    spans: list[Span] = []
    pauses: list[list[int]] = []
    t = 0
    for c in range(CALLS):
        i = 10 * c + 1
        fc_ns = FC_NS + (FULL_NS if c == 4 else 0)
        spans.append(Span(i + 1, i, L, "fc", t + 1000, t + 1000 + fc_ns, 1, linear_attrs(64, 256, 256)))
        if c == 4:
            pauses.append([TID, t + 2000, t + 2000 + FULL_NS, 2])
            pauses.append([OTHER_TID, t + 2000, t + 2000 + FULL_NS, 2])
        b = t + 2000 + fc_ns
        spans.append(Span(i + 2, i, L, "block", b, b + RELU_NS + 2000, 1, {"ml.layer.type": "Block"}))
        spans.append(Span(i + 3, i + 2, L, "block.relu", b + 1000, b + 1000 + RELU_NS, 1, {"ml.layer.type": "ReLU"}))
        if c == 2:
            pauses.append([TID, b + 2000, b + 2000 + YOUNG_NS, 0])
        end = b + RELU_NS + 3000
        spans.append(Span(i, None, M, "Net", t, end, 1, {"ml.layer.type": "Net"}))
        pauses.append([TID, end + 100, end + 200, 1])  # between two calls
        t = end + 1000
    return Run(
        path=Path("hand-made"),
        meta={"name": "hand-made", "complete": True, "pid": 5, "gc": {"pauses": pauses}},
        tracks={1: Track(1, TrackKind.THREAD, "MainThread", 5, TID)},
        spans=spans,
    )


def test_collections_are_charged_to_the_innermost_call_and_counted_around_it() -> None:
    run = gc_run()
    charged = gc_by_row(run.table, run.tracks, run.meta)
    assert charged.own == {("fc", L): GcTime(1, FULL_NS, 1), ("block.relu", L): GcTime(1, YOUNG_NS, 0)}
    assert charged.within[("block", L)] == GcTime(1, YOUNG_NS, 0)
    assert charged.within[("Net", M)] == GcTime(2, FULL_NS + YOUNG_NS, 1)


def test_a_layer_is_not_judged_overhead_bound_for_a_collection() -> None:
    a = analyze(gc_run(), CPU, include_cold=True)
    fc = next(r for r in a.layers if r.stat.name == "fc")
    assert fc.gc == GcTime(1, FULL_NS, 1) and fc.stat.self_ns == CALLS * FC_NS + FULL_NS
    assert fc.verdict is not None and fc.verdict.bound is not Bound.OVERHEAD
    assert "200.00 ms of the program's garbage collection (1 full collection)" in fc.verdict.reason
    assert fc.achieved_flops is not None and fc.achieved_flops > 0.3 * 100e9  # over its 4 ms, not 204 ms
    assert [r.stat.name for r in a.top_by_self(2)] == ["block.relu", "fc"]  # 6 ms of its own against fc's 4 ms
    assert any(n.startswith("Garbage collection:") and "the most in layer fc" in n for n in a.findings.notes)


def test_the_json_report_says_each_layers_collections() -> None:
    run = gc_run()
    data = build_report(run, analyze(run, CPU, include_cold=True))
    layers = {x["name"]: x for x in data["layers"]}
    assert (layers["fc"]["gc_self_ns"], layers["fc"]["gc_total_ns"]) == (FULL_NS, FULL_NS)
    assert (layers["block"]["gc_self_ns"], layers["block"]["gc_total_ns"]) == (0, YOUNG_NS)


def test_a_run_without_collections_says_nothing() -> None:
    run = gc_run()
    run.meta.pop("gc")
    a = analyze(run, CPU, include_cold=True)
    assert all(r.gc is None and r.gc_within is None for r in a.layers)
    assert not any("Garbage collection" in n for n in a.findings.notes)
    assert gc_note([], []) == ""
