"""The op level's converter process: converts each cycle's Kineto trace and appends the events
to the run's ``events.jsonl``, outside the traced process (and its GIL).

``python -m mltrace.formats.kineto_serve`` reads one request per line on stdin (JSON)::

    {"path": <Kineto trace>, "events": <events.jsonl>, "epoch_ns": …, "monotonic_ns": …}

and answers on stdout, one JSON line each. While it converts it asks the traced process for
what only that process may allocate, and reads the answer on stdin:

- ``{"track": ["thread", tid, name, pid]}`` (or ``["gpu_stream", device, stream, pid]``,
  ``["counter", name, unit, device]``) → ``{"row": <track row>}``: the session's track, so ops
  land on the same thread tracks as the layer spans (asked once per key);
- ``{"ids": n}`` → ``{"ids": [n event ids]}``: the session's ids for the cycle's spans and
  flows (the conversion numbers them 1…n first).

Then it appends the events as one line (``os.write`` on an ``O_APPEND`` descriptor: one
write, which the session's own appends do not interleave), removes the trace file and answers
``{"done": {"spans": n, "stats": {…}, "peak_rss_kb": its peak resident memory}}``; ``{"error": text}`` where the cycle failed (the trace
file is then left for ``mltrace import``). Op and layer-like spans are written as templates
(``run/store.py``) numbered from ``TEMPLATE_BASE``, apart from the session's own. At the end
of its input (the session's stop, or the traced process's death) it exits: a cycle it had its
ids for when the program was killed still reaches the run; one it had not stays in its trace
file. It imports neither torch nor the tracer: its start costs an interpreter and mltrace's
ground modules.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import IO, Any

from mltrace.formats.kineto import KinetoEvents, kineto_to_events, load_kineto_json
from mltrace.run.events import Span, Track
from mltrace.run.jsoncodec import dumps, loads, trimmed
from mltrace.run.levels import Level
from mltrace.run.store import encode_batch, span_row

#: The first template id of the converter's span templates (the session's count from 1).
TEMPLATE_BASE = 1 << 40
_TEMPLATED = frozenset({Level.OP, Level.LAYER, Level.USER})
_TEMPLATES_MAX = 65536


class _Channel:
    """The request/answer lines with the traced process."""

    def __init__(self, inp: IO[bytes], out: IO[bytes]) -> None:
        self._in, self._out = inp, out

    def send(self, obj: Any) -> None:
        self._out.write(dumps(obj) + b"\n")
        self._out.flush()

    def ask(self, obj: Any) -> Any:
        """Sends a question and returns the answer (EOFError: the traced process is gone)."""
        self.send(obj)
        line = self._in.readline()
        if not line:
            raise EOFError("the traced process closed the pipe")
        return loads(line)


class _SessionTracks:
    """The session's tracks, asked for once per key (``formats.kineto.Tracks``)."""

    def __init__(self, channel: _Channel) -> None:
        self._channel = channel
        self._known: dict[tuple[Any, ...], Track] = {}

    def _get(self, key: tuple[Any, ...]) -> Track:
        track = self._known.get(key)
        if track is None:
            r = self._channel.ask({"track": list(key)})["row"]
            track = self._known[key] = Track(
                id=r[0], kind=r[1], name=r[2], pid=r[3], tid=r[4], device=r[5], stream=r[6], unit=r[7], parent_track=r[8]
            )
        return track

    def thread(self, tid: int, name: str = "", pid: int | None = None) -> Track:
        return self._get(("thread", tid, name, pid))

    def gpu_stream(self, device: int, stream: int, pid: int | None = None) -> Track:
        return self._get(("gpu_stream", device, stream, pid))

    def counter(self, name: str, unit: str = "", device: int = -1) -> Track:
        return self._get(("counter", name, unit, device))


