"""Variables mltrace sets in the traced process's C environment, out of the program's view.

The C libraries read their settings with ``getenv`` (oneDNN's ``ONEDNN_VERBOSE_TIMESTAMP``,
Kineto's ``KINETO_LOG_LEVEL``), and Python reads ``PYTHONPATH`` and ``MLTRACE_FOLLOW`` from the
environment a child starts with. ``put`` sets such a variable with ``os.putenv``, which changes
the C environment and leaves ``os.environ`` as it was: the program reads, copies and hands on
the environment it has without mltrace. ``take_back`` sets the C environment's variable back to
the program's view (its value in ``os.environ``, or unset).

A child started from the C environment (``os.system``, ``os.exec*``, ``os.posix_spawn``, or
``subprocess`` and multiprocessing where the follow wrapper is not installed) inherits the
variables put. ``children_environ`` is the environment such a child would have had without
mltrace: the follow wrapper (``follow/context.py``) starts ``subprocess`` and multiprocessing
children from it, but mltrace's own (``own_child``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

#: The variables put here and not taken back, with the values put.
_put: dict[str, str] = {}


def put(name: str, value: str) -> None:
    """Sets ``name`` to ``value`` in the C environment alone (``os.environ`` unchanged)."""
    os.putenv(name, value)
    _put[name] = value


def take_back(name: str) -> None:
    """Sets ``name`` in the C environment back to the program's view: its value in
    ``os.environ``, or unset where it has none."""
    _put.pop(name, None)
    value = os.environ.get(name)
    if value is None:
        os.unsetenv(name)
    else:
        os.putenv(name, value)


def is_put(name: str) -> bool:
    """Whether ``name`` is set here and not taken back."""
    return name in _put


_starting = threading.local()


@contextlib.contextmanager
def own_child() -> Iterator[None]:
    """Around the start of one of mltrace's own processes (a helper) in the calling thread: the
    follow wrapper (``follow/context.py``) leaves its environment as it is given."""
    _starting.own = True
    try:
        yield
    finally:
        _starting.own = False


def starting_own_child() -> bool:
    """Whether the calling thread starts one of mltrace's own processes (``own_child``)."""
    return bool(getattr(_starting, "own", False))


def children_environ() -> list[bytes]:
    """The C environment as ``NAME=value`` entries with every variable put here as the program
    sees it (its value in ``os.environ``, or absent): the environment a child started from it
    would have without mltrace. ``os.environ``'s entries where the C ``environ`` cannot be read."""
    put_names = {os.fsencode(name) for name in _put}
    entries = [e for e in _read_c_environ() if e.partition(b"=")[0] not in put_names]
    for name in put_names:
        value = os.environb.get(name)
        if value is not None:
            entries.append(name + b"=" + value)
    return entries


def _read_c_environ() -> list[bytes]:
    """The process's C ``environ``; ``os.environb``'s entries where it cannot be read (there, a
    variable set with ``os.putenv`` alone is missing)."""
    try:
        import ctypes

        environ = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
        entries: list[bytes] = []
        while (entry := environ[len(entries)]) is not None:
            entries.append(entry)
        return entries
    except Exception:  # noqa: BLE001 - no C environ symbol here: the program's view
        return [k + b"=" + v for k, v in os.environb.items()]
