"""Two runs compared layer by layer, layer type by type, op by op and kernel by kernel.

Rows are matched by name (layer path, layer type, op name, kernel name). A row
is *added* (only in B), *removed* (only in A), *slower* or *faster* when its
time changed by more than ``threshold`` (relative) and ``min_delta_ns``
(absolute), else *same*.

When both runs have model calls and their numbers differ (3 iterations
against 10), times are compared per model call, so that the number of
iterations does not read as a slowdown; otherwise totals are compared. A
level that ended early in a run (``--max-spans``, ``--op-inferences``) is
compared per model call it recorded in.
Typical uses: batch 1 against batch 8, fp32 against bf16, PyTorch against
ONNX Runtime (then layer names differ and the layer-type and op tables say
more than the layer table). ONNX Runtime's layers are named by the torch
module path their nodes came from, so an fp32 model and its int8 copy
(``quantize_dynamic``, QDQ) pair layer by layer. Where each run has one
model and their names differ (``model.onnx`` against ``model.int8.onnx``),
the two are one row, ``A → B``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mltrace.analysis.bottleneck import Analysis, NameRow, analyze
from mltrace.analysis.memory import MemoryChange, memory_diff
from mltrace.run.levels import HIERARCHY, Level
from mltrace.run.store import Run

ADDED, REMOVED, SLOWER, FASTER, SAME = "added", "removed", "slower", "faster", "same"


@dataclass
class DiffRow:
    """One name in both runs.

    Attributes:
        name: the layer path, type, op or kernel name.
        status: "added", "removed", "slower", "faster" or "same".
        calls_a, calls_b: calls in each run (raw counts, not normalised).
        time_a, time_b: time in each run (ns), per model call or total (see ``RunDiff.basis``).
    """

    name: str
    status: str
    calls_a: int
    calls_b: int
    time_a: float
    time_b: float

    @property
    def delta_ns(self) -> float:
        """B minus A (ns)."""
        return self.time_b - self.time_a


@dataclass
class RunDiff:
    """The comparison of run A and run B.

    Attributes:
        a_name, b_name: the runs' names.
        a_path, b_path: the run directories ("" when not from disk).
        basis: "per model call" or "totals".
        threshold: relative change that counts (0.1 = 10%).
        min_delta_ns: absolute change that counts (ns).
        model_calls: model calls in A and in B.
        totals: (what, A ns, B ns): model time and the time of each level.
        layers: layers (total time), by |Δ|, largest first.
        types: layer types (self time).
        ops: op names (total time).
        kernels: GPU kernel names (total time).
        memory: memory peaks, A against B (``analysis.memory.memory_diff``; empty when
            neither run was recorded with ``--memory``).
    """

    a_name: str
    b_name: str
    basis: str
    threshold: float
    min_delta_ns: int
    model_calls: tuple[int, int]
    a_path: str = ""
    b_path: str = ""
    totals: list[tuple[str, float, float]] = field(default_factory=list)
    layers: list[DiffRow] = field(default_factory=list)
    types: list[DiffRow] = field(default_factory=list)
    ops: list[DiffRow] = field(default_factory=list)
    kernels: list[DiffRow] = field(default_factory=list)
    memory: list[MemoryChange] = field(default_factory=list)

    def row(self, section: str, name: str) -> DiffRow | None:
        """The row named ``name`` in ``section`` ("layers", "types", "ops", "kernels"), or None."""
        return next((r for r in getattr(self, section) if r.name == name), None)


def status_of(calls_a: int, calls_b: int, time_a: float, time_b: float, threshold: float, min_delta_ns: float) -> str:
    """The status of one row from its numbers (see the module docstring)."""
    if calls_a == 0 and calls_b == 0:
        return SAME
    if calls_a == 0:
        return ADDED
    if calls_b == 0:
        return REMOVED
    delta = time_b - time_a
    if abs(delta) < min_delta_ns:
        return SAME
    if time_b > time_a * (1 + threshold):
        return SLOWER
    if time_a > time_b * (1 + threshold):
        return FASTER
    return SAME


def _section(
    a: dict[str, tuple[int, float]], b: dict[str, tuple[int, float]], scale_a: float, scale_b: float, threshold: float, min_delta_ns: int
) -> list[DiffRow]:
    rows = []
    for name in a.keys() | b.keys():
        ca, ta = a.get(name, (0, 0))
        cb, tb = b.get(name, (0, 0))
        time_a, time_b = ta * scale_a, tb * scale_b
        rows.append(DiffRow(name, status_of(ca, cb, time_a, time_b, threshold, min_delta_ns), ca, cb, time_a, time_b))
    rows.sort(key=lambda r: (-abs(r.delta_ns), r.name))
    return rows


def _names(rows: list[NameRow]) -> dict[str, tuple[int, float]]:
    return {r.name: (r.calls, r.total_ns) for r in rows}


def diff_analyses(
    a: Analysis,
    b: Analysis,
    a_name: str = "A",
    b_name: str = "B",
    threshold: float = 0.10,
    min_delta_ns: int = 1_000,
    per_call: bool | None = None,
) -> RunDiff:
    """Compares two analyses (see ``diff_runs``)."""
    ba, bb = a.breakdown, b.breakdown
    ma, mb = ba.model_calls, bb.model_calls
    if per_call is None:  # per call also where a level recorded fewer calls in one run (it ended early)
        per_call = ma > 0 and mb > 0 and any(ba.calls_for(lv) != bb.calls_for(lv) for lv in (Level.MODEL, Level.LAYER, Level.OP))
    if per_call and (ma == 0 or mb == 0):
        per_call = False

    def scales(level: Level) -> tuple[float, float]:
        """What one run's times of ``level`` are multiplied by: 1 / the model calls it recorded in."""
        if not per_call:
            return 1.0, 1.0
        ca, cb = ba.calls_for(level), bb.calls_for(level)
        return (1.0 / ca if ca else 1.0), (1.0 / cb if cb else 1.0)

    out = RunDiff(a_name, b_name, "per model call" if per_call else "totals", threshold, min_delta_ns, (ma, mb))
    sa, sb = scales(Level.MODEL)
    out.totals.append(("model time", ba.model_ns * sa, bb.model_ns * sb))
    la = {lt.level: lt.time_ns for lt in ba.levels}
    lb = {lt.level: lt.time_ns for lt in bb.levels}
    for lv in (*HIERARCHY, Level.USER):
        if lv in la or lv in lb:
            sa, sb = scales(lv)
            out.totals.append((f"{lv.label} level", la.get(lv, 0) * sa, lb.get(lv, 0) * sb))
    # Model rows are in the layer table too: each row takes its own level's scale.
    layer_a = {r.stat.name: (r.stat.calls, r.stat.total_ns * scales(r.stat.level)[0]) for r in a.layers}
    layer_b = {r.stat.name: (r.stat.calls, r.stat.total_ns * scales(r.stat.level)[1]) for r in b.layers}
    _pair_single_models(a, b, layer_a, layer_b)
    out.layers = _section(layer_a, layer_b, 1.0, 1.0, threshold, min_delta_ns)
    sa, sb = scales(Level.LAYER)
    out.types = _section(
        {t.type: (t.calls, t.self_ns) for t in a.types},
        {t.type: (t.calls, t.self_ns) for t in b.types},
        sa,
        sb,
        threshold,
        min_delta_ns,
    )
    sa, sb = scales(Level.OP)
    out.ops = _section(_names(a.ops), _names(b.ops), sa, sb, threshold, min_delta_ns)
    out.kernels = _section(_names(a.kernels), _names(b.kernels), sa, sb, threshold, min_delta_ns)
    out.memory = memory_diff(a.memory, b.memory)
    return out


