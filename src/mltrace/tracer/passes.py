"""Correlator passes: pure functions ``Run -> Run`` run in order at the end.

Each pass takes the run's events and returns a run with corrected events; a
pass records what it found under ``run.meta["correlation"][<pass name>]``.
``PIPELINE`` is the order the session applies them in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from mltrace.run.store import Run
from mltrace.tracer.model import Span, Track, TrackKind

Pass = Callable[[Run], Run]


def _note(run: Run, name: str, facts: dict[str, Any]) -> None:
    run.meta.setdefault("correlation", {})[name] = facts


def sort_spans(run: Run) -> Run:
    """Orders spans by start time (ns), outer spans first on ties."""
    spans = sorted(run.spans, key=lambda s: (s.start_ns, -s.end_ns, s.id))
    return replace(run, spans=spans)


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
    tracks = dict(run.tracks)
    next_id = max(tracks, default=0) + 1
    by_track: dict[int, list[Span]] = {}
    for s in run.spans:
        by_track.setdefault(s.track_id, []).append(s)
    moved = 0
    new_spans: list[Span] = []
    overflow_of: dict[tuple[int, int], int] = {}
    for track_id, spans in by_track.items():
        spans.sort(key=lambda s: (s.start_ns, -s.end_ns, s.id))
        lanes: list[list[Span]] = [[]]  # lane 0 is the original track; each lane is a stack
        for s in spans:
            lane_no = _place(lanes, s)
            if lane_no == 0:
                new_spans.append(s)
                continue
            key = (track_id, lane_no)
            if key not in overflow_of:
                parent = tracks.get(track_id)
                name = f"{parent.name if parent else track_id} (async {lane_no})"
                tracks[next_id] = Track(
                    next_id,
                    TrackKind.ASYNC,
                    name,
                    parent.pid if parent else 0,
                    parent.tid if parent else 0,
                    parent_track=track_id,
                )
                overflow_of[key] = next_id
                next_id += 1
            moved += 1
            clone = Span(s.id, s.parent_id, s.level, s.name, s.start_ns, s.end_ns, overflow_of[key], s.attrs)
            new_spans.append(clone)
    _note(run, "separate_overlaps", {"moved": moved, "extra_tracks": len(overflow_of)})
    return replace(run, tracks=tracks, spans=new_spans)


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


def default_pipeline() -> list[Pass]:
    """The passes in order. Sources' passes slot in before the checks."""
    passes: list[Pass] = [sort_spans]
    try:
        from mltrace.tracer import passes_nesting

        passes += [passes_nesting.nest_by_containment, passes_nesting.attach_gpu_to_launch]
        from mltrace.tracer import gpu_library

        passes.append(gpu_library.attribute_gpu_library)
    except (ImportError, AttributeError):
        pass
    try:
        from mltrace.tracer import passes_library

        passes.append(passes_library.attach_library_calls)
    except (ImportError, AttributeError):
        pass
    passes += [attribute_samples, separate_overlaps, check_containment]
    return passes


def correlate(run: Run, pipeline: list[Pass] | None = None) -> Run:
    """Applies every pass in order."""
    for p in pipeline if pipeline is not None else default_pipeline():
        run = p(run)
    return run


def attribute_samples(run: Run, top: int = 5) -> Run:
    """Gives each span the source lines sampled while it was innermost on its thread.

    Leaf ``SOURCE`` slices (the sampled line at the top of a Python stack) on a
    "(python)" track are matched by midpoint to the innermost model, layer, op
    or user span on the thread track they sample; each span gets
    ``ml.source.hot_lines``: up to ``top`` ``[file:line function, ns]`` pairs,
    hottest first.
    """
    from mltrace.tracer.levels import Level

    samples = [s for s in run.spans if s.level == Level.SOURCE]
    if not samples:
        return run
    has_child = {s.parent_id for s in samples if s.parent_id is not None}
    leaves = [s for s in samples if s.id not in has_child]
    sample_track_parent = {t.id: t.parent_track for t in run.tracks.values() if t.parent_track >= 0}
    targets: dict[int, list[Span]] = {}
    for s in run.spans:
        if s.level in (Level.MODEL, Level.LAYER, Level.OP, Level.USER):
            targets.setdefault(s.track_id, []).append(s)
    for spans in targets.values():
        spans.sort(key=lambda s: (s.start_ns, -s.end_ns))
    hot: dict[int, dict[str, int]] = {}
    attributed = 0
    for leaf in leaves:
        thread_track = sample_track_parent.get(leaf.track_id)
        candidates = targets.get(thread_track, []) if thread_track is not None else []
        mid = (leaf.start_ns + leaf.end_ns) // 2
        best: Span | None = None
        for c in candidates:  # innermost = last-starting container
            if c.start_ns > mid:
                break
            if c.end_ns >= mid:
                best = c
        if best is None:
            continue
        attributed += 1
        loc = f"{leaf.attrs.get('code.file.path', '?')}:{leaf.attrs.get('code.line.number', 0)} {leaf.name}"
        per = hot.setdefault(best.id, {})
        per[loc] = per.get(loc, 0) + max(leaf.duration_ns, 1)
    for span in run.spans:
        lines = hot.get(span.id)
        if lines:
            span.attrs["ml.source.hot_lines"] = [[k, v] for k, v in sorted(lines.items(), key=lambda kv: -kv[1])[:top]]
    _note(run, "attribute_samples", {"sampled_leaves": len(leaves), "attributed": attributed})
    return run
