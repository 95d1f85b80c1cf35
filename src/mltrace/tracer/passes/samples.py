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

    py-spy merges consecutive samples that show the same stack into one slice per frame,
    so a slice on a "(python)" track stands for a run of samples, not for the time its
    code ran: in a loop of short calls, samples one period apart can show the same line
    of different calls. So each frame's slice, less the parts its callees cover (the
    time it was the top of the stack), is split back into its samples, one per sampling
    period (``run.json`` ``sources["py-spy"]["rate_hz"]``, else 100 Hz) from the first,
    and each sample is matched by its own time and its stack to the innermost model,
    layer or user span (``_StackMatcher``: the stack decides where the time, off by up to
    a period, falls in the wrong layer), and to the innermost op in it, on the thread
    track it samples. The line a sample
    stands for is the innermost frame of its stack that is model code
    (``analysis.codepaths.is_model_code``: outside torch, keras/tensorflow, onnxruntime,
    mltrace and the standard library), so a ``Conv2d`` gets the user's line that called
    it, not torch's ``conv.py``. Samples with no model-code frame, and samples outside
    every span, count for nothing. Each span gets ``ml.source.hot_lines``: up to ``top``
    ``["file:line function", ns]`` pairs, hottest first, each sample counting for the
    time its run of samples lasted divided among them.
    """
    from mltrace.tracer.callsite import is_model_code
    from mltrace.tracer.passes.nesting import spans_at_level

    samples = spans_at_level(run.spans, Level.SOURCE)
    if not samples:
        return run
    by_id = {s.id: s for s in samples}
    period = _period_ns(run)
    sample_track_parent = {t.id: t.parent_track for t in run.tracks.values() if t.parent_track >= 0}
    structural = _StackMatcher(run.spans, period)
    ops = _Containers(run.spans, lambda s: s.level == Level.OP)
    hot: dict[int, dict[str, int]] = {}
    taken = attributed = no_model_code = 0
    for top_frame, first, last in _top_of_stack(samples):
        thread_track = sample_track_parent.get(top_frame.track_id)
        if thread_track is None:
            continue
        frames = _stack(top_frame, by_id)
        stack = SampledStack(frames)
        frame = next((f for f in frames if _is_model_file(f, is_model_code)), None)
        loc = f"{frame.attrs.get('code.file.path', '?')}:{frame.attrs.get('code.line.number', 0)} {frame.name}" if frame else ""
        for at, ns in _sample_times(first, last, period):
            taken += 1
            layer = structural.owner(thread_track, at, stack)
            op = ops.innermost(thread_track, at)
            if op is not None and layer is not None and not layer.start_ns <= op.start_ns <= op.end_ns <= layer.end_ns:
                op = None  # the op at that time ran in another layer than the stack shows
            owners = [c for c in (layer, op) if c is not None]
            if not owners:
                continue
            attributed += 1
            if frame is None:
                no_model_code += 1
                continue
            for owner in owners:
                per = hot.setdefault(owner.id, {})
                per[loc] = per.get(loc, 0) + ns
    for span in run.spans:
        lines = hot.get(span.id)
        if lines:
            hot_lines = [[k, v] for k, v in sorted(lines.items(), key=lambda kv: (-kv[1], kv[0]))[:top]]
            span.attrs = {**span.attrs, "ml.source.hot_lines": hot_lines}  # a loaded span's dict may be shared
    _note(run, "attribute_samples", {"samples": taken, "attributed": attributed, "no_model_code": no_model_code})
    return run


def _period_ns(run: Run) -> int:
    """py-spy's sampling period as recorded in run.json, else that of 100 Hz."""
    info = run.meta.get("sources", {}).get("py-spy") if isinstance(run.meta.get("sources"), dict) else None
    rate = info.get("rate_hz") if isinstance(info, dict) else None
    if isinstance(rate, int) and not isinstance(rate, bool) and rate > 0:
        return 1_000_000_000 // rate
    return 10_000_000


def _top_of_stack(frames: list[Span]) -> list[tuple[Span, int, int]]:
    """``(frame, start, end)`` for each stretch of time a frame was the top of its stack:
    its slice less those of its callees (py-spy's slices on one track nest)."""
    callees: dict[int, list[Span]] = {}
    for f in frames:
        if f.parent_id is not None:
            callees.setdefault(f.parent_id, []).append(f)
    out: list[tuple[Span, int, int]] = []
    for f in frames:
        at = f.start_ns
        for c in sorted(callees.get(f.id, ()), key=lambda c: c.start_ns):
            if c.start_ns > at:
                out.append((f, at, c.start_ns))
            at = max(at, c.end_ns)
        if f.end_ns > at:
            out.append((f, at, f.end_ns))
    return out


def _sample_times(first: int, last: int, period: int) -> list[tuple[int, int]]:
    """``(time, ns)`` of the samples in a run of samples that showed one stack from
    ``first`` until (not including) ``last``: one a period apart from ``first``, the
    stretch's time shared among them."""
    n = max(1, round((last - first) / period))
    step = (last - first) / n
    return [(first + round(k * step), round((k + 1) * step) - round(k * step)) for k in range(n)]


def _stack(top: Span, by_id: dict[int, Span]) -> list[Span]:
    """The frames of one sampled stack, innermost first: ``top`` and its callers."""
    out: list[Span] = []
    frame: Span | None = top
    seen: set[int] = set()
    while frame is not None and frame.id not in seen:  # a corrupt, cyclic chain ends the walk
        out.append(frame)
        seen.add(frame.id)
        frame = by_id.get(frame.parent_id) if frame.parent_id is not None else None
    return out


