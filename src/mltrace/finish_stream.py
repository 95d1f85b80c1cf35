"""The end of a run done a segment at a time while the program runs.

``finalize_run`` (``finish.py``) loads every event at the end and correlates and writes them
all at once, which takes longer the longer the run. ``StreamedFinish`` follows the run's
events.jsonl instead and, each time the session says how far the run is complete
(``seal``), correlates the part of it that is done and appends it to the final files; at the
end (``finalize``) only what came after the last seal is left.

The session seals at a time ``S`` when every event that ends at or before ``S`` is in
events.jsonl (``Source.sealed_until_ns``). A segment is then every span not yet taken that
ends at or before ``W``, the last moment before ``S`` less an allowance that no op or layer
call runs across, with the untimed CPU library calls up to ``W`` plus the allowance (a verbose
line is read some time after its call; ``attach_library_calls``); a library call
that no span of the segment takes comes back for the next one. A segment goes through the
correlator passes on its own: a span and the spans inside it end in one segment, except a
span that is still running at a seal (a model call, a user span around the loop), which ends
in a later one. So a span left without a parent in its segment (a *root*) is held, and at the
end gets the innermost span around it among those that were running at a seal
(``_Crossing``), as the passes over the whole run would give it.

Every span comes out as the whole run's passes give it (parent, times, track, attributes), and
so do the passes' counts in run.json but one: ``nest_by_containment.parents_set`` leaves out the
untimed library calls that nesting would give, over the whole run, a span in another segment
(``attach_library_calls`` replaces that parent either way).

Where the streamed part cannot stand (a span that arrives after its part of the run was
sealed, flows, followed processes, memory events), ``finalize`` returns None and the run is
finished whole; the files written so far are temporary and removed.

Outputs, each a part at a time: events.jsonl (``EventsRewriter``), trace.pftrace
(``PerfettoEncoder``), spans.bin (``TableWriter``), and at the end the summary and run.json.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from mltrace.formats.kineto import MEMORY_EVENT
from mltrace.formats.kineto_serve import peak_rss_kb
from mltrace.run import store
from mltrace.run.events import CounterSample, Instant, Span, Track
from mltrace.run.levels import Level
from mltrace.run.store import EventsRewriter, Run
from mltrace.run.table import TABLE_FILE, TableWriter
from mltrace.tracer.passes.nesting import may_contain, tie_rank

#: How long after a CPU library call its verbose line may be read (ns) until the run shows
#: otherwise: a segment sealed at ``S`` takes the other spans up to ``S`` minus the allowance,
#: and untimed library calls up to that plus the allowance (``StreamedFinish.lag_ns``).
LIBRARY_LAG_NS = 500_000_000
#: The least allowance, and how many times the longest delay seen so far it is.
_LEAST_LAG_NS = 100_000_000
_LAG_MARGIN = 3
#: The first id of the tracks the passes add in a segment (lanes): above the session's.
_TRACK_BASE = 1 << 41


class _Crossing:
    """Spans that were running at a seal, by track: the containers a held root may have."""

    def __init__(self) -> None:
        self._by_track: dict[int, list[Span]] = {}

    def add(self, s: Span) -> None:
        self._by_track.setdefault(s.track_id, []).append(s)

    def forget_ended_before(self, ns: int) -> None:
        """Drops the spans that ended before ``ns``: no root still to be placed lies in them."""
        for track, spans in list(self._by_track.items()):
            kept = [s for s in spans if s.end_ns >= ns]
            if kept:
                self._by_track[track] = kept
            else:
                del self._by_track[track]

    def innermost(self, r: Span) -> Span | None:
        """The innermost of them that contains ``r`` and whose level may hold it."""
        best: Span | None = None
        for c in self._by_track.get(r.track_id, ()):
            if c.id == r.id or c.start_ns > r.start_ns or c.end_ns < r.end_ns or not may_contain(c.level, r.level):
                continue
            if c.start_ns == r.start_ns and c.end_ns == r.end_ns and _rank(c) >= _rank(r):
                continue  # identical intervals: the coarser level is outside
            if best is None or _order(c) > _order(best):
                best = c
        return best


def _innermost_of(a: Span | None, b: Span | None) -> Span | None:
    """The further in of two containers of one span (either may be None)."""
    if a is None or b is None:
        return a or b
    return a if _order(a) > _order(b) else b


def _rank(s: Span) -> int:
    return tie_rank(s.level)


def _order(s: Span) -> tuple[int, int, int, int]:
    """The containment sweep's order (``innermost_containers``): later is further in."""
    return (s.start_ns, -s.end_ns, _rank(s), s.id)


