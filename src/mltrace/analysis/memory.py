"""Memory per layer and op, and the run's peak (runs recorded with ``--memory``).

The numbers come from the spans' ``ml.memory.*`` attributes (``tracer/passes/memory.py``)
and the ``<device>.memory.allocated`` counter tracks. Definitions (docs/ANALYSIS.md,
"Memory"):

- per layer and per op name, over the calls the tables count: ``alloc_bytes`` and
  ``freed_bytes`` summed over its calls, ``peak_bytes`` the highest any call's net
  allocation rose above its start (bytes);
- the run's peak per device: the highest sample of its counter track, over the whole run,
  and the layer holding it: the innermost layer (else the model) running when it was
  taken, on any thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mltrace.run.events import TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run

if TYPE_CHECKING:
    import numpy as np

#: The suffix of the counter tracks of allocated bytes (``kineto.memory_counter_name``).
COUNTER_SUFFIX = ".memory.allocated"


@dataclass
class MemoryRow:
    """A layer or op name's memory over its counted calls (bytes).

    Attributes:
        name: the layer path or op name.
        level: ``Level.LAYER``, ``Level.MODEL`` or ``Level.OP``.
        calls: calls with memory numbers.
        alloc_bytes: allocated, summed over the calls.
        freed_bytes: freed, summed over the calls.
        peak_bytes: the highest peak of one call (``ml.memory.peak_bytes``).
        device: the device of the largest peak (``cpu``, ``cuda:0``, …).
    """

    name: str
    level: Level
    calls: int
    alloc_bytes: int
    freed_bytes: int
    peak_bytes: int
    device: str


@dataclass
class DevicePeak:
    """The highest allocated bytes of one device in the run.

    Attributes:
        track: the counter track's name (``cpu.memory.allocated``).
        device: the counter track's device index (-1: CPU).
        bytes: the highest sample (bytes).
        ts_ns: when it was taken (session clock).
        layer: the innermost layer (else model) running then, or None.
        samples: how many samples the track has.
    """

    track: str
    device: int
    bytes: int
    ts_ns: int
    layer: str | None
    samples: int


@dataclass
class MemoryReport:
    """What the report's memory section shows.

    Attributes:
        peaks: one per device with memory samples, largest first.
        layers: layers and models, by peak, largest first.
        ops: op names, by allocated bytes, largest first.
    """

    peaks: list[DevicePeak] = field(default_factory=list)
    layers: list[MemoryRow] = field(default_factory=list)
    ops: list[MemoryRow] = field(default_factory=list)

    def layer(self, name: str) -> MemoryRow | None:
        """The row of a layer (or model) name, or None."""
        return next((r for r in self.layers if r.name == name), None)

    def op(self, name: str) -> MemoryRow | None:
        """The row of an op name, or None."""
        return next((r for r in self.ops if r.name == name), None)


def memory_report(run: Run, counted: Run | None = None) -> MemoryReport | None:
    """The memory section's data, or None for a run recorded without ``--memory``.

    Args:
        run: the whole run (its counter tracks and spans give the peaks).
        counted: the run whose spans the tables count (without its cold calls); default ``run``.
    """
    recorded = isinstance(run.meta.get("correlation"), dict) and "attribute_memory" in run.meta["correlation"]
    if not recorded and not any(t.name.endswith(COUNTER_SUFFIX) for t in run.tracks.values()):
        return None  # the attribute sets are not decoded for nothing
    rows = _rows(counted if counted is not None else run)
    peaks = _peaks(run)
    if not peaks and rows is None:
        return None
    layers, ops = rows if rows is not None else ([], [])
    return MemoryReport(peaks=peaks, layers=layers, ops=ops)


def _set_values(run: Run) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """Per attribute set: alloc, freed and peak bytes (-1: none) and its device."""
    import numpy as np

    t = run.table
    n = t.attr_set_count
    alloc, freed, peak = (np.full(n, -1, np.int64) for _ in range(3))
    devices = [""] * n
    for k in range(n):
        a = t.attr_set(k)
        if "ml.memory.alloc_bytes" in a:
            keys = ("ml.memory.alloc_bytes", "ml.memory.freed_bytes", "ml.memory.peak_bytes")
            alloc[k], freed[k], peak[k] = (int(a.get(x) or 0) for x in keys)
            devices[k] = str(a.get("ml.memory.device", ""))
    return alloc, freed, peak, devices


def _rows(run: Run) -> tuple[list[MemoryRow], list[MemoryRow]] | None:
    """Layer and op rows, or None when no span has memory numbers."""
    import numpy as np

    t = run.table
    if not len(t):
        return None
    alloc, freed, peak, devices = _set_values(run)
    level = t.level.astype(np.int64)
    keep = (alloc[t.attr] >= 0) & np.isin(level, [int(Level.MODEL), int(Level.LAYER), int(Level.OP)])
    if not keep.any():
        return None
    rows = np.nonzero(keep)[0]
    key = level[rows] * len(t.names) + t.name[rows].astype(np.int64)
    groups, inverse = np.unique(key, return_inverse=True)
    sets = t.attr[rows]
    alloc_sum = np.bincount(inverse, alloc[sets], len(groups))
    freed_sum = np.bincount(inverse, freed[sets], len(groups))
    calls = np.bincount(inverse, minlength=len(groups))
    order = np.lexsort((-peak[sets], inverse))  # by group, largest peak first
    first = order[np.searchsorted(inverse[order], np.arange(len(groups)))]
    out: list[MemoryRow] = []
    for g, k in enumerate(groups.tolist()):
        lv, name = divmod(k, len(t.names))
        s = int(sets[first[g]])
        out.append(MemoryRow(t.names[name], Level(lv), int(calls[g]), int(alloc_sum[g]), int(freed_sum[g]), int(peak[s]), devices[s]))
    layers = sorted((r for r in out if r.level is not Level.OP), key=lambda r: (-r.peak_bytes, r.name))
    ops = sorted((r for r in out if r.level is Level.OP), key=lambda r: (-r.alloc_bytes, r.name))
    return layers, ops


def _peaks(run: Run) -> list[DevicePeak]:
    """The highest sample of every ``*.memory.allocated`` counter track, with the layer then."""
    tracks = {t.id: t for t in run.tracks.values() if t.kind == TrackKind.COUNTER and t.name.endswith(COUNTER_SUFFIX)}
    best: dict[int, tuple[float, int, int]] = {}  # track → (value, ts, samples)
    for c in run.counters:
        if c.track_id in tracks:
            value, ts, n = best.get(c.track_id, (float("-inf"), 0, 0))
            best[c.track_id] = (c.value, c.ts_ns, n + 1) if c.value > value else (value, ts, n + 1)
    peaks = [DevicePeak(tracks[k].name, tracks[k].device, int(v), ts, _layer_at(run, ts), n) for k, (v, ts, n) in best.items()]
    return sorted(peaks, key=lambda p: (-p.bytes, p.track))


def _layer_at(run: Run, ts: int) -> str | None:
    """The innermost (latest-starting) layer running at ``ts``, else model, else None."""
    import numpy as np

    t = run.table
    inside = (t.start <= ts) & (t.end >= ts)
    level = t.level.astype(np.int64)
    for lv in (Level.LAYER, Level.MODEL):
        rows = np.nonzero(inside & (level == int(lv)))[0]
        if len(rows):
            return t.names[int(t.name[rows[np.argmax(t.start[rows])]])]
    return None


@dataclass
class MemoryChange:
    """One peak in two runs (bytes; None where that run has none).

    Attributes:
        name: ``peak <counter track>`` for a device's peak, else a layer's name.
        a_bytes, b_bytes: the peak in run A and in run B.
    """

    name: str
    a_bytes: int | None
    b_bytes: int | None


def memory_diff(a: MemoryReport | None, b: MemoryReport | None) -> list[MemoryChange]:
    """Peaks of two runs side by side: each device's peak first, then every layer's peak of
    one call, by the size of the change, largest first. Empty when neither run recorded memory."""
    if a is None and b is None:
        return []
    pa = {p.track: p.bytes for p in a.peaks} if a is not None else {}
    pb = {p.track: p.bytes for p in b.peaks} if b is not None else {}
    devices = [MemoryChange(f"peak {t}", pa.get(t), pb.get(t)) for t in sorted(pa.keys() | pb.keys())]
    la = {r.name: r.peak_bytes for r in a.layers} if a is not None else {}
    lb = {r.name: r.peak_bytes for r in b.layers} if b is not None else {}
    layers = [MemoryChange(n, la.get(n), lb.get(n)) for n in la.keys() | lb.keys()]
    layers.sort(key=lambda c: (-abs((c.b_bytes or 0) - (c.a_bytes or 0)), c.name))
    return devices + layers
