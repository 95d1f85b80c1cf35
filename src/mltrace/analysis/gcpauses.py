"""The program's own garbage collections inside its layer and model calls.

A collection holds the thread that set it off (and every other Python thread) inside
whichever call allocated then: a full collection of a process with a framework loaded takes
100 ms or more, and the layer it lands in would look like a layer with 100 ms of fixed
per-call cost. run.json ``gc.pauses`` (``tracer/sources/gc_pauses.py``: thread, begin ns,
end ns, generation) says when they ran; each is charged to the innermost layer or model call
running on its thread, where it counts in that call's self time. The report keeps the times
as measured, judges a row's verdict on its time less its collections, and says how much of
its time they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mltrace.run.events import Track, TrackKind
from mltrace.run.levels import Level

if TYPE_CHECKING:
    import numpy as np

    from mltrace.run.table import SpanTable

#: (native thread id, begin ns, end ns, generation) of one collection.
Pause = tuple[int, int, int, int]


@dataclass(frozen=True)
class GcTime:
    """Collections charged to one layer or model, over all its calls.

    Attributes:
        count: how many.
        ns: their summed duration (ns).
        full: how many of them were full collections (the oldest generation).
    """

    count: int
    ns: int
    full: int = 0

    def kinds(self) -> str:
        """``"1 full collection"``, ``"3 young collections"``, ``"4 collections, 1 full"``."""
        plural = "s" if self.count != 1 else ""
        if self.full == self.count:
            return f"{self.count} full collection{plural}"
        if self.full == 0:
            return f"{self.count} young collection{plural}"
        return f"{self.count} collections, {self.full} full"

    def text(self) -> str:
        """``"210 ms of the program's garbage collection (1 full collection)"``."""
        from mltrace.analysis.units import fmt_ns

        return f"{fmt_ns(self.ns)} of the program's garbage collection ({self.kinds()})"


def gc_pauses(meta: dict[str, Any]) -> list[Pause]:
    """The collections run.json keeps (``gc.pauses``), well-formed rows only."""
    rows = (meta.get("gc") or {}).get("pauses") or []
    return [
        (r[0], r[1], r[2], r[3]) for r in rows if isinstance(r, list) and len(r) == 4 and all(type(v) is int for v in r) and r[2] >= r[1]
    ]


@dataclass(frozen=True)
class GcByRow:
    """The collections charged to each layer or model, by (name, level) as the report's rows
    name them.

    Attributes:
        own: those charged to its own calls (the innermost call running then): in its self time.
        within: those inside its calls at any depth (its children's included): in its total time.
    """

    own: dict[tuple[str, Level], GcTime]
    within: dict[tuple[str, Level], GcTime]


def gc_by_row(table: SpanTable, tracks: dict[int, Track], meta: dict[str, Any], keep: np.ndarray | None = None) -> GcByRow:
    """Charges each collection of the traced process to the innermost layer or model call
    running on its thread when it began (the part of it before that call's end), and counts it
    inside that call's enclosing layer and model calls too.

    ``keep`` (a mask over the table's rows) leaves out the calls it does not mark, as if they
    were not in the table: the summary's cold calls (whole model calls with their subtrees),
    whose collections are then charged to nothing, as in the report's table without them."""
    pauses = gc_pauses(meta)
    if not pauses or not len(table):
        return GcByRow({}, {})
    import numpy as np

    pid = meta.get("pid")
    tid_of = {t.id: t.tid for t in tracks.values() if t.kind == TrackKind.THREAD and (pid is None or t.pid == pid)}
    calls = ((table.level == int(Level.LAYER)) | (table.level == int(Level.MODEL))) & (table.end >= table.start)
    if keep is not None:
        calls &= keep
    rows = np.nonzero(calls)[0]
    if not len(rows):
        return GcByRow({}, {})
    track_ids, which = np.unique(table.track[rows], return_inverse=True)
    row_tid = np.array([tid_of.get(int(t), -1) for t in track_ids], dtype=np.int64)[which]
    parent = table.parent_row()
    own: dict[tuple[str, Level], list[int]] = {}
    within: dict[tuple[str, Level], list[int]] = {}
    for tid in {p[0] for p in pauses}:
        mine = rows[row_tid == tid]
        if not len(mine):
            continue
        mine = mine[np.argsort(table.start[mine], kind="stable")]
        starts = table.start[mine]
        for thread, begin, end, generation in pauses:
            at = _innermost(table, calls, parent, mine, starts, begin) if thread == tid else -1
            if at < 0:
                continue
            took, full = min(end, int(table.end[at])) - begin, int(generation == 2)
            _add(own, _key(table, at), took, full)
            for key in _enclosing(table, calls, parent, at):
                _add(within, key, took, full)
    return GcByRow({k: GcTime(*v) for k, v in own.items()}, {k: GcTime(*v) for k, v in within.items()})


def _key(table: SpanTable, row: int) -> tuple[str, Level]:
    return table.names[int(table.name[row])], Level(int(table.level[row]))


def _add(acc: dict[tuple[str, Level], list[int]], key: tuple[str, Level], ns: int, full: int) -> None:
    got = acc.setdefault(key, [0, 0, 0])
    got[0] += 1
    got[1] += ns
    got[2] += full


def _enclosing(table: SpanTable, calls: np.ndarray, parent: np.ndarray, row: int) -> list[tuple[str, Level]]:
    """The rows' keys of the layer and model call ``row`` and of those around it, each once."""
    keys: list[tuple[str, Level]] = []
    while row >= 0:
        if calls[row]:
            key = _key(table, row)
            if key not in keys:
                keys.append(key)
        row = int(parent[row])
    return keys


def _innermost(table: SpanTable, calls: np.ndarray, parent: np.ndarray, mine: np.ndarray, starts: np.ndarray, at_ns: int) -> int:
    """The row of the innermost layer or model call of ``mine`` (one thread's, by start) running
    at ``at_ns``, or -1: the last to begin by then, or the nearest of its ancestors still
    running (calls on a thread nest, so the innermost running call is one of them)."""
    import numpy as np

    k = int(np.searchsorted(starts, at_ns, side="right")) - 1
    row = int(mine[k]) if k >= 0 else -1
    while row >= 0 and not (calls[row] and table.start[row] <= at_ns < table.end[row]):
        row = int(parent[row])
    return row


def gc_note(models: list[tuple[str, GcTime]], layers: list[tuple[str, GcTime]]) -> str:
    """The report's line on the program's collections inside its model calls ("" where none
    ran there): ``models`` and ``layers`` are (name, collections inside its calls) of each
    model and of each layer charged with some (its own)."""
    from mltrace.analysis.units import fmt_ns

    inside = [g for _, g in models]
    if not inside:
        return ""
    total = GcTime(sum(g.count for g in inside), sum(g.ns for g in inside), sum(g.full for g in inside))
    text = f"Garbage collection: the program's own collections took {fmt_ns(total.ns)} inside its model calls ({total.kinds()})"
    if layers:
        name, most = max(layers, key=lambda item: item[1].ns)
        text += f", the most in layer {name} ({fmt_ns(most.ns)})"
    return text + "; each call's time includes them (the self-time tables show how much), the verdicts leave them out"
