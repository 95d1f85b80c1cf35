"""Ending detail levels partway through a run, between two inferences.

The op level's profilers hold every event in memory until they stop, and the session's end
loads every streamed span, so a long run ends them early while the model level goes on:

- the op level of each framework after ``--op-inferences N`` of its own model calls (one
  ``LevelWindow`` per framework whose op source can end, ``Source.framework``; shared sources
  end with the last framework that made model calls), or all of it once the process passes
  the op level's memory budget (``MemoryWatch``) or the span limit;
- the layer level at ``--max-spans`` streamed spans (at twice that the trace is full,
  ``Session.fill``).

An end happens right after a model call returns (``Session.model_call_ended``), on the thread
the window names where one must (``Source.thread_ident``), so no model call is cut in half.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import TypeGuard

from mltrace.tracer.clock import now_ns
from mltrace.tracer.sources.base import EndsEarly, Source


def can_end_early(source: Source) -> TypeGuard[EndsEarly]:
    """Whether ``source`` may end before the session does: it says so (``can_end_early``) and
    has ``end_early()``. Where it records one framework's ops it names it (``framework``): its
    op level then ends after that framework's own model calls; without one, it is shared and
    ends with the last framework that made model calls."""
    return bool(source.can_end_early) and isinstance(source, EndsEarly)


class LevelWindow:
    """When a level ends: after a number of model calls, or on request.

    Args:
        end: ends the level; called once, with this window, on the thread of
            the model call after which it ends.
        limit: model calls to record the level for (None: until a request, or
            the end of the session).
        limit_text: the option that set ``limit``, for messages (``--op-inferences``).
        owner_thread: returns the ident of the thread that must do the ending, or
            None where any thread may (a profiler that never started); None (the
            default): any thread.
        framework: the framework whose model calls it counts (``ml.framework``), or
            None: every model call.

    Attributes:
        calls: model calls that ended so far.
        reason: why the level ends (set once; None while it goes on).
        ended_ns: when it ended (session clock), or None.
    """

    def __init__(
        self,
        end: Callable[[LevelWindow], None],
        limit: int | None = None,
        limit_text: str = "",
        owner_thread: Callable[[], int | None] | None = None,
        framework: str | None = None,
    ) -> None:
        self._end = end
        self.framework = framework
        self.limit = limit
        self._limit_text = limit_text
        self._owner_thread = owner_thread
        self._counter = itertools.count(1)
        self.calls = 0
        self.reason: str | None = None
        self.ended_ns: int | None = None
        self._lock = threading.Lock()

    def request(self, reason: str) -> None:
        """Asks for the end at the next model call's return (any thread may ask)."""
        if self.reason is None:
            self.reason = reason

    def end_now(self, reason: str) -> bool:
        """Ends the level now, on this thread, whether or not a model call is running (the
        trace is full: nothing after this is recorded anyway). Returns False where it had
        ended, or where only another thread may end it (its next model call still does)."""
        self.request(reason)
        return self._end_here()

    def model_ended(self) -> None:
        """Called after every outermost model call, on the thread that made it."""
        if self.ended_ns is not None:
            return
        self.calls = next(self._counter)
        if self.reason is None and self.limit is not None and self.calls >= self.limit:
            self.reason = f"{self._limit_text} {self.limit}"
        if self.reason is not None:
            self._end_here()

    def _end_here(self) -> bool:
        """Ends the level on this thread, unless it has ended or another thread must end it."""
        if self._owner_thread is not None:
            owner = self._owner_thread()
            if owner is not None and threading.get_ident() != owner:
                return False
        with self._lock:
            if self.ended_ns is not None:
                return False
            self.ended_ns = now_ns()
        self._end(self)
        return True
