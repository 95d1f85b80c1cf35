"""Correlator passes that give spans their parents from time and from launches.

``nest_by_containment``
    On one track (one thread, one GPU stream), a span whose interval lies
    inside another's ran inside it: an op inside the layer whose forward
    called it, a CUDA launch call inside its op. Post-hoc sources (Kineto,
    ONNX Runtime profiles, verbose logs) know the times but not mltrace's
    live parents, so this pass supplies them.
``attach_gpu_to_launch``
    A GPU activity runs on a stream track, after the CPU call that launched
    it returned; it is nested under that call through its launch flow.

Both are pure: they return a new ``Run`` whose changed spans are copies; the
input run's spans are not modified.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.settings import SWEEP

#: Sort rank of each level for spans with identical intervals: the coarser
#: span is the container. User spans (``record_function``, ``mltrace.span``)
#: usually wrap what they annotate, so they rank outermost.
_TIE_RANK = {Level.USER: 0, Level.MODEL: 1, Level.LAYER: 2, Level.OP: 3, Level.LIBRARY: 4, Level.KERNEL: 5}


# The same, indexed by the level's integer value: list indexing is much
# cheaper than hashing an enum member, and the sort key runs once per span.
def _rank_table() -> tuple[int, ...]:
    table = [9] * (max(Level) + 1)
    for level, rank in _TIE_RANK.items():
        table[level] = rank
    return tuple(table)


_RANK_BY_VALUE = _rank_table()


def tie_rank(level: Level) -> int:
    """The rank of ``level`` among spans with identical intervals (``_TIE_RANK``: the coarser outside)."""
    return _RANK_BY_VALUE[level]


#: Dead entries (ended before the current span) tolerated in the sweep stack
#: before it is compacted; only partially overlapping spans leave them.
_COMPACT_AFTER = 32


def _note(run: Run, name: str, facts: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``run.meta`` with ``facts`` under ``correlation.<name>``."""
    meta = dict(run.meta)
    correlation = dict(meta.get("correlation") or {})
    correlation[name] = facts
    meta["correlation"] = correlation
    return meta


#: The deepest level that may hold a user span: Python code (``record_function``,
#: ``mltrace.span``) runs between library calls and kernels, never inside one.
USER_HOLDER = Level.OP


def may_contain(outer: Level, inner: Level) -> bool:
    """Whether a span at ``outer`` may be the parent of one at ``inner``.

    Levels nest from the model down (an op never contains a layer); spans of
    the same level nest (aten::linear → aten::addmm); user spans hold any span and
    are held by any but a library call or a kernel (an untimed library call's
    interval, which ends at its line's receipt, may overlap the user span after it).
    """
    return outer is Level.USER or outer <= (USER_HOLDER if inner is Level.USER else inner)


def is_program_region(span: Span) -> bool:
    """Whether ``span`` is a region the program's own code opened live (``mltrace.span``,
    ``@mltrace.trace``): a user span with its call site (``code.file.path``), not a range torch
    or the program opened through ``record_function`` (those come from the profiler)."""
    return span.level is Level.USER and "code.file.path" in span.attrs and "torch.range" not in span.attrs


def keeps_recorded_parent(span: Span, container: Span) -> bool:
    """Whether ``span`` keeps its recorded parent rather than take ``container``, a closer span
    that contains it: a model call or a user span was given the innermost span open in its
    context (thread or asyncio task) as it began, program regions included, so a region of the
    program's that was open without being chosen ran in another task on the same thread (a
    concurrent request). A layer call's recorded parent is the module that called it, which
    knows no program region, so a region inside that module is its closer parent."""
    return span.level in (Level.USER, Level.MODEL) and is_program_region(container)


def _copy_with_parent(s: Span, parent_id: int | None) -> Span:
    return Span(s.id, parent_id, s.level, s.name, s.start_ns, s.end_ns, s.track_id, s.attrs)


