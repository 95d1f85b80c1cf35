"""mltrace's own pauses of the traced program: torch.profiler's cycle switches, which hold the
program's thread between two model calls (run.json ``torch_profiler.pauses``), and the op
level's early end, which holds it while the profilers stop (``op_window``: ``ended_ns``,
``pause_s`` and, since it was recorded, ``thread``). The report leaves them out of what it
says of the program's time: idle time between model calls, a ``generate()`` call's times per
token, a request's time outside its model calls."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mltrace.run.store import Run

#: The name a gap gives mltrace's own pause at one of its ends.
TRACER_PAUSE = "mltrace's pause"


class Pauses:
    """The run's pauses as sorted, disjoint (begin, end) session-clock intervals (ns)."""

    def __init__(self, intervals: list[tuple[int, int]]) -> None:
        self.intervals = _merged(intervals)
        self._begins = [b for b, _ in self.intervals]

    @classmethod
    def of_run(cls, meta: dict[str, Any], thread: int | None = None) -> Pauses:
        """The pauses run.json keeps (``torch_profiler.pauses``: [thread, begin ns, end ns] each;
        the op level's early ends, ``op_window``), of one thread (its native id, a thread
        track's ``tid``) or of all. An early end recorded without its thread counts for all."""
        rows = [r for r in (meta.get("torch_profiler") or {}).get("pauses") or [] if isinstance(r, list) and len(r) == 3]
        rows += _op_window_pauses(meta.get("op_window") or {})
        return cls(sorted({(int(r[1]), int(r[2])) for r in rows if thread is None or r[0] in (None, thread)}))

    def __bool__(self) -> bool:
        return bool(self.intervals)

    def within(self, begin: int, end: int) -> int:
        """How long the pauses cover of ``[begin, end)`` (ns)."""
        if not self.intervals or end <= begin:
            return 0
        i = max(0, bisect.bisect_right(self._begins, begin) - 1)
        total = 0
        for b, e in self.intervals[i:]:
            if b >= end:
                break
            total += max(0, min(e, end) - max(b, begin))
        return total


def _merged(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``intervals`` sorted, the overlapping ones joined: the op level's early end holds
    torch.profiler's last stop, which run.json keeps as a pause of its own."""
    out: list[tuple[int, int]] = []
    for b, e in sorted((b, e) for b, e in intervals if e > b):
        if out and b <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((b, e))
    return out


def _op_window_pauses(window: dict[str, Any]) -> list[list[Any]]:
    """[thread or None, begin ns, end ns] of the op level's early ends (the whole level's entry
    and each framework's, which may repeat it)."""
    out = []
    for entry in (window, *(window.get("frameworks") or {}).values()):
        begin, took = entry.get("ended_ns"), entry.get("pause_s")
        if isinstance(begin, int) and isinstance(took, (int, float)) and took > 0:
            out.append([entry.get("thread"), begin, begin + int(took * 1e9)])
    return out


class PausesByTrack:
    """Each thread track's own pauses, read from run.json once per thread (none for a track that
    is not in the run)."""

    def __init__(self, run: Run) -> None:
        self._run = run
        self._by_thread: dict[int | None, Pauses] = {}

    def of(self, track_id: int) -> Pauses:
        """The pauses of the thread of track ``track_id``."""
        track = self._run.tracks.get(track_id)
        tid = track.tid if track is not None else None
        if tid not in self._by_thread:
            self._by_thread[tid] = Pauses.of_run(self._run.meta, thread=tid) if tid is not None else Pauses([])
        return self._by_thread[tid]