class StreamedFinish:
    """Correlates and writes a run a segment at a time (the module docstring).

    Args:
        run_dir: the run directory; its run.json and events.jsonl exist.
    """

    def __init__(self, run_dir: Path) -> None:
        from mltrace.run.perfetto import PerfettoEncoder

        self.run_dir = run_dir
        self.meta = store.read_meta(run_dir)
        self._events = run_dir / store.EVENTS_FILE
        self._offset = 0
        self._templates: dict[int, tuple[str, dict[str, Any]]] = {}
        self._tracks: dict[int, Track] = {}
        self._unwritten_tracks: list[Track] = []
        self._added_tracks: dict[tuple[str, int], int] = {}  # (name, parent track) → a pass's track's id here
        self._pending: list[Span] = []
        self._instants: list[Instant] = []  # every one read (the table's other events, the summary)
        self._counters: list[CounterSample] = []
        self._waiting_instants: list[Instant] = []  # read and not yet in a segment
        self._waiting_counters: list[CounterSample] = []
        self._roots: list[Span] = []
        self._used_tracks: set[int] = set()
        self._crossing = _Crossing()
        self.sealed_ns: int | None = None  # W of the last segment
        self._lag_seen_ns: int | None = None  # the longest delay from an op's end to its untimed call's line
        self.segments = 0
        self.spans_done = 0
        #: Why the streamed part cannot stand (None while it can).
        self.broken: str | None = None
        self._notes: dict[str, dict[str, Any]] = {}
        self._rewriter = EventsRewriter(self._events, tmp=run_dir / (store.EVENTS_FILE + ".streamed.tmp"))
        self._table = TableWriter(spill=run_dir / TABLE_FILE)
        self._pftrace_tmp = run_dir / (store.TRACE_FILE + ".streamed.tmp")
        self._pftrace: IO[bytes] = open(self._pftrace_tmp, "wb")  # noqa: SIM115 - closed in _complete() or discard()
        self._encoder = PerfettoEncoder(self.meta)

    # -- reading -------------------------------------------------------------------------

    def _read_new(self) -> None:
        """Decodes the lines appended to events.jsonl since the last read (complete lines only)."""
        with open(self._events, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n")
        if end < 0:
            return
        self._offset += end + 1
        part = Run(self.run_dir, self.meta)
        for line in data[:end].split(b"\n"):
            if line:
                store.decode_batch(part, line, self._templates)
        for t in part.tracks.values():
            if t.id not in self._tracks:
                self._tracks[t.id] = t
                self._unwritten_tracks.append(t)
        sealed = self.sealed_ns
        late = [s for s in part.spans if sealed is not None and -1 < s.end_ns <= sealed]
        if late and sealed is not None:
            first = min(late, key=lambda s: s.end_ns)
            self.broken = (
                f"{len(late):,} spans arrived after their part of the run was finished (e.g. {first.level.label} "
                f"{first.name!r}, which ended {(sealed - first.end_ns) / 1e6:.1f} ms before that part's end)"
            )
        if part.flows:
            self.broken = "the run has flows (GPU launches), which are written with both ends at once"
        if any(i.name == MEMORY_EVENT for i in part.instants):
            self.broken = "the run records memory events"
        self._pending.extend(part.spans)
        self._instants.extend(part.instants)
        self._counters.extend(part.counters)
        self._waiting_instants.extend(part.instants)
        self._waiting_counters.extend(part.counters)

    # -- segments ------------------------------------------------------------------------

    def seal(self, sealed_ns: int, open_ns: int | None = None) -> int:
        """Correlates and writes every span that ends by a gap before ``sealed_ns`` less the
        library allowance (and the untimed library calls up to the allowance after it), and the
        held spans that began before ``open_ns``, the start of the earliest span still running
        (None: none runs): nothing that comes later can hold them. Returns how many spans it
        wrote."""
        if self.broken is not None:
            return 0
        self._read_new()
        lag = self.lag_ns
        w = _gap_before(self._pending, sealed_ns - lag)
        if self.broken is not None or (self.sealed_ns is not None and w <= self.sealed_ns):
            return 0
        take: list[Span] = []
        keep: list[Span] = []
        for s in self._pending:
            # an untimed call's end is the receipt of its line, after its op ended
            limit = w + lag if s.level is Level.LIBRARY and s.attrs.get("ml.library.untimed") else w
            (take if -1 < s.end_ns <= limit else keep).append(s)
        if not take:
            return 0
        done = self._segment(take, keep, w, final=False)
        self._pending = keep
        self.sealed_ns = w
        done += self._settle_roots(before_ns=open_ns if open_ns is not None else sealed_ns)
        # A root still held, or of a later segment (it ends after w), lies in no span that ended before both.
        self._crossing.forget_ended_before(min([w, *(r.end_ns for r in self._roots)]))
        return done

    def _segment(self, take: list[Span], keep: list[Span], w: int | None, final: bool) -> int:
        """Runs the passes over ``take`` and writes what they settled; library calls that found
        no parent and ended after ``w`` less the allowance go back to ``keep``."""
        from mltrace.tracer.passes import correlate, nest_by_containment

        instants = [i for i in self._waiting_instants if w is None or i.ts_ns <= w]
        counters = [c for c in self._waiting_counters if w is None or c.ts_ns <= w]
        self._waiting_instants = [i for i in self._waiting_instants if w is not None and i.ts_ns > w]
        self._waiting_counters = [c for c in self._waiting_counters if w is not None and c.ts_ns > w]
        meta = {k: v for k, v in self.meta.items() if k != "correlation"}
        run = Run(self.run_dir, meta, tracks=dict(self._tracks), spans=take, instants=instants, counters=counters)
        ids = {s.id for s in take}
        before = {s.id: s.parent_id for s in take}
        pipeline = _segment_pipeline()
        upto_nesting = pipeline.index(nest_by_containment) + 1
        run = correlate(run, pipeline[:upto_nesting])
        nested = {s.id for s in run.spans if s.parent_id != before[s.id] and (before[s.id] is None or before[s.id] not in ids)}
        run = correlate(run, pipeline[upto_nesting:])
        spans = self._own_tracks(run)
        originals = {s.id: s for s in take if s.level is Level.LIBRARY}
        retry_after = (w - self.lag_ns) if w is not None else None
        settled: list[Span] = []
        retried = moved = 0
        for s in spans:
            if s.parent_id is None and not final and s.id in originals and retry_after is not None and s.end_ns > retry_after:
                keep.append(originals[s.id])  # its op may end in the next segment
                retried += 1
                moved += s.track_id != originals[s.id].track_id and "(async" in self._tracks[s.track_id].name
                continue
            settled.append(s)
        correlation = run.meta.get("correlation") or {}
        correlation["nest_by_containment"] = _nesting_counts(correlation.get("nest_by_containment"), nested, before, settled)
        _adjust(correlation, "attach_library_calls", unattached=-retried)
        _adjust(correlation, "separate_overlaps", moved=-moved)
        correlation.get("separate_overlaps", {}).pop("extra_tracks", None)  # counted at the end
        self._note(correlation)
        self._learn_lag(settled)
        prior = self.sealed_ns
        ready: list[Span] = []
        for s in settled:
            if prior is not None and s.start_ns < prior:
                self._crossing.add(s)
            if s.parent_id is None and not final:
                self._roots.append(s)
            else:
                ready.append(s)
        self._write(ready, settled, instants, counters)
        self.segments += 1
        return len(settled)

    @property
    def lag_ns(self) -> int:
        """The allowance for a library call's line to be read (``LIBRARY_LAG_NS`` until an
        untimed call was placed, then ``_LAG_MARGIN`` times the longest delay seen from its op's
        end to its receipt, at least ``_LEAST_LAG_NS``, at most ``LIBRARY_LAG_NS``)."""
        if self._lag_seen_ns is None:
            return LIBRARY_LAG_NS
        return min(LIBRARY_LAG_NS, max(_LEAST_LAG_NS, _LAG_MARGIN * self._lag_seen_ns))

    def _learn_lag(self, spans: list[Span]) -> None:
        """Notes the delays from the ops' ends to the receipt of their untimed library calls."""
        ends = {s.id: s.end_ns for s in spans if s.level is Level.OP}
        for s in spans:
            if s.level is not Level.LIBRARY or s.parent_id not in ends:
                continue
            received = s.attrs.get("ml.library.receive_ns")
            if isinstance(received, int):
                lag = received - ends[s.parent_id]
                self._lag_seen_ns = lag if self._lag_seen_ns is None else max(self._lag_seen_ns, lag)

    def _own_tracks(self, run: Run) -> list[Span]:
        """The run's spans with the tracks the passes added (lanes) given ids of this finish's
        own, one per lane across segments."""
        renamed: dict[int, int] = {}
        for tid, t in run.tracks.items():
            if tid in self._tracks:
                continue
            key = (t.name, t.parent_track)
            own = self._added_tracks.get(key)
            if own is None:
                own = self._added_tracks[key] = _TRACK_BASE + len(self._added_tracks)
                track = Track(own, t.kind, t.name, t.pid, t.tid, t.device, t.stream, t.unit, t.parent_track)
                self._tracks[own] = track
                self._unwritten_tracks.append(track)
            renamed[tid] = own
        if not renamed:
            return run.spans
        return [
            Span(s.id, s.parent_id, s.level, s.name, s.start_ns, s.end_ns, renamed[s.track_id], s.attrs) if s.track_id in renamed else s
            for s in run.spans
        ]

    def _note(self, correlation: dict[str, Any]) -> None:
        """Adds a segment's pass notes to the run's: counts add up, examples are kept up to five."""
        for name, facts in correlation.items():
            mine = self._notes.setdefault(name, {})
            for key, value in (facts or {}).items():
                if isinstance(value, bool) or not isinstance(value, (int, float, list)):
                    mine[key] = value
                elif isinstance(value, list):
                    mine[key] = (mine.get(key) or []) + value[: max(0, 5 - len(mine.get(key) or []))]
                else:
                    mine[key] = mine.get(key, 0) + value

    def _write(self, ready: list[Span], encoded: list[Span], instants: list[Instant], counters: list[CounterSample]) -> None:
        """Appends ``ready`` to events.jsonl and the table, and ``encoded`` (ready and held
        roots: the trace file needs no parents) with the instants and counters to the trace."""
        tracks, self._unwritten_tracks = self._unwritten_tracks, []
        self._rewriter.write(tracks=tracks, spans=ready, instants=instants, counters=counters)
        self._table.add(ready)
        self._used_tracks.update(s.track_id for s in encoded)
        self._encoder.encode(tracks=tracks, spans=encoded, instants=instants, counters=counters, write=self._pftrace.write)
        self.spans_done += len(ready)

    # -- the end -------------------------------------------------------------------------

    def finalize(self, meta: dict[str, Any], phase: Callable[[str], None] | None = None) -> Run | None:
        """Finishes the run: the rest of the events, the held roots' parents, the files and the
        summary in run.json (``meta``, updated in place). None where the streamed part cannot
        stand (``broken``): the temporary files are removed and nothing else is touched."""
        say = phase or (lambda step: None)
        say("reading the last events")
        self._read_new()
        if self.broken is None and any(s.end_ns < 0 for s in self._pending):
            self.broken = "spans still open at the end"
        if self.broken is not None:
            self.discard()
            return None
        rest, self._pending = self._pending, []
        say(f"correlating the last {len(rest):,} spans")
        if rest or self._waiting_instants or self._waiting_counters:
            self._segment(rest, [], None, final=True)
        self._settle_roots()
        return self._complete(meta, say)

    def _settle_roots(self, before_ns: int | None = None) -> int:
        """Gives each held root that began before ``before_ns`` (None: every one, at the end)
        the innermost span around it among those that ran across a seal (written, or read and
        not yet taken), writes them, and returns how many. A span running across a seal that
        has not reached events.jsonl yet was still running then, so it began at or after the
        earliest start of the spans running (``seal``'s ``open_ns``): a root that began before
        that has every span that can hold it at hand."""
        if before_ns is None:
            roots, self._roots = self._roots, []
            waiting = _Crossing()
        else:
            roots = [r for r in self._roots if r.start_ns < before_ns]
            if not roots:
                return 0
            self._roots = [r for r in self._roots if r.start_ns >= before_ns]
            waiting = _Crossing()
            for s in self._pending:
                if self.sealed_ns is not None and s.start_ns < self.sealed_ns:
                    waiting.add(s)
        settled = 0
        out: list[Span] = []
        for r in roots:
            if r.level is Level.LIBRARY:  # attach_library_calls alone places them: none took it
                out.append(r)
                continue
            c = _innermost_of(self._crossing.innermost(r), waiting.innermost(r))
            if c is not None:
                r = Span(r.id, c.id, r.level, r.name, r.start_ns, r.end_ns, r.track_id, r.attrs)
                settled += 1
            out.append(r)
        if out:
            tracks, self._unwritten_tracks = self._unwritten_tracks, []
            self._rewriter.write(tracks=tracks, spans=out)
            self._table.add(out)
            self.spans_done += len(out)
        nesting = self._notes.setdefault("nest_by_containment", {})
        nesting["parents_set"] = nesting.get("parents_set", 0) + settled
        return len(out)

    def _complete(self, meta: dict[str, Any], say: Callable[[str], None]) -> Run:
        """Writes the files in their places, the containment check and the summary."""
        from mltrace.analysis.summary import summarize

        say(f"writing {store.EVENTS_FILE}, {TABLE_FILE} and {store.TRACE_FILE}")
        self._rewriter.commit()
        self._pftrace.close()
        os.replace(self._pftrace_tmp, self.run_dir / store.TRACE_FILE)
        others = store.encode_batch(tracks=self._tracks.values(), instants=self._instants, counters=self._counters)
        table = self._table.write(self.run_dir / TABLE_FILE, others, self._events)
        self._notes["check_containment"] = check_containment_table(table)
        lanes = [t for t in self._added_tracks.values() if t in self._used_tracks and "(async" in self._tracks[t].name]
        if "separate_overlaps" in self._notes:
            self._notes["separate_overlaps"]["extra_tracks"] = len(lanes)
        meta["correlation"] = {**(meta.get("correlation") or {}), **self._notes}
        meta["finish"] = {"streamed": True, "streamed_segments": self.segments, "peak_rss_kb": peak_rss_kb()}
        run = Run(self.run_dir, meta, tracks=dict(self._tracks), instants=self._instants, counters=self._counters, table=table)
        say("summarizing")
        meta["summary"] = summarize(run, table=table)
        meta["complete"] = True
        store.write_meta(self.run_dir, meta)
        return run

    def discard(self) -> None:
        """Removes the temporary files written so far."""
        self._rewriter.discard()
        self._table.discard()
        self._pftrace.close()
        self._pftrace_tmp.unlink(missing_ok=True)


def _gap_before(spans: list[Span], limit: int) -> int:
    """The latest time at or before ``limit`` that no span of ``spans`` (but the library calls)
    runs across, else ``limit``: a segment that ends there cuts no op or layer call in two, so
    the library calls inside them end in their segment."""
    import numpy as np

    calls = [s for s in spans if s.level is not Level.LIBRARY and -1 < s.end_ns and s.start_ns < limit]
    if not calls:
        return limit
    start = np.fromiter((s.start_ns for s in calls), dtype=np.int64, count=len(calls))
    end = np.minimum(np.fromiter((s.end_ns for s in calls), dtype=np.int64, count=len(calls)), limit)
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)  # the latest end among the spans that start by each
    gaps = np.flatnonzero(reach[:-1] <= start[1:])  # nothing runs across reach[i]
    if reach[-1] < limit:
        return limit
    return int(reach[gaps[-1]]) if len(gaps) else limit


