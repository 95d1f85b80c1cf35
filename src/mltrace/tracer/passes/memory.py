"""Memory per span: allocations, frees and peaks from torch.profiler's memory events.

``kineto_to_events`` turns each ``[memory]`` event (an allocation or a free,
``profile_memory=True``) into an ``Instant`` on the thread that made it. This pass
gives every model, layer, op and user span on that thread the events that happened
while it ran (between its start and end, inclusive): each event counts for the
innermost span running on its thread and for every span around it. Per span and
device:

- ``alloc_bytes``: the sum of its allocations (bytes);
- ``freed_bytes``: the sum of its frees (bytes, positive);
- ``peak_bytes``: the highest its net allocation (allocations minus frees, in event
  order) rose above zero while it ran: the memory it held at its peak (bytes);
- ``peak_total_bytes``: the device's allocated bytes (torch's ``Total Allocated``) at
  their highest while it ran.

A span gets the numbers of the device it allocated most on (``ml.memory.device``):
``ml.memory.alloc_bytes``, ``ml.memory.freed_bytes``, ``ml.memory.peak_bytes``,
``ml.memory.peak_total_bytes``. The instants are then dropped: the counter track
(``<device>.memory.allocated``, one sample per event) keeps the run's curve, and
run.json's ``correlation.attribute_memory`` the counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mltrace.run.events import Instant, Span
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.tracer.passes.checks import note
from mltrace.tracer.sources.kineto import MEMORY_EVENT

if TYPE_CHECKING:
    import numpy as np

#: The levels whose spans get memory numbers.
_LEVELS = frozenset({Level.MODEL, Level.LAYER, Level.OP, Level.USER})
#: Span attributes this pass sets.
ATTRS = ("ml.memory.device", "ml.memory.alloc_bytes", "ml.memory.freed_bytes", "ml.memory.peak_bytes", "ml.memory.peak_total_bytes")


@dataclass(frozen=True)
class SpanMemory:
    """What one span did to one device's memory (bytes).

    Attributes:
        device: ``cpu``, ``cuda:0``, …
        alloc_bytes: allocated while it ran.
        freed_bytes: freed while it ran (positive).
        peak_bytes: the highest its net allocation rose above its start (≥ 0).
        peak_total_bytes: the device's allocated bytes at their highest while it ran.
    """

    device: str
    alloc_bytes: int
    freed_bytes: int
    peak_bytes: int
    peak_total_bytes: int

    def attrs(self) -> dict[str, Any]:
        """The span attributes (``ATTRS``)."""
        return dict(zip(ATTRS, (self.device, self.alloc_bytes, self.freed_bytes, self.peak_bytes, self.peak_total_bytes)))


class _Events:
    """One thread's memory events on one device, as prefix sums for interval queries."""

    def __init__(self, device: str, events: Sequence[Instant]) -> None:
        import numpy as np

        ordered = sorted(events, key=lambda e: e.ts_ns)  # stable: Kineto's order breaks ties
        self.device = device
        self.ts = np.fromiter((e.ts_ns for e in ordered), np.int64, len(ordered))
        size = np.fromiter((int(e.attrs["ml.memory.bytes"]) for e in ordered), np.int64, len(ordered))
        total = np.fromiter((int(e.attrs["ml.memory.total_allocated"]) for e in ordered), np.int64, len(ordered))
        zero = np.zeros(1, np.int64)
        self.net = np.concatenate([zero, np.cumsum(size)])  # net[k]: the sum of the first k events
        self.after = np.concatenate([self.net[1:], zero])  # after[k]: net after event k (and a sentinel)
        self.alloc = np.concatenate([zero, np.cumsum(np.maximum(size, 0))])
        self.freed = np.concatenate([zero, np.cumsum(np.maximum(-size, 0))])
        self.total = np.concatenate([total, zero])  # a sentinel, so that reduceat may index len(events)

    def query(self, starts: np.ndarray, ends: np.ndarray) -> list[SpanMemory | None]:
        """The numbers of spans with these starts and ends (ns); None where no event fell inside."""
        import numpy as np

        lo = np.searchsorted(self.ts, starts, side="left")
        hi = np.searchsorted(self.ts, ends, side="right")
        some = hi > lo
        out: list[SpanMemory | None] = [None] * len(starts)
        if not some.any():
            return out
        lo, hi = lo[some], hi[some]
        # reduceat over [lo, hi) pairs: the even results are the spans' ranges (all non-empty here).
        pairs = np.stack([lo, hi], axis=1).ravel()
        net_peak = np.maximum.reduceat(self.after, pairs)[::2]
        total_peak = np.maximum.reduceat(self.total, pairs)[::2]
        alloc = self.alloc[hi] - self.alloc[lo]
        freed = self.freed[hi] - self.freed[lo]
        peak = np.maximum(net_peak - self.net[lo], 0)
        for k, i in enumerate(np.nonzero(some)[0].tolist()):
            out[i] = SpanMemory(self.device, int(alloc[k]), int(freed[k]), int(peak[k]), int(total_peak[k]))
        return out


