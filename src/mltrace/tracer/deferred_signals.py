"""Holding SIGINT and SIGTERM back while a step that must not be cut in two runs."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

_HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Runs the block with SIGINT and SIGTERM held back: on the main thread (the only one whose
    Python code a signal's handler interrupts), each handler the program set from Python is
    swapped for one that notes the signal, and put back after the block, which then raises
    the signals that came, in order, so that their handlers run as soon as it ends. Handlers
    set outside Python, and other threads, are left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    saved: dict[signal.Signals, Any] = {}
    for sig in _HELD:
        current = signal.getsignal(sig)
        if current is None or current == signal.SIG_IGN:  # not set from Python, or ignored
            continue
        saved[sig] = current
        signal.signal(sig, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        for held, handler in saved.items():
            signal.signal(held, handler)
        for signum in came:
            signal.raise_signal(signum)