def _nesting_counts(facts: dict[str, Any] | None, nested: set[int], before: dict[int, int | None], settled: list[Span]) -> dict[str, int]:
    """``nest_by_containment``'s counts as the whole run's pass gives them, for the spans the
    segment settled (``nested``: those it gave a parent they lacked or had outside the segment).
    A span whose parent (set while the program ran) ends in a later segment got the innermost
    span around it here, which the whole run's pass counts as refined, not set; a library call
    handed to the next segment counts there."""
    refined = (facts or {}).get("parents_refined", 0)
    parents_set = 0
    for s in settled:
        if s.id in nested:
            if before[s.id] is None:
                parents_set += 1
            else:
                refined += 1
    return {"parents_set": parents_set, "parents_refined": refined}


def _adjust(correlation: dict[str, Any], name: str, **changes: int) -> None:
    """Adds ``changes`` to the counts a pass noted (``correlation[name]``)."""
    facts = correlation.get(name)
    if isinstance(facts, dict):
        for key, change in changes.items():
            if isinstance(facts.get(key), int):
                facts[key] += change


def _segment_pipeline() -> list[Any]:
    """The correlator passes for a segment: all but the containment check, which runs once
    over the whole table at the end (``check_containment_table``)."""
    from mltrace.tracer.passes import check_containment, default_pipeline

    return [p for p in default_pipeline() if p is not check_containment]


def check_containment_table(table: Any) -> dict[str, Any]:
    """``check_containment``'s counts over a span table: children outside their parent's
    interval and children whose parent is not in the run (no flows: the streamed finish
    takes no GPU launches)."""
    import numpy as np

    parent = table.parent_row()
    has_parent = table.parent_id >= 0
    missing = has_parent & (parent < 0)
    rows = np.flatnonzero(parent >= 0)
    p = parent[rows]
    outside = rows[(table.start[rows] < table.start[p]) | (table.end[rows] > table.end[p])]
    examples = []
    for r in outside[:5].tolist():
        q = int(parent[r])
        examples.append(
            f"{table.names[int(table.name[r])]} [{int(table.start[r])}, {int(table.end[r])}] outside "
            f"{table.names[int(table.name[q])]} [{int(table.start[q])}, {int(table.end[q])}]"
        )
    return {"outside_parent": int(len(outside)), "missing_parent": int(missing.sum()), "asynchronous_children": 0, "examples": examples}


__all__ = ["LIBRARY_LAG_NS", "StreamedFinish", "check_containment_table"]
