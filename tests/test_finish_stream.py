"""The streamed finish (issue 27, ``finish_stream.StreamedFinish``) on a raw run of a real
traced program: a run finished a segment at a time is the run finished whole, and where the
streamed part cannot stand (a late span, a finisher process that is gone) the run is finished
whole and still complete."""

from __future__ import annotations

import bisect
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mltrace import finish
from mltrace.finish import _finalize_whole, finalize_run, seal_run
from mltrace.finish_stream import StreamedFinish
from mltrace.run import store
from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.run.store import Run

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL (no library level on CPU)")

#: An LSTM and a linear head on CPU: oneDNN (the LSTM) and MKL (the head's SGEMM) calls at the
#: library level. After its calls it idles past three flushes (0.5 s apart), so the last op
#: cycle is converted and streamed, then dies by SIGKILL: events.jsonl stays as streamed.
RAW_PROGRAM = """
import os, signal, time
import torch

torch.manual_seed(0)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(16, 32, batch_first=True)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])

model = Net().eval()
x = torch.randn(2, 8, 16)
with torch.no_grad():
    for _ in range(200):
        model(x)
        time.sleep(0.004)
print("called", flush=True)
time.sleep(1.5)
os.kill(os.getpid(), signal.SIGKILL)
"""

#: Seals this far apart (session time) over the raw run, and how long after its last span they
#: go on (the program idled 1.5 s after its calls, flushing; a seal takes what ends a library
#: allowance of up to 0.5 s before it).
SEAL_STEP_NS = 200_000_000
SEALS_AFTER_NS = 1_200_000_000
TEMPORARY = ("events.jsonl.streamed.tmp", "trace.pftrace.streamed.tmp")


