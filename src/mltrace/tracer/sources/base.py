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
