"""Reading and writing a run directory, ``mltrace-runs/<name>-<YYYYmmdd-HHMMSS>/``.

``run.json`` holds the metadata (written at start with ``"complete": false``, rewritten at
the end); ``events.jsonl`` the canonical event stream, one JSON object of row batches a line
(``tracks``, ``spans``, ``templates``, ``instants``, ``counters``, ``flows``), appended while
the program runs and replaced atomically by the correlated events at the end (a torn last
line is ignored on load); ``trace.pftrace`` the Perfetto trace; ``spans.bin`` the spans as
columns (``run/table.py``), a cache. Rows are positional, to keep the file small and fast:

- span: ``[id, parent_id|null, level, name, start_ns, end_ns, track_id, attrs]``, or with a
  ninth element, a template id: a null ``name`` is the template's, and ``attrs`` update the
  template's attributes
- template: ``[template_id, name, attrs]``, in the line of the first span that uses it or an
  earlier one: what many spans share (a layer's path, facts and shapes, written once)
- instant: ``[name, ts_ns, track_id, level, attrs]``
- counter: ``[track_id, ts_ns, value]``
- flow: ``[id, from_span, to_span, kind]``
- track: ``[id, kind, name, pid, tid, device, stream, unit, parent_track]``
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from mltrace.run.events import CounterSample, Flow, Instant, Span, Track
from mltrace.run.gcpause import gc_paused
from mltrace.run.jsoncodec import dumps, trimmed
from mltrace.run.jsoncodec import loads as _loads
from mltrace.run.levels import Level
from mltrace.run.metadata import meta_problem
from mltrace.run.table import TABLE_FILE

if TYPE_CHECKING:
    from mltrace.run.table import SpanTable

META_FILE = "run.json"
EVENTS_FILE = "events.jsonl"
TRACE_FILE = "trace.pftrace"
#: The files the streamed finish writes in the run directory until its end (removed where it
#: cannot finish): events.jsonl's and trace.pftrace's, and the span table's arrays.
STREAMED_TEMPORARY = "*.streamed.tmp"

FORMAT_VERSION = 1


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
    span_rows: Iterable[bytes] = (),
    span_templates: Iterable[bytes] = (),
    instants: Iterable[Instant] = (),
    counters: Iterable[CounterSample] = (),
    flows: Iterable[Flow] = (),
) -> bytes:
    """Encodes one batch as a single JSON line (bytes, newline-terminated).

    ``span_rows`` are spans a producer encoded itself (``Recorder.drain(encoded=True)``):
    each a comma-separated run of ``span_row`` arrays (UTF-8), written after ``spans``;
    ``span_templates`` the same for the templates they refer to.
    """
    obj: dict[str, list[Any]] = {}
    rows: list[Any] = [track_row(t) for t in tracks]
    if rows:
        obj["tracks"] = rows
    rows = [span_row(s) for s in spans]
    encoded = [r for r in span_rows if r]
    if encoded and rows:
        encoded.insert(0, dumps(rows)[1:-1])
    elif rows:
        obj["spans"] = rows
    for key, rows in (
        ("instants", [[i.name, i.ts_ns, i.track_id, int(i.level), i.attrs] for i in instants]),
        ("counters", [[c.track_id, c.ts_ns, c.value] for c in counters]),
        ("flows", [[f.id, f.from_span, f.to_span, f.kind] for f in flows]),
    ):
        if rows:
            obj[key] = rows
    line = dumps(obj)
    templates = [t for t in span_templates if t]
    if not templates and not encoded:
        return line + b"\n"
    # The pre-encoded rows spliced in as the line's first keys, joined once: a flush's rows are
    # megabytes, and each concatenation would copy them all again.
    pieces = [b"{"]
    for opening, runs in ((b'"templates":[', templates), (b'"spans":[', encoded)):
        if runs:
            pieces += [b"," if len(pieces) > 1 else b"", opening, *_commas(runs), b"]"]
    pieces += [b"," + line[1:] if line != b"{}" else b"}", b"\n"]
    return b"".join(pieces)


def _commas(runs: list[bytes]) -> list[bytes]:
    """``runs`` with ``b","`` between each two."""
    out = [b","] * (2 * len(runs) - 1)
    out[::2] = runs
    return out


class Run:
    """A loaded run: metadata plus every event, read-only by convention.

    Attributes:
        path: the run directory.
        meta: the contents of run.json.
        tracks: tracks by id.
        spans: every span, in file order. A run loaded from its span table
            builds these objects on first access only (see ``table``).
        instants, counters, flows: the other events.
        torn: True when the event stream ended in a partial line (killed run).
    """

    def __init__(
        self,
        path: Path,
        meta: dict[str, Any],
        tracks: dict[int, Track] | None = None,
        spans: list[Span] | None = None,
        instants: list[Instant] | None = None,
        counters: list[CounterSample] | None = None,
        flows: list[Flow] | None = None,
        torn: bool = False,
        table: SpanTable | None = None,
    ) -> None:
        self.path = path
        self.meta = meta
        self.tracks: dict[int, Track] = tracks if tracks is not None else {}
        self._spans: list[Span] | None = spans if spans is not None or table is not None else []
        self.instants: list[Instant] = instants if instants is not None else []
        self.counters: list[CounterSample] = counters if counters is not None else []
        self.flows: list[Flow] = flows if flows is not None else []
        self.torn = torn
        self._table = table

    @property
    def spans(self) -> list[Span]:
        if self._spans is None:
            assert self._table is not None
            with gc_paused():
                self._spans = self._table.to_spans()
        return self._spans

    @spans.setter
    def spans(self, spans: list[Span]) -> None:
        self._spans = spans
        self._table = None

    @property
    def table(self) -> SpanTable:
        """The spans as columns: the stored table, or one built from ``spans`` now."""
        if self._table is not None:
            return self._table
        from mltrace.run.table import SpanTable

        return SpanTable.from_spans(self.spans)

    def replace(self, **changes: Any) -> Run:
        """A new run with ``changes`` (keyword: any constructor argument) applied."""
        fields: dict[str, Any] = {
            "path": self.path,
            "meta": self.meta,
            "tracks": self.tracks,
            "instants": self.instants,
            "counters": self.counters,
            "flows": self.flows,
            "torn": self.torn,
        }
        if "spans" not in changes:
            fields["spans"] = self._spans
            fields["table"] = self._table
        fields.update(changes)
        return Run(**fields)

    @property
    def span_count(self) -> int:
        return len(self._table) if self._table is not None else len(self.spans)

    @property
    def complete(self) -> bool:
        """Whether the run ended normally and its events are the correlated ones."""
        return bool(self.meta.get("complete"))

    def span_by_id(self) -> dict[int, Span]:
        """A fresh id → span index."""
        return {s.id: s for s in self.spans}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Run):
            return NotImplemented
        return (
            self.path == other.path
            and self.meta == other.meta
            and self.tracks == other.tracks
            and self.spans == other.spans
            and self.instants == other.instants
            and self.counters == other.counters
            and self.flows == other.flows
            and self.torn == other.torn
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, spans={self.span_count}, complete={self.complete})"


#: Span templates of the file being decoded: id → (name, attributes).
_Templates = dict[int, tuple[str, dict[str, Any]]]


#: Integers the run's columns hold (int64): ids, times (ns), tracks.
_INT64 = range(-(1 << 63), 1 << 63)
_LEVELS = {int(lv): lv for lv in Level}


def _int(value: Any, what: str, *, low: int = -(1 << 63), none: bool = False) -> None:
    """Raises ValueError naming ``what`` unless ``value`` is an int64 of at least ``low`` (or None where allowed)."""
    if value is None and none:
        return
    if type(value) is not int or value not in _INT64 or value < low:
        raise ValueError(f"{what} is {_shown(value)}, not a whole number" + (f" ≥ {low}" if low > -(1 << 63) else " in int64"))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _row(r: Any, n: int, what: str) -> list[Any]:
    """``r`` when it is a list of ``n`` items (ValueError naming ``what`` otherwise)."""
    if type(r) is not list or len(r) != n:
        raise ValueError(f"a {what} row is {_shown(r)}, not a list of {n} items")
    return r


def _check_span(r: Any, templates: _Templates) -> None:
    """Raises ValueError saying what is wrong with span row ``r`` (``store`` docstring layout)."""
    if type(r) is not list or len(r) not in (8, 9):
        raise ValueError(f"a span row is {_shown(r)}, not a list of 8 or 9 items")
    _int(r[0], "a span id", low=0)
    _int(r[1], f"the parent id of span {r[0]}", low=0, none=True)
    if type(r[2]) is not int or r[2] not in _LEVELS:
        raise ValueError(f"span {r[0]} has level {_shown(r[2])}, not one of {sorted(_LEVELS)}")
    _int(r[4], f"the start of span {r[0]}")
    _int(r[5], f"the end of span {r[0]}")
    if r[5] < r[4] and r[5] != -1:  # -1: still open (``Span.end_ns``)
        raise ValueError(f"span {r[0]} ends ({r[5]}) before it starts ({r[4]})")
    _int(r[6], f"the track of span {r[0]}")
    if type(r[7]) is not dict:
        raise ValueError(f"span {r[0]} has attributes {_shown(r[7])}, not an object")
    if len(r) == 9:
        if type(r[8]) is not int or r[8] not in templates:
            raise ValueError(f"span {r[0]} refers to span template {_shown(r[8])}, which no earlier line defines")
        if r[3] is not None and type(r[3]) is not str:
            raise ValueError(f"span {r[0]} has name {_shown(r[3])}, not text")
    elif type(r[3]) is not str:
        raise ValueError(f"span {r[0]} has name {_shown(r[3])}, not text")


def _track(r: Any) -> Track:
    r = _row(r, 9, "track")
    _int(r[0], "a track id")
    for i, what in ((3, "pid"), (4, "tid"), (5, "device"), (6, "stream"), (8, "parent track")):
        _int(r[i], f"the {what} of track {r[0]}")
    if type(r[1]) is not str or type(r[2]) is not str or type(r[7]) is not str:
        raise ValueError(f"track {r[0]} has a kind, name or unit that is not text")
    return Track(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8])


def _instant(r: Any) -> Instant:
    r = _row(r, 5, "instant")
    _int(r[1], "an instant's time")
    _int(r[2], "an instant's track")
    if type(r[0]) is not str or type(r[3]) is not int or r[3] not in _LEVELS or type(r[4]) is not dict:
        raise ValueError(f"an instant row is {_shown(r)}: its name, level or attributes have the wrong type")
    return Instant(r[0], r[1], r[2], _LEVELS[r[3]], r[4])


def _counter(r: Any) -> CounterSample:
    r = _row(r, 3, "counter")
    _int(r[0], "a counter's track")
    _int(r[1], "a counter sample's time")
    if type(r[2]) not in (int, float) or not -1e300 < r[2] < 1e300:
        raise ValueError(f"a counter sample's value is {_shown(r[2])}, not a finite number")
    return CounterSample(r[0], r[1], r[2])


def _flow(r: Any) -> Flow:
    r = _row(r, 4, "flow")
    for i, what in ((0, "a flow's id"), (1, "a flow's source span"), (2, "a flow's destination span")):
        _int(r[i], what)
    if type(r[3]) is not str:
        raise ValueError(f"flow {r[0]} has kind {_shown(r[3])}, not text")
    return Flow(r[0], r[1], r[2], r[3])


def _rows(obj: dict[str, Any], key: str) -> list[Any]:
    rows = obj.get(key, ())
    if type(rows) is not list and rows != ():
        raise ValueError(f"{key!r} is {_shown(rows)}, not a list")
    return rows or []


def _decode_line(run: Run, obj: dict[str, Any], templates: _Templates | None = None) -> None:
    """Adds one events.jsonl line's events to ``run``; ``templates`` carries templates from line to line.

    Raises:
        ValueError: saying what is wrong, for a row of another shape or type than the store
            writes (an id or time that is not an int64, a span that ends before it starts, …).
    """
    for r in _rows(obj, "tracks"):
        track = _track(r)
        run.tracks[track.id] = track
    if templates is None:
        templates = {}
    for t in _rows(obj, "templates"):
        if type(t) is not list or len(t) != 3 or type(t[0]) is not int or not isinstance(t[1], str) or not isinstance(t[2], dict):
            raise ValueError("malformed span template")
        templates[t[0]] = (t[1], t[2])
    rows = _rows(obj, "spans")
    spans = run.spans if rows else []
    levels = _LEVELS
    t, low, high = type, -(1 << 63), 1 << 63
    for r in rows:
        # The common row in one expression (a call per row cost loading a third more); any other
        # goes through _check_span, which passes the rare valid ones (an open span) or says why not.
        if not (
            t(r) is list
            and (len(r) == 8 and t(r[3]) is str or len(r) == 9 and (r[3] is None or t(r[3]) is str) and t(r[8]) is int)
            and (len(r) == 8 or r[8] in templates)
            and t(r[0]) is int
            and t(r[2]) is int
            and t(r[4]) is int
            and t(r[5]) is int
            and t(r[6]) is int
            and t(r[7]) is dict
            and (r[1] is None or t(r[1]) is int and 0 <= r[1] < high)
            and r[2] in levels
            and 0 <= r[0] < high
            and low <= r[4] <= r[5] < high
            and low <= r[6] < high
        ):
            _check_span(r, templates)
        if len(r) > 8:
            name, attrs = templates[r[8]]
            if r[3] is not None:
                name = r[3]
            spans.append(Span(r[0], r[1], levels[r[2]], name, r[4], r[5], r[6], {**attrs, **r[7]} if r[7] else attrs))  # shared: see Span
        else:
            spans.append(Span(r[0], r[1], levels[r[2]], r[3], r[4], r[5], r[6], r[7]))
    run.instants.extend(_instant(r) for r in _rows(obj, "instants"))
    run.counters.extend(_counter(r) for r in _rows(obj, "counters"))
    run.flows.extend(_flow(r) for r in _rows(obj, "flows"))


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
    except RecursionError:
        raise RunError(f"{meta_path}: unreadable run metadata (nested too deeply)") from None
    if not isinstance(meta, dict) or meta.get("format") != "mltrace-run":
        raise RunError(f"{meta_path}: not mltrace run metadata")
    problem = meta_problem(meta)
    if problem is not None:
        raise RunError(f"{meta_path}: malformed run metadata: {problem}")
    return meta


def load_run(path: str | os.PathLike[str], *, cache_table: bool = False, verify_table: bool = True) -> Run:
    """Loads a run directory (or its run.json / events.jsonl) into memory.

    A run that was killed loads up to its last complete flush; ``Run.torn``
    says whether a partial last line was dropped. When the run directory has
    a span table (``spans.bin``) built from the current events.jsonl, the
    spans come from it: their objects are built only when ``Run.spans`` is
    first used, and ``Run.table`` costs nothing.

    Args:
        path: the run directory, or a file in it.
        cache_table: when there is no current span table, write one (best
            effort: a read-only run directory is left as it is).
        verify_table: check the span table's CRC-32 (False: a table this process has just
            seen written, read without going over the whole file).

    Raises:
        RunError: if the path is not a readable mltrace run.
    """
    p = Path(path)
    if p.is_file() and p.name in (META_FILE, EVENTS_FILE, TRACE_FILE, TABLE_FILE):
        p = p.parent
    if not p.exists():
        raise RunError(f"{p}: no such run directory")
    if not p.is_dir():
        raise RunError(f"{p}: not a run directory (give the folder that holds {META_FILE})")
    meta = read_meta(p)
    events = p / EVENTS_FILE
    if not events.exists():
        raise RunError(f"{p}: run has no {EVENTS_FILE}")
    _check_events_size(events, meta)
    with gc_paused():  # millions of small lists and Span objects, none in a cycle
        run = _load_from_table(p, meta, events, verify_table)
        if run is not None:
            return run
        run = Run(path=p, meta=meta)
        try:
            data = events.read_bytes()
        except OSError as exc:
            raise RunError(f"{events}: {exc.strerror}") from None
        lines = data.split(b"\n")
        del data
        _decode_lines(run, lines, len(lines) - 1, events)
        if cache_table and run.complete and not run.torn:
            try:
                write_table(p, run)
            except (OSError, ValueError, TypeError, OverflowError):
                pass  # a cache: failing to write it only costs the next load its speed
    return run


def _check_events_size(events: Path, meta: dict[str, Any]) -> None:
    """Refuses a complete run whose events.jsonl is shorter than run.json recorded (a file
    that grew or changed is read, and its lines checked, as any other).

    Raises:
        RunError: saying how much of it is left.
    """
    expected = meta.get("events_bytes")
    if not meta.get("complete") or expected is None:
        return
    try:
        size = events.stat().st_size
    except OSError as exc:
        raise RunError(f"{events}: {exc.strerror}") from None
    if size < expected:
        raise RunError(f"{events}: truncated: {size:,} of the {expected:,} bytes this complete run wrote")


def _load_from_table(p: Path, meta: dict[str, Any], events: Path, verify: bool = True) -> Run | None:
    if not (p / TABLE_FILE).exists():
        return None
    from mltrace.run.table import read_table

    got = read_table(p / TABLE_FILE, events, verify)
    if got is None:
        return None
    table, others = got
    run = Run(path=p, meta=meta, table=table)
    try:
        obj = _loads(others)
        _decode_line(run, obj)
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    return run


def write_table(run_dir: Path, run: Run) -> SpanTable:
    """Writes the span table of ``run`` (whose events are ``run_dir``/events.jsonl as written)
    and returns it."""
    from mltrace.run.table import write_table as _write

    others = encode_batch(tracks=run.tracks.values(), instants=run.instants, counters=run.counters, flows=run.flows)
    return _write(run_dir / TABLE_FILE, run.spans, others, run_dir / EVENTS_FILE)


def decode_batch(run: Run, line: bytes, templates: dict[int, tuple[str, dict[str, Any]]]) -> None:
    """Adds the events of one events.jsonl line to ``run`` (``templates`` carries the span
    templates from line to line), for a reader that follows the stream as it is written.

    Raises:
        ValueError: for a line that is not a batch the store writes.
    """
    obj = _loads(line)
    if not isinstance(obj, dict):
        raise ValueError("not an object")
    _decode_line(run, obj, templates)


def _decode_lines(run: Run, lines: list[bytes], last: int, events: Path) -> None:
    templates: _Templates = {}
    for number, line in enumerate(lines):
        if not line:
            continue
        try:
            obj = _loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
            _decode_line(run, obj, templates)
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

    def write(self, **batch: Any) -> bytes:
        """Appends one batch as one line; returns the line (``b"{}\\n"``, unwritten, for an empty batch)."""
        line = encode_batch(**batch)
        if line != b"{}\n":
            self._file.write(line)
        return line

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


#: Span templates remembered at most while a run is written; the table starts over beyond.
_TEMPLATES_MAX = 65536
#: The levels whose spans repeat their name and attributes from call to call.
_TEMPLATED = frozenset({Level.LAYER, Level.OP})


def write_events_atomically(path: Path, run: Run, batch_size: int = 20000) -> None:
    """Replaces ``path`` with all events of ``run`` (write to a temp file, then rename).

    Layer and op spans repeat their name and attributes call after call (path,
    facts, shapes): from the second span with the same ones on, they are written
    as a template and rows that refer to it, as the layer level streams them.
    Other spans, and those seen once, are written out in full. Spans keep their
    order. The spans of one template are left sharing one attribute dict (see
    ``Span``), as they are when loaded: the passes after this one cache by it.
    """
    writer = EventsRewriter(path, batch_size)
    try:
        writer.write(tracks=run.tracks.values(), spans=run.spans)
        writer.write(instants=run.instants, counters=run.counters, flows=run.flows)
    except BaseException:
        writer.discard()
        raise
    writer.commit()


class EventsRewriter:
    """Writes a run's events to a temp file (``tmp``, else ``path`` + ".tmp") batch by batch, then replaces ``path``
    (``commit``): the templates of repeated layer and op spans (``write_events_atomically``)
    carry over from batch to batch, so a run can be written a part at a time."""

    def __init__(self, path: Path, batch_size: int = 20000, tmp: Path | None = None) -> None:
        self.path = path
        self.tmp = tmp if tmp is not None else path.with_name(path.name + ".tmp")
        self._file: IO[bytes] = open(self.tmp, "wb")  # noqa: SIM115 - closed in commit() or discard()
        self._batch = batch_size
        # (name, attributes) → [template id (0: seen once), the dict the spans of the template share]
        self._seen: dict[tuple[str, bytes], list[Any]] = {}
        # id of an attribute dict → its encoding, and the dict itself (held, so the id stays its own)
        self._encoded: dict[int, tuple[bytes, dict[str, Any]]] = {}
        self._next_id = 1

    def write(
        self,
        *,
        tracks: Iterable[Track] = (),
        spans: Sequence[Span] = (),
        instants: Sequence[Instant] = (),
        counters: Sequence[CounterSample] = (),
        flows: Sequence[Flow] = (),
    ) -> None:
        """Appends these events (tracks first, then spans, instants, counters, flows)."""
        f, size = self._file, self._batch
        track_list = list(tracks)
        if track_list:
            f.write(encode_batch(tracks=track_list))
        for i in range(0, len(spans), size):
            templates, rows = self._span_rows(spans[i : i + size])
            f.write(encode_batch(span_rows=[dumps(rows)[1:-1]] if rows else [], span_templates=[b",".join(templates)]))
        for i in range(0, len(instants), size):
            f.write(encode_batch(instants=instants[i : i + size]))
        for i in range(0, len(counters), size):
            f.write(encode_batch(counters=counters[i : i + size]))
        for i in range(0, len(flows), size):
            f.write(encode_batch(flows=flows[i : i + size]))

    def _span_rows(self, spans: Sequence[Span]) -> tuple[list[bytes], list[list[Any]]]:
        """The new templates and the rows of ``spans`` (encoded together: orjson is quicker in
        bulk, and holds one buffer)."""
        seen, encoded = self._seen, self._encoded
        templates: list[bytes] = []
        rows: list[list[Any]] = []
        for s in spans:
            if s.level not in _TEMPLATED:
                rows.append(span_row(s))
                continue
            a = s.attrs
            known = encoded.get(id(a))
            if known is None:
                if len(encoded) >= _TEMPLATES_MAX:
                    encoded.clear()
                known = encoded[id(a)] = (trimmed(dumps(a)), a)
            attrs = known[0]
            key = (s.name, attrs)
            entry = seen.get(key)
            if entry is None:
                if len(seen) >= _TEMPLATES_MAX:
                    seen.clear()  # written templates stay valid; later repeats get new ones
                seen[key] = [0, a]
                rows.append(span_row(s))
                continue
            if entry[1] is not a:
                s.attrs = entry[1]  # equal attributes, one dict
            tid = entry[0]
            if tid == 0:
                tid = entry[0] = self._next_id
                self._next_id += 1
                templates.append(dumps([tid, s.name])[:-1] + b"," + attrs + b"]")
            rows.append([s.id, s.parent_id, int(s.level), None, s.start_ns, s.end_ns, s.track_id, {}, tid])
        return templates, rows

    def commit(self) -> None:
        """Closes the temp file and puts it in ``path``'s place."""
        self._file.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        """Closes and removes the temp file; ``path`` stays as it was."""
        self._file.close()
        self.tmp.unlink(missing_ok=True)


def write_meta(run_dir: Path, meta: dict[str, Any]) -> None:
    """Writes run.json atomically. A complete run's records the size of its events.jsonl
    (``events_bytes``), so that a reader can tell a truncated one from a short run."""
    if meta.get("complete") is True:
        try:
            meta["events_bytes"] = (run_dir / EVENTS_FILE).stat().st_size
        except OSError:
            meta.pop("events_bytes", None)
    tmp = run_dir / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, run_dir / META_FILE)