def innermost_containers(spans: list[Span]) -> tuple[dict[int, int], dict[int, int]]:
    """Finds, for spans of one track, the innermost span containing each one.

    A span ``p`` contains ``s`` when ``p.start_ns <= s.start_ns`` and
    ``s.end_ns <= p.end_ns`` and ``p``'s level may hold ``s``'s (see
    ``may_contain``). Identical intervals nest by level (coarser outside),
    then by id. Among several containers the one that started last wins
    (with proper nesting, the innermost one).

    One sweep over the spans sorted by (start, -end, level rank, id) with a
    stack of open spans: O(n log n) for the sort, O(n) for the sweep when
    spans nest properly.

    Args:
        spans: spans of one track (not modified; any order).

    Returns:
        ``(container, order)``: span id → id of its innermost container
        (absent when none), and span id → position in the sweep order.
    """
    rank = _RANK_BY_VALUE
    ordered = sorted(spans, key=lambda s: (s.start_ns, -s.end_ns, rank[s.level], s.id))
    container: dict[int, int] = {}
    order: dict[int, int] = {}
    stack: list[Span] = []
    user, holder = Level.USER, USER_HOLDER
    for i, s in enumerate(ordered):
        sid = s.id
        order[sid] = i
        start, end, level = s.start_ns, s.end_ns, s.level
        # Spans that ended by the time s starts are done (unless s is a
        # zero-length span at their very end, which they still contain).
        while stack and stack[-1].end_ns <= start and not (stack[-1].start_ns <= start and end <= stack[-1].end_ns):
            stack.pop()
        dead = 0
        for j in range(len(stack) - 1, -1, -1):
            p = stack[j]
            # may_contain, inlined: this loop runs once per span.
            if p.end_ns >= end and (p.level is user or p.level <= (holder if level is user else level)):
                container[sid] = p.id  # p.start_ns <= start holds: p came earlier in the sort
                break
            if p.end_ns < start:
                dead += 1
        if dead > _COMPACT_AFTER:
            stack = [p for p in stack if p.end_ns >= start]
        stack.append(s)
    return container, order


def nest_by_containment(run: Run) -> Run:
    """Sets parents from time containment on each track.

    A span gets the innermost span of its track that contains it (see
    ``innermost_containers``) as parent when it has no parent, when its
    parent is missing from the run, or when its parent is on the same track
    and that innermost container lies inside the parent (the container is a
    closer ancestor: e.g. a ``record_function`` range between a layer and an
    op). Parents on other tracks (a kernel's launch call) are kept, and so are
    the recorded parents of model calls and user spans against a region of
    the program's from another asyncio task (``keeps_recorded_parent``).

    Records ``parents_set`` and ``parents_refined`` under
    ``meta["correlation"]["nest_by_containment"]``.

    Args:
        run: the run (not modified).

    Returns:
        A run with new span list; changed spans are copies.
    """
    sweep = sweep_module()
    if sweep is not None and run.spans:
        return _nest_by_containment_columns(run, sweep)
    by_track: dict[int, list[Span]] = {}
    for s in run.spans:
        by_track.setdefault(s.track_id, []).append(s)
    by_id = {s.id: s for s in run.spans}
    new_parent: dict[int, int] = {}
    set_count = refined = 0
    for spans in by_track.values():
        container, order = innermost_containers(spans)
        for s in spans:
            c = container.get(s.id)
            if c is None or c == s.parent_id:
                continue
            parent = by_id.get(s.parent_id) if s.parent_id is not None else None
            if parent is None:
                new_parent[s.id] = c
                set_count += 1
                continue
            if parent.track_id != s.track_id or parent.id not in order:
                continue
            inner = by_id[c]
            if (
                parent.start_ns <= inner.start_ns
                and inner.end_ns <= parent.end_ns
                and order[parent.id] < order[c]
                and may_contain(parent.level, inner.level)
                and not keeps_recorded_parent(s, inner)
            ):
                new_parent[s.id] = c
                refined += 1
    spans_out = [_copy_with_parent(s, new_parent[s.id]) if s.id in new_parent else s for s in run.spans]
    meta = _note(run, "nest_by_containment", {"parents_set": set_count, "parents_refined": refined})
    return run.replace(spans=spans_out, meta=meta)


