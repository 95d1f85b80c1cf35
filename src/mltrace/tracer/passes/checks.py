"""Generic passes: ordering, overlap separation, and the containment check."""

from __future__ import annotations

from typing import Any

from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.store import Run


def note(run: Run, name: str, facts: dict[str, Any]) -> None:
    """Records what a pass found under ``run.meta["correlation"][name]``."""
    run.meta.setdefault("correlation", {})[name] = facts


_note = note


def sort_spans(run: Run) -> Run:
    """Orders spans by start time (ns), outer spans first on ties, then by id (stable)."""
    import numpy as np

    from mltrace.tracer.passes.nesting import pick, span_columns

    spans = run.spans
    c = span_columns(spans, ("id", "start", "end"))
    order = np.lexsort((c["id"], -c["end"], c["start"]))
    return run.replace(spans=pick(spans, order.tolist()))


def check_containment(run: Run) -> Run:
    """Counts children that are not inside their parent's interval.

    Records ``outside_parent`` (count) and up to five examples; a correct
    trace has none. Nothing is changed: a child outside its parent means a
    source or a pass is wrong, and hiding it would hide the bug.
    """
    by_id = {s.id: s for s in run.spans}
    # GPU work runs after the call that launched it returns: a launch child is
    # asynchronous by nature and exempt (linked by a flow, on another track).
    launched = {(f.from_span, f.to_span) for f in run.flows if f.kind == "launch"}
    bad: list[str] = []
    count = 0
    orphans = 0
    asynchronous = 0
    for s in run.spans:
        if s.parent_id is None:
            continue
        p = by_id.get(s.parent_id)
        if p is None:
            orphans += 1
            continue
        if (p.id, s.id) in launched:
            asynchronous += 1
            continue
        if s.start_ns < p.start_ns or s.end_ns > p.end_ns:
            count += 1
            if len(bad) < 5:
                bad.append(f"{s.name} [{s.start_ns}, {s.end_ns}] outside {p.name} [{p.start_ns}, {p.end_ns}]")
    _note(
        run,
        "check_containment",
        {"outside_parent": count, "missing_parent": orphans, "asynchronous_children": asynchronous, "examples": bad},
    )
    return run


def separate_overlaps(run: Run) -> Run:
    """Moves spans that overlap a sibling on one track to extra tracks.

    Perfetto drops slices that overlap without nesting on one track (they
    happen with asyncio tasks interleaving on a thread). Each such span and
    everything nested in it goes to the first "(async n)" track where it
    nests properly.
    """
    ordered, lanes = _lanes(run.spans)
    if not any(lanes):
        _note(run, "separate_overlaps", {"moved": 0, "extra_tracks": 0})
        return run.replace(spans=ordered)
    tracks = dict(run.tracks)
    next_id = max(tracks, default=0) + 1
    moved = 0
    new_spans: list[Span] = []
    overflow_of: dict[tuple[int, int], int] = {}
    for s, lane_no in zip(ordered, lanes):
        if lane_no == 0:
            new_spans.append(s)
            continue
        key = (s.track_id, lane_no)
        if key not in overflow_of:
            parent = tracks.get(s.track_id)
            name = f"{parent.name if parent else s.track_id} (async {lane_no})"
            tracks[next_id] = Track(
                next_id,
                TrackKind.ASYNC,
                name,
                parent.pid if parent else 0,
                parent.tid if parent else 0,
                parent_track=s.track_id,
            )
            overflow_of[key] = next_id
            next_id += 1
        moved += 1
        new_spans.append(Span(s.id, s.parent_id, s.level, s.name, s.start_ns, s.end_ns, overflow_of[key], s.attrs))
    _note(run, "separate_overlaps", {"moved": moved, "extra_tracks": len(overflow_of)})
    return run.replace(tracks=tracks, spans=new_spans)


def _lanes(spans: list[Span]) -> tuple[list[Span], list[int]]:
    """The spans grouped by track (in order of first appearance), each track's by (start, -end,
    id), and the lane each is placed on (``_place``; 0: its own track). The sweep runs in C
    where ``mltrace._sweep`` is built."""
    from mltrace.tracer.passes.nesting import sweep_module

    sweep = sweep_module()
    if sweep is None or not spans:
        by_track: dict[int, list[Span]] = {}
        for s in spans:
            by_track.setdefault(s.track_id, []).append(s)
        ordered: list[Span] = []
        lanes: list[int] = []
        for group in by_track.values():
            group.sort(key=lambda s: (s.start_ns, -s.end_ns, s.id))
            stacks: list[list[Span]] = [[]]  # lane 0 is the original track; each lane is a stack
            for s in group:
                ordered.append(s)
                lanes.append(_place(stacks, s))
        return ordered, lanes
    import numpy as np

    from mltrace.tracer.passes.nesting import pick, span_columns

    c = span_columns(spans, ("id", "track", "start", "end"))
    track, first = np.unique(c["track"], return_index=True)
    appearance = np.empty(len(track), dtype=np.int64)
    appearance[np.argsort(first, kind="stable")] = np.arange(len(track))
    group = appearance[np.searchsorted(track, c["track"])]  # a track's rank by first appearance
    order = np.lexsort((c["id"], -c["end"], c["start"], group))
    lane = np.empty(len(spans), dtype=np.int64)
    sweep.lanes(order, group, c["start"], c["end"], lane)
    return pick(spans, order.tolist()), lane[order].tolist()


def _place(lanes: list[list[Span]], s: Span) -> int:
    """Puts ``s`` on the first lane where it nests; returns that lane's index."""
    for index, stack in enumerate(lanes):
        while stack and stack[-1].end_ns <= s.start_ns:
            stack.pop()
        if not stack or s.end_ns <= stack[-1].end_ns:
            stack.append(s)
            return index
    lanes.append([s])
    return len(lanes) - 1
