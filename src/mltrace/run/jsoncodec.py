"""The run directory's JSON: ``dumps`` (compact, orjson where installed, what JSON cannot hold
written as text), ``loads``, and ``trimmed`` for encoded bytes kept beyond a moment."""

from __future__ import annotations

import json
from typing import Any


def jsonable(value: Any) -> Any:
    """``value`` with what JSON (orjson) cannot hold made text: integers beyond 64 bits,
    dictionary keys that are not strings, and (through ``str``) any other object; tuples and
    sets become lists. For attributes a program set that a plain dump refused."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, float)):
        return value
    if isinstance(value, int):
        return value if -(1 << 63) <= value < (1 << 64) else str(value)
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    return str(value)


try:  # orjson is ~5x faster on large runs; the stdlib is the fallback.
    import orjson as _orjson

    def dumps(obj: Any) -> bytes:
        """Compact JSON. orjson's result holds a buffer of 4 KB or more whatever its length:
        pass anything kept beyond a moment through ``trimmed``. What JSON cannot hold (an
        attribute of 2**70) is written as text (``jsonable``) rather than failing the write."""
        try:
            return _orjson.dumps(obj, option=_orjson.OPT_SERIALIZE_NUMPY, default=str)
        except TypeError:
            return _orjson.dumps(jsonable(obj), option=_orjson.OPT_SERIALIZE_NUMPY, default=str)

    loads = _orjson.loads
except ImportError:  # pragma: no cover - depends on the environment

    def dumps(obj: Any) -> bytes:
        try:
            return json.dumps(obj, separators=(",", ":"), default=str).encode()
        except (TypeError, ValueError):
            return json.dumps(jsonable(obj), separators=(",", ":"), default=str).encode()

    loads = json.loads  # type: ignore[assignment]


def trimmed(data: bytes) -> bytes:
    """A copy of ``data`` that holds no more memory than its length (see ``dumps``)."""
    return bytes(memoryview(data))
