"""Source level: Python stack samples from py-spy, attributed to spans.

py-spy samples this process from outside (``py-spy record -p PID -f
chrometrace --idle``), so sampling costs the program little. Its chrometrace
output opens a frame at the first sample that shows it and closes it at the
first sample that no longer does; ``--idle`` keeps the samples of a waiting
thread (sleep, lock, I/O), which py-spy otherwise leaves out, so that a frame's
slice never spans time in which its thread was not sampled. Its timestamps
count from py-spy's own start; they are aligned to the session clock by a
marker: a uniquely named busy function run for a known interval right after
py-spy attaches. The first sample inside the marker and the first one after it
each bound the offset to one sampling period; the offset is the middle of what
both allow (its half-width recorded in run.json).

Samples become ``Level.SOURCE`` slices on a "(python)" track next to each
thread; the ``attribute_samples`` pass then gives every span the hottest
source lines sampled while it was the innermost span on its thread.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mltrace.run.events import Event, Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.tracer.clock import now_ns
from mltrace.tracer.sources.base import Source

if TYPE_CHECKING:
    from mltrace.tracer.sources.base import SessionView

MARKER = "_mltrace_pyspy_clock_marker"
_MARKER_NS = 60_000_000  # long enough for several samples at 100 Hz


def _mltrace_pyspy_clock_marker(duration_ns: int) -> tuple[int, int]:
    start = now_ns()
    x = 0
    while now_ns() - start < duration_ns:
        x += 1
    return start, now_ns()


def find_py_spy() -> str | None:
    """The py-spy executable: next to this interpreter, else on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    if here.exists():
        return str(here)
    return shutil.which("py-spy")


class PySpySource(Source):
    """Samples Python stacks with py-spy while the session runs.

    Args:
        rate_hz: samples per second.
        native: also sample native (C/C++) frames.
    """

    name = "py-spy"
    levels: tuple[Level, ...] = ()  # started by the --py-spy option, not by a level

    def __init__(self, rate_hz: int = 100, native: bool = False) -> None:
        self.rate_hz = rate_hz
        self.native = native
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._session: SessionView | None = None
        self._marker: tuple[int, int] | None = None
        self._stderr: list[bytes] = []

    def available(self) -> str | None:
        if find_py_spy() is None:
            return "py-spy is not installed (pip install 'mltrace[source]')"
        return None

    def start(self, session: SessionView) -> None:
        exe = find_py_spy()
        assert exe is not None
        self._session = session
        self._tmp = tempfile.TemporaryDirectory(prefix="mltrace-pyspy-")
        out = os.path.join(self._tmp.name, "samples.json")
        cmd = [exe, "record", "-p", str(os.getpid()), "-f", "chrometrace", "-o", out, "-r", str(self.rate_hz), "-t", "--nonblocking"]
        cmd.append("--idle")  # a waiting thread's samples too: else its last stack spans the wait
        if self.native:
            cmd.append("--native")
        self._out = out
        # py-spy announces "Sampling process" on stdout; errors go to stderr: read both.
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        started = threading.Event()

        def read_stderr() -> None:
            assert self._proc is not None and self._proc.stdout is not None
            for line in self._proc.stdout:
                self._stderr.append(line)
                if b"Sampling process" in line:
                    started.set()
            started.set()

        threading.Thread(target=read_stderr, name="mltrace-pyspy-stderr", daemon=True).start()
        if not started.wait(10) or self._proc.poll() is not None:
            err = b"".join(self._stderr).decode(errors="replace").strip().splitlines()
            self._kill()
            raise RuntimeError(err[-1] if err else "py-spy did not start (is ptrace permitted?)")
        # py-spy reports it is sampling slightly before the first sample: give it two periods.
        time.sleep(2.0 / self.rate_hz)
        self._marker = _mltrace_pyspy_clock_marker(_MARKER_NS)

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)

    def sealed_until_ns(self) -> int | None:
        """0 while py-spy samples: the samples come at ``stop()``."""
        return 0 if self._proc is not None else None

    def stop(self) -> list[Event]:
        try:
            if self._proc is None:
                return []
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGINT)
                try:
                    self._proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self._kill()
            try:
                with open(self._out, encoding="utf-8") as f:
                    trace = json.load(f)
            except (OSError, ValueError) as exc:
                raise RuntimeError(f"py-spy wrote no readable samples: {exc}") from None
            assert self._session is not None and self._marker is not None
            return self._convert(trace)
        finally:
            self._kill()
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    def _convert(self, trace: Any) -> list[Event]:
        session = self._session
        assert session is not None and self._marker is not None
        events = trace if isinstance(trace, list) else trace.get("traceEvents", [])
        period = 1_000_000_000 // self.rate_hz
        alignment = marker_offset_ns(events, self._marker, period)
        session.meta.setdefault("sources", {})["py-spy"] = {
            "rate_hz": self.rate_hz,
            "native": self.native,
            "idle_samples": True,
            "alignment_uncertainty_ns": alignment[1] if alignment is not None else period,
            "aligned": alignment is not None,
        }
        if alignment is None:
            session.note_limitation("py-spy samples could not be aligned to the trace (marker not sampled); samples dropped")
            return []
        offset = alignment[0]
        idents = session.recorder.thread_idents
        out: list[Event] = []
        tracks: dict[int, Track] = {}
        stacks: dict[int, list[Span]] = {}
        for ev in events:
            ph = ev.get("ph")
            if ph not in ("B", "E"):
                continue
            tid = int(ev.get("tid", 0))
            name = str(ev.get("name", ""))
            ts = int(float(ev.get("ts", 0)) * 1000) + offset
            if ph == "B":
                if name.startswith("thread ("):
                    stacks.setdefault(tid, [])
                    continue
                track = tracks.get(tid)
                if track is None:
                    parent_id = idents.get(tid)
                    parent = session.tracks.tracks.get(parent_id) if parent_id is not None else None
                    base = parent.name if parent is not None else f"thread {tid}"
                    track = _sample_track(session, parent, base, tid)
                    tracks[tid] = track
                    out.append(track)
                st = stacks.setdefault(tid, [])
                args = ev.get("args") or {}
                attrs: dict[str, Any] = {"code.function.name": name, "mltrace.source": "py-spy"}
                if args.get("filename"):
                    attrs["code.file.path"] = args["filename"]
                    attrs["code.line.number"] = int(args.get("line", 0))
                span = Span(session.new_id(), st[-1].id if st else None, Level.SOURCE, name, ts, -1, track.id, attrs)
                st.append(span)
            else:
                open_stack = stacks.get(tid)
                if not open_stack or name.startswith("thread ("):
                    continue
                span = open_stack.pop()
                span.end_ns = max(ts, span.start_ns)
                if name != MARKER:  # the marker is mltrace's own, not the program's
                    out.append(span)
        return out