def span_memory(spans: Sequence[Span], events: Sequence[Instant]) -> dict[int, SpanMemory]:
    """Each span's memory numbers from the memory events on its track (module docstring).

    Args:
        spans: the spans to give numbers (any level; only their track and times are read).
        events: ``[memory]`` instants (``ml.memory.bytes``, ``ml.memory.total_allocated``,
            ``ml.memory.device``).

    Returns:
        Span id → the numbers of the device it allocated most on (spans with no event
        inside are left out).
    """
    import numpy as np

    groups: dict[int, dict[str, list[Instant]]] = {}
    for e in events:
        groups.setdefault(e.track_id, {}).setdefault(str(e.attrs.get("ml.memory.device", "cpu")), []).append(e)
    by_track: dict[int, list[Span]] = {}
    for s in spans:
        if s.track_id in groups and s.end_ns >= s.start_ns:
            by_track.setdefault(s.track_id, []).append(s)
    out: dict[int, SpanMemory] = {}
    for track, on_track in by_track.items():
        starts = np.fromiter((s.start_ns for s in on_track), np.int64, len(on_track))
        ends = np.fromiter((s.end_ns for s in on_track), np.int64, len(on_track))
        for device in sorted(groups[track]):
            found = _Events(device, groups[track][device]).query(starts, ends)
            for s, m in zip(on_track, found):
                if m is not None and (s.id not in out or m.alloc_bytes > out[s.id].alloc_bytes):
                    out[s.id] = m
    return out


def attribute_memory(run: Run) -> Run:
    """Gives model, layer, op and user spans their memory numbers and drops the memory
    instants (module docstring). A run without memory events is returned as it is."""
    events = [i for i in run.instants if i.name == MEMORY_EVENT and _well_formed(i)]
    if not events and not any(i.name == MEMORY_EVENT for i in run.instants):
        return run
    numbers = span_memory([s for s in run.spans if s.level in _LEVELS], events)
    for span in run.spans:
        m = numbers.get(span.id)
        if m is not None:
            span.attrs = {**span.attrs, **m.attrs()}  # a loaded span's dict may be shared
    devices = sorted({str(e.attrs["ml.memory.device"]) for e in events})
    dropped = sum(1 for i in run.instants if i.name == MEMORY_EVENT)
    note(run, "attribute_memory", {"memory_events": dropped, "well_formed": len(events), "spans": len(numbers), "devices": devices})
    return run.replace(instants=[i for i in run.instants if i.name != MEMORY_EVENT])


def _well_formed(i: Instant) -> bool:
    a = i.attrs
    return all(isinstance(a.get(k), int) and not isinstance(a.get(k), bool) for k in ("ml.memory.bytes", "ml.memory.total_allocated"))
