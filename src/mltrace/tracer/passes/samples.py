"""Attributes py-spy samples to the spans that were running when they were taken."""

from __future__ import annotations

import bisect
from collections.abc import Callable

from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.tracer.passes.checks import note as _note

_STRUCTURAL = (Level.MODEL, Level.LAYER, Level.USER)


def attribute_samples(run: Run, top: int = 5) -> Run:
    """Gives each span the model-code lines sampled while it was innermost on its thread.

    Each leaf ``SOURCE`` slice (the top of one sampled Python stack) on a "(python)"
    track is matched by its midpoint to the innermost model, layer or user span, and to
    the innermost op, on the thread track it samples. The line it stands for is the
    innermost frame of its stack that is model code (``analysis.codepaths.is_model_code``:
    outside torch, keras/tensorflow, onnxruntime, mltrace and the standard library), so a
    ``Conv2d`` gets the user's line that called it, not torch's ``conv.py``. Samples with no
    model-code frame count for nothing. Each span gets ``ml.source.hot_lines``: up to
    ``top`` ``["file:line function", ns]`` pairs, hottest first.
    """
    from mltrace.tracer.callsite import is_model_code
    from mltrace.tracer.passes.nesting import spans_at_level

    samples = spans_at_level(run.spans, Level.SOURCE)
    if not samples:
        return run
    by_id = {s.id: s for s in samples}
    has_child = {s.parent_id for s in samples if s.parent_id is not None}
    leaves = [s for s in samples if s.id not in has_child]
    sample_track_parent = {t.id: t.parent_track for t in run.tracks.values() if t.parent_track >= 0}
    structural = _Containers(run.spans, lambda s: s.level in _STRUCTURAL)
    ops = _Containers(run.spans, lambda s: s.level == Level.OP)
    hot: dict[int, dict[str, int]] = {}
    attributed = no_model_code = 0
    for leaf in leaves:
        thread_track = sample_track_parent.get(leaf.track_id)
        if thread_track is None:
            continue
        mid = (leaf.start_ns + leaf.end_ns) // 2
        owners = [c for c in (structural.innermost(thread_track, mid), ops.innermost(thread_track, mid)) if c is not None]
        if not owners:
            continue
        attributed += 1
        frame = _model_frame(leaf, by_id, is_model_code)
        if frame is None:
            no_model_code += 1
            continue
        loc = f"{frame.attrs.get('code.file.path', '?')}:{frame.attrs.get('code.line.number', 0)} {frame.name}"
        for owner in owners:
            per = hot.setdefault(owner.id, {})
            per[loc] = per.get(loc, 0) + max(leaf.duration_ns, 1)
    for span in run.spans:
        lines = hot.get(span.id)
        if lines:
            hot_lines = [[k, v] for k, v in sorted(lines.items(), key=lambda kv: (-kv[1], kv[0]))[:top]]
            span.attrs = {**span.attrs, "ml.source.hot_lines": hot_lines}  # a loaded span's dict may be shared
    _note(run, "attribute_samples", {"sampled_leaves": len(leaves), "attributed": attributed, "no_model_code": no_model_code})
    return run


def _model_frame(leaf: Span, by_id: dict[int, Span], is_model_code: Callable[[str], bool]) -> Span | None:
    """The innermost frame of the leaf's stack (the leaf, then its callers) in model code."""
    frame: Span | None = leaf
    seen: set[int] = set()
    while frame is not None and frame.id not in seen:  # a corrupt, cyclic chain ends the walk
        path = frame.attrs.get("code.file.path")
        if isinstance(path, str) and is_model_code(path):
            return frame
        seen.add(frame.id)
        frame = by_id.get(frame.parent_id) if frame.parent_id is not None else None
    return None


class _Containers:
    """Spans of one kind per thread track, to find the innermost one holding a time."""

    def __init__(self, spans: list[Span], keep: Callable[[Span], bool]) -> None:
        per_track: dict[int, list[Span]] = {}
        for s in spans:
            if keep(s):
                per_track.setdefault(s.track_id, []).append(s)
        self._spans: dict[int, list[Span]] = {}
        self._starts: dict[int, list[int]] = {}
        self._reach: dict[int, list[int]] = {}  # the latest end among spans[0..i]
        for track, items in per_track.items():
            items.sort(key=lambda s: (s.start_ns, -s.end_ns))
            reach, latest = [], -(1 << 63)
            for s in items:
                latest = max(latest, s.end_ns)
                reach.append(latest)
            self._spans[track], self._starts[track], self._reach[track] = items, [s.start_ns for s in items], reach

    def innermost(self, track: int, t: int) -> Span | None:
        """The last-starting span on ``track`` with start ≤ ``t`` ≤ end (nested spans: the
        innermost), or None."""
        items = self._spans.get(track)
        if not items:
            return None
        reach = self._reach[track]
        i = bisect.bisect_right(self._starts[track], t) - 1
        while i >= 0 and reach[i] >= t:  # no earlier span reaches t once reach[i] < t
            if items[i].end_ns >= t:
                return items[i]
            i -= 1
        return None
