"""Correlator pass: put CPU library calls (oneDNN, MKL) under the ops that issued them.

The verbose lines these calls come from name no thread, so the source puts them on the track
of the thread that started it; ``attach_library_calls`` moves each call to the track of its
op and sets its parent:

- a timed call (oneDNN with ``ONEDNN_VERBOSE_TIMESTAMP``) goes to the innermost span that
  contains it (``_Containing``);
- an untimed call (every MKL call) goes, in issue order, to the first leaf caller op that can
  have made it (``_first_fit``, ``_compatible``), each thread's calls from the op its previous
  call went to on (``_ThreadCursors``), an untimed oneDNN call to the op that started last
  (``_last_started``), and is laid out inside that op;
- a call that no op can be shown to have issued is set apart on a lane of its own
  (``_set_apart``).
"""

from __future__ import annotations

import bisect
import re
from typing import Any

from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run

CPU_LIBRARIES = frozenset({"oneDNN", "MKL"})
"""``ml.library.name`` values this pass handles."""

MKL_CALLER_OPS = frozenset(
    {
        # GEMM / GEMV (aten/src/ATen/native/LinearAlgebra.cpp → at::native::cpublas / mkl)
        "aten::addmm",
        "aten::_addmm_activation",
        "aten::mm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::addbmm",
        "aten::addmv",
        "aten::addmv_",
        "aten::mv",
        "aten::dot",
        "aten::vdot",
        "aten::matmul",
        "aten::linear",
        "aten::einsum",
        "aten::tensordot",
        # convolutions on torch's native path (im2col + SGEMM): small 2D/3D, transposed,
        # dilated. (Not aten::_convolution: it also wraps the oneDNN path.)
        "aten::thnn_conv2d",
        "aten::_slow_conv2d_forward",
        "aten::slow_conv3d",
        "aten::slow_conv3d_forward",
        "aten::slow_conv_transpose2d",
        "aten::slow_conv_transpose3d",
        "aten::slow_conv_dilated2d",
        "aten::slow_conv_dilated3d",
        # fused attention / transformer kernels that call SGEMM directly
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_native_multi_head_attention",
        "aten::_transformer_encoder_layer_fwd",
    }
)
"""aten ops that reach MKL BLAS with torch 2.13 on CPU (seen in torch.profiler runs)."""

GEMM_OPS = frozenset(
    {
        "aten::addmm",
        "aten::_addmm_activation",
        "aten::mm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::addbmm",
        "aten::addmv",
        "aten::addmv_",
        "aten::mv",
        "aten::matmul",
        "aten::linear",
    }
)
"""Caller ops whose BLAS sizes are sizes of their inputs (used to check a match by shape)."""

BLOCKED_GEMM_OPS = frozenset({"aten::_scaled_dot_product_flash_attention_for_cpu"})
"""Caller ops that multiply blocks of their inputs: the flash-attention kernel runs one SGEMM
per (query block, key block) pair on every intra-op thread, so M and N are its block sizes
(e.g. 32 and 128) and only the head dimension is sure to be an input dimension."""

IM2COL_OPS = frozenset({"aten::_slow_conv2d_forward", "aten::thnn_conv2d", "aten::slow_conv3d_forward", "aten::slow_conv3d"})
"""Native convolutions that lower to one GEMM per image (checked by weight shape)."""

_SINGLE_GEMM_OPS = frozenset({"aten::addmm", "aten::_addmm_activation", "aten::mm", "aten::addmv", "aten::addmv_", "aten::mv"})
_BATCHED_GEMM_OPS = frozenset({"aten::bmm", "aten::baddbmm"})
_CONTEXT_LEVELS = (Level.MODEL, Level.LAYER, Level.USER)
_GEMM = re.compile(r"[SDCZ]GEMM(?:_BATCH_STRIDED)?\Z")
_GEMV = re.compile(r"[SDCZ]GEMV\Z")


