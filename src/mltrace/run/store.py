"""Reading and writing a run directory.

Layout of ``mltrace-runs/<name>-<YYYYmmdd-HHMMSS>/``:

``run.json``
    Run metadata (command, host, versions, levels and why, summary). Written
    at start with ``"complete": false`` and rewritten at the end.
``events.jsonl``
    The canonical event stream. Each line is one JSON object holding a batch
    of rows (``tracks``, ``spans``, ``instants``, ``counters``, ``flows``).
    Appended while the program runs (at most one flush interval old), then
    replaced atomically by the correlated events when the run ends. A torn
    last line (the process was killed mid-write) is ignored on load.
``trace.pftrace``
    The Perfetto trace, streamed the same way and rewritten at the end.

Row layouts (positional, to keep the file small and fast to load):

- span: ``[id, parent_id|null, level, name, start_ns, end_ns, track_id, attrs]``
- instant: ``[name, ts_ns, track_id, level, attrs]``
- counter: ``[track_id, ts_ns, value]``
- flow: ``[id, from_span, to_span, kind]``
- track: ``[id, kind, name, pid, tid, device, stream, unit, parent_track]``
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from mltrace.tracer.levels import Level
from mltrace.tracer.model import CounterSample, Flow, Instant, Span, Track

META_FILE = "run.json"
EVENTS_FILE = "events.jsonl"
TRACE_FILE = "trace.pftrace"

FORMAT_VERSION = 1

try:  # orjson is ~5x faster on large runs; the stdlib is the fallback.
    import orjson as _orjson

    def _dumps(obj: Any) -> bytes:
        return _orjson.dumps(obj, option=_orjson.OPT_SERIALIZE_NUMPY, default=str)

    _loads = _orjson.loads
except ImportError:  # pragma: no cover - depends on the environment

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":"), default=str).encode()

    _loads = json.loads  # type: ignore[assignment]


class RunError(Exception):
    """A run directory or trace file that cannot be read (missing, torn, foreign)."""


def span_row(s: Span) -> list[Any]:
    return [s.id, s.parent_id, int(s.level), s.name, s.start_ns, s.end_ns, s.track_id, s.attrs]


def track_row(t: Track) -> list[Any]:
    return [t.id, t.kind, t.name, t.pid, t.tid, t.device, t.stream, t.unit, t.parent_track]


def encode_batch(
    *,
    tracks: Iterable[Track] = (),
    spans: Iterable[Span] = (),
    instants: Iterable[Instant] = (),
    counters: Iterable[CounterSample] = (),
    flows: Iterable[Flow] = (),
) -> bytes:
    """Encodes one batch as a single JSON line (bytes, newline-terminated)."""
    obj: dict[str, list[Any]] = {}
    rows: list[Any] = [track_row(t) for t in tracks]
    if rows:
        obj["tracks"] = rows
    rows = [span_row(s) for s in spans]
    if rows:
        obj["spans"] = rows
    rows = [[i.name, i.ts_ns, i.track_id, int(i.level), i.attrs] for i in instants]
    if rows:
        obj["instants"] = rows
    rows = [[c.track_id, c.ts_ns, c.value] for c in counters]
    if rows:
        obj["counters"] = rows
    rows = [[f.id, f.from_span, f.to_span, f.kind] for f in flows]
    if rows:
        obj["flows"] = rows
    return _dumps(obj) + b"\n"


@dataclass
class Run:
    """A loaded run: metadata plus every event, read-only by convention.

    Attributes:
        path: the run directory.
        meta: the contents of run.json.
        tracks: tracks by id.
        spans: every span, in file order.
        instants, counters, flows: the other events.
        torn: True when the event stream ended in a partial line (killed run).
    """

    path: Path
    meta: dict[str, Any]
    tracks: dict[int, Track] = field(default_factory=dict)
    spans: list[Span] = field(default_factory=list)
    instants: list[Instant] = field(default_factory=list)
    counters: list[CounterSample] = field(default_factory=list)
    flows: list[Flow] = field(default_factory=list)
    torn: bool = False

    @property
    def complete(self) -> bool:
        """Whether the run ended normally and its events are the correlated ones."""
        return bool(self.meta.get("complete"))

    def span_by_id(self) -> dict[int, Span]:
        """A fresh id → span index."""
        return {s.id: s for s in self.spans}


def _decode_line(run: Run, obj: dict[str, Any]) -> None:
    for r in obj.get("tracks", ()):
        run.tracks[r[0]] = Track(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8])
    levels = {int(lv): lv for lv in Level}
    spans = run.spans
    for r in obj.get("spans", ()):
        spans.append(Span(r[0], r[1], levels[r[2]], r[3], r[4], r[5], r[6], r[7]))
    for r in obj.get("instants", ()):
        run.instants.append(Instant(r[0], r[1], r[2], levels[r[3]], r[4]))
    for r in obj.get("counters", ()):
        run.counters.append(CounterSample(r[0], r[1], r[2]))
    for r in obj.get("flows", ()):
        run.flows.append(Flow(r[0], r[1], r[2], r[3]))


def read_meta(run_dir: Path) -> dict[str, Any]:
    """Reads run.json of ``run_dir``.

    Raises:
        RunError: if it is missing or not an mltrace run.
    """
    meta_path = run_dir / META_FILE
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunError(f"{run_dir}: not an mltrace run directory (no {META_FILE})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunError(f"{meta_path}: unreadable run metadata ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != "mltrace-run":
        raise RunError(f"{meta_path}: not mltrace run metadata")
    return meta


def load_run(path: str | os.PathLike[str]) -> Run:
    """Loads a run directory (or its run.json / events.jsonl) into memory.

    A run that was killed loads up to its last complete flush; ``Run.torn``
    says whether a partial last line was dropped.

    Raises:
        RunError: if the path is not a readable mltrace run.
    """
    p = Path(path)
    if p.is_file() and p.name in (META_FILE, EVENTS_FILE, TRACE_FILE):
        p = p.parent
    if not p.exists():
        raise RunError(f"{p}: no such run directory")
    if not p.is_dir():
        raise RunError(f"{p}: not a run directory (give the folder that holds {META_FILE})")
    meta = read_meta(p)
    run = Run(path=p, meta=meta)
    events = p / EVENTS_FILE
    if not events.exists():
        raise RunError(f"{p}: run has no {EVENTS_FILE}")
    try:
        data = events.read_bytes()
    except OSError as exc:
        raise RunError(f"{events}: {exc.strerror}") from None
    lines = data.split(b"\n")
    del data
    last = len(lines) - 1
    # Millions of small lists and Span objects: the cyclic GC would rescan them
    # over and over while they are built (3-5x slower); none of them form cycles.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        _decode_lines(run, lines, last, events)
    finally:
        if gc_was_enabled:
            gc.enable()
    return run


def _decode_lines(run: Run, lines: list[bytes], last: int, events: Path) -> None:
    for number, line in enumerate(lines):
        if not line:
            continue
        try:
            obj = _loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
            _decode_line(run, obj)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            if number == last:  # torn final write of a killed run
                run.torn = True
                break
            raise RunError(f"{events}:{number + 1}: corrupt event line ({exc})") from None


class EventWriter:
    """Appends event batches to an events.jsonl file (one line per batch)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[bytes] = open(path, "ab")  # noqa: SIM115 - closed in close()

    def write(self, **batch: Any) -> None:
        line = encode_batch(**batch)
        if line != b"{}\n":
            self._file.write(line)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_events_atomically(path: Path, run: Run, batch_size: int = 20000) -> None:
    """Replaces ``path`` with all events of ``run`` (write to a temp file, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(encode_batch(tracks=run.tracks.values()))
        for i in range(0, len(run.spans), batch_size):
            f.write(encode_batch(spans=run.spans[i : i + batch_size]))
        for i in range(0, len(run.instants), batch_size):
            f.write(encode_batch(instants=run.instants[i : i + batch_size]))
        for i in range(0, len(run.counters), batch_size):
            f.write(encode_batch(counters=run.counters[i : i + batch_size]))
        for i in range(0, len(run.flows), batch_size):
            f.write(encode_batch(flows=run.flows[i : i + batch_size]))
    os.replace(tmp, path)


def write_meta(run_dir: Path, meta: dict[str, Any]) -> None:
    """Writes run.json atomically."""
    tmp = run_dir / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, run_dir / META_FILE)
