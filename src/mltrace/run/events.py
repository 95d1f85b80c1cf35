"""The trace model: spans, instants, counter samples, flows and tracks.

All times are integer nanoseconds on the session clock (see ``tracer/clock.py``).
Attributes are flat ``str -> JSON value`` maps whose names follow
docs/CONVENTIONS.md. Nothing here holds tensor values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

from mltrace.run.levels import Level

AttrValue = Union[str, int, float, bool, None, list[Any]]
Attrs = dict[str, Any]


class Span:
    """A timed interval at one level, on one track, with a parent.

    Attributes:
        id: unique within the run (>0).
        parent_id: the enclosing span's id, or None for a root.
        level: the span's level.
        name: display name (a layer path, an op name, a kernel name, …).
        start_ns: start on the session clock (ns).
        end_ns: end on the session clock (ns); -1 while open.
        track_id: the track (thread, GPU stream, …) the span runs on.
        attrs: attributes (names per docs/CONVENTIONS.md). A loaded span's dict
            may be shared with other spans (the calls of one layer share their
            template's), and so may the values in it: to change a loaded span's
            attributes, give it a new dict (``span.attrs = {**span.attrs, k: v}``);
            never change a dict or a value in place.
    """

    __slots__ = ("id", "parent_id", "level", "name", "start_ns", "end_ns", "track_id", "attrs", "_up", "_fin")

    def __init__(
        self,
        id: int,
        parent_id: int | None,
        level: Level,
        name: str,
        start_ns: int,
        end_ns: int,
        track_id: int,
        attrs: Attrs | None = None,
    ) -> None:
        self.id = id
        self.parent_id = parent_id
        self.level = level
        self.name = name
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.track_id = track_id
        self.attrs: Attrs = attrs if attrs is not None else {}
        self._up: Span | None = None  # live recording only: the enclosing open span
        # Live recording only: completes attrs off the hot path (called when the span is drained).
        self._fin: Callable[[Span], None] | None = None

    @property
    def duration_ns(self) -> int:
        """End minus start (ns); 0 while the span is open."""
        return self.end_ns - self.start_ns if self.end_ns >= 0 else 0

    def __repr__(self) -> str:
        return (
            f"Span(id={self.id}, parent={self.parent_id}, {self.level.label}, {self.name!r}, "
            f"{self.start_ns}..{self.end_ns}, track={self.track_id})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Span):
            return NotImplemented
        return (
            self.id == other.id
            and self.parent_id == other.parent_id
            and self.level == other.level
            and self.name == other.name
            and self.start_ns == other.start_ns
            and self.end_ns == other.end_ns
            and self.track_id == other.track_id
            and self.attrs == other.attrs
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(slots=True)
class Instant:
    """A point event (ns) on a track, e.g. "model loaded" or a Python sample."""

    name: str
    ts_ns: int
    track_id: int
    level: Level = Level.USER
    attrs: Attrs = field(default_factory=dict)


@dataclass(slots=True)
class CounterSample:
    """One value of a counter track (e.g. GPU utilisation %) at a time (ns)."""

    track_id: int
    ts_ns: int
    value: float


@dataclass(slots=True)
class Flow:
    """A causal arrow between two spans, usually on different tracks.

    Examples: a CUDA launch → its kernel; an op → work on an intra-op thread.
    """

    id: int
    from_span: int
    to_span: int
    kind: str = "launch"


class TrackKind:
    """The kinds of track (plain strings, stored as-is in files)."""

    THREAD = "thread"
    GPU_STREAM = "gpu_stream"
    COUNTER = "counter"
    ASYNC = "async"


@dataclass(slots=True)
class Track:
    """Where events are drawn: a thread, a GPU stream, a counter, …

    Attributes:
        id: unique within the run.
        kind: one of ``TrackKind``.
        name: display name ("MainThread", "GPU 0 stream 7", "gpu.utilization").
        pid: owning process id (for GPU tracks, the process that used the GPU).
        tid: OS thread id (thread tracks), else 0.
        device: GPU index for GPU and GPU counter tracks, else -1.
        stream: CUDA stream id for GPU stream tracks, else -1.
        unit: unit of a counter track ("%", "bytes", "W", "MHz", "C").
        parent_track: for async overflow tracks, the thread track they belong to.
    """

    id: int
    kind: str
    name: str
    pid: int
    tid: int = 0
    device: int = -1
    stream: int = -1
    unit: str = ""
    parent_track: int = -1


Event = Union[Span, Instant, CounterSample, Flow, Track]