@pytest.fixture(scope="module")
def raw_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of RAW_PROGRAM traced at every CPU level, as it was when the program
    died: streamed, never finished (``MLTRACE_FINISH_STREAM=0``: no finisher process)."""
    base = tmp_path_factory.mktemp("raw")
    script = base / "raw.py"
    script.write_text(textwrap.dedent(RAW_PROGRAM), encoding="utf-8")
    run_dir = base / "run"
    env = {**os.environ, "MLTRACE_FINISH_STREAM": "0", "MLTRACE_OP_CYCLE_S": "0.3"}
    env.pop("MLTRACE_OUTPUT", None)
    cmd = [sys.executable, "-m", "mltrace", "python", "-q", "-o", str(run_dir), str(script)]
    done = subprocess.run(cmd, capture_output=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode(errors="replace")
    assert done.stdout == b"called\n"
    run = store.load_run(run_dir)
    assert run.meta.get("complete") is not True
    levels = Counter(s.level for s in run.spans)
    assert levels[Level.MODEL] == 200 and levels[Level.LAYER] == 400
    assert levels[Level.OP] > 0 and levels[Level.LIBRARY] > 0
    return run_dir


@pytest.fixture(autouse=True)
def no_finisher_left() -> Iterator[None]:
    """Ends any finisher process a test left in ``finish._streams`` and forgets the runs."""
    yield
    for run_dir in list(finish._streams):
        finish._streams.pop(run_dir).discard(timeout_s=5.0)
    finish._unstreamed.clear()


def _copy(raw: Path, dest: Path) -> Path:
    shutil.copytree(raw, dest)
    return dest


def _meta(raw: Path) -> dict[str, Any]:
    """The metadata the finish is given (a fresh copy each time)."""
    return json.loads(json.dumps(store.read_meta(raw)))


def _seal_times(run: Run, step_ns: int = SEAL_STEP_NS) -> list[int]:
    """Session times every ``step_ns`` from the first span's start to ``SEALS_AFTER_NS`` after
    the last span's end, as the session's flushes sealed the run until it died."""
    first = min(s.start_ns for s in run.spans)
    last = max(s.end_ns for s in run.spans)
    return list(range(first + step_ns, last + SEALS_AFTER_NS, step_ns))


def _first_half(run: Run) -> list[int]:
    """The seal times up to the middle of the run's spans: a segment or more, not the end."""
    first = min(s.start_ns for s in run.spans)
    last = max(s.end_ns for s in run.spans)
    return [t for t in _seal_times(run) if t <= (first + last) // 2 + SEAL_STEP_NS]


def _by_id(run: Run) -> dict[int, tuple[Any, ...]]:
    """Each span's parent, level, name, interval, track name and attributes, by id (the ids of
    tracks a pass adds may differ, their names not)."""
    names = {t.id: t.name for t in run.tracks.values()}
    return {
        s.id: (s.parent_id, s.level, s.name, s.start_ns, s.end_ns, names.get(s.track_id), json.dumps(s.attrs, sort_keys=True, default=str))
        for s in run.spans
    }


def _open_at(run: Run, t: int) -> int | None:
    """The start of the earliest model, layer or user span running at ``t`` (the session's
    ``open_ns`` at a seal then: the spans its recorder and layer hooks hold open), or None."""
    held = (Level.USER, Level.MODEL, Level.LAYER)
    return min((s.start_ns for s in run.spans if s.level in held and s.start_ns <= t < s.end_ns), default=None)


def _streamed(run_dir: Path, meta: dict[str, Any], with_open: bool = True) -> StreamedFinish:
    """``run_dir`` finished by a ``StreamedFinish`` sealed every ``SEAL_STEP_NS``, each seal told
    the earliest start of the spans running then (``with_open``) or that none runs."""
    streamed = StreamedFinish(run_dir)
    raw = store.load_run(run_dir)
    for t in _seal_times(raw):
        streamed.seal(t, _open_at(raw, t) if with_open else None)
    assert streamed.finalize(meta) is not None, streamed.broken
    return streamed


def _no_temporary_files(run_dir: Path) -> None:
    left = sorted(p.name for p in run_dir.iterdir() if p.name.endswith(".tmp"))
    assert left == [], f"temporary files left: {left}"


@pytest.mark.parametrize("with_open", [True, False], ids=["spans-open-at-seals", "none-open"])
def test_a_run_finished_a_segment_at_a_time_is_the_run_finished_whole(raw_run: Path, tmp_path: Path, with_open: bool) -> None:
    """Two copies of a raw run, one finished whole, one sealed every 0.2 s of session time
    (told the spans then running, as the session does, or that none ran) and then finalized:
    the same spans (parents, levels, names, times, track names, attributes), the same summary,
    and run.json says how many segments were streamed."""
    whole_dir, streamed_dir = _copy(raw_run, tmp_path / "whole"), _copy(raw_run, tmp_path / "streamed")
    _finalize_whole(whole_dir, _meta(raw_run), None, None, None)
    streamed = _streamed(streamed_dir, _meta(raw_run), with_open)
    whole, parts = store.load_run(whole_dir), store.load_run(streamed_dir)
    a, b = _by_id(whole), _by_id(parts)
    assert a.keys() == b.keys()
    differing = [(a[i], b[i]) for i in a if a[i] != b[i]]
    assert differing == [], f"{len(differing)} spans differ, e.g. {differing[:3]}"
    assert parts.meta["summary"] == whole.meta["summary"]
    assert parts.meta["complete"] is True and "finish" not in whole.meta
    assert parts.meta["finish"]["streamed_segments"] == streamed.segments >= 2
    assert streamed.spans_done == len(parts.spans)
    # the events.jsonl each wrote (not the span table): the same spans, counters and instants
    jsonl = {d: _copy(d, tmp_path / f"jsonl-{d.name}") for d in (whole_dir, streamed_dir)}
    for copy in jsonl.values():
        (copy / "spans.bin").unlink()
    from_whole, from_parts = (store.load_run(jsonl[d]) for d in (whole_dir, streamed_dir))
    assert _by_id(from_parts) == a == _by_id(from_whole)
    assert from_whole.counters and sorted(from_parts.counters, key=repr) == sorted(from_whole.counters, key=repr)
    assert sorted(from_parts.instants, key=repr) == sorted(from_whole.instants, key=repr)
    # library calls ended in many segments, each under the op that issued it, as whole
    library = [s for s in parts.spans if s.level is Level.LIBRARY]
    times = _seal_times(parts)
    assert len({bisect.bisect_left(times, s.end_ns) for s in library}) >= 2  # in more than one segment
    assert library and sum(s.parent_id is not None for s in library) == sum(a[s.id][0] is not None for s in library)
    check = parts.meta["correlation"]["check_containment"]
    assert check["outside_parent"] == check["missing_parent"] == 0
    _no_temporary_files(streamed_dir)


def test_a_run_finished_a_segment_at_a_time_has_the_correlation_notes_of_the_whole(raw_run: Path, tmp_path: Path) -> None:
    """The passes' counts in run.json (``correlation``) add up to those of the whole finish, but
    ``nest_by_containment.parents_set``: over the whole run, nesting first gives an untimed
    (MKL) library call the span around its line's receipt, which ``attach_library_calls`` then
    replaces; in a segment that span may lie in another, and the call is not counted there. So
    the streamed count is short by at most the untimed calls (finish_stream's docstring)."""
    whole_dir, streamed_dir = _copy(raw_run, tmp_path / "whole"), _copy(raw_run, tmp_path / "streamed")
    _finalize_whole(whole_dir, _meta(raw_run), None, None, None)
    _streamed(streamed_dir, _meta(raw_run))
    whole = store.read_meta(whole_dir)["correlation"]
    streamed = store.read_meta(streamed_dir)["correlation"]
    nest_whole, nest_streamed = whole.pop("nest_by_containment"), streamed.pop("nest_by_containment")
    assert streamed == whole
    assert nest_streamed["parents_refined"] == nest_whole["parents_refined"]
    untimed = whole["attach_library_calls"]["untimed"]
    assert 0 <= nest_whole["parents_set"] - nest_streamed["parents_set"] <= untimed


def _late_span(run: Run) -> Span:
    """A span with an id of its own, a second before the run's first span: any segment written
    took its part of the run (a segment ends at most a library allowance, 0.5 s, before a
    seal, and after a span's end)."""
    first = min(s.start_ns for s in run.spans)
    track = min(run.spans, key=lambda s: s.start_ns).track_id
    return Span(max(s.id for s in run.spans) + 1, None, Level.USER, "late", first - 1_000_000_000, first - 900_000_000, track, {})


def _append(run_dir: Path, span: Span) -> None:
    with open(run_dir / store.EVENTS_FILE, "ab") as f:
        f.write(store.encode_batch(spans=[span]))


def test_a_span_written_after_its_part_was_sealed_breaks_the_streamed_finish(raw_run: Path, tmp_path: Path) -> None:
    """A span that ends before a seal but comes after it: ``finalize`` answers None, says why,
    removes its temporary files and leaves events.jsonl as it was; the whole finish then
    finishes the run with that span."""
    run_dir = _copy(raw_run, tmp_path / "run")
    raw = store.load_run(run_dir)
    times, half = _seal_times(raw), _first_half(raw)
    streamed = StreamedFinish(run_dir)
    for t in half:
        streamed.seal(t)
    assert streamed.segments >= 1 and streamed.sealed_ns is not None
    late = _late_span(raw)
    assert late.end_ns <= streamed.sealed_ns
    _append(run_dir, late)
    events = (run_dir / store.EVENTS_FILE).read_bytes()
    for t in times[len(half) :]:
        streamed.seal(t)
    meta = _meta(raw_run)
    assert streamed.finalize(meta) is None
    assert streamed.broken is not None and "after their part of the run" in streamed.broken
    _no_temporary_files(run_dir)
    assert (run_dir / store.EVENTS_FILE).read_bytes() == events
    assert not (run_dir / store.TRACE_FILE).exists() and not (run_dir / "spans.bin").exists()
    assert "summary" not in meta and store.read_meta(run_dir).get("complete") is not True
    done = _finalize_whole(run_dir, meta, None, None, None)
    assert done.meta["complete"] is True and "finish" not in done.meta
    assert len(store.load_run(run_dir).spans) == len(raw.spans) + 1


def _process_sealed(run_dir: Path, raw: Run, monkeypatch: pytest.MonkeyPatch) -> finish._FinisherProcess:
    """``seal_run`` over the first half of the run: the finisher process started (events.jsonl
    is over ``MLTRACE_FINISH_STREAM`` bytes) and sealed."""
    monkeypatch.setenv("MLTRACE_FINISH_STREAM", "65536")
    for t in _first_half(raw):
        seal_run(run_dir, t, _open_at(raw, t))
    stream = finish._streams.get(run_dir)
    assert stream is not None, "no finisher process started"
    _wait_for_a_segment(run_dir)
    return stream


def _wait_for_a_segment(run_dir: Path, timeout_s: float = 60) -> None:
    """Waits until the finisher process has written a segment (seals have no answer): its
    temporary trace file is written to only by segments."""
    trace = run_dir / "trace.pftrace.streamed.tmp"
    deadline = time.monotonic() + timeout_s
    while not (trace.exists() and trace.stat().st_size > 0):
        assert time.monotonic() < deadline, "the finisher process wrote no segment"
        time.sleep(0.02)


def test_finalize_run_finishes_the_streamed_run_in_its_finisher_process(
    raw_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``seal_run`` starts the finisher process, ``finalize_run`` has it finish the run: the
    run finished whole, with the streamed segments in run.json, the process gone."""
    whole_dir, run_dir = _copy(raw_run, tmp_path / "whole"), _copy(raw_run, tmp_path / "run")
    raw = store.load_run(run_dir)
    stream = _process_sealed(run_dir, raw, monkeypatch)
    for t in _seal_times(raw)[len(_first_half(raw)) :]:
        seal_run(run_dir, t, _open_at(raw, t))
    meta = _meta(raw_run)
    phases: list[str] = []
    finalize_run(run_dir, meta, phases.append)
    assert run_dir not in finish._streams and stream._proc.poll() == 0
    assert meta["complete"] is True and meta["finish"]["streamed_segments"] >= 2
    assert store.read_meta(run_dir) == meta
    assert any(p.startswith("correlating the last") for p in phases)
    _finalize_whole(whole_dir, _meta(raw_run), None, None, None)
    assert _by_id(store.load_run(run_dir)) == _by_id(store.load_run(whole_dir))
    _no_temporary_files(run_dir)


def test_a_late_span_has_finalize_run_finish_the_run_whole(raw_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The finisher process answers a fallback (a span came after its part was sealed): the
    run is finished whole, complete, with that span, and no streamed segments in run.json."""
    run_dir = _copy(raw_run, tmp_path / "run")
    raw = store.load_run(run_dir)
    _process_sealed(run_dir, raw, monkeypatch)
    _append(run_dir, _late_span(raw))
    seal_run(run_dir, _seal_times(raw)[-1])  # the process reads the late span
    meta = _meta(raw_run)
    run = finalize_run(run_dir, meta)
    assert meta["complete"] is True and meta["finish"]["streamed"] is False
    assert "spans arrived after their part of the run was finished" in meta["finish"]["why"]
    assert len(run.spans) == len(store.load_run(run_dir).spans) == len(raw.spans) + 1
    assert any(s.name == "late" for s in store.load_run(run_dir).spans)
    _no_temporary_files(run_dir)


def _kill_finisher(stream: finish._FinisherProcess) -> None:
    stream._proc.send_signal(signal.SIGKILL)
    stream._proc.wait(timeout=30)


def test_a_finisher_process_that_is_gone_leaves_the_run_to_the_whole_finish(
    raw_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finisher process killed after some seals: the next seal finds it gone, and
    ``finalize_run`` finishes the run whole: complete, the spans of a whole finish."""
    whole_dir, run_dir = _copy(raw_run, tmp_path / "whole"), _copy(raw_run, tmp_path / "run")
    raw = store.load_run(run_dir)
    _kill_finisher(_process_sealed(run_dir, raw, monkeypatch))
    seal_run(run_dir, _seal_times(raw)[-1])
    assert run_dir not in finish._streams and run_dir in finish._unstreamed
    meta = _meta(raw_run)
    finalize_run(run_dir, meta)
    assert meta["complete"] is True and meta["finish"] == {"streamed": False, "why": "the finisher process ended while the program ran"}
    _finalize_whole(whole_dir, _meta(raw_run), None, None, None)
    assert _by_id(store.load_run(run_dir)) == _by_id(store.load_run(whole_dir))
    assert store.read_meta(run_dir)["summary"] == store.read_meta(whole_dir)["summary"]


def test_a_finisher_process_gone_at_the_finish_leaves_the_run_to_the_whole_finish(
    raw_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finisher process killed after the last seal: ``finalize_run`` gets no answer and
    finishes the run whole: complete, the spans of a whole finish."""
    whole_dir, run_dir = _copy(raw_run, tmp_path / "whole"), _copy(raw_run, tmp_path / "run")
    raw = store.load_run(run_dir)
    _kill_finisher(_process_sealed(run_dir, raw, monkeypatch))
    meta = _meta(raw_run)
    finalize_run(run_dir, meta)
    assert run_dir not in finish._streams
    assert meta["complete"] is True and meta["finish"]["streamed"] is False
    assert "ended without an answer" in meta["finish"]["why"]
    _finalize_whole(whole_dir, _meta(raw_run), None, None, None)
    assert _by_id(store.load_run(run_dir)) == _by_id(store.load_run(whole_dir))


def test_a_finisher_process_that_is_gone_leaves_no_temporary_files(raw_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the whole finish that stood in for a killed finisher process, the run directory
    holds no temporary file."""
    run_dir = _copy(raw_run, tmp_path / "run")
    _kill_finisher(_process_sealed(run_dir, store.load_run(run_dir), monkeypatch))
    finalize_run(run_dir, _meta(raw_run))
    assert store.read_meta(run_dir)["complete"] is True
    _no_temporary_files(run_dir)


def test_perfetto_reads_the_streamed_trace_as_the_whole_one(raw_run: Path, tmp_path: Path) -> None:
    """Perfetto's trace processor (WASM, headless Chromium) reads trace.pftrace written a
    segment at a time, held spans after their segment, as the one written at once: per thread,
    the same slices (count, total duration, a sum over their starts) at the same depths."""
    from tests.support.perfetto_tp import query_trace, require_trace_processor

    require_trace_processor()
    whole_dir, streamed_dir = _copy(raw_run, tmp_path / "whole"), _copy(raw_run, tmp_path / "streamed")
    _finalize_whole(whole_dir, _meta(raw_run), None, None, None)
    _streamed(streamed_dir, _meta(raw_run))
    query = {
        "tracks": "select th.tid as tid, count(*) as n, sum(s.dur) as dur, sum(s.ts % 1000003) as ts, "
        "sum(s.depth) as depth, max(s.depth) as deepest from slice s left join thread_track tt on s.track_id = tt.id "
        "left join thread th using (utid) group by th.tid order by th.tid"
    }
    whole = query_trace(whole_dir / store.TRACE_FILE, query)["tracks"]
    streamed = query_trace(streamed_dir / store.TRACE_FILE, query)["tracks"]
    assert sum(int(str(row["n"])) for row in whole) == len(store.load_run(whole_dir).spans)
    assert any(row["tid"] is not None for row in whole)
    assert streamed == whole


def test_a_run_with_followed_processes_is_finished_whole_and_says_so(
    raw_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose finish merges followed processes' events (``extend``) is finished whole, its
    finisher process ended and its files removed, and run.json says why."""
    run_dir = _copy(raw_run, tmp_path / "run")
    raw = store.load_run(run_dir)
    stream = _process_sealed(run_dir, raw, monkeypatch)
    meta = _meta(raw_run)
    finalize_run(run_dir, meta, extend=lambda run: run)
    assert stream._proc.returncode is not None and run_dir not in finish._streams
    why = "the events of followed processes are merged in at the end"
    assert meta["complete"] is True and meta["finish"] == {"streamed": False, "why": why}
    assert store.read_meta(run_dir)["finish"] == meta["finish"]
    _no_temporary_files(run_dir)
