"""SIGINT and SIGTERM while a session finishes: a short grace, then the finish is cut short.

A user who presses Ctrl-C twice, or a supervisor that sends SIGTERM twice, must not get
mltrace's traceback, a signal's exit status instead of the program's, or a run with nothing
in it. While ``FinishGuard`` is entered (in the main thread only: Python sets handlers
nowhere else), both signals go to its handler instead of the program's:

- the first one starts a grace of ``GRACE_S`` seconds: a small run's finish (the op spans
  converted, the run correlated) still ends within it;
- when the grace runs out, or at any later signal, ``FinishInterrupted`` is raised in the
  main thread, wherever the finish is (at its next Python instruction: a long call into a
  native library ends first); the session catches it and keeps what was written;
- once the finish is being cut short, further signals are only counted.

The program's handlers are put back on exit, in ``finally``.
"""

from __future__ import annotations

import ctypes
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

#: Seconds the finish may go on after the first signal that arrives during it.
GRACE_S = 1.0

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class FinishInterrupted(BaseException):
    """Raised in the main thread to cut a finish short (a ``BaseException``, so that the
    finish's own ``except Exception`` around each source does not swallow it)."""


class FinishGuard:
    """Context manager: SIGINT/SIGTERM during the block cut it short (module docstring).

    Attributes:
        signum: the first signal that arrived during the block (None: none did).
        cutting: the block is being cut short; later signals are only counted.
        later: how many signals arrived after the cut began.
    """

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.signum: int | None = None
        self.cutting = False
        self.later = 0
        self._saved: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._done = False
        self._pending = False  # an asynchronous FinishInterrupted was set on the main thread
        self._timer: threading.Timer | None = None
        self._main = threading.main_thread().ident

    def __enter__(self) -> FinishGuard:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in _SIGNALS:
            try:
                self._saved[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):
                continue
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            with self._lock:
                self._done = True
                if self._timer is not None:
                    self._timer.cancel()
                if self._pending:  # set but perhaps not raised yet: it must not reach the program
                    _set_async_exc(self._main, None)
        finally:
            for sig, handler in self._saved.items():
                try:
                    signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
                except (ValueError, OSError):
                    pass

    @property
    def signal_name(self) -> str | None:
        """The first signal's name (``SIGINT``), or None."""
        return signal.Signals(self.signum).name if self.signum is not None else None

    def cut(self) -> None:
        """Marks the block as being cut short: later signals are only counted."""
        with self._lock:
            self.cutting = True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        with self._lock:
            if self.cutting or self._done:
                self.later += 1
                return
            if self.signum is None:
                self.signum = signum
                self._timer = threading.Timer(self.grace_s, self._grace_over)
                self._timer.daemon = True
                try:
                    self._timer.start()
                    return
                except RuntimeError:  # no new threads: cut short now
                    pass
            self.cutting = True
        raise FinishInterrupted(signum)

    def _grace_over(self) -> None:
        with self._lock:
            if self.cutting or self._done:
                return
            self.cutting = True
            self._pending = True
            _set_async_exc(self._main, FinishInterrupted)


def _set_async_exc(thread_ident: int | None, exc: type[BaseException] | None) -> None:
    """Raises ``exc`` in the thread at its next Python instruction (None: withdraws a pending one)."""
    if thread_ident is None:
        return
    try:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_ident), ctypes.py_object(exc) if exc is not None else None)
    except (AttributeError, ValueError):
        pass
