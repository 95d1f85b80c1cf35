"""The source contract.

A source produces events for one or more levels. Live sources (hooks,
decorators) record spans through ``session.recorder`` while the program runs;
post-hoc sources (profilers, log parsers) return a batch of events from
``stop()``. Sources import their framework lazily, never at module import.

Every source subclasses ``Source``: it defines the required members and inherits
the declared defaults of the optional ones, which it overrides where it can do
more. Optional methods are small protocols (``EndsEarly``, ``StartsAProfiler``,
…) that the session checks with ``isinstance``. ``FrameworkSource`` is the base of
the sources that wrap a framework's functions (its patches and its problems).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mltrace.tracer import messages

if TYPE_CHECKING:
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

    def end_op_level_now(self, framework: str | None, reason: str) -> bool:
        """Ends ``framework``'s op level now, on this thread, for ``reason`` (``tracer/windows.py``).
        False where there is no such level to end, or only another thread may end it."""
        ...

    def flush_soon(self) -> None:
        """Has the next flush run now (a source whose events just reached the run: the finish
        may then take them at once)."""
        ...


@runtime_checkable
class Source(Protocol):
    """What every source provides; every source subclasses it.

    Required:
        name: short identifier used in run.json and messages ("torch.modules").
        levels: the levels this source can produce.
        available(), start(), stop(): below.

    Optional, declared here with the default a source gets unless it says otherwise
    (the op level's early end, ``tracer/windows.py``):
        framework: the ``ml.framework`` whose model calls count toward its op level's
            end (``--op-inferences``); None: shared by every framework (ends with the last).
        thread_ident: the thread that must end it early; None: any thread.
        can_end_early: it may end before the session does (``end_early()``, ``EndsEarly``).
        profiling: a profiler of its own records now; ending the op level early frees
            what it holds (the memory budget ends the op level only then). Default False.
        holds_run_events: what its profiler holds grows with the run until it stops, so the
            process's growth counts toward the op level's memory budget. Default: while it
            profiles; a profiler that hands its events over in cycles says False (its running
            cycle's cost is its ``stop_bytes``).
        recording_ops: its part of the op level records now; a source whose profiler
            starts later (at its framework's import) or has ended says False. Default
            True: it records from ``start()`` on.
    """

    name: str
    levels: tuple[Level, ...]
    framework: str | None = None
    thread_ident: int | None = None

    @property
    def can_end_early(self) -> bool:
        """Whether it may end before the session does (it then has ``end_early()``)."""
        return False

    @property
    def profiling(self) -> bool:
        """Whether a profiler of its own records now."""
        return False

    @property
    def recording_ops(self) -> bool:
        """Whether its part of the op level records now."""
        return True

    @property
    def holds_run_events(self) -> bool:
        """Whether what its profiler holds grows with the run until it stops."""
        return self.profiling

    def available(self) -> str | None:
        """Returns None when the source can run here, else the reason it cannot."""
        ...

    def start(self, session: SessionView) -> None:
        """Starts recording; ``session.levels`` says which levels are enabled."""
        ...

    def stop(self) -> list[Event]:
        """Stops recording, removes every hook, and returns post-hoc events."""
        ...

    def sealed_until_ns(self) -> int | None:
        """The session time (ns) up to which its events have reached the session: every event
        of it that ends at or before this time is recorded, queued or written already, so the
        finish may correlate that part of the run while the program runs (``finish_stream``).
        None: it keeps nothing back (its events are recorded as they happen); 0: nothing is
        sealed yet (a post-hoc source returns its events from ``stop()``). Default None."""
        return None


# -- optional methods ------------------------------------------------------------------------
# A source implements those it can; the session asks with ``isinstance``.


@runtime_checkable
class EndsEarly(Source, Protocol):
    """A source whose recording may end before the session does (``can_end_early``);
    ``stop()`` still returns its events at the session's end."""

    def end_early(self) -> None:
        """Stops recording now, freeing what it can."""
        ...


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
class HandsOverEvents(Protocol):
    """A post-hoc source that hands its events to the session while the program runs."""

    def drain_events(self) -> list[Event]:
        """The events it made since the last call (the session queues them before each flush)."""
        ...


@runtime_checkable
class HoldsOpenSpans(Protocol):
    """A source that keeps spans open outside the recorder (calls still running)."""

    def earliest_open_ns(self) -> int | None:
        """The start of the earliest of them still running, or None where none is."""
        ...


@runtime_checkable
class ReleasesInForkedChild(Protocol):
    """A source that hooks the program in-process and must let go in a forked child."""

    def release_in_forked_child(self) -> None:
        """In a child forked while the session runs: takes its hooks out, writing nothing."""
        ...


@runtime_checkable
class CostsMemoryToStop(Protocol):
    """A source whose stop materialises the events it holds (torch.profiler's)."""

    def stop_bytes(self) -> int:
        """About how much memory its stop would take now (bytes)."""
        ...


@runtime_checkable
class CountsPendingSpans(Protocol):
    """A source that holds spans not yet handed to the recorder (the span limit counts them)."""

    def pending_spans(self) -> int:
        """How many spans it holds now."""
        ...


class FrameworkSource(Source):
    """The base of a source that wraps a framework's functions (TensorFlow, ONNX Runtime):
    the attributes it replaced, put back at ``stop()``, and its problems, each kept once for
    run.json (``sources_info``, ``limitations``), the serious ones also said on stderr."""

    def __init__(self) -> None:
        self._patched: list[tuple[Any, str, Any]] = []
        self._problems: list[str] = []

    def _patch(self, owner: Any, name: str, fn: Any) -> None:
        """Sets ``owner.name`` to ``fn``, keeping the original (a class's own attribute, from
        its ``__dict__``: a staticmethod stays one when put back)."""
        self._patched.append((owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, fn)

    def _unpatch(self) -> None:
        """Puts back every original, the last replaced first."""
        while self._patched:
            owner, name, orig = self._patched.pop()
            setattr(owner, name, orig)

    def _note(self, message: str) -> None:
        """Keeps a problem for run.json (once)."""
        if message not in self._problems:
            self._problems.append(message)

    def _warn(self, message: str) -> None:
        """Keeps a problem for run.json and says it on stderr (once)."""
        if message not in self._problems:
            self._problems.append(message)
            messages.warn(f"{self.name}: {message}")

    def _note_problems(self, session: SessionView) -> None:
        """Files every problem kept as a limitation of the run (at ``stop()``)."""
        for problem in self._problems:
            session.note_limitation(f"{self.name}: {problem}")