def _blas_sizes(call: Span) -> tuple[int, ...]:
    """The M, N(, K) of a GEMM/GEMV library span, from its ``ml.library.desc``; () if unknown."""
    kind = str(call.attrs.get("ml.library.kind", ""))
    args = str(call.attrs.get("ml.library.desc", "")).split(",")
    picked = args[2:5] if _GEMM.match(kind) else args[1:3] if _GEMV.match(kind) else []
    try:
        return tuple(int(a) for a in picked)
    except ValueError:
        return ()


def _input_dims(op: Span) -> set[int] | None:
    """Every dimension of an op's input shapes (``ml.input.shapes``), or None if not recorded."""
    shapes = op.attrs.get("ml.input.shapes")
    if not isinstance(shapes, list):
        return None
    dims: set[int] = set()
    for shape in shapes:
        if isinstance(shape, list):
            dims.update(d for d in shape if isinstance(d, int))
    return dims or None


def _compatible(call: Span, op: Span) -> bool:
    """False only when shapes prove that ``op`` cannot have made ``call``.

    A batched call (``SGEMM_BATCH``…) never comes from a single-matrix op
    (``aten::addmm``, ``aten::mm``, …). GEMM-like ops: M, N and K are each
    some dimension of the inputs; blocked ones (flash attention): at least one is.
    Native convolutions (im2col + GEMM, one call per image): N is the number
    of output channels and K the product of the other weight dimensions
    (``ic/groups * kh * kw``), the weight being the second input.
    """
    return _Compatibility()(call, op)


class _Compatibility:
    """``_compatible``, with each call's kind and sizes and each op's input dimensions worked
    out once: a pass asks about one call against several ops, and about one op for several calls."""

    def __init__(self) -> None:
        self._call: Span | None = None
        self._kind = ""
        self._sizes: tuple[int, ...] = ()
        self._shapes: dict[tuple[str, str], tuple[str, tuple[int, ...]]] = {}  # (kind, desc) -> (kind, sizes)
        self._dims: dict[int, tuple[list[Any], set[int] | None]] = {}  # id(shapes) -> (shapes, its dims)

    def __call__(self, call: Span, op: Span) -> bool:
        if call is not self._call:
            self._call = call
            self._kind, self._sizes = self._shape(call)
        name = op.name
        if "_BATCH" in self._kind and name in _SINGLE_GEMM_OPS:
            return False  # a batched call comes from a batched op, even when its sizes are hidden
        sizes = self._sizes
        if not sizes:
            return True
        if name in GEMM_OPS:
            dims = self._input_dims(op)
            return dims is None or dims.issuperset(sizes)
        if name in BLOCKED_GEMM_OPS:
            # (key block, query block, head dim) or (head dim, query block, key block): the head
            # dimension (the query's last) is one of them, and no block exceeds the longer of the
            # query's and the key's sequence (a decode step with a KV cache: 1 query, 33 keys).
            shapes = op.attrs.get("ml.input.shapes")
            if not isinstance(shapes, list) or not shapes or not isinstance(shapes[0], list) or len(shapes[0]) < 2:
                return True
            head = shapes[0][-1]
            seqs = [x[-2] for x in shapes[:2] if isinstance(x, list) and len(x) >= 2]
            if not isinstance(head, int) or not all(isinstance(n, int) for n in seqs):
                return True
            return head in sizes and all(n <= max(*seqs, head) for n in sizes)
        if name in IM2COL_OPS and len(sizes) == 3:
            shapes = op.attrs.get("ml.input.shapes")
            if not isinstance(shapes, list) or len(shapes) < 2 or not isinstance(shapes[1], list) or len(shapes[1]) < 3:
                return True
            weight = [d for d in shapes[1] if isinstance(d, int)]
            taps = 1
            for d in weight[1:]:
                taps *= d
            return sizes[1] == weight[0] and sizes[2] == taps
        return True

    def _shape(self, call: Span) -> tuple[str, tuple[int, ...]]:
        """The call's ``ml.library.kind`` and ``_blas_sizes``, worked out once per (kind, desc)."""
        attrs = call.attrs
        kind, desc = attrs.get("ml.library.kind", ""), attrs.get("ml.library.desc", "")
        if not isinstance(kind, str) or not isinstance(desc, str):
            return str(kind), _blas_sizes(call)
        shape = self._shapes.get((kind, desc))
        if shape is None:
            shape = self._shapes[(kind, desc)] = (kind, _blas_sizes(call))
        return shape

    def _input_dims(self, op: Span) -> set[int] | None:
        """``_input_dims(op)``, worked out once per shapes list: the ops of one call site share
        theirs (a loaded span's attributes are never changed in place)."""
        shapes = op.attrs.get("ml.input.shapes")
        if not isinstance(shapes, list):
            return None
        known = self._dims.get(id(shapes))
        if known is not None and known[0] is shapes:
            return known[1]
        dims = _input_dims(op)
        self._dims[id(shapes)] = (shapes, dims)  # holds the list: its id is not reused meanwhile
        return dims