def sweep_module() -> Any:
    """The C sweeps (``mltrace._sweep``), unless not built or ``MLTRACE_SWEEP=python``."""
    from mltrace.native import c_helper

    return c_helper("_sweep", SWEEP)


#: span_columns' keys, each with the span attribute it holds.
_COLUMNS = {"id": "id", "parent": "parent_id", "track": "track_id", "start": "start_ns", "end": "end_ns", "level": "level"}


def span_columns(spans: list[Span], keys: tuple[str, ...] = tuple(_COLUMNS)) -> dict[str, Any]:
    """id, parent id (-1: none), track, start, end and level of each span (or those of them
    that ``keys`` names), as int64 arrays. Read in C (``mltrace._sweep.columns``) where it is
    built, else one ``numpy.fromiter`` a column."""
    import numpy as np

    n = len(spans)
    sweep = sweep_module()
    if sweep is not None and hasattr(sweep, "columns"):
        table = np.empty((len(keys), n), dtype=np.int64)
        nullable = 1 << keys.index("parent") if "parent" in keys else 0
        try:
            sweep.columns(spans, tuple(_COLUMNS[k] for k in keys), nullable, table)
        except (TypeError, ValueError, OverflowError, AttributeError):
            pass  # a value numpy.fromiter may read differently (or fail on): read as it does
        else:
            return dict(zip(keys, table))
    readers = {
        "id": lambda: (s.id for s in spans),
        "parent": lambda: (-1 if s.parent_id is None else s.parent_id for s in spans),
        "track": lambda: (s.track_id for s in spans),
        "start": lambda: (s.start_ns for s in spans),
        "end": lambda: (s.end_ns for s in spans),
        "level": lambda: (int(s.level) for s in spans),
    }
    return {k: np.fromiter(readers[k](), dtype=np.int64, count=n) for k in keys}


def level_column(spans: list[Span]) -> Any:
    """Each span's level as an int64 array, read in C (``_sweep.columns``) where it is built;
    None where it is not (a Python loop over the spans is then as quick)."""
    sweep = sweep_module()
    if sweep is None or not hasattr(sweep, "columns"):
        return None
    return span_columns(spans, ("level",))["level"]


def spans_at_level(spans: list[Span], level: Level) -> list[Span]:
    """``[s for s in spans if s.level == level]``, picked on the level column where it is read in C."""
    levels = level_column(spans)
    if levels is None:
        return [s for s in spans if s.level == level]
    return pick(spans, (levels == level).nonzero()[0].tolist())


def pick(spans: list[Span], rows: list[int]) -> list[Span]:
    """``[spans[i] for i in rows]``, by one ``operator.itemgetter`` call."""
    if len(rows) < 2:
        return [spans[i] for i in rows]
    return list(itemgetter(*rows)(spans))


def _with_parents(sweep: Any, spans: list[Span], rows: Any, parents: Any) -> list[Span]:
    """A copy of ``spans`` where each of ``rows`` is ``_copy_with_parent`` of its span with the
    parent id in ``parents`` (int64 arrays): in C (``_sweep.with_parents``) where it is built."""
    import numpy as np

    rows = np.ascontiguousarray(rows, dtype=np.int64)
    parents = np.ascontiguousarray(parents, dtype=np.int64)
    if hasattr(sweep, "with_parents") and type(spans) is list:
        try:
            out: list[Span] = sweep.with_parents(spans, rows, parents, Span, "parent_id", ("_up", "_fin"))
        except TypeError:
            pass  # spans of another class: made by the constructor
        else:
            return out
    spans_out = list(spans)
    for r, p in zip(rows.tolist(), parents.tolist()):
        spans_out[r] = _copy_with_parent(spans[r], None if p < 0 else p)
    return spans_out