def _sample_track(session: SessionView, parent: Track | None, base: str, tid: int) -> Track:
    return session.tracks._get(  # noqa: SLF001 - the registry's keyed constructor
        ("pyspy", parent.id if parent else tid),
        Track,
        kind=TrackKind.ASYNC,
        name=f"{base} (python)",
        pid=session.tracks.pid,
        tid=parent.tid if parent else 0,
        parent_track=parent.id if parent else -1,
    )


def marker_offset_ns(events: list[dict[str, Any]], marker: tuple[int, int], period_ns: int) -> tuple[int, int] | None:
    """Offset (ns) to add to py-spy timestamps (µs × 1000) to get session ns, and its
    uncertainty (half-width, ns); None when no sample fell inside the marker.

    ``marker`` is the marker's ``(start, end)`` in session ns. The first ``B`` event of
    the marker function is the first sample inside it, taken within one period after
    the marker began; its last ``E`` event is the first sample after it, taken within
    one period after the marker ended. Each bounds the offset to one period; the
    offset is the middle of the range both allow (of the first alone when py-spy's
    timing jittered so that they do not meet).
    """
    first_in = last_out = None
    for ev in events:
        if ev.get("name") != MARKER:
            continue
        ts = int(float(ev.get("ts", 0)) * 1000)
        if ev.get("ph") == "B" and first_in is None:
            first_in = ts
        elif ev.get("ph") == "E":
            last_out = ts
    if first_in is None:
        return None
    low, high = marker[0] - first_in, marker[0] - first_in + period_ns
    if last_out is not None and max(low, marker[1] - last_out) <= min(high, marker[1] - last_out + period_ns):
        low, high = max(low, marker[1] - last_out), min(high, marker[1] - last_out + period_ns)
    return (low + high) // 2, (high - low + 1) // 2