def _is_model_file(frame: Span, is_model_code: Callable[[str], bool]) -> bool:
    """Whether the frame's file is model code (``is_model_code``)."""
    path = frame.attrs.get("code.file.path")
    return isinstance(path, str) and is_model_code(path)


class SampledStack:
    """What a sampled stack can tell about the spans it ran in: its frames' functions and
    lines, as sets to look up."""

    def __init__(self, frames: list[Span]) -> None:
        self.functions: set[tuple[str, str]] = set()
        self.lines: set[tuple[str, int]] = set()
        self.forwards: dict[str, int] = {}  # file → the deepest line of a "forward" frame in it
        for f in frames:
            path, line = f.attrs.get("code.file.path"), f.attrs.get("code.line.number")
            if not isinstance(path, str):
                continue
            parts = f.name.split(".")
            for i in range(len(parts)):  # "Outer.Inner.forward" is also "Inner.forward"
                self.functions.add((path, ".".join(parts[i:])))
            if isinstance(line, int):
                self.lines.add((path, line))
                if f.name == "forward" or f.name.endswith(".forward"):
                    self.forwards[path] = max(self.forwards.get(path, 0), line)

    def shows(self, span: Span) -> int:
        """How surely this stack ran inside ``span``, from its recorded forward
        (``ml.defined.*``) and call site (``code.*``): 4 when a frame is that forward (file
        and qualified name) and a frame is at its call site, 3 the forward alone, 2 when a
        frame is only some ``forward`` in its file at or below its line (an inherited
        forward, or Python before 3.11, whose frames carry no class name), 1 the call site
        alone (the call's own work before or after its forward), 0 neither: the stack ran
        outside it; -1 when the span names no forward (user spans, other frameworks' and
        TorchScript layers): the stack cannot tell."""
        path = span.attrs.get("ml.defined.file.path")
        function = span.attrs.get("ml.defined.function.name")
        if not isinstance(path, str) or not isinstance(function, str):
            return -1
        site = (span.attrs.get("code.file.path"), span.attrs.get("code.line.number"))
        at_site = not isinstance(site[0], str) or site in self.lines
        if (path, function) in self.functions:
            return 4 if at_site else 3
        line = span.attrs.get("ml.defined.line.number")
        deepest = self.forwards.get(path)
        if deepest is not None and (not isinstance(line, int) or deepest >= line):
            return 2
        return 1 if at_site else 0


class _StackMatcher:
    """The model, layer or user span a sample ran in: the innermost one at its time when
    its stack agrees, else the one its stack shows among those near that time.

    A sample's time is py-spy's (when py-spy handled it, aligned by the marker), off from
    the moment the stack was read by up to a sampling period when the machine is busy, so
    near the end of a layer the innermost span at that time can be the next layer while
    the stack still shows the one before. The stack decides then: among the spans within
    one period of the time and their callers, the one whose forward the stack runs most
    surely (``SampledStack.shows``), the innermost of equals, then the nearest in time;
    when it runs none of theirs, the innermost span at that time that it does not rule
    out (one whose call site it shows, or one it cannot check), else none.
    """

    def __init__(self, spans: list[Span], period: int) -> None:
        self._containers = _Containers(spans, lambda s: s.level in _STRUCTURAL)
        self._by_id = {s.id: s for s in spans if s.level in _STRUCTURAL}
        self._depth: dict[int, int] = {}
        self._period = period

    def owner(self, track: int, at: int, stack: SampledStack) -> Span | None:
        here = self._containers.innermost(track, at)
        if here is not None and stack.shows(here) in (4, -1):
            return here
        near = {s.id: s for s in self._callers(self._containers.innermost(track, at - self._period))}
        for s in self._containers.starting(track, at - self._period, at + self._period):
            near[s.id] = s
        for s in self._callers(here):
            near[s.id] = s
        ranked = [(stack.shows(s), s) for s in near.values()]
        runs = [(rank, s) for rank, s in ranked if rank >= 2]  # the stack runs their forward
        if runs:
            return max(runs, key=lambda rs: (rs[0], self.depth(rs[1]), -_distance(rs[1], at)))[1]
        # No forward near: the innermost span at that time the stack does not rule out.
        return next((s for s in self._callers(here) if stack.shows(s) != 0), None)

    def _callers(self, span: Span | None) -> list[Span]:
        """``span`` and the model, layer and user spans above it."""
        out: list[Span] = []
        while span is not None and len(out) <= len(self._by_id):
            out.append(span)
            span = self._by_id.get(span.parent_id) if span.parent_id is not None else None
        return out

    def depth(self, span: Span) -> int:
        """How many model, layer and user spans hold ``span``."""
        got = self._depth.get(span.id)
        if got is None:
            got = len(self._callers(span)) - 1
            self._depth[span.id] = got
        return got


def _distance(span: Span, at: int) -> int:
    """How far ``at`` lies outside ``span`` (0 inside)."""
    return max(0, span.start_ns - at, at - span.end_ns)


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

    def starting(self, track: int, first: int, last: int) -> list[Span]:
        """The spans on ``track`` that start from ``first`` to ``last``."""
        starts = self._starts.get(track)
        if not starts:
            return []
        return self._spans[track][bisect.bisect_left(starts, first) : bisect.bisect_right(starts, last)]

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