def _nest_by_containment_columns(run: Run, sweep: Any) -> Run:
    """``nest_by_containment`` on columns, with the sweep in C: the same parents, the same notes."""
    import numpy as np

    from mltrace.run.table import parent_rows

    spans = run.spans
    c = span_columns(spans)
    ids, track, start, end, level = c["id"], c["track"], c["start"], c["end"], c["level"]
    rank = np.asarray(_RANK_BY_VALUE, dtype=np.int64)[level]
    ordered = np.lexsort((ids, rank, -end, start, track))  # per track, innermost_containers' order
    inner = np.empty(len(spans), dtype=np.int64)
    sweep.containers(ordered, track, start, end, level, int(Level.USER), int(USER_HOLDER), inner)
    prow = parent_rows(ids, c["parent"])
    has = inner >= 0
    safe = np.where(has, inner, 0)
    differs = has & (ids[safe] != c["parent"])
    orphan = differs & (prow < 0)  # no parent, or one missing from the run
    pos = np.empty(len(spans), dtype=np.int64)
    pos[ordered] = np.arange(len(spans))
    p = np.where(prow >= 0, prow, 0)
    user = int(Level.USER)
    allowed = (level[p] == user) | (level[p] <= np.where(level[safe] == user, int(USER_HOLDER), level[safe]))
    refine = (
        differs
        & (prow >= 0)
        & (track[p] == track)  # parents on other tracks (a kernel's launch call) are kept
        & (start[p] <= start[safe])
        & (end[safe] <= end[p])
        & (pos[p] < pos[safe])
        & allowed
    )
    for row in np.nonzero(refine)[0].tolist():  # few: the parents a closer container refines
        if keeps_recorded_parent(spans[row], spans[int(inner[row])]):
            refine[row] = False
    rows = np.nonzero(orphan | refine)[0]
    spans_out = _with_parents(sweep, spans, rows, ids[inner[rows]])
    facts = {"parents_set": int(orphan.sum()), "parents_refined": int(refine.sum())}
    return run.replace(spans=spans_out, meta=_note(run, "nest_by_containment", facts))


def attach_gpu_to_launch(run: Run) -> Run:
    """Makes each GPU activity a child of the CPU call that launched it.

    The link is the ``Flow(kind="launch")`` from the launch call (a
    ``cudaLaunchKernel``, ``cudaMemcpyAsync``, ``cudaGraphLaunch``…) to the
    activity; every kernel of a graph launch gets the one graph launch as
    parent. The launch call itself is nested in its op by
    ``nest_by_containment``. A child here runs after its parent ended (the
    GPU is asynchronous), which validation must allow for parents reached
    by a launch flow.

    Records ``attached`` and ``missing_endpoint`` (flows naming a span that
    is not in the run) under ``meta["correlation"]["attach_gpu_to_launch"]``.

    Args:
        run: the run (not modified).

    Returns:
        A run with a new span list; changed spans are copies.
    """
    launches = [f for f in run.flows if f.kind == "launch"]
    if not launches:  # a run with no GPU work: nothing to attach
        meta = _note(run, "attach_gpu_to_launch", {"attached": 0, "missing_endpoint": 0})
        return run.replace(spans=list(run.spans), meta=meta)
    ids = {s.id for s in run.spans}
    parent_of: dict[int, int] = {}
    missing = 0
    for f in launches:
        if f.from_span not in ids or f.to_span not in ids:
            missing += 1
            continue
        parent_of.setdefault(f.to_span, f.from_span)  # the first launch flow wins
    spans_out: list[Span] = []
    attached = 0
    for s in run.spans:
        p = parent_of.get(s.id)
        if p is not None and p != s.parent_id and p != s.id:
            spans_out.append(_copy_with_parent(s, p))
            attached += 1
        else:
            spans_out.append(s)
    meta = _note(run, "attach_gpu_to_launch", {"attached": attached, "missing_endpoint": missing})
    return run.replace(spans=spans_out, meta=meta)
