"""The report's cross-stack chains and hot lines count the calls its tables count."""

from __future__ import annotations

import io
from pathlib import Path

from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.report_data import build_report
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.viewers.terminal import render_report

MS = 1_000_000


def _call(first_id: int, model: str, layer: str, start: int, ms: int, hot_ns: int) -> list[Span]:
    """One model call of ``ms`` milliseconds: its layer, an op in it and an MKL call in the op."""
    i = first_id
    layer_attrs = {"ml.layer.type": "Linear", "ml.source.hot_lines": [["/src/net.py:7 forward", hot_ns]]}
    return [
        Span(i, None, Level.MODEL, model, start, start + ms * MS, 1, {"ml.layer.type": model}),
        Span(i + 1, i, Level.LAYER, layer, start + 10, start + ms * MS - 10, 1, layer_attrs),
        Span(i + 2, i + 1, Level.OP, "aten::linear", start + 20, start + ms * MS - 20, 1, {}),
        Span(i + 3, i + 2, Level.LIBRARY, "MKL SGEMM", start + 30, start + ms * MS - 30, 1, {"ml.library.name": "MKL"}),
    ]


def _run(spans: list[Span]) -> Run:
    return Run(Path("hand"), {"name": "hand", "complete": True}, {1: Track(1, TrackKind.THREAD, "MainThread", 1, 1)}, spans)


def _cold_first_call_run() -> Run:
    """Net called 5 times: a 50 ms cold first call, then 1 ms steady calls."""
    spans = _call(1, "Net", "fc", 0, 50, hot_ns=40 * MS)
    for k in range(1, 5):
        spans += _call(1 + 4 * k, "Net", "fc", 100 * MS * k, 1, hot_ns=MS)
    return _run(spans)


def _chain_line(text: str, layer: str) -> str:
    return next(line for line in text.splitlines() if line.strip().startswith(f"{layer} (") and "→" in line)


def test_cross_stack_chain_leaves_out_the_cold_calls_the_tables_leave_out() -> None:
    run = _cold_first_call_run()
    for include_cold, linear in ((False, "aten::linear 4.00 ms"), (True, "aten::linear 54.00 ms")):
        a = analyze(run, include_cold=include_cold)
        assert a.cold.cold_calls == 1
        out = io.StringIO()
        render_report(run, a, file=out, width=250)
        assert linear in _chain_line(out.getvalue(), "fc"), out.getvalue()


def test_hot_lines_leave_out_the_cold_calls_the_tables_leave_out() -> None:
    run = _cold_first_call_run()
    (fc,) = build_report(run, analyze(run, include_cold=False))["layers"]
    assert fc["calls"] == 4
    assert [h["ns"] for h in fc["hot_lines"]] == [4 * MS]


def test_cross_stack_chain_of_a_layer_path_two_models_share() -> None:
    """A generator and a discriminator each with a ``main.0``: the report names the rows
    after their models, and each row's chain is found under that name."""
    spans: list[Span] = []
    for k in range(3):
        spans += _call(1 + 8 * k, "Generator", "main.0", 10 * MS * k, 2, hot_ns=MS)
        spans += _call(5 + 8 * k, "Discriminator", "main.0", 10 * MS * k + 5 * MS, 1, hot_ns=MS)
    run = _run(spans)
    out = io.StringIO()
    render_report(run, analyze(run), file=out, width=250)
    text = out.getvalue()
    assert "aten::linear 6.00 ms" in _chain_line(text, "Generator.main.0"), text
    assert "aten::linear 3.00 ms" in _chain_line(text, "Discriminator.main.0"), text


def test_library_calls_no_op_issued_are_counted_in_a_finding() -> None:
    """An MKL call the library pass set apart (no op could be shown to have issued it) is in
    no table: a finding says how many of the CPU library calls that is."""
    spans = _cold_first_call_run().spans
    apart = {"ml.library.name": "MKL", "ml.library.placement": "unplaced"}
    run = _run([*spans, Span(99, None, Level.LIBRARY, "MKL SGEMM", 5 * MS, 6 * MS, 1, apart)])
    a = analyze(run, include_cold=False)
    (note,) = [n for n in a.findings.notes if "could not be placed" in n]
    assert note.startswith("1 of 6 CPU library calls (MKL, oneDNN) could not be placed")
    out = io.StringIO()
    render_report(run, a, file=out, width=250)
    assert note in out.getvalue()
    assert not [n for n in analyze(_cold_first_call_run()).findings.notes if "could not be placed" in n]
