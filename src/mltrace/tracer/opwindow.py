"""Ending the op and library levels partway through a run, between two inferences.

torch.profiler keeps every op in memory until it stops (about 0.6 MB a batch-8
inference of the example CNN), and converting its events at the session's end
needs several times that again. A long run at the op level would exhaust the
machine. So the op level can end early, and the model and layer levels go on:

- after ``--op-inferences N`` model calls (outermost ``nn.Module`` calls), or
- when the process has grown past the memory budget (``MemoryWatch``).

The end runs on the program's own thread, right after a model call returns,
because torch.profiler can only be stopped by the thread that started it (and
between inferences no op is cut in half). The torch.modules source calls
``model_ended`` after every outermost call; that is one attribute read and a
counter per inference. Sources that can end this way say so with
``can_end_early``; the others (ONNX Runtime's and TensorFlow's profilers, the
CUDA kernel paths) run to the end of the session.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeGuard

from mltrace.tracer.clock import now_ns

if TYPE_CHECKING:
    from mltrace.tracer.session import Session
    from mltrace.tracer.sources.base import Source


class EndsEarly(Protocol):
    """A source whose recording may end before the session does; ``stop()`` still returns
    its events at the session's end."""

    name: str

    def end_early(self) -> None:
        """Stops recording now, freeing what it can."""
        ...


def can_end_early(source: Source) -> TypeGuard[EndsEarly]:
    """Whether ``source`` may end before the session does (its ``can_end_early``)."""
    return bool(getattr(source, "can_end_early", False)) and callable(getattr(source, "end_early", None))


class OpWindow:
    """When the op level ends: after a number of model calls, or on request.

    Args:
        session: the session whose sources end.
        limit: model calls to record ops for (None: until a request, or the end).
        owner_thread: returns the ident of the thread that must do the ending
            (the one that started torch.profiler), or None while it has not started.

    Attributes:
        calls: model calls that ended so far.
        reason: why the op level ends (set once; None while it goes on).
        ended_ns: when it ended (session clock), or None.
    """

    def __init__(self, session: Session, limit: int | None, owner_thread: Callable[[], int | None]) -> None:
        self._session = session
        self.limit = limit
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

    def model_ended(self) -> None:
        """Called after every outermost model call, on the thread that made it."""
        if self.ended_ns is not None:
            return
        self.calls = next(self._counter)
        if self.reason is None and self.limit is not None and self.calls >= self.limit:
            self.reason = f"--op-inferences {self.limit}"
        if self.reason is None or threading.get_ident() != self._owner_thread():
            return
        with self._lock:
            if self.ended_ns is not None:
                return
            self.ended_ns = now_ns()
        self._session.end_op_level(self)