class _Templates:
    """Span templates written so far: (level, name, attributes) → template id."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, str, bytes], int] = {}
        self._next = TEMPLATE_BASE

    def encode(self, spans: list[Span]) -> tuple[bytes, bytes]:
        """(new templates, span rows), each comma-separated (``encode_batch``'s pieces)."""
        templates: list[bytes] = []
        rows: list[list[Any]] = []
        for s in spans:
            if s.level not in _TEMPLATED or s.parent_id is not None:
                rows.append(span_row(s))
                continue
            attrs = trimmed(dumps(s.attrs))
            key = (int(s.level), s.name, attrs)
            tid = self._ids.get(key)
            if tid is None:
                if len(self._ids) >= _TEMPLATES_MAX:
                    self._ids.clear()  # written templates stay valid; later repeats get new ones
                tid = self._ids[key] = self._next
                self._next += 1
                templates.append(dumps([tid, s.name])[:-1] + b"," + attrs + b"]")
            rows.append([s.id, None, int(s.level), None, s.start_ns, s.end_ns, s.track_id, {}, tid])
        return b",".join(templates), dumps(rows)[1:-1] if rows else b""


def _renumber(result: KinetoEvents, ids: list[int]) -> None:
    """Gives the events the session's ids (the conversion numbered them 1…n)."""
    for s in result.spans:
        s.id = ids[s.id - 1]
        if s.parent_id is not None:
            s.parent_id = ids[s.parent_id - 1]
    for f in result.flows:
        f.id, f.from_span, f.to_span = ids[f.id - 1], ids[f.from_span - 1], ids[f.to_span - 1]


class Server:
    """Converts one cycle per request (``serve``)."""

    def __init__(self, channel: _Channel) -> None:
        self._channel = channel
        self._tracks = _SessionTracks(channel)
        self._templates = _Templates()

    def convert(self, request: dict[str, Any]) -> dict[str, Any]:
        """Converts the trace of ``request`` and appends its events; the answer to send."""
        path = Path(request["path"])
        trace = load_kineto_json(path)
        offset = int(request["monotonic_ns"]) - int(request["epoch_ns"])
        counter = iter(range(1, 1 << 62))
        result = kineto_to_events(trace, self._tracks, counter.__next__, lambda ns: ns + offset, external_ids=False)
        del trace
        used = next(counter) - 1
        if used:
            _renumber(result, self._channel.ask({"ids": used})["ids"])
        templates, rows = self._templates.encode(result.spans)
        line = encode_batch(
            tracks=result.tracks,
            span_rows=[rows],
            span_templates=[templates],
            instants=result.instants,
            counters=result.counters,
            flows=result.flows,
        )
        fd = os.open(request["events"], os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        path.unlink(missing_ok=True)
        return {"done": {"spans": len(result.spans), "stats": result.stats.as_dict(), "peak_rss_kb": peak_rss_kb()}}


def peak_rss_kb() -> int:
    """This process's peak resident memory (kB, ``VmHWM``; ``ru_maxrss`` would be the traced
    process's, whose memory map this one's exec replaced), 0 where unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _release_free_memory() -> None:
    """glibc's ``malloc_trim``: what a cycle's load and conversion freed goes back to the system."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def serve(inp: IO[bytes], out: IO[bytes]) -> int:
    """Answers requests until the end of ``inp``; 0."""
    channel = _Channel(inp, out)
    server = Server(channel)
    for line in iter(inp.readline, b""):
        try:
            answer = server.convert(loads(line))
        except EOFError:
            return 0
        except Exception as exc:  # noqa: BLE001 - one cycle lost, said to the traced process
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            channel.send(answer)
        except (BrokenPipeError, OSError):
            return 0
        _release_free_memory()
    return 0


def main() -> int:
    """The process's entry: Ctrl-C in the terminal is the traced program's to handle; this
    process ends at the end of its input."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    status = serve(sys.stdin.buffer, sys.stdout.buffer)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # the traced program waits for this process's end: no teardown to wait for


if __name__ == "__main__":
    sys.exit(main())