def _with_note(run: Run, facts: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``run.meta`` with ``facts`` under ``correlation.attach_library_calls``."""
    meta = dict(run.meta)
    meta["correlation"] = {**(meta.get("correlation") or {}), "attach_library_calls": facts}
    return meta


def _leaf_callers(callers: list[Span]) -> list[Span]:
    """The caller ops with no other of them nested in them on their track, by (start, end, id).

    Each track's ops (tracks in order of first appearance) are sorted by (start, -end, id) for
    ``_with_nested``; both sorts are stable numpy sorts on the ops' columns."""
    import numpy as np

    from mltrace.tracer.passes.nesting import pick, span_columns

    n = len(callers)
    if not n:
        return []
    c = span_columns(callers, ("track", "start", "end", "id"))
    tracks, first = np.unique(c["track"], return_index=True)
    appearance = np.empty(len(tracks), dtype=np.int64)
    appearance[np.argsort(first, kind="stable")] = np.arange(len(tracks))
    group = appearance[np.searchsorted(tracks, c["track"])]
    order = np.lexsort((c["id"], -c["end"], c["start"], group))
    ordered = pick(callers, order.tolist())
    keep = np.ones(n, dtype=bool)  # by position in ordered
    cuts = [0, *(np.flatnonzero(np.diff(group[order])) + 1).tolist(), n]
    for lo, hi in zip(cuts, cuts[1:]):
        part = ordered[lo:hi]
        inner = _with_nested(part)
        if inner:
            keep[lo:hi] = [s.id not in inner for s in part]
    rows = order[keep]
    return pick(callers, rows[np.lexsort((c["id"][rows], c["end"][rows], c["start"][rows]))].tolist())


def _with_nested(spans: list[Span]) -> set[int]:
    """Ids of the spans (sorted by start, longest first) that another of them ends inside,
    among those still open when it starts. While each open span lies inside the one below
    it (``crossing`` counts those that do not), a span inside the innermost open one is
    inside all of them, and each of those was taken when the one above it began: only
    the innermost is taken, instead of a walk down the whole stack."""
    stack: list[tuple[Span, bool]] = []  # open spans, each with whether it ends after the one below
    crossing = 0
    inner: set[int] = set()
    for s in spans:
        while stack and stack[-1][0].end_ns <= s.start_ns:
            crossing -= stack.pop()[1]
        if stack and not crossing and s.end_ns <= stack[-1][0].end_ns:
            inner.add(stack[-1][0].id)
        else:
            for outer, _ in stack:
                if s.end_ns <= outer.end_ns:
                    inner.add(outer.id)
        crosses = bool(stack) and s.end_ns > stack[-1][0].end_ns
        crossing += crosses
        stack.append((s, crosses))
    return inner


class _Containing:
    """Finds the innermost of many spans (on any tracks) that contains an interval.

    The spans are sorted by start, longest first among equal starts; the answer
    for ``[start, end]`` is the last span, among those that start by ``start``,
    that ends at or after ``end``: the containing span that started last, and of
    those the shortest. Each block's greatest end lets the search skip a block of
    spans that all ended too early, so a call inside an op is found a few steps
    from where its start falls. (A scan of every op for each call made the end
    of a run of a few hundred inferences take minutes.)
    """

    def __init__(self, spans: list[Span], block: int = 64) -> None:
        self._spans = sorted(spans, key=lambda s: (s.start_ns, -s.end_ns, s.id))
        self._starts = [s.start_ns for s in self._spans]
        self._ends = [s.end_ns for s in self._spans]
        self._block = b = block
        self._block_max = [max(self._ends[i : i + b]) for i in range(0, len(self._ends), b)]

    def innermost(self, start: int, end: int, slack_ns: int, prefer_track: int) -> Span | None:
        """The span with ``span.start - slack <= start`` and ``end <= span.end + slack`` that started
        last, then the shortest; among equal intervals, one on ``prefer_track`` (else the first by id)."""
        i = bisect.bisect_right(self._starts, start + slack_ns) - 1
        reach = end - slack_ns
        ends, block_max, b = self._ends, self._block_max, self._block
        while i >= 0:
            first = i - i % b
            if block_max[i // b] < reach:
                i = first - 1  # no span of this block ends late enough
                continue
            while i >= first and ends[i] < reach:
                i -= 1
            if i >= first:
                break
        if i < 0:
            return None
        # Equal intervals sort by id: the first of them on the preferred track, else the first.
        first_equal = i
        while first_equal > 0 and self._starts[first_equal - 1] == self._starts[i] and self._ends[first_equal - 1] == self._ends[i]:
            first_equal -= 1
        equal = self._spans[first_equal : i + 1]
        return next((s for s in equal if s.track_id == prefer_track), equal[0])


def _end_bounds(library: list[Span]) -> dict[int, int]:
    """For untimed calls, the start of the next timed call in issue order (ns).

    Valid when one thread issued every call: its calls ran one after another,
    so an untimed call ended before the next timed call started. That bound
    does not depend on when the reader received the line, which may be late
    (the reader reads in batches).
    """
    bounds: dict[int, int] = {}
    next_start: int | None = None
    for s in sorted(library, key=lambda s: (s.attrs.get("ml.library.seq", 0), s.id), reverse=True):
        if not s.attrs.get("ml.library.untimed"):
            next_start = s.start_ns
        elif next_start is not None:
            bounds[s.id] = next_start
    return bounds


def _first_fit(
    call: Span,
    callers: list[Span],
    rows: list[int],
    begin: int,
    d: int,
    upper: int,
    lower: int,
    slack_ns: int,
    filled: dict[int, int],
    thread_filled: dict[int, int],
    complete: set[int],
    compatible: _Compatibility,
) -> tuple[int, int]:
    """The first caller op among ``callers[rows[begin]]``, ``callers[rows[begin + 1]]``, … (in
    order of start) that can have issued ``call``, and where the call starts in it.

    The op must have started before the call could have (``upper - d``, the
    call having ended by ``upper``), still run at ``lower``, not be ruled out by
    shapes, and have room for the call. A single-matrix op (``aten::addmm``,
    ``aten::mm``, …) makes one call, and so does a batched one (``aten::bmm``)
    that made a batched call (``SGEMM_BATCH``): ``complete`` holds those. Otherwise
    room is counted with the calls packed from the op's start: after those already given to it (``filled``: op id →
    end of its packed calls) and after the previous call of its thread
    (``thread_filled``: track → end; MKL is called from one thread at a time),
    allowing 10 % on the call's own duration. A blocked op (flash attention)
    runs its calls in parallel on its intra-op threads, so each call only has
    to fit in the op. Returns ``(-1, 0)`` when no op qualifies, else the op's index in ``callers``.
    """
    latest_start = upper - d + slack_ns
    for j in range(begin, len(rows)):
        i = rows[j]
        op = callers[i]
        if op.start_ns > latest_start:
            break  # sorted by start: no later op qualifies
        # (A complete op is never a blocked one: checked first, it skips the shape check.)
        if op.id in complete or op.end_ns < lower or not compatible(call, op):
            continue  # complete: one matrix product, or one batched call, made already
        if op.name in BLOCKED_GEMM_OPS:
            if d <= op.end_ns - op.start_ns + slack_ns:
                return i, op.start_ns
            continue
        t0 = max(op.start_ns, filled.get(op.id, op.start_ns), thread_filled.get(op.track_id, op.start_ns))
        if t0 + d <= op.end_ns + slack_ns + d // 10:
            return i, t0
    return -1, 0


class _ThreadCursors:
    """Where the search for each MKL call's op begins, thread by thread.

    Calls are taken in issue order, and the calls of one thread were issued in the order of
    its ops: on each thread track the search begins at the op the thread's previous call went
    to. A server's request threads issue calls in turn, so one cursor over every thread's ops
    (in order of start) would pass over the op of a request that started before another
    thread's op took a call, and leave the rest of that request's calls unplaced. The first
    fit of a call is the earliest-starting of each track's first fit (``_first_fit``), among
    the tracks of the process whose track the call was read on; with one track this is the
    search from the previous call's op on.
    """

    def __init__(self, callers: list[Span], tracks: dict[int, Track]) -> None:
        self._rows: dict[int, list[int]] = {}  # track -> indices in callers, by start
        for i, op in enumerate(callers):
            self._rows.setdefault(op.track_id, []).append(i)
        self._tracks = tracks
        self._reach: dict[int, list[int]] = {}  # track -> greatest end of its ops up to each
        for track, rows in self._rows.items():
            reach, top = [], -(1 << 63)
            for i in rows:
                top = max(top, callers[i].end_ns)
                reach.append(top)
            self._reach[track] = reach
        self._at: dict[int, int] = dict.fromkeys(self._rows, 0)  # track -> its previous call's op

    def first_fit(self, call: Span, callers: list[Span], d: int, upper: int, lower: int, *rest: Any) -> tuple[int, int]:
        """``_first_fit`` on each track from its cursor (past the ops that ended before
        ``lower``): the candidate that started first, or ``(-1, 0)``. ``rest``: the rest of
        ``_first_fit``'s arguments, from ``slack_ns`` on."""
        best, best_start = -1, 0
        pid = self._pid(call.track_id)
        for track, rows in self._rows.items():
            if pid is not None and self._pid(track) not in (pid, None):
                continue  # another process's thread: its calls are read on its own tracks
            begin = max(self._at[track], bisect.bisect_left(self._reach[track], lower))
            if begin >= len(rows) or (best >= 0 and rows[begin] > best):
                continue  # every op left on this track starts after the candidate found
            i, start = _first_fit(call, callers, rows, begin, d, upper, lower, *rest)
            if i >= 0 and (best < 0 or i < best):
                best, best_start = i, start
        return best, best_start

    def _pid(self, track: int) -> int | None:
        """The process of a track, or None where the run names none."""
        t = self._tracks.get(track)
        return t.pid if t is not None else None

    def chose(self, i: int, callers: list[Span]) -> None:
        """The call went to ``callers[i]``: its thread's next call is looked for from there."""
        track = callers[i].track_id
        self._at[track] = bisect.bisect_left(self._rows[track], i)


def _last_started(
    call: Span,
    callers: list[Span],
    cur: int,
    used: bool,
    d: int,
    upper: int,
    max_lag_ns: int,
    slack_ns: int,
    compatible: _Compatibility,
) -> int:
    """Index of the caller op, from ``cur`` on, that started last before ``call`` could have; -1 if none.

    The rule for untimed oneDNN calls: among the ops that started by
    ``upper - d``, still ran ``max_lag_ns`` before ``upper`` and are not ruled
    out by shapes, the latest. The op at ``cur`` (the previous call's) stays a
    candidate while it ran, since calls of one op may overlap (two OpenMP threads).
    """
    chosen = -1
    if (
        used
        and cur < len(callers)
        and callers[cur].start_ns <= upper
        and callers[cur].end_ns >= upper - max_lag_ns
        and compatible(call, callers[cur])
    ):
        chosen = cur
    for i in range(cur, len(callers)):
        op = callers[i]
        if op.start_ns > upper - d + slack_ns:
            break  # sorted by start: no later op qualifies
        if op.end_ns >= upper - max_lag_ns and compatible(call, op):
            chosen = i
    return chosen


def attach_library_calls(run: Run, slack_ns: int = 2_000, max_lag_ns: int = 500_000_000) -> Run:
    """Sets the parent (and track) of each CPU library span to the op that issued it.

    Timed calls: the parent is the innermost OP span, on any thread track of the run, whose
    interval contains the call's, each end widened by ``slack_ns`` (oneDNN stamps with a µs
    clock; a call that overhangs its parent by less is clipped to it); without one, the
    innermost containing span of another CPU level (layer, model, user).

    Untimed calls ended at or before the time ``r`` their line was received, having run ``d``
    ns; ``r`` may be late by however long the reader took. When one thread issued every call,
    ``r`` is first lowered to the start of the next timed call in issue order
    (``_end_bounds``). MKL calls are taken in issue order (``ml.library.seq``) and given to
    leaf caller ops (``MKL_CALLER_OPS`` with no such op nested in them on their track,
    leaving out ops that issued a timed oneDNN call): the first, from the op its thread's
    previous call went to on (``_ThreadCursors``: each thread track keeps its place, and only
    the tracks of the process that read the line are searched), that can have made the call
    (``_first_fit``). So receipt time only bounds the search,
    and a late line lands where a prompt one would (``benchmarks/mkl_placement.py`` measures
    this on a recorded run). Issue order cannot tell a caller op that made no MKL call (a
    tiny matrix on torch's own path) from a later one with compatible shapes that did: the
    call goes to the first. Untimed oneDNN calls go to leaf OP spans by ``_last_started``.

    An untimed call is laid out inside its op: it ends at ``min(r, op end)``, lasts ``d``
    where room allows, does not start before the previous call in the op ends (it is
    shortened instead), and gets ``ml.library.placement = "estimated"``. Calls with no
    candidate, and timed calls inside no span, are counted and set apart (``_set_apart``).

    Args:
        run: the run; not modified.
        slack_ns: tolerance (ns) on interval ends: clock resolution and alignment.
        max_lag_ns: longest plausible delay (ns) between an untimed call's end
            and the receipt of its line: the reader reads in batches of up to
            100 ms, and its Python loop waits for the GIL, which the program may
            hold for tens of ms (the last lines of a run, read while the session
            stopped, came 65 ms late with 10 ms batches). Issue order and room
            decide; this only keeps a call with no caller op (MKL used outside
            any profiled op) off a long-finished one.

    Returns:
        A run whose CPU library spans are replaced by re-parented copies;
        ``run.meta["correlation"]["attach_library_calls"]`` counts
        ``timed``/``untimed`` calls attached and ``unattached``.
    """
    from mltrace.tracer.passes.nesting import level_column

    all_spans = run.spans
    levels = level_column(all_spans)
    lib_level = Level.LIBRARY
    if levels is not None:
        at_level: Any = (levels == lib_level).nonzero()[0].tolist()
    else:
        at_level = (i for i, s in enumerate(all_spans) if s.level == lib_level)
    rows = [i for i in at_level if str(all_spans[i].attrs.get("ml.library.name")) in CPU_LIBRARIES]
    if not rows:
        return run.replace(meta=_with_note(run, {"timed": 0, "untimed": 0, "unattached": 0}))
    library = [all_spans[i] for i in rows]
    ops, context = _cpu_ops_and_context(run, levels)

    replaced: dict[int, Span] = {}
    issuer: dict[int, Span] = {}  # library span id -> the span it was put under
    counts = {"timed": 0, "untimed": 0, "unattached": 0}
    unplaced: list[Span] = []
    issuing_tracks: set[int] = set()  # tracks of the ops that issued timed calls

    op_index: _Containing | None = None
    context_index: _Containing | None = None
    for s in library:
        if s.attrs.get("ml.library.untimed"):
            continue
        op_index = op_index or _Containing(ops)
        parent = op_index.innermost(s.start_ns, s.end_ns, slack_ns, s.track_id)
        if parent is None:
            context_index = context_index or _Containing(context)
            parent = context_index.innermost(s.start_ns, s.end_ns, slack_ns, s.track_id)
        if parent is None:
            unplaced.append(s)
            continue
        counts["timed"] += 1
        issuing_tracks.add(parent.track_id)
        # Inside its parent within the slack (µs stamps): clipped to it, so it nests.
        start = min(max(s.start_ns, parent.start_ns), parent.end_ns)
        end = max(min(s.end_ns, parent.end_ns), start)
        replaced[s.id] = Span(s.id, parent.id, s.level, s.name, start, end, parent.track_id, dict(s.attrs))
        issuer[s.id] = parent

    untimed = sorted(
        (s for s in library if s.attrs.get("ml.library.untimed")),
        key=lambda s: (s.attrs.get("ml.library.seq", 0), s.id),
    )
    if untimed:
        # An op that issued a timed (oneDNN) call took that path, not MKL (bf16 matmuls).
        onednn_issuers = {span.parent_id for span in replaced.values()}
        mkl_callers = _leaf_callers([o for o in ops if o.name in MKL_CALLER_OPS and o.id not in onednn_issuers])
        op_leaves: list[Span] | None = None  # for untimed oneDNN calls, made when one comes
        issuing_tracks.update(op.track_id for op in mkl_callers)
        bounds = _end_bounds(library) if len(issuing_tracks) <= 1 else {}
        mkl_cursors = _ThreadCursors(mkl_callers, run.tracks)
        onednn_cursor = 0  # untimed oneDNN calls: the op of the previous one
        used = {"MKL": False, "oneDNN": False}
        last_end: dict[int, int] = {}  # op id -> end of the last call laid out in it
        filled: dict[int, int] = {}  # op id -> end of the MKL calls packed into it from its start
        complete: set[int] = set()  # ops that made the one call they make
        thread_filled: dict[int, int] = {}  # track -> end of its last packed (sequential) MKL call
        compatible = _Compatibility()
        for s in untimed:
            lib = s.attrs["ml.library.name"]
            if lib == "MKL":
                callers = mkl_callers
            else:
                callers = op_leaves = op_leaves if op_leaves is not None else _leaf_callers(ops)
            d = s.attrs.get("ml.library.exec_ns", s.end_ns - s.start_ns)
            received = s.attrs.get("ml.library.receive_ns", s.end_ns)
            r = min(received, bounds.get(s.id, received))
            if lib == "MKL":
                chosen, packed_start = mkl_cursors.first_fit(
                    s, callers, d, r, received - max_lag_ns, slack_ns, filled, thread_filled, complete, compatible
                )
            else:
                chosen = _last_started(s, callers, onednn_cursor, used[lib], d, r, max_lag_ns, slack_ns, compatible)
            if chosen < 0:
                unplaced.append(s)
                continue
            if lib == "MKL":
                mkl_cursors.chose(chosen, callers)
            else:
                onednn_cursor = chosen
            used[lib] = True
            op = callers[chosen]
            if lib == "MKL":
                if op.name not in BLOCKED_GEMM_OPS:
                    filled[op.id] = thread_filled[op.track_id] = packed_start + d
                if op.name in _SINGLE_GEMM_OPS or (op.name in _BATCHED_GEMM_OPS and "_BATCH" in str(s.attrs.get("ml.library.kind", ""))):
                    complete.add(op.id)
            # Laid out as late as its receipt allows, after the calls before it in the op.
            end = max(op.start_ns, min(r, op.end_ns))
            start = max(op.start_ns, end - d, last_end.get(op.id, op.start_ns))
            end = max(end, start)  # never after its receipt, unless pushed by the call before
            last_end[op.id] = end
            attrs = dict(s.attrs)
            attrs["ml.library.placement"] = "estimated"
            replaced[s.id] = Span(s.id, op.id, s.level, s.name, start, end, op.track_id, attrs)
            issuer[s.id] = op
            counts["untimed"] += 1

    for sid, span in replaced.items():
        # The library call belongs to the framework of the op that issued it (a span of the
        # run, found among its ops or context spans: ids are unique in a run).
        parent_attrs = issuer[sid].attrs
        if "ml.framework" in parent_attrs:
            span.attrs = {**span.attrs, "ml.framework": parent_attrs["ml.framework"]}  # may be shared
    counts["unattached"] = len(unplaced)
    tracks = dict(run.tracks)
    replaced.update(_set_apart(unplaced, tracks))
    spans = list(all_spans)
    for i in rows:  # only library spans are replaced
        new = replaced.get(spans[i].id)
        if new is not None:
            spans[i] = new
    return run.replace(spans=spans, tracks=tracks, meta=_with_note(run, counts))


def _cpu_ops_and_context(run: Run, levels: Any = None) -> tuple[list[Span], list[Span]]:
    """The run's op spans, and its model, layer and user spans, on CPU tracks (thread or async;
    every span where the run names no tracks), in run order. ``levels``: the spans' level
    column (``nesting.level_column``), which picks them by numpy, or None."""
    cpu_tracks = {tid for tid, t in run.tracks.items() if t.kind in (TrackKind.THREAD, TrackKind.ASYNC)}
    anywhere = not run.tracks
    spans = run.spans
    if levels is not None:
        import numpy as np

        from mltrace.tracer.passes.nesting import pick, span_columns

        on_cpu: Any = True
        if not anywhere:
            track = span_columns(spans, ("track",))["track"]
            on_cpu = np.isin(track, np.fromiter(cpu_tracks, dtype=np.int64, count=len(cpu_tracks)))
        ops_rows = ((levels == Level.OP) & on_cpu).nonzero()[0]
        context_rows = (np.isin(levels, np.array(_CONTEXT_LEVELS, dtype=np.int64)) & on_cpu).nonzero()[0]
        return pick(spans, ops_rows.tolist()), pick(spans, context_rows.tolist())
    op_level, context_levels = Level.OP, _CONTEXT_LEVELS
    ops: list[Span] = []
    context: list[Span] = []
    for s in spans:
        level = s.level
        if level == op_level:
            if anywhere or s.track_id in cpu_tracks:
                ops.append(s)
        elif level in context_levels and (anywhere or s.track_id in cpu_tracks):
            context.append(s)
    return ops, context


def _set_apart(unplaced: list[Span], tracks: dict[int, Track]) -> dict[int, Span]:
    """Calls that no op of the run can be shown to have issued, as roots on a lane of their own
    beside the track they were read on (``ml.library.placement = "unplaced"``). The verbose
    lines name no thread, so such a call is never left under a span it merely overlaps in
    time: on a server, another thread's request."""
    lanes: dict[int, int] = {}
    out: dict[int, Span] = {}
    for s in unplaced:
        lane = lanes.get(s.track_id)
        if lane is None:
            lane = lanes[s.track_id] = max(tracks, default=0) + 1
            home = tracks.get(s.track_id)
            pid, tid = (home.pid, home.tid) if home is not None else (0, 0)
            name = f"{home.name if home is not None else 'CPU'} (library calls not placed)"
            tracks[lane] = Track(lane, TrackKind.ASYNC, name, pid, tid, parent_track=s.track_id)
        out[s.id] = Span(s.id, None, s.level, s.name, s.start_ns, s.end_ns, lane, {**s.attrs, "ml.library.placement": "unplaced"})
    return out