def _pair_single_models(a: Analysis, b: Analysis, layer_a: dict[str, tuple[int, float]], layer_b: dict[str, tuple[int, float]]) -> None:
    """Renames the model rows to ``"A → B"`` in both tables where each run has one model
    and the names differ (an fp32 model file against its int8 copy)."""
    models_a = [r.stat.name for r in a.layers if r.stat.level is Level.MODEL]
    models_b = [r.stat.name for r in b.layers if r.stat.level is Level.MODEL]
    if len(models_a) != 1 or len(models_b) != 1 or models_a[0] == models_b[0]:
        return
    (na,), (nb,) = models_a, models_b
    if nb in layer_a or na in layer_b:  # the name is a layer of the other run: keep rows apart
        return
    both = f"{na} → {nb}"
    layer_a[both] = layer_a.pop(na)
    layer_b[both] = layer_b.pop(nb)


def diff_runs(a: Run, b: Run, threshold: float = 0.10, min_delta_ns: int = 1_000, per_call: bool | None = None) -> RunDiff:
    """Compares run B against run A.

    Args:
        a: the reference run.
        b: the run compared with it.
        threshold: relative change that counts as slower/faster (0.1 = 10%).
        min_delta_ns: absolute change below which a row is "same" (ns).
        per_call: compare per model call (True), totals (False), or decide
            (None: per call when both runs have model calls in different numbers).

    Returns:
        The comparison; rows sorted by the size of their change.
    """
    d = diff_analyses(
        analyze(a),
        analyze(b),
        str(a.meta.get("name") or a.path.name),
        str(b.meta.get("name") or b.path.name),
        threshold,
        min_delta_ns,
        per_call,
    )
    d.a_path, d.b_path = str(a.path), str(b.path)
    return d
