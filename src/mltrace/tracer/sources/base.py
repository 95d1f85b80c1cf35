"""The source contract.

A source produces events for one or more levels. Live sources (hooks,
decorators) record spans through ``session.recorder`` while the program runs;
post-hoc sources (profilers, log parsers) return a batch of events from
``stop()``. Sources import their framework lazily, never at module import.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from mltrace.config import ProfileOptions
from mltrace.run.events import Event
from mltrace.run.levels import Level
from mltrace.tracer.clock import ClockAnchor
from mltrace.tracer.recorder import Recorder
from mltrace.tracer.tracks import TrackRegistry


class SessionView(Protocol):
    """What a source may use of the session that starts it (``tracer/session.py``'s ``Session``).

    Attributes:
        options: the session's options.
        run_dir: the run directory.
        levels: the levels enabled in this session.
        anchor: the clock anchor (monotonic ↔ epoch), for foreign clocks.
        tracks: the track registry.
        recorder: the live recorder (spans begun and ended while the program runs).
        meta: run metadata being built (a source's own entry under ``sources``).
        errors: failures of mltrace's own parts, written to run.json.
        started: the sources started so far, in start order.
        full: the trace is full: nothing more is recorded.
    """

    options: ProfileOptions
    run_dir: Path | None
    levels: frozenset[Level]
    anchor: ClockAnchor
    tracks: TrackRegistry
    recorder: Recorder
    meta: dict[str, Any]
    errors: list[str]
    started: list[Source]
    full: bool

    def new_id(self) -> int:
        """A fresh event id for post-hoc events."""
        ...

    def note_limitation(self, text: str) -> None:
        """Records something the run could not see (run.json ``limitations``)."""
        ...

    def model_call_ended(self, framework: str | None = None) -> None:
        """Tells the session an outermost model call of ``framework`` returned (``tracer/windows.py``)."""
        ...

    def add_model_call_listener(self, listener: Callable[[str | None], None]) -> None:
        """Calls ``listener(framework)`` after every outermost model call, on its thread."""
        ...

    def add_events(self, events: list[Event]) -> None:
        """Queues post-hoc events for the next flush (any thread)."""
        ...


@runtime_checkable
class Source(Protocol):
    """What every source provides.

    Attributes:
        name: short identifier used in run.json and messages ("torch.modules").
        levels: the levels this source can produce.
    """

    name: str
    levels: tuple[Level, ...]

    def available(self) -> str | None:
        """Returns None when the source can run here, else the reason it cannot."""
        ...

    def start(self, session: SessionView) -> None:
        """Starts recording; ``session.levels`` says which levels are enabled."""
        ...

    def stop(self) -> list[Event]:
        """Stops recording, removes every hook, and returns post-hoc events."""
        ...


# -- optional capabilities ------------------------------------------------------------------
# A source implements those it can; the session asks with ``isinstance``. Besides these, a
# source that can end its op level early has ``can_end_early`` (true) and ``end_early()``
# (``tracer/windows.EndsEarly``), and may name ``framework`` (its ops' framework; None or
# absent: shared by every framework), ``thread_ident`` (the thread that must end it; None:
# any) and ``profiling`` (whether its profiler is recording).


@runtime_checkable
class StartsAProfiler(Protocol):
    """A source whose profiler may start after ``start()`` returns (at its framework's import)."""

    def around_profiler_start(self, before: Callable[[], None], after: Callable[[], None]) -> None:
        """Calls ``before`` and ``after`` around its profiler's start (now, or when it starts)."""
        ...


@runtime_checkable
class EndsLayerLevel(Protocol):
    """A source whose layer level can end while its model level goes on (``--max-spans``)."""

    def end_layer_level(self) -> bool:
        """Stops recording layer spans from the next model call on; returns whether it recorded any."""
        ...


@runtime_checkable
class EndsRecording(Protocol):
    """A source that can stop recording altogether when the trace is full (``Session.fill``)."""

    def end_recording(self) -> None:
        """Takes its hooks out of the program's path; ``stop()`` still returns what it has."""
        ...


@runtime_checkable
class ReleasesInForkedChild(Protocol):
    """A source that hooks the program in-process and must let go in a forked child."""

    def release_in_forked_child(self) -> None:
        """In a child forked while the session runs: takes its hooks out, writing nothing."""
        ...


@runtime_checkable
class CountsPendingSpans(Protocol):
    """A source that holds spans not yet handed to the recorder (the span limit counts them)."""

    def pending_spans(self) -> int:
        """How many spans it holds now."""
        ...
