"""Attributes py-spy samples to the spans that were running when they were taken."""

from __future__ import annotations

from mltrace.run.store import Run
from mltrace.tracer.model import Span
from mltrace.tracer.passes.checks import note as _note


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
            hot_lines = [[k, v] for k, v in sorted(lines.items(), key=lambda kv: -kv[1])[:top]]
            span.attrs = {**span.attrs, "ml.source.hot_lines": hot_lines}  # a loaded span's dict may be shared
    _note(run, "attribute_samples", {"sampled_leaves": len(leaves), "attributed": attributed})
    return run
