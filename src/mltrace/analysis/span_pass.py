"""The pass over a run's span table that gathers the report's numbers.

Everything here works on columns (``run.table``), one numpy operation per
level of nesting rather than one Python step per span, so a report over a
million spans costs well under a second here. Python loops remain only over
what is small: distinct names, distinct attribute sets, GPU kernels and API
calls (whose names live in attributes), and a sample of op calls per op name
(and per layer row and op name, for the bytes of a layer's own ops) for bytes
estimates.

Definitions (docs/ANALYSIS.md; ``analysis.breakdown`` is the plain reference
implementation of the shared ones):

- *owner* of a span: its nearest strict ancestor at the model or layer level.
- *top-level op*: an op with no op among its ancestors.
- a span's *self time* (op, library call, API call): its duration minus its
  direct children's on the same track at the op, library or kernel level.
- a layer call's *self time*: its duration minus its direct children at the
  model, layer or user level.
- *compile time*: torch.compile's compile-time ranges (``run/ranges.py``), torch's wrappers
  around them and everything inside: counted apart (``Gathered.compile_ops``), not in the name
  tables, FLOPs, ops per call or data movement, which describe the work the model runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mltrace.analysis.breakdown import OpEnds, op_ends, window_end
from mltrace.analysis.roofline import (
    CHILDREN,
    EXPLICIT,
    IO,
    NO_DATA_OPS,
    OP_BYTES_RULES,
    OPS,
    explicit_work,
    io_bytes,
    layer_formula_work,
    op_bytes,
    reads_sparse,
)
from mltrace.analysis.tree import pair_sums, tree_of
from mltrace.run.events import TrackKind
from mltrace.run.levels import Level
from mltrace.run.ranges import DATALOADER, is_compile_range, torch_range_kind, wraps_compile_range

if TYPE_CHECKING:
    from mltrace.run.store import Run
    from mltrace.run.table import SpanTable

MODEL, LAYER, OP, LIB, KERNEL, USER = (int(x) for x in (Level.MODEL, Level.LAYER, Level.OP, Level.LIBRARY, Level.KERNEL, Level.USER))
_FLOPS_BIT = 1 << 20  # in an ancestor mask: an enclosing op already carries ml.flops
_BYTES_BIT = 1 << 21  # in an ancestor mask: an enclosing op moves data (its bytes count its contents')
BYTES_SAMPLES = 256  # op calls per name whose bytes are estimated (the rest are scaled)
OWN_BYTES_SAMPLES = 32  # op calls per layer row and op name whose bytes give a layer's own ops' (``_own_op_bytes``)

_GPU_COPY_ACTIVITIES = frozenset({"gpu_memcpy", "gpu_memset"})

#: TensorFlow's variable reads (``formats.xspace.VARIABLE_READ_OPS``, not imported: reading the
#: span table needs no profile reader).
VARIABLE_READ_OPS = frozenset({"ReadVariableOp"})

#: Ops that only move or re-lay data (PyTorch, ONNX Runtime, TensorFlow names).
DATA_MOVEMENT_OPS = frozenset(
    {
        "aten::copy_",
        "aten::to",
        "aten::_to_copy",
        "aten::contiguous",
        "aten::clone",
        "aten::cat",
        "aten::stack",
        "aten::constant_pad_nd",
        "aten::pad",
        "aten::repeat",
        "aten::index_select",
        "aten::gather",
        "aten::narrow_copy",
        "aten::_copy_from",
        "aten::_copy_from_and_resize",
        "Transpose",
        "Concat",
        "Cast",
        "Pad",
        "Gather",
        "Tile",
        "MemcpyToHost",
        "MemcpyFromHost",
        "ConcatV2",
        "Pack",
        "TensorListStack",
    }
)


@dataclass
class NameAcc:
    """One op, library call, API call or kernel name, summed over the run."""

    calls: int = 0
    total_ns: int = 0
    self_ns: int = 0
    flops: float = 0.0
    device_ns: int = 0
    kernels: int = 0
    bytes: float = 0.0
    detail: str = ""


@dataclass
class RowAcc:
    """One layer or model (by name and level), summed over its calls.

    ``first`` is the row of the call whose attributes describe the layer (type, dtype): the
    deepest, then the last-ending one; ``site`` is the row of a call from the layer's most
    frequent call site (``code.*``), ``first`` where that is its site too.
    """

    name: str
    level: Level
    first: int
    site: int = -1
    type: str = ""
    calls: int = 0
    total_ns: int = 0
    self_ns: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    work_source: str = ""
    op_ns: int = 0
    op_count: int = 0
    framework_ns: int = 0
    op_calls: int = 0  # calls made while the op level recorded (all of them unless it ended early)
    op_calls_ns: int = 0  # their summed durations
    layer_calls: int = 0  # calls made while the layer level recorded (all of them unless it ended early)
    layer_calls_ns: int = 0  # their summed durations
    kernel_ns: int = 0
    kernel_count: int = 0
    # The calls whose work is known in full, which the verdict is over (all of them unless the
    # op level ended early): calls with ops, calls whose work comes from a formula or explicit
    # attributes, calls of a row without ops of its own whose children's work is all known, and
    # calls like one with ops (``_LikeCalls``); where the row ran kernels, calls with ops only.
    # Their count, time, FLOPs and bytes.
    known_calls: int = 0
    known_ns: int = 0
    known_flops: float = 0.0
    known_bytes: float = 0.0
    has_child_layers: bool = False
    direct_ops: dict[str, list[int]] = field(default_factory=dict)
    libraries: dict[str, list[int]] = field(default_factory=dict)
    kernels: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class TypeAcc:
    """All layer-level calls of one layer type, each with what it does itself: its self time,
    the work of its own ops (its work less its child layers'), its own ops and kernels, so that a
    container (``Sequential``, an exported module holding its nodes) counts none of its
    children's and the columns sum over types without counting any work twice. ``total_ns`` is
    the duration of its calls that are in no other call of its type."""

    calls: int = 0
    total_ns: int = 0
    self_ns: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    known_calls: int = 0  # as ``RowAcc``'s, each call on its row's basis; their self time and own work
    known_ns: int = 0
    known_flops: float = 0.0
    known_bytes: float = 0.0
    op_ns: int = 0  # its calls' own top-level ops: time and number
    op_count: int = 0
    kernel_ns: int = 0  # GPU kernels its own ops launched: time and number
    kernel_count: int = 0


def child_roles(meta: dict[str, Any], pids: set[int]) -> list[str]:
    """The roles of the child processes ``pids`` (run.json ``processes``: ``rank 1``,
    ``DataLoader worker 0``; ``pid N`` where it names none), in the order it lists them."""
    named = {p.get("pid"): p.get("role") for p in meta.get("processes") or [] if isinstance(p, dict)}
    order = [pid for pid in named if pid in pids] + sorted(pid for pid in pids if pid not in named)
    return [str(named.get(pid) or f"pid {pid}") for pid in order]


@dataclass
class Gathered:
    """What the pass found; ``bottleneck.analyze`` turns it into an ``Analysis``."""

    table: SpanTable  # the table the numbers come from
    span_count: int = 0
    counts: dict[int, int] = field(default_factory=dict)
    level_ns: dict[int, int] = field(default_factory=dict)
    scoped_level_ns: dict[int, int] = field(default_factory=dict)  # level time in scope (see ``scoped``)
    ops: dict[str, NameAcc] = field(default_factory=dict)
    libs: dict[str, NameAcc] = field(default_factory=dict)
    kernels: dict[str, NameAcc] = field(default_factory=dict)
    runtime: dict[str, NameAcc] = field(default_factory=dict)
    rows: list[RowAcc] = field(default_factory=list)
    types: dict[str, TypeAcc] = field(default_factory=dict)
    model_intervals: list[tuple[int, int, str]] = field(default_factory=list)
    gpu_busy: dict[int, list[tuple[int, int, str]]] = field(default_factory=dict)
    moves: dict[str, list[int]] = field(default_factory=dict)
    top_op_ns: int = 0
    wall_ns: int = 0
    ops_outside_layers: int = 0
    ops_outside_layers_ns: int = 0
    reads_outside_layers: int = 0  # variable reads in no layer that name theirs (``ml.tf.layer``)
    reads_outside_layers_ns: int = 0
    layer_ops_outside_layers: int = 0  # other ops in no layer that name theirs (``ml.tf.layer``)
    layer_ops_outside_layers_ns: int = 0
    ops_outside_models: int = 0
    # When the run has model, layer or user spans, the name tables (ops, library calls, API
    # calls, kernels) and data movement count only what ran inside one; what ran outside
    # (model construction, weight init, the program's own tensor code) is only counted here.
    scoped: bool = False
    unscoped_ops: int = 0
    unscoped_ops_ns: int = 0  # outermost ops only
    unscoped_ops_elsewhere: int = 0  # of them, in processes other than the program's (workers)
    unscoped_ops_roles: list[str] = field(default_factory=list)  # those processes' roles (``child_roles``)
    unscoped_ops_loading: int = 0  # of them, inside the DataLoader's batches (collate)
    unscoped_ops_compile: int = 0  # of them, torch.compile's compile time (see below)
    # torch.compile's compile time inside model calls and user spans (``_compile_time``): its
    # ops, left out of the name tables, FLOPs, ops per call and data movement, and the time
    # of the outermost compile-time spans.
    compile_ops: int = 0
    compile_ns: int = 0
    # torch's own record_function ranges (``run/ranges.py``): user spans that are not the
    # program's regions. Each kind's (count, time outside another of torch's ranges), and the
    # DataLoader's batches as intervals (for the idle time between model calls).
    torch_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    loading_intervals: list[tuple[int, int]] = field(default_factory=list)
    # The outermost ops outside every model call and user span in the program's own process
    # (starts, ends): its own tensor code between model calls (for the idle time).
    outside_op_intervals: tuple[np.ndarray, np.ndarray] | None = None
    # Where the op level ended before the run did (run.json "op_window"): the session clock
    # time each framework's ended; layer and model calls that ended after their framework's
    # end have no ops and are left out of framework overhead and of the ops-per-call rule.
    op_ends: OpEnds = field(default_factory=OpEnds)
    # The same for the layer level (run.json "layer_window"): model calls that ended after it
    # have no layer spans, and layer shares are of the calls before it.
    layer_end_ns: int | None = None


def _ops_recorded_per_call(ends: OpEnds, t: SpanTable, call_rows: np.ndarray, cowner: np.ndarray, cdepth: np.ndarray) -> np.ndarray:
    """Whether the op level of each call's framework recorded it: the call ended before that
    level's end (``OpEnds``) and overlaps none of its pauses (``OpEnds.gaps``). The outermost
    calls' own ``ml.framework`` decides, inherited by the calls inside them."""
    never = np.iinfo(np.int64).max
    outer = np.nonzero(cowner < 0)[0]
    if ends.by_framework:
        op_end = np.full(len(call_rows), never, dtype=np.int64)
        for c in outer.tolist():
            end = ends.of(t.attrs(int(call_rows[c])).get("ml.framework"))
            if end is not None:
                op_end[c] = end
    else:
        op_end = np.full(len(call_rows), never if ends.default is None else ends.default, dtype=np.int64)
    recorded = t.end[call_rows] <= op_end
    for framework, gaps in ends.gaps.items():
        mine = outer[[t.attrs(int(call_rows[c])).get("ml.framework") == framework for c in outer.tolist()]]
        recorded[mine] &= ~_overlaps(gaps, t.start[call_rows[mine]], t.end[call_rows[mine]])
    for d in range(2, int(cdepth.max()) + 1 if len(cdepth) else 0):
        inner = np.nonzero((cdepth == d) & (cowner >= 0))[0]
        recorded[inner] = recorded[cowner[inner]]
    return recorded


def _overlaps(gaps: list[tuple[int, int]], start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Whether each interval (``start``, ``end``) overlaps one of ``gaps`` (sorted, disjoint)."""
    begins = np.fromiter((g[0] for g in gaps), dtype=np.int64, count=len(gaps))
    gap_ends = np.fromiter((g[1] for g in gaps), dtype=np.int64, count=len(gaps))
    last = np.searchsorted(begins, end, side="left") - 1  # the last gap that begins before the call ends
    return (last >= 0) & (gap_ends[np.maximum(last, 0)] > start)


# -- structure ---------------------------------------------------------------------


def _ops_above(rows: np.ndarray, parent: np.ndarray, is_op: np.ndarray, name: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, op name) for every op ancestor of each of ``rows``, each name once per row."""
    import numpy as np

    got_rows, got_names = [], []
    cur = parent[rows]
    while len(rows):
        live = cur >= 0
        rows, cur = rows[live], cur[live]
        op = is_op[cur]
        got_rows.append(rows[op])
        got_names.append(name[cur[op]])
        cur = parent[cur]
    if not got_rows:
        return rows, rows
    pairs = np.unique(np.stack([np.concatenate(got_rows), np.concatenate(got_names).astype(np.int64)]), axis=1)
    return pairs[0], pairs[1]


# -- the pass --------------------------------------------------------------------------


def _torch_ranges(
    g: Gathered, is_user: np.ndarray, name: np.ndarray, names: list[str], start: np.ndarray, end: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The user spans that are torch's own ranges (``run/ranges.py``), and of them the
    DataLoader's batches; fills ``g.torch_ranges`` (each kind's count and time, nested ranges
    of a kind counted once) and ``g.loading_intervals``."""
    kinds = {i: kind for i, n in enumerate(names) if (kind := torch_range_kind(n)) is not None}
    none = np.zeros(len(name), dtype=bool)
    if not kinds:
        return none, none
    kind_of = np.full(len(names), -1, dtype=np.int64)
    labels = sorted(set(kinds.values()))
    for i, kind in kinds.items():
        kind_of[i] = labels.index(kind)
    row_kind = np.where(is_user, kind_of[name.astype(np.int64)], -1)
    for k, kind in enumerate(labels):
        rows = np.nonzero(row_kind == k)[0]
        if len(rows):
            g.torch_ranges[kind] = (len(rows), union_ns(start[rows], end[rows]))
    loading = row_kind == (labels.index(DATALOADER) if DATALOADER in labels else -2)
    g.loading_intervals = list(zip(start[loading].tolist(), end[loading].tolist(), strict=True))
    return row_kind >= 0, loading


def _compile_time(parent: np.ndarray, tree: Any, lv: np.ndarray, name: np.ndarray, names: list[str]) -> np.ndarray:
    """The rows of torch.compile's compile time: its compile-time ranges (``is_compile_range``)
    at the op or user level, the ranges torch opens around the outermost of them
    (``wraps_compile_range``), and every span inside those."""
    marked = np.fromiter((is_compile_range(nm) for nm in names), dtype=bool, count=len(names))
    ranged = (lv == OP) | (lv == USER)
    is_range = ranged & marked[name]
    if not is_range.any():
        return is_range
    outer = is_range & ~tree.ancestor_or(is_range)
    for row in np.nonzero(outer)[0].tolist():
        inner = names[int(name[row])]
        up = int(parent[row])
        while up >= 0 and ranged[up] and wraps_compile_range(names[int(name[up])], inner):
            is_range[up] = True
            up = int(parent[up])
    return is_range | tree.ancestor_or(is_range)


def _over_sparse(is_op: np.ndarray, parent: np.ndarray, name: np.ndarray, names: list[str]) -> np.ndarray:
    """The ops with a sparse tensor's op inside them (``reads_sparse``): their inputs' recorded
    shapes are dense, so the FLOPs counted from them (a sparse ``aten::mm`` as a dense product)
    are not their work."""
    marked = np.fromiter((reads_sparse(nm) for nm in names), dtype=bool, count=len(names))
    over = np.zeros(len(is_op), dtype=bool)
    rows = np.nonzero(is_op & marked[name])[0]
    while len(rows):
        up = parent[rows]
        up = up[up >= 0]
        up = np.unique(up[is_op[up] & ~over[up]])
        over[up] = True
        rows = up
    return over


def _no_data_names(names: list[str]) -> np.ndarray:
    """Per name: whether the op moves no data itself (``roofline.NO_DATA_OPS``: views, metadata,
    dropout)."""
    return np.fromiter((nm in NO_DATA_OPS for nm in names), dtype=bool, count=len(names))


def _sparse_names(names: list[str]) -> np.ndarray:
    """Per name: whether the op runs on a sparse tensor only (``roofline.reads_sparse``)."""
    return np.fromiter((reads_sparse(nm) for nm in names), dtype=bool, count=len(names))


def _op_call_bytes(t: SpanTable, rows: np.ndarray, name: np.ndarray, names: list[str]) -> np.ndarray:
    """Bytes each op call in ``rows`` moves (``roofline.op_bytes``, or its name's rule in
    ``OP_BYTES_RULES``), worked out once per distinct name and attribute set."""
    if not len(rows):
        return np.zeros(0)
    nset = max(t.attr_set_count, 1)
    keys = name[rows] * nset + t.attr[rows].astype(np.int64)
    distinct, which = np.unique(keys, return_inverse=True)
    per_key = np.fromiter(
        (OP_BYTES_RULES.get(names[k // nset], op_bytes)(t.attr_set(k % nset)) for k in distinct.tolist()),
        dtype=np.float64,
        count=len(distinct),
    )
    return per_key[which]


def _own_op_bytes(
    t: SpanTable, rows: np.ndarray, call: np.ndarray, row_of_call: np.ndarray, name: np.ndarray, names: list[str], ncall: int
) -> np.ndarray:
    """Bytes the op calls ``rows`` move, summed per layer call (``call``: the call each is
    in; ``row_of_call``: each call's report row). Each op call counts the mean over the last
    ``OWN_BYTES_SAMPLES`` calls of its op name in its layer row (all of them where there are
    no more), so the Python work is bounded by rows × op names, not by op calls (an imported
    trace gives every op call attributes of its own)."""
    if not len(rows):
        return np.zeros(ncall)
    distinct, which = np.unique(row_of_call[call] * len(names) + name[rows], return_inverse=True)
    sample = _first_n_by_key(np.arange(len(rows)), which, OWN_BYTES_SAMPLES)
    sums = np.bincount(which[sample], weights=_op_call_bytes(t, rows[sample], name, names), minlength=len(distinct))
    mean = sums / np.bincount(which[sample], minlength=len(distinct))  # every key has a sample
    return np.bincount(call, weights=mean[which], minlength=ncall)


def union_ns(start: np.ndarray, end: np.ndarray) -> int:
    """Length of the union of the intervals [start, end) (ns)."""
    if not len(start):
        return 0
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    first = np.ones(len(s), dtype=bool)  # where a run of overlapping intervals begins
    first[1:] = s[1:] > np.maximum.accumulate(e)[:-1]
    begins = np.nonzero(first)[0]
    return int((np.maximum.reduceat(e, begins) - s[begins]).sum())


def _sum_by(keys: np.ndarray, values: np.ndarray, size: int) -> np.ndarray:
    """Integer sums of ``values`` grouped by ``keys`` in 0..size-1."""
    if not len(keys):
        return np.zeros(size, dtype=np.int64)
    return np.rint(np.bincount(keys, weights=values, minlength=size)).astype(np.int64)


def _count_by(keys: np.ndarray, size: int) -> np.ndarray:
    return np.bincount(keys, minlength=size).astype(np.int64) if len(keys) else np.zeros(size, dtype=np.int64)


def _pair_table(left: np.ndarray, right: np.ndarray, dur: np.ndarray, right_names: list[str]) -> dict[int, dict[str, list[int]]]:
    """``pair_sums`` with the right-hand keys named."""
    return {k: {right_names[r]: v for r, v in row.items()} for k, row in pair_sums(left, right, dur).items()}


def gather(run: Run) -> Gathered:  # noqa: C901 - one pass, in stages
    """Gathers every number of the report from ``run``'s span table."""
    t = run.table
    g = Gathered(table=t, span_count=len(t))
    n = len(t)
    if n == 0:
        return g
    names = t.names
    lv = t.level.astype(np.int64)
    start, end = t.start, t.end
    dur = np.maximum(end - start, 0)
    durf = dur.astype(np.float64)
    tree = tree_of(t)
    parent = tree.parent
    has_parent = parent >= 0
    p0 = np.where(has_parent, parent, 0)  # parent row, 0 for roots (mask with has_parent)
    plv = np.where(has_parent, lv[p0], 0)

    gpu_tracks = {tid: max(tr.device, 0) for tid, tr in run.tracks.items() if tr.kind == TrackKind.GPU_STREAM}
    on_gpu = np.isin(t.track, np.fromiter(gpu_tracks, dtype=np.int64, count=len(gpu_tracks)))
    is_op = lv == OP
    is_lib = lv == LIB
    is_struct = (lv == MODEL) | (lv == LAYER)
    is_gpu_kernel = (lv == KERNEL) & on_gpu
    is_runtime = (lv == KERNEL) & ~on_gpu
    over_sparse = _over_sparse(is_op, parent, t.name.astype(np.int64), names)
    flops_set = is_op & t.has_flops & ~over_sparse
    moves_data = is_op & ~_no_data_names(names)[t.name.astype(np.int64)]
    torch_range, loading_range = _torch_ranges(g, lv == USER, t.name, names, start, end)
    is_user = (lv == USER) & ~torch_range
    compile_time = _compile_time(parent, tree, lv, t.name.astype(np.int64), names)

    # What each span inherits from its ancestors.
    # torch's ranges pass no level on: a span of the program's inside one is still counted
    bits = np.where(torch_range, 0, np.int64(1) << lv) | np.where(flops_set, _FLOPS_BIT, 0) | np.where(moves_data, _BYTES_BIT, 0)
    mask = tree.ancestor_or(bits)
    owner = tree.nearest(is_struct)
    top_above = tree.nearest(is_op & ~((mask & (1 << OP)) != 0))  # the outermost op above, if any
    # In scope of the name tables: inside a model, layer or user span (everything, in a run
    # with none, such as an imported profiler trace).
    scope = is_struct | is_user
    g.scoped = bool(scope.any())
    in_scope = (tree.nearest(scope) >= 0) | scope | tree.detached if g.scoped else np.ones(n, dtype=bool)
    # The name tables, FLOPs and data movement count what ran in scope and was not compiling.
    tabled = in_scope & ~compile_time

    # -- levels ------------------------------------------------------------------------
    own_level_free = (mask & (np.int64(1) << lv)) == 0
    counted = ~torch_range  # torch's ranges are counted apart (g.torch_ranges), not as the program's spans
    present = np.unique(lv[counted])
    counts = _count_by(lv[counted], 16)
    level_ns = _sum_by(lv[own_level_free & counted], durf[own_level_free & counted], 16)
    g.counts = {int(x): int(counts[x]) for x in present}
    g.level_ns = {int(x): int(level_ns[x]) for x in present}
    free_in_scope = own_level_free & in_scope & counted
    scoped_ns = _sum_by(lv[free_in_scope], durf[free_in_scope], 16)
    g.scoped_level_ns = {int(x): int(scoped_ns[x]) for x in present}
    g.wall_ns = int(end.max() - start.min())

    # -- name accumulators ---------------------------------------------------------------
    nn = len(names)
    name = t.name.astype(np.int64)
    # Runtime (API) calls and GPU kernels are named by attributes: intern those names.
    rt_rows = np.nonzero(is_runtime & tabled)[0]
    rt_names: list[str] = []
    rt_key = np.full(n, -1, dtype=np.int64)
    if len(rt_rows):
        idx: dict[str, int] = {}
        keys = []
        for r in rt_rows.tolist():
            a = t.attrs(r)
            api = str(a.get("cuda.api.name") or names[int(name[r])])
            keys.append(idx.setdefault(api, len(idx)))
        rt_key[rt_rows] = keys
        rt_names = list(idx)

    # Self time: each op / library / API call loses its same-track children at those levels.
    acc_parent = has_parent & ((plv == OP) | (plv == LIB) | ((plv == KERNEL) & ~on_gpu[p0]))
    sub = acc_parent & ((lv == OP) | (lv == LIB) | (lv == KERNEL)) & (t.track == t.track[p0])
    sub_rows = np.nonzero(sub)[0]
    sub_parent = parent[sub_rows]

    def in_itself(kind: np.ndarray, key_of: np.ndarray) -> np.ndarray:
        """Rows of ``kind`` whose same-track parent is of ``kind`` and has their key: a call that
        dispatches to itself (``aten::linear`` under autocast), which is part of the outer call."""
        return kind & has_parent & kind[p0] & (key_of == key_of[p0]) & (t.track == t.track[p0])

    def table(rows: np.ndarray, key_of: np.ndarray, key_names: list[str], kind: np.ndarray) -> dict[str, NameAcc]:
        """Calls, total and self time of ``rows`` (all of one kind), by ``key_of[row]``. A row
        whose same-track parent is of its kind and key (an op that dispatches to itself, as
        ``aten::linear`` does under autocast) is part of its parent's call: neither a call nor
        time of its own, and what runs inside it is subtracted from the outer call's self time."""
        size = len(key_names)
        inner = in_itself(kind, key_of)
        outer_rows = rows[~inner[rows]]
        keys = key_of[outer_rows]
        calls = _count_by(keys, size)
        total = _sum_by(keys, durf[outer_rows], size)
        sub_here = kind[sub_parent] & ~inner[sub_rows]
        self_ns = total - _sum_by(key_of[sub_parent[sub_here]], durf[sub_rows[sub_here]], size)
        return {key_names[k]: NameAcc(int(calls[k]), int(total[k]), int(self_ns[k])) for k in np.nonzero(calls)[0].tolist()}

    all_op_rows = np.nonzero(is_op)[0]
    op_rows = np.nonzero(is_op & tabled)[0]
    lib_rows = np.nonzero(is_lib & tabled)[0]
    op_in_itself = in_itself(is_op, name)  # counted with the outer call, in FLOPs and bytes too
    g.ops = table(op_rows, name, names, is_op & tabled)  # ops and library calls are keyed by span name
    g.libs = table(lib_rows, name, names, is_lib & tabled)
    if len(rt_rows):
        g.runtime = table(rt_rows, rt_key, rt_names, is_runtime & tabled)
    for row in _first_by_key(lib_rows, name[lib_rows]).tolist():
        lib = t.attrs(row).get("ml.library.name")
        g.libs[names[int(name[row])]].detail = str(lib) if lib else ""

    # FLOPs of an op name: every call's own count, since its row is judged by its total time
    # (aten::conv2d and the aten::mkldnn_convolution inside it both carry the convolution's).
    own = np.nonzero(flops_set & tabled & ~op_in_itself & ~np.isnan(t.flops))[0]
    if len(own):
        fl = np.bincount(name[own], weights=t.flops[own], minlength=nn)
        for k in np.unique(name[own]).tolist():
            g.ops[names[k]].flops = float(fl[k])
    # FLOPs summed over a layer: ops with ml.flops and no enclosing op that has it already
    # (not compiling: the ops a compile traces on fake tensors compute nothing).
    counted = flops_set & ~compile_time & ((mask & _FLOPS_BIT) == 0) & ~np.isnan(t.flops)
    cf_rows = np.nonzero(counted)[0]
    # Bytes summed over a layer's own ops: the outermost ops that move data, each call's own
    # (not inside another such op, whose bytes count its contents'; not over a sparse tensor,
    # whose recorded shapes are dense; not compiling). Inside a view or dropout, the ops that
    # do its work count.
    own_moves = moves_data & ~over_sparse & ~_sparse_names(names)[name] & ~compile_time & ((mask & _BYTES_BIT) == 0) & (owner >= 0)
    cb_rows = np.nonzero(own_moves)[0]

    # Bytes of ops: estimated from the last BYTES_SAMPLES calls of each name, scaled.
    outer_op_rows = op_rows[~op_in_itself[op_rows]]
    sample = _first_n_by_key(outer_op_rows, name[outer_op_rows], BYTES_SAMPLES)
    sampled: dict[int, list[int]] = {}
    for row in sample.tolist():
        k = int(name[row])
        sampled.setdefault(k, []).append(OP_BYTES_RULES.get(names[k], op_bytes)(t.attrs(row)))
    for k, got in sampled.items():
        acc = g.ops[names[k]]
        acc.bytes = 0.0 if names[k] in NO_DATA_OPS else sum(got) * (acc.calls / len(got))

    top_level_op = is_op & ((mask & (1 << OP)) == 0)
    g.top_op_ns = int(dur[top_level_op & tabled].sum())
    g.compile_ops = int((is_op & in_scope & compile_time).sum())
    outer_compile = compile_time & ~tree.ancestor_or(compile_time)
    g.compile_ns = int(dur[outer_compile & in_scope].sum())
    g.unscoped_ops = int((is_op & ~in_scope).sum())
    g.unscoped_ops_compile = int((is_op & ~in_scope & compile_time).sum())
    g.unscoped_ops_ns = int(dur[top_level_op & ~in_scope].sum())
    main_pid = run.meta.get("pid")
    other = [tid for tid, tr in run.tracks.items() if main_pid is not None and tr.pid not in (None, main_pid)]
    if other:
        elsewhere = is_op & ~in_scope & np.isin(t.track, np.asarray(other, dtype=np.int64))
        g.unscoped_ops_elsewhere = int(elsewhere.sum())
        pids = {run.tracks[int(k)].pid for k in np.unique(t.track[elsewhere]).tolist()}
        g.unscoped_ops_roles = child_roles(run.meta, pids)
    if loading_range.any():
        g.unscoped_ops_loading = int((is_op & ~in_scope & (tree.nearest(loading_range) >= 0)).sum())
    outside = top_level_op & ~in_scope
    if other:
        outside &= ~np.isin(t.track, np.asarray(other, dtype=np.int64))
    g.outside_op_intervals = (start[outside], end[outside])

    # Data movement: top-level movement ops, and nested ones not inside another movement op.
    moving = np.zeros(nn, dtype=bool)
    for i, nm in enumerate(names):
        if nm in DATA_MOVEMENT_OPS:
            moving[i] = True
    move_rows = np.nonzero(is_op & tabled & moving[name])[0]
    if len(move_rows):
        nested = ~top_level_op[move_rows]
        inside = np.zeros(len(move_rows), dtype=bool)
        cur = np.where(nested, parent[move_rows], -1)
        while True:
            walking = cur >= 0
            walking[walking] &= lv[cur[walking]] == OP
            if not walking.any():
                break
            inside |= walking & moving[name[np.where(walking, cur, 0)]]
            cur = np.where(walking & ~inside, parent[np.where(walking, cur, 0)], -1)
        keep = move_rows[~inside]
        for op_name, (calls, ns) in _pair_table(np.zeros(len(keep), dtype=np.int64), name[keep], durf[keep], names).get(0, {}).items():
            g.moves[op_name] = [calls, ns]

    # -- GPU kernels -------------------------------------------------------------------------
    gk_all = np.nonzero(is_gpu_kernel)[0]
    # A kernel with no known launch (no parent) stays in the tables of a scoped run.
    gk_rows = gk_all[tabled[gk_all] | ~has_parent[gk_all]]
    k_names: list[str] = []
    k_key = np.full(n, -1, dtype=np.int64)
    if len(gk_all):
        kidx: dict[str, int] = {}
        details: dict[str, str] = {}
        keys = []
        tabled = np.zeros(n, dtype=bool)
        tabled[gk_rows] = True
        for r in gk_all.tolist():
            a = t.attrs(r)
            kname = str(a.get("gpu.kernel.name") or names[int(name[r])])
            g.gpu_busy.setdefault(gpu_tracks[int(t.track[r])], []).append((int(start[r]), int(end[r]), kname))
            if not tabled[r]:
                continue
            k = kidx.get(kname)
            if k is None:
                k = kidx[kname] = len(kidx)
            # Described by its last call in the file, as the other names are.
            details[kname] = str(a.get("ml.library.name") or a.get("gpu.activity") or "")
            keys.append(k)
            activity = a.get("gpu.activity")
            if (isinstance(activity, str) and activity in _GPU_COPY_ACTIVITIES) or kname.startswith(("Memcpy", "Memset")):
                label = kname if len(kname) <= 40 else kname[:39] + "…"
                got = g.moves.setdefault(label, [0, 0])
                got[0] += 1
                got[1] += int(dur[r])
        k_key[gk_rows] = keys
        k_names = list(kidx)
        kc = _count_by(k_key[gk_rows], len(k_names))
        kt = _sum_by(k_key[gk_rows], durf[gk_rows], len(k_names))
        g.kernels = {k_names[k]: NameAcc(int(kc[k]), int(kt[k]), int(kt[k]), detail=details[k_names[k]]) for k in range(len(k_names))}
        # Device time of every op above each kernel (an op name once per kernel): a nested
        # op with FLOPs (aten::addmm under aten::linear) is judged by the kernels it launched.
        krows, tops = _ops_above(gk_rows[top_above[gk_rows] >= 0], parent, lv == OP, name)
        dn = _sum_by(tops, durf[krows], nn)
        dc = _count_by(tops, nn)
        for k in np.unique(tops).tolist():
            top = g.ops.get(names[k])
            if top is None:  # an op outside every model and user span, left out of a scoped table
                continue
            top.device_ns += int(dn[k])
            top.kernels += int(dc[k])

    # -- layer calls ----------------------------------------------------------------------------
    call_rows = np.nonzero(is_struct)[0][::-1]  # last-ending first
    ncall = len(call_rows)
    call_of = np.full(n, -1, dtype=np.int64)
    call_of[call_rows] = np.arange(ncall)
    cowner = np.where(owner[call_rows] >= 0, call_of[np.maximum(owner[call_rows], 0)], -1)
    cdur = dur[call_rows]
    sdepth = np.zeros(n, dtype=np.int64)  # model/layer ancestors-or-self
    for rows in tree.by_depth:
        p = parent[rows]
        sdepth[rows] = np.where(p >= 0, sdepth[np.maximum(p, 0)], 0) + is_struct[rows]
    cdepth = sdepth[call_rows]
    for r in np.nonzero(lv == MODEL)[0].tolist():
        g.model_intervals.append((int(start[r]), int(end[r]), names[int(name[r])]))

    # Rows of the report: one per (name, level).
    rkey_raw = name[call_rows] * 16 + lv[call_rows]
    rkeys, crow = np.unique(rkey_raw, return_inverse=True)
    nrow = len(rkeys)

    # Per-call sums of the call's own contents (before subtree sums).
    def per_call(rows: np.ndarray, values: np.ndarray | None = None) -> np.ndarray:
        c = call_of[owner[rows]]
        return _count_by(c, ncall) if values is None else _sum_by(c, values, ncall)

    # A call's children and direct ops: torch's ranges in between are seen through (the ops
    # torch.compile's region holds are its model's), and are no children themselves.
    above = tree.nearest(~torch_range) if torch_range.any() else parent
    in_call = (above >= 0) & np.isin(lv[np.maximum(above, 0)], (MODEL, LAYER))
    child = np.nonzero(in_call & (is_struct | is_user))[0]
    child_ns = _sum_by(call_of[above[child]], durf[child], ncall)
    direct = np.nonzero(is_op & in_call)[0]
    direct_op_ns = _sum_by(call_of[above[direct]], durf[direct], ncall)  # compile time is not framework overhead
    direct = direct[~compile_time[direct]]  # the layer's top ops: the work it runs
    tl = np.nonzero(top_level_op & ~compile_time & (owner >= 0))[0]
    op_ns = per_call(tl, durf[tl])
    op_count = per_call(tl)
    cfo = cf_rows[owner[cf_rows] >= 0]
    own_op_flops = np.bincount(call_of[owner[cfo]], weights=t.flops[cfo], minlength=ncall) if len(cfo) else np.zeros(ncall)
    has_op_flops = _count_by(call_of[owner[cfo]], ncall) > 0
    gko = gk_rows[owner[gk_rows] >= 0]
    kern_ns = per_call(gko, durf[gko])
    kern_count = per_call(gko)

    # Each call's own ops and kernels (not its child layers'), for the layer type table.
    own_op_ns, own_op_count, own_kern_ns, own_kern_count = op_ns.copy(), op_count.copy(), kern_ns.copy(), kern_count.copy()
    # Subtree sums, deepest calls first.
    has_children = np.zeros(ncall, dtype=bool)
    levels_desc = [np.nonzero(cdepth == d)[0] for d in range(int(cdepth.max()) if ncall else 0, 0, -1)]
    for cs in levels_desc:
        up = cowner[cs]
        m = up >= 0
        cs, up = cs[m], up[m]
        if not len(cs):
            continue
        has_children[up] = True
        for arr in (op_ns, op_count, kern_ns, kern_count):
            np.add.at(arr, up, arr[cs])
        np.logical_or.at(has_op_flops, up, has_op_flops[cs])

    # Work (FLOPs, bytes) per call, from attributes shared by calls with identical ones.
    call_sets = t.attr[call_rows]
    sets, set_of_call = np.unique(call_sets, return_inverse=True)
    nset = len(sets)
    f_exp = np.full(nset, np.nan)
    b_exp = np.full(nset, np.nan)
    form_f = np.full(nset, np.nan)
    form_b = np.full(nset, np.nan)
    form_src = np.zeros(nset, dtype=np.int64)
    io = np.zeros(nset)
    ltypes: list[str] = []
    type_index: dict[str, int] = {}
    sources = [EXPLICIT, OPS, CHILDREN, IO]
    site_index: dict[str, int] = {}
    set_site = np.zeros(nset, dtype=np.int64)
    content_index: dict[str, int] = {}
    set_content = np.zeros(nset, dtype=np.int64)  # equal attributes, one number (``_LikeCalls``)
    for i, k in enumerate(sets.tolist()):
        a = t.attr_set(k)
        set_site[i] = site_index.setdefault(site_key(a), len(site_index))
        set_content[i] = content_index.setdefault(repr(sorted(a.items())), len(content_index))
        ltype = str(a.get("ml.layer.type", ""))
        ltypes.append(ltype)
        type_index.setdefault(ltype, len(type_index))
        if "ml.flops" in a or "ml.bytes" in a:
            given_flops, given_bytes = explicit_work(a)
            if given_flops is not None:
                f_exp[i] = given_flops
            if given_bytes is not None:
                b_exp[i] = given_bytes
        formula = layer_formula_work(ltype, a)
        if formula is not None:
            form_f[i], form_b[i] = formula.flops, formula.bytes
            if formula.source not in sources:
                sources.append(formula.source)
            form_src[i] = sources.index(formula.source)
        io[i] = float(io_bytes(a))
    cf_exp, cb_exp = f_exp[set_of_call], b_exp[set_of_call]
    cform_f, cform_b, cform_src, cio = form_f[set_of_call], form_b[set_of_call], form_src[set_of_call], io[set_of_call]
    # Own ops' bytes, for the calls whose bytes they make up (no explicit bytes, no formula).
    needs_own = np.isnan(cb_exp) & np.isnan(cform_b)
    cb_rows = cb_rows[needs_own[call_of[owner[cb_rows]]]]
    own_op_bytes = _own_op_bytes(t, cb_rows, call_of[owner[cb_rows]], crow, name, names, ncall)
    g.op_ends = op_ends(run)
    g.layer_end_ns = window_end(run, "layer_window")
    # A call has layer spans if it started before the layer level's end (calls in flight then
    # finish theirs), and ops if it also ended before its framework's op level did.
    with_layers = start[call_rows] <= g.layer_end_ns if g.layer_end_ns is not None else np.ones(ncall, dtype=bool)
    with_ops = with_layers & _ops_recorded_per_call(g.op_ends, t, call_rows, cowner, cdepth)
    # Rows with ops of their own (in any call): a call of theirs without ops misses their work.
    own_ops = (_count_by(crow[call_of[above[direct]]], nrow) > 0)[crow]
    flops = np.zeros(ncall)
    moved = np.zeros(ncall)
    source = np.zeros(ncall, dtype=np.int64)
    known = np.zeros(ncall, dtype=bool)  # the call's work is known in full (``RowAcc.known_calls``)
    child_flops = np.zeros(ncall)
    child_bytes = np.zeros(ncall)
    unknown_children = np.zeros(ncall, dtype=np.int64)
    like = _LikeCalls(crow * nset + set_content[set_of_call], child_flops, child_bytes)
    for cs in levels_desc:
        # A call with counted ops in its subtree does its own ops' FLOPs and its child layers'
        # work, each child's on its own basis: a child whose ops count nothing (a pooling layer)
        # brings its formula's, so its parent's work holds what its own row shows.
        fe, fo, ff = cf_exp[cs], own_op_flops[cs] + child_flops[cs], cform_f[cs]
        has_fe, has_ff, kids, hof = ~np.isnan(fe), ~np.isnan(ff), has_children[cs], has_op_flops[cs]
        flops[cs] = np.where(has_fe, fe, np.where(hof, fo, np.where(has_ff, ff, np.where(kids, child_flops[cs], 0.0))))
        source[cs] = np.where(has_fe, 0, np.where(hof, 1, np.where(has_ff, cform_src[cs], np.where(kids, 2, 3))))
        be, fb = cb_exp[cs], cform_b[cs]
        # Else what its children and its own ops move (a layer whose forward runs ops itself),
        # at least its inputs, outputs and parameters.
        moved[cs] = np.where(~np.isnan(be), be, np.where(~np.isnan(fb), fb, np.maximum(cio[cs], child_bytes[cs] + own_op_bytes[cs])))
        children_known = kids & (unknown_children[cs] == 0) & ~own_ops[cs]
        known[cs] = with_ops[cs] | has_fe | has_ff | children_known
        like.give_own_work(cs[~known[cs] & (unknown_children[cs] == 0)], cs[with_ops[cs]], known, flops, moved)
        up = cowner[cs]
        m = up >= 0
        if m.any():
            np.add.at(child_flops, up[m], flops[cs][m])
            np.add.at(child_bytes, up[m], moved[cs][m])
            np.add.at(unknown_children, up[m], ~known[cs][m])

    self_ns = np.maximum(cdur - child_ns, 0)
    framework = np.maximum(self_ns - direct_op_ns, 0)
    framework = np.where(with_ops, framework, 0)
    r_opcalls = _count_by(crow[with_ops], nrow)
    r_opcalls_ns = _sum_by(crow[with_ops], cdur[with_ops].astype(np.float64), nrow)
    r_layercalls = _count_by(crow[with_layers], nrow)
    r_layercalls_ns = _sum_by(crow[with_layers], cdur[with_layers].astype(np.float64), nrow)
    rc = _count_by(crow, nrow)
    r_total = _sum_by(crow, cdur.astype(np.float64), nrow)
    # A model call that began after the layer level ended has no layer children: its self
    # time is unknown, not its whole duration, so model rows sum the calls with layers.
    known_self = with_layers | (lv[call_rows] != MODEL)
    r_self = _sum_by(crow[known_self], self_ns[known_self].astype(np.float64), nrow)
    r_flops = np.bincount(crow, weights=flops, minlength=nrow) if ncall else np.zeros(nrow)
    r_bytes = np.bincount(crow, weights=moved, minlength=nrow) if ncall else np.zeros(nrow)
    r_opns = _sum_by(crow, op_ns.astype(np.float64), nrow)
    r_opc = _sum_by(crow, op_count.astype(np.float64), nrow)
    r_kns = _sum_by(crow, kern_ns.astype(np.float64), nrow)
    r_kc = _sum_by(crow, kern_count.astype(np.float64), nrow)
    r_fw = _sum_by(crow, framework.astype(np.float64), nrow)
    r_kids = _count_by(crow[has_children], nrow) > 0
    # The calls each row is judged over (``RowAcc.known_calls``): those whose work is known in
    # full; where the row ran kernels, only those with ops (kernels exist in them alone).
    basis = known & (with_ops | (r_kc == 0)[crow])
    r_known = _count_by(crow[basis], nrow)
    r_known_ns = _sum_by(crow[basis], cdur[basis].astype(np.float64), nrow)
    r_known_flops = np.bincount(crow[basis], weights=flops[basis], minlength=nrow)
    r_known_bytes = np.bincount(crow[basis], weights=moved[basis], minlength=nrow)
    # The call that describes each row: the deepest, then one with ops (where the op level
    # ended early, its work basis is the ops'), then the last-ending (lowest call index).
    pick = np.lexsort((np.arange(ncall), ~with_ops, -cdepth, crow))
    first_call = pick[np.searchsorted(crow[pick], np.arange(nrow))]
    site_call = _most_frequent(crow, set_site[set_of_call], first_call, nrow)
    direct_tables = _pair_table(crow[call_of[above[direct]]], name[direct], durf[direct], names)
    lib_tables = _subtree_tables(lib_rows, name[lib_rows], names, owner, call_of, cowner, crow, durf)
    kern_tables = _subtree_tables(gk_rows, k_key[gk_rows], k_names, owner, call_of, cowner, crow, durf)
    for r in range(nrow):
        c = int(first_call[r])
        row = int(call_rows[c])
        racc = RowAcc(
            name=names[int(rkeys[r] // 16)],
            level=Level(int(rkeys[r] % 16)),
            first=row,
            site=int(call_rows[int(site_call[r])]),
            type=ltypes[int(set_of_call[c])],
            calls=int(rc[r]),
            total_ns=int(r_total[r]),
            self_ns=int(r_self[r]),
            flops=float(r_flops[r]),
            bytes=float(r_bytes[r]),
            work_source=sources[int(source[c])],
            op_ns=int(r_opns[r]),
            op_count=int(r_opc[r]),
            framework_ns=int(r_fw[r]),
            op_calls=int(r_opcalls[r]),
            op_calls_ns=int(r_opcalls_ns[r]),
            layer_calls=int(r_layercalls[r]),
            layer_calls_ns=int(r_layercalls_ns[r]),
            kernel_ns=int(r_kns[r]),
            kernel_count=int(r_kc[r]),
            known_calls=int(r_known[r]),
            known_ns=int(r_known_ns[r]),
            known_flops=float(r_known_flops[r]),
            known_bytes=float(r_known_bytes[r]),
            has_child_layers=bool(r_kids[r]),
            direct_ops=direct_tables.get(r, {}),
            libraries=lib_tables.get(r, {}),
            kernels=kern_tables.get(r, {}),
        )
        g.rows.append(racc)

    # Layer types (layer level only), each call with what it does itself (``TypeAcc``).
    lay = np.nonzero(lv[call_rows] == LAYER)[0]
    if len(lay):
        type_names = list(type_index)
        call_type = np.asarray([type_index[x] for x in ltypes], dtype=np.int64)[set_of_call]
        tix = call_type[lay]
        nt = len(type_names)
        own_flops = np.maximum(flops - child_flops, 0.0)
        own_moved = np.maximum(moved - child_bytes, 0.0)
        outer = lay[~_in_own_type(lay, cowner, np.where(lv[call_rows] == LAYER, call_type, -1))]
        tc = _count_by(tix, nt)
        tt = _sum_by(call_type[outer], cdur[outer].astype(np.float64), nt)
        ts = _sum_by(tix, self_ns[lay].astype(np.float64), nt)
        tf = np.bincount(tix, weights=own_flops[lay], minlength=nt)
        tb = np.bincount(tix, weights=own_moved[lay], minlength=nt)
        kb = basis[lay]  # each call on its row's basis
        kt, kc = tix[kb], lay[kb]
        known_sums = (
            _count_by(kt, nt),
            _sum_by(kt, self_ns[kc].astype(np.float64), nt),
            np.bincount(kt, weights=own_flops[kc], minlength=nt),
            np.bincount(kt, weights=own_moved[kc], minlength=nt),
        )
        own_sums = [_sum_by(tix, x[lay].astype(np.float64), nt) for x in (own_op_ns, own_op_count, own_kern_ns, own_kern_count)]
        for k in np.nonzero(tc)[0].tolist():
            g.types[type_names[k]] = TypeAcc(
                int(tc[k]),
                int(tt[k]),
                int(ts[k]),
                float(tf[k]),
                float(tb[k]),
                known_calls=int(known_sums[0][k]),
                known_ns=int(known_sums[1][k]),
                known_flops=float(known_sums[2][k]),
                known_bytes=float(known_sums[3][k]),
                op_ns=int(own_sums[0][k]),
                op_count=int(own_sums[1][k]),
                kernel_ns=int(own_sums[2][k]),
                kernel_count=int(own_sums[3][k]),
            )

    # Ops in a model but in no layer, and ops in no model at all. A model with no child modules
    # (``ml.model.leaf``) is its own only layer: its ops are in no other, and not counted.
    own = owner[all_op_rows]
    g.ops_outside_models = int((own < 0).sum())
    in_model = all_op_rows[(own >= 0) & (lv[np.maximum(own, 0)] == MODEL)]
    in_model = in_model[~_leaf_models(t, owner[in_model])]
    # An op that names its layer (``ml.tf.layer``) ran outside that layer's span: a variable
    # read before it began, a BatchNormalization's arithmetic on its weights alone with the
    # step's reads. The layer's, not the model's own work; counted apart, reads on their own.
    named = _names_its_layer(t, in_model)
    reads = named & _variable_read_names(names)[t.name[in_model].astype(np.int64)]
    layer_ops = named & ~reads
    g.reads_outside_layers = int(reads.sum())
    g.reads_outside_layers_ns = int(dur[in_model[reads & top_level_op[in_model]]].sum())
    g.layer_ops_outside_layers = int(layer_ops.sum())
    g.layer_ops_outside_layers_ns = int(dur[in_model[layer_ops & top_level_op[in_model]]].sum())
    in_model = in_model[~named]
    g.ops_outside_layers = len(in_model)
    g.ops_outside_layers_ns = int(dur[in_model[top_level_op[in_model]]].sum())  # nested ops' time is their outer op's
    return g


@dataclass
class _LikeCalls:
    """Where the op level ended early, a call after its end whose children's work is known does
    the work of its own ops that its like calls with ops did (``kind``: its row and attributes,
    so the same inputs' shapes and types); ``child_flops`` and ``child_bytes`` per call."""

    kind: np.ndarray
    child_flops: np.ndarray
    child_bytes: np.ndarray

    def give_own_work(self, todo: np.ndarray, donors: np.ndarray, known: np.ndarray, flops: np.ndarray, moved: np.ndarray) -> None:
        """Gives each call in ``todo`` its children's work plus the mean own work (beyond the
        children's) of the calls in ``donors`` of its kind, and marks it known; a call with no
        like call among them stays unknown."""
        if not len(todo) or not len(donors):
            return
        kinds, which = np.unique(self.kind[donors], return_inverse=True)
        count = np.bincount(which)
        pos = np.minimum(np.searchsorted(kinds, self.kind[todo]), len(kinds) - 1)
        like = kinds[pos] == self.kind[todo]
        todo, pos = todo[like], pos[like]
        own_flops = np.maximum(flops[donors] - self.child_flops[donors], 0)
        own_bytes = np.maximum(moved[donors] - self.child_bytes[donors], 0)
        flops[todo] = self.child_flops[todo] + (np.bincount(which, weights=own_flops) / count)[pos]
        moved[todo] = np.maximum(moved[todo], self.child_bytes[todo] + (np.bincount(which, weights=own_bytes) / count)[pos])
        known[todo] = True


def _in_own_type(calls: np.ndarray, cowner: np.ndarray, call_type: np.ndarray) -> np.ndarray:
    """Per call of ``calls``: whether a layer call of its own type encloses it (a ``Sequential``
    in a ``Sequential``), walking up ``cowner``, the enclosing call of each; ``call_type`` is
    each call's type, -1 for model calls."""
    inside = np.zeros(len(calls), dtype=bool)
    up = cowner[calls]
    while True:
        live = up >= 0
        if not live.any():
            return inside
        inside |= live & (call_type[np.maximum(up, 0)] == call_type[calls])
        up = np.where(live, cowner[np.maximum(up, 0)], -1)


def _names_its_layer(t: SpanTable, rows: np.ndarray) -> np.ndarray:
    """Per op row: whether it names the layer it did work for (``ml.tf.layer``, TensorFlow graph
    runs)."""
    sets, which = np.unique(t.attr[rows], return_inverse=True)
    named = np.fromiter((bool(t.attr_set(int(k)).get("ml.tf.layer")) for k in sets.tolist()), dtype=bool, count=len(sets))
    return named[which.reshape(-1)] if len(rows) else np.zeros(0, dtype=bool)


def _variable_read_names(names: list[str]) -> np.ndarray:
    """Per name id: whether the name is a TensorFlow variable read's (``VARIABLE_READ_OPS``)."""
    return np.fromiter((nm in VARIABLE_READ_OPS for nm in names), dtype=bool, count=len(names))


def _leaf_models(t: SpanTable, rows: np.ndarray) -> np.ndarray:
    """Per row of a model span: whether its model has no child modules (``ml.model.leaf``), read
    once per distinct attribute set."""
    sets, which = np.unique(t.attr[rows], return_inverse=True)
    leaf = np.fromiter((t.attr_set(k).get("ml.model.leaf") is True for k in sets.tolist()), dtype=bool, count=len(sets))
    return leaf[which]


def site_key(attrs: dict[str, Any]) -> str:
    """A call site's key, for any attribute values (an odd one may be a list)."""
    return repr((attrs.get("code.file.path"), attrs.get("code.line.number")))


def _most_frequent(group: np.ndarray, value: np.ndarray, prefer: np.ndarray, ngroup: int) -> np.ndarray:
    """For each group ``g`` (0 to ``ngroup`` - 1, each with an index), an index holding the
    group's most frequent value: ``prefer[g]`` where its value is as frequent, else the first
    index of that value. ``group`` and ``value`` give each index's."""
    chosen = prefer.copy()
    if not len(group):
        return chosen
    base = int(value.max()) + 1
    pairs, first_index, counts = np.unique(group * base + value, return_index=True, return_counts=True)
    pair_group = pairs // base
    order = np.lexsort((-counts, pair_group))  # by group, the most frequent value first
    best = order[np.searchsorted(pair_group[order], np.arange(ngroup))]
    own = counts[np.searchsorted(pairs, group[prefer] * base + value[prefer])]
    replace = own < counts[best]
    chosen[replace] = first_index[best[replace]]
    return chosen


def _first_by_key(rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """For each key, its row that comes last in the file (the first one a reverse scan meets)."""
    return _first_n_by_key(rows, keys, 1)


def _first_n_by_key(rows: np.ndarray, keys: np.ndarray, limit: int) -> np.ndarray:
    """Up to ``limit`` rows per key, the last ones in the file."""
    if not len(rows):
        return rows
    rev = rows[::-1]
    rk = keys[::-1]
    order = np.argsort(rk, kind="stable")
    sorted_keys = rk[order]
    group_start = np.searchsorted(sorted_keys, sorted_keys, side="left")
    rank = np.arange(len(order)) - group_start
    return rev[order[rank < limit]]


def _subtree_tables(
    rows: np.ndarray,
    keys: np.ndarray,
    key_names: list[str],
    owner: np.ndarray,
    call_of: np.ndarray,
    cowner: np.ndarray,
    crow: np.ndarray,
    durf: np.ndarray,
) -> dict[int, dict[str, list[int]]]:
    """``report row → {name: [calls, ns]}`` over every layer call that encloses each of ``rows``."""
    has = owner[rows] >= 0
    rows, keys = rows[has], keys[has]
    cur = call_of[owner[rows]]
    lefts, rights, durs = [], [], []
    while len(cur):
        lefts.append(crow[cur])
        rights.append(keys)
        durs.append(durf[rows])
        cur = cowner[cur]
        keep = cur >= 0
        cur, keys, rows = cur[keep], keys[keep], rows[keep]
    if not lefts:
        return {}
    return _pair_table(np.concatenate(lefts), np.concatenate(rights), np.concatenate(durs), key_names)
