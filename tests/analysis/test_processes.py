"""The processes section from a run built by hand, where every number is known: each listed
process's model calls, spans, parent and note, and the report JSON and Markdown of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from analysis.schema_check import errors
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.peaks import Peaks, PeakSet
from mltrace.analysis.processes import process_rows
from mltrace.analysis.report_data import build_report
from mltrace.analysis.report_schema import REPORT_SCHEMA
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.viewers.markdown import render_markdown

PEAKS = PeakSet(Peaks("cpu", "test CPU", 100e9, 10e9, "assumed"))


def _run(processes: list[dict[str, Any]]) -> Run:
    """The program (pid 9) makes no model call; rank 0 (pid 10) two, on two threads, one with
    a nested model span; its DataLoader worker (pid 11) runs an op; pid 12 recorded nothing."""
    tracks = {
        1: Track(1, TrackKind.THREAD, "MainThread", 10, 10),
        2: Track(2, TrackKind.THREAD, "worker", 10, 13),
        3: Track(3, TrackKind.THREAD, "MainThread", 11, 11),
    }
    spans = [
        Span(1, None, Level.MODEL, "Net", 0, 1_000, 1, {}),
        Span(2, 1, Level.MODEL, "Inner", 100, 900, 1, {}),
        Span(3, None, Level.MODEL, "Net", 2_000, 2_500, 2, {}),
        Span(4, None, Level.OP, "aten::add", 0, 100, 3, {}),
    ]
    return Run(Path("hand"), {"name": "hand", "complete": True, "processes": processes}, tracks, spans)


PROCESSES = [
    {"pid": 9, "role": "main", "finished": True},
    {"pid": 10, "ppid": 9, "role": "rank 0", "start": "exec", "finished": True},
    {"pid": 11, "ppid": 10, "role": "DataLoader worker 0", "start": "fork", "finished": False, "level": "layer: capped"},
    {"pid": 12, "ppid": 4242, "role": "pid 12", "finished": True, "note": "no framework imported: nothing recorded"},
]


def test_each_process_has_its_model_calls_spans_parent_and_note() -> None:
    rows = process_rows(run=_run(PROCESSES))
    assert rows is not None
    got = [(r.pid, r.role, r.start, r.parent, r.model_calls, r.model_ns, r.spans) for r in rows]
    assert got == [
        (9, "main", None, None, 0, 0, 0),
        (10, "rank 0", "exec", "main", 2, 1_500, 3),  # the nested model span is no call of its own
        (11, "DataLoader worker 0", "fork", "rank 0", 0, 0, 1),
        (12, "pid 12", None, "pid 4242", 0, 0, 0),  # started by a process the run does not list
    ]
    assert [r.note for r in rows] == [
        "",
        "",
        "had not finished its trace: what it streamed; layer: capped",
        "no framework imported: nothing recorded",
    ]


def test_one_process_has_no_section() -> None:
    assert process_rows(run=_run(PROCESSES[:1])) is None
    assert process_rows(run=_run([])) is None


def test_report_json_and_markdown() -> None:
    run = _run(PROCESSES)
    data = build_report(run, analyze(run, PEAKS))
    assert errors(data, REPORT_SCHEMA) == []
    calls = [(p["role"], p["model_calls"]) for p in data["processes"]]
    assert calls == [("main", 0), ("rank 0", 2), ("DataLoader worker 0", 0), ("pid 12", 0)]
    md = render_markdown(data).splitlines()
    at = md.index("### Processes")
    assert md[at + 2] == "4 processes, 1 with model calls."
    assert any(line.startswith("| DataLoader worker 0 | 11 | rank 0 (fork) | 0 |") for line in md[at:])


def test_an_unfinished_process_is_said_to_run_on_or_to_have_ended_and_an_anonymous_one_by_its_command() -> None:
    """run.json's ``running`` of a process that had not finished its trace: still running at
    the run's end, or ended before its finish (killed); a process known by its pid alone that
    was started by exec is named by its command line (a forked one's is its parent's)."""
    command = ["python", "worker.py", "--n", "2"]
    processes = [
        PROCESSES[0],
        {"pid": 13, "ppid": 9, "role": "pid 13", "start": "exec", "finished": False, "running": False, "command": command},
        {"pid": 14, "ppid": 9, "role": "pid 14", "start": "fork", "finished": False, "running": True, "command": command},
        {"pid": 15, "ppid": 9, "role": "SpawnProcess-1", "start": "exec", "finished": True, "command": command},
        {"pid": 16, "ppid": 9, "role": "pid 16", "start": "exec", "finished": True, "command": command},
    ]
    rows = process_rows(run=_run(processes))
    assert rows is not None
    assert [(r.pid, r.parent, r.note) for r in rows[1:]] == [
        (13, "main", "ended before it finished its trace (killed): what it streamed; command: python worker.py --n 2"),
        (14, "main", "was still running when the run ended: what it streamed"),
        (15, "main", ""),
        (16, "main", "command: python worker.py --n 2"),
    ]
