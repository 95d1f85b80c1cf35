"""Cold start apart from steady state: which model calls warmed the model up.

The rule (docs/ANALYSIS.md, "Cold start"), per model (model spans of one name, in
start order), with m and MAD the median and the median absolute deviation of the
durations of every call but the first:

- a call is an *outlier* when its duration d > m + k·1.4826·MAD and d > r·m
  (``ColdRule``: k = 5, r = 1.5): robust to a slow call among the steady ones, and
  never triggered by ordinary jitter when MAD is tiny;
- the first call is cold when it is an outlier, and so is each following call while
  every call before it was cold (a warm-up over several calls), where its calling
  thread's CPU time (``ml.thread.cpu_ns``, torch model calls) is an outlier too against
  the CPU times of every call but the first: a call that other processes slowed waited
  for a core and did no more work, so contention at the start is no warm-up;
- a later call is cold only when it is an outlier *and* one-time work ran inside it:
  an op, library call or CUDA API call whose name says compile, autotune, kernel
  loading, lazy initialisation or weight transfer (``ONE_TIME``) and which is absent
  from most of the model's calls. A later call whose contents were not recorded
  (no ops, library or API calls under it) is never cold: a GC pause is not warm-up.

A generate loop's prefill and decode calls (``ml.generate.phase``) are two kinds of call,
and so are a Keras model's ``predict()`` batches, eager calls and ``tf.function`` graph calls
(``ml.keras.method``): the rule runs on each kind apart, so a prefill is never cold for being
a prefill, and the first eager call after warm ``predict()`` calls is judged among the eager
calls, not hidden among faster graph calls. A torch model's training and evaluation calls
(``ml.model.training``, ``ml.grad.enabled``) and the calls at each batch size (the leading
dimension of the first input) are kinds of call too (``call_kinds``): a training step at batch
64 and an evaluation at batch 250 are not one workload. The only
call of its kind (the prefill of a program's one ``generate()``) has no reference to be an
outlier against: it is cold when torch.compile compiled inside it (one-time work of the
``compile`` category), so a prefill that compiled for its new shape is not steady.
A model called once has no steady state to compare with: its call is steady.
A call made while ``torch.jit.trace`` recorded a graph (``ml.jit.trace``: the trace, its check's
trace, the TorchScript ONNX exporter's) is cold whatever its time, and is no reference for the
rule: recording a graph is one-time work, as compiling is.
A call that raised (its model span has ``error.type``, ``FAILED_ATTR``) is neither: it is
left out of the rule and of the steady statistics, and counted apart (``ModelCalls.failed``).
What the cold calls spent time on is the excess of their ops', library calls' and
CUDA API calls' self time over as many steady calls (``Spent``), both with such work
recorded in them (none after the op level ended early): a model with no such steady call
lists none.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mltrace.run.events import TrackKind
from mltrace.run.levels import Level

if TYPE_CHECKING:
    import numpy as np

    from mltrace.run.store import Run
    from mltrace.run.table import SpanTable

#: (category, pattern) for names of one-time work; first match wins.
ONE_TIME: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (cat, re.compile(pat, re.IGNORECASE))
    for cat, pat in (
        ("compile", r"dynamo|inductor|codegen|compile_fx|aot_autograd|nvrtc|triton.*compile|compile_inner|call_user_compiler"),
        ("autotune", r"autotun|cudnnFind|Find\w*Algorithm|benchmark"),
        ("kernel loading (JIT)", r"cuModule|cuLibrary|FuncGetAttribute|FuncSetAttribute|cuKernelGet|jit.*creat|creat.*jit"),
        ("lazy init", r"Malloc|MemAlloc|HostAlloc|cuInit|lazy_?init|Create\b|Create[A-Z]|cudaGetDeviceProperties"),
        ("weight transfer", r"HtoD|MemcpyHtoD"),
    )
)
#: Categories for the names that took longer in cold calls (``Spent``), first match wins.
_SPENT: tuple[tuple[str, re.Pattern[str]], ...] = (
    *ONE_TIME,
    ("cuDNN/cuBLAS set-up", re.compile(r"cudnn|cublas|miopen|rocblas|hipblas|nvjet", re.IGNORECASE)),
    ("oneDNN/MKL set-up (JIT)", re.compile(r"mkldnn|onednn|oneDNN|MKL", re.IGNORECASE)),
    ("data transfer", re.compile(r"copy|aten::to\b|_to_copy|Memcpy", re.IGNORECASE)),
)
_TOP_SPENT = 8
#: The attribute a model span has when its call raised (the exception's type; OpenTelemetry's).
FAILED_ATTR = "error.type"
#: The calling thread's CPU time over a model call (ns; torch model spans).
CPU_ATTR = "ml.thread.cpu_ns"
#: The attribute of a PyTorch model call made while ``torch.jit.trace`` (or the TorchScript ONNX
#: exporter) recorded a graph: cold, whatever its time (``JIT_TRACE_WORK``).
JIT_TRACE_ATTR = "ml.jit.trace"
#: The one-time work a JIT-traced call did: (category, name), as ``ModelCalls.one_time`` lists it.
JIT_TRACE_WORK = ("compile", "torch.jit.trace")


@dataclass(frozen=True)
class ColdRule:
    """The constants of the cold-start rule.

    Attributes:
        k: robust z: an outlier exceeds the median by more than k·1.4826·MAD.
        min_ratio: and is more than this many times the median.
    """

    k: float = 5.0
    min_ratio: float = 1.5


COLD_RULE = ColdRule()


def outlier_bound(reference: Sequence[int], rule: ColdRule = COLD_RULE) -> float | None:
    """The duration (ns) above which a call is a robust outlier against ``reference`` (ns):
    above both the median plus ``k`` scaled MADs and ``min_ratio`` times the median; None for
    no reference."""
    if not reference:
        return None
    m = float(statistics.median(reference))
    mad = float(statistics.median(abs(x - m) for x in reference))
    return max(m + rule.k * 1.4826 * mad, rule.min_ratio * m)


def cold_indices(
    durations: Sequence[int], one_time: Sequence[bool | None], rule: ColdRule = COLD_RULE, cpu: Sequence[int | None] | None = None
) -> list[int]:
    """Which calls of one model are cold (the rule of the module docstring).

    Args:
        durations: every call's duration (ns), in start order.
        one_time: per call, whether one-time work was seen inside it (None: its
            contents were not recorded).
        rule: the constants.
        cpu: per call, the calling thread's CPU time over it (ns; None where unknown). A
            warm-up after the first call goes on only through calls whose CPU time is an
            outlier too (``warming_by_cpu``): a call slowed by other processes on the
            machine waits for a core, it does no more work.

    Returns:
        Indices of the cold calls, ascending.
    """
    if len(durations) < 2:
        return []
    bound = outlier_bound(list(durations[1:]), rule)  # once: every call is judged against the same reference
    assert bound is not None
    busy = warming_by_cpu(cpu, rule)
    cold: list[int] = []
    for i, d in enumerate(durations):
        warming = len(cold) == i and (i == 0 or busy(i))  # every call before this one was cold
        if not d > bound:
            continue
        if warming or one_time[i]:
            cold.append(i)
    return cold


#: The fewest calls with a known CPU time (after the first) that make a reference for it.
MIN_CPU_REFERENCE = 3


def warming_by_cpu(cpu: Sequence[int | None] | None, rule: ColdRule = COLD_RULE) -> Callable[[int], bool]:
    """Whether call ``i`` may go on warming a model up by its CPU time: it is an outlier against
    the CPU times of every call but the first, as durations are judged; any call where the CPU
    times are unknown (no ``cpu``, too few known, or not this call's)."""
    known = [c for c in (cpu or [])[1:] if c is not None]
    bound = outlier_bound(known, rule) if len(known) >= MIN_CPU_REFERENCE else None
    if cpu is None or bound is None:
        return lambda i: True
    limit, times = bound, cpu

    def busy(i: int) -> bool:
        own = times[i]
        return own is None or own > limit

    return busy


def cold_by_kind(
    durations: Sequence[int],
    one_time: Sequence[bool | None],
    kinds: Sequence[str],
    rule: ColdRule = COLD_RULE,
    compiled: Sequence[bool] | None = None,
    cpu: Sequence[int | None] | None = None,
) -> list[int]:
    """``cold_indices`` within each kind of call apart: a generate loop's prefill (the whole
    prompt) is another kind of call than its decode steps (one token), not a cold one. The
    only call of its kind, among other calls of the model, is cold when it compiled.

    Args:
        durations, one_time: as for ``cold_indices``, every call of one model in start order.
        kinds: per call, its kind ("prefill", "decode"; "" for a plain call).
        rule: the constants.
        compiled: per call, whether torch.compile compiled inside it (one-time work of the
            ``compile`` category); None: none did.
        cpu: per call, the calling thread's CPU time (``cold_indices``); None: unknown.

    Returns:
        Indices of the cold calls, ascending.
    """
    positions: dict[str, list[int]] = {}
    for i, kind in enumerate(kinds):
        positions.setdefault(kind, []).append(i)
    cold: list[int] = []
    for at in positions.values():
        if len(at) == 1 and len(durations) > 1:
            cold += [i for i in at if compiled is not None and compiled[i]]
            continue
        kind_cpu = [cpu[i] for i in at] if cpu is not None else None
        cold += [at[j] for j in cold_indices([durations[i] for i in at], [one_time[i] for i in at], rule, kind_cpu)]
    return sorted(cold)


def percentile_ns(values: Sequence[int], q: float) -> int | None:
    """The ``q``-th percentile (0..100) of durations (ns), linearly interpolated between
    the closest ranks (numpy's default), rounded to whole ns; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return round(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


def call_durations(run: Run, keys: list[tuple[str, Level]]) -> dict[tuple[str, Level], list[int]]:
    """The duration (ns) of every call of each (span name, level), in start order."""
    import numpy as np

    t = run.table
    if not keys or not len(t):
        return {}
    index = {nm: i for i, nm in enumerate(t.names)}
    out: dict[tuple[str, Level], list[int]] = {}
    levels = t.level.astype(np.int64)
    names = t.name.astype(np.int64)
    wanted = {(index[name], int(level)): (name, level) for name, level in keys if name in index}
    if not wanted:
        return {}
    rows = np.nonzero(np.isin(levels, [lv for _, lv in wanted]))[0]
    rows = rows[np.argsort(t.start[rows], kind="stable")]
    dur = np.maximum(t.end[rows] - t.start[rows], 0)
    for row, d in zip(rows.tolist(), dur.tolist()):
        key = wanted.get((int(names[row]), int(levels[row])))
        if key is not None:
            out.setdefault(key, []).append(int(d))
    return out


@dataclass
class KindCalls:
    """One kind of a model's calls (``call_kinds``).

    Attributes:
        kind: the kind ("train, batch 64"; "" for the calls with none of the others' parts).
        calls: how many calls of this kind.
        total_ns: their summed duration, cold and failed calls included (ns).
        cold: how many of them were cold.
        failed: how many of them raised.
        steady: the steady calls' durations (ns), in start order.
    """

    kind: str
    calls: int = 0
    total_ns: int = 0
    cold: int = 0
    failed: int = 0
    steady: list[int] = field(default_factory=list)

    @property
    def steady_median_ns(self) -> int | None:
        """Median duration of the kind's steady calls (ns)."""
        return percentile_ns(self.steady, 50)

    @property
    def steady_p90_ns(self) -> int | None:
        """90th percentile of the kind's steady calls' durations (ns)."""
        return percentile_ns(self.steady, 90)


@dataclass
class KindTotals:
    """One kind of a model's calls as the report's tables count them (``ModelCalls.counted_by_kind``).

    Attributes:
        kind: the kind (``call_kinds``).
        durations: the counted calls' durations (ns), in start order.
    """

    kind: str
    durations: list[int] = field(default_factory=list)

    @property
    def calls(self) -> int:
        """How many calls of this kind the tables count."""
        return len(self.durations)

    @property
    def total_ns(self) -> int:
        """Their summed duration (ns)."""
        return sum(self.durations)

    @property
    def median_ns(self) -> int | None:
        """Their median duration (ns)."""
        return percentile_ns(self.durations, 50)

    @property
    def p90_ns(self) -> int | None:
        """The 90th percentile of their durations (ns)."""
        return percentile_ns(self.durations, 90)


@dataclass
class ModelCalls:
    """One model's calls, cold and steady.

    Attributes:
        name: the model span's name.
        durations: every call's duration (ns), in start order.
        cold: indices of the cold calls.
        one_time: one-time work seen in the cold calls: category → names.
        failed: indices of the calls that raised (never cold, never steady).
        kinds: every call's kind (``call_kinds``), in start order; empty when not known.
    """

    name: str
    durations: list[int]
    cold: list[int] = field(default_factory=list)
    one_time: dict[str, list[str]] = field(default_factory=dict)
    failed: list[int] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)

    @property
    def steady(self) -> list[int]:
        """Durations of the steady calls (ns): neither cold nor failed."""
        apart = {*self.cold, *self.failed}
        return [d for i, d in enumerate(self.durations) if i not in apart]

    @property
    def cold_ns(self) -> int:
        """Summed duration of the cold calls (ns)."""
        return sum(self.durations[i] for i in self.cold)

    @property
    def steady_median_ns(self) -> int | None:
        """Median duration of the steady calls (ns)."""
        return percentile_ns(self.steady, 50)

    @property
    def steady_p90_ns(self) -> int | None:
        """90th percentile of the steady calls' durations (ns)."""
        return percentile_ns(self.steady, 90)

    def by_kind(self) -> list[KindCalls]:
        """The calls per kind of call, in the order each kind first ran; empty when the calls
        are of one kind (the model's own figures are then the kind's)."""
        if len(set(self.kinds)) < 2:
            return []
        cold, failed = set(self.cold), set(self.failed)
        out: dict[str, KindCalls] = {}
        for i, d in enumerate(self.durations):
            name = self.kinds[i] if i < len(self.kinds) else ""
            kind = out.setdefault(name, KindCalls(name))
            kind.calls += 1
            kind.total_ns += d
            kind.cold += i in cold
            kind.failed += i in failed
            if i not in cold and i not in failed:
                kind.steady.append(d)
        return list(out.values())

    def counted_by_kind(self, include_cold: bool) -> list[KindTotals]:
        """The calls the report's tables count (all of them with ``include_cold``, else all but
        the cold ones; failed calls are counted) per kind of call, in the order each kind first
        ran; empty when those calls are of one kind (the model's row mixes no kinds)."""
        cold = set() if include_cold else set(self.cold)
        out: dict[str, KindTotals] = {}
        for i, d in enumerate(self.durations):
            if i not in cold:
                name = self.kinds[i] if i < len(self.kinds) else ""
                out.setdefault(name, KindTotals(name)).durations.append(d)
        return list(out.values()) if len(out) > 1 else []

    def steady_by_kind(self) -> list[tuple[str, list[int]]]:
        """The steady calls' durations (ns) per kind of call, in the order each kind first
        ran; one entry ("", all of them) when the calls are of one kind."""
        apart = {*self.cold, *self.failed}
        by_kind: dict[str, list[int]] = {}
        for i, d in enumerate(self.durations):
            if i not in apart:
                by_kind.setdefault(self.kinds[i] if i < len(self.kinds) else "", []).append(d)
        return list(by_kind.items()) if len(by_kind) > 1 else [("", self.steady)]


@dataclass
class Spent:
    """What cold calls spent their extra time on: one name's excess self time.

    Attributes:
        name: an op, library call or CUDA API call.
        category: what kind of one-time work the name suggests ("" when none).
        ns: its self time in the cold calls minus that in as many steady calls (ns).
    """

    name: str
    category: str
    ns: int


@dataclass
class ColdStart:
    """The cold calls of every model of a run.

    Attributes:
        models: per model, its calls.
        spent: the names the cold calls spent most extra time on, largest first.
        rows: rows of the span table inside cold calls (the calls themselves included).
        intervals: the cold calls as (start ns, end ns, name): busy time, not idle, when
            the tables leave them out.
    """

    models: list[ModelCalls] = field(default_factory=list)
    spent: list[Spent] = field(default_factory=list)
    rows: np.ndarray | None = None
    intervals: list[tuple[int, int, str]] = field(default_factory=list)

    @property
    def cold_calls(self) -> int:
        """Number of cold calls over all models."""
        return sum(len(m.cold) for m in self.models)

    @property
    def cold_ns(self) -> int:
        """Their summed duration (ns)."""
        return sum(m.cold_ns for m in self.models)

    @property
    def failed_calls(self) -> int:
        """Number of model calls that raised, over all models."""
        return sum(len(m.failed) for m in self.models)

    def failed_text(self) -> str:
        """One line on the model calls that raised ("" when none did)."""
        n = self.failed_calls
        if not n:
            return ""
        per_model = ", ".join(f"{m.name} {len(m.failed)} of {len(m.durations)}" for m in self.models if m.failed)
        return (
            f"{n} model {'call' if n == 1 else 'calls'} raised an exception ({per_model}): left out of the cold-start rule "
            "and the models' steady median and p90; their spans are counted in the tables"
        )

    def model(self, name: str) -> ModelCalls | None:
        """The calls of the model ``name``, or None."""
        return next((m for m in self.models if m.name == name), None)


def category_of(name: str, patterns: Sequence[tuple[str, re.Pattern[str]]] = ONE_TIME) -> str:
    """The one-time category a span name suggests ("" when none)."""
    return next((cat for cat, pat in patterns if pat.search(name)), "")


def _work_names(run: Run, t: SpanTable) -> tuple[np.ndarray, list[str]]:
    """Per row, a key for its name as ops, library and CUDA API calls are listed (-1 for
    other rows); CPU-side API calls by ``cuda.api.name``, GPU memcpys by their kind."""
    import numpy as np

    lv = t.level.astype(np.int64)
    gpu = np.fromiter((tid for tid, tr in run.tracks.items() if tr.kind == TrackKind.GPU_STREAM), dtype=np.int64)
    on_gpu = np.isin(t.track, gpu)
    key = np.full(len(t), -1, dtype=np.int64)
    plain = np.isin(lv, [int(Level.OP), int(Level.LIBRARY)])
    key[plain] = t.name[plain]
    names = list(t.names)
    index = {n: i for i, n in enumerate(names)}
    kernel_rows = np.nonzero(lv == int(Level.KERNEL))[0]
    sets, inverse = np.unique(t.attr[kernel_rows], return_inverse=True)
    for j, k in enumerate(sets.tolist()):
        a = t.attr_set(int(k))
        name = a.get("cuda.api.name")
        if name is None and a.get("gpu.activity") == "gpu_memcpy":
            name = f"GPU memcpy {a.get('gpu.memcpy.kind', '?')}"
        if isinstance(name, str):
            rows = kernel_rows[inverse == j]
            rows = rows[~on_gpu[rows]] if not name.startswith("GPU memcpy") else rows
            key[rows] = index.setdefault(name, len(names))
            if len(names) < len(index):
                names.append(name)
    return key, names


def _self_ns(t: SpanTable, parent: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Duration minus the durations of direct children that are listed work on the same track."""
    import numpy as np

    dur = np.maximum(t.end - t.start, 0).astype(np.float64)
    child = (key >= 0) & (parent >= 0)
    child &= np.where(parent >= 0, key[np.maximum(parent, 0)] >= 0, False) & (t.track == t.track[np.maximum(parent, 0)])
    sub = np.bincount(parent[child], weights=dur[child], minlength=len(t)) if child.any() else np.zeros(len(t))
    return np.maximum(dur - sub, 0)


def model_call_rows(t: SpanTable) -> dict[str, list[int]]:
    """Each model's call spans as rows of ``t``, in start order, by the model span's name: the
    calls that ``ModelCalls``' indices count (its ``durations``, ``cold``, ``failed``)."""
    import numpy as np

    rows = np.nonzero(t.level.astype(np.int64) == int(Level.MODEL))[0]
    rows = rows[np.argsort(t.start[rows], kind="stable")]
    calls_of: dict[str, list[int]] = {}
    for r in rows.tolist():
        calls_of.setdefault(t.names[int(t.name[r])], []).append(r)
    return calls_of


def find_cold_start(run: Run, rule: ColdRule = COLD_RULE, spent: bool = True) -> ColdStart:
    """Tells the cold calls of each model from its steady ones (module docstring).

    Args:
        run: the run.
        rule: the constants of the rule.
        spent: also find what the cold calls spent their extra time on (``ColdStart.spent``).

    Returns:
        The models' calls, what the cold ones spent time on, and their rows.
    """
    import numpy as np

    from mltrace.analysis.tree import tree_of

    t = run.table
    out = ColdStart()
    calls_of = model_call_rows(t)
    if not calls_of:
        return out
    lv = t.level.astype(np.int64)
    tree = tree_of(t)
    is_model = lv == int(Level.MODEL)
    owner = tree.nearest(is_model)  # each span's nearest model call
    key, names = _work_names(run, t)
    markers = _one_time_markers(key, names, owner)
    cold_flag = np.zeros(len(t), dtype=bool)
    weight = np.zeros(len(t), dtype=np.float64)  # +1 cold, -n_cold/n_steady steady: for the excess
    for name, rows in calls_of.items():
        model = _model_calls(name, rows, t, markers, names, rule)
        out.models.append(model)
        if model.cold:
            cold_rows = [rows[i] for i in model.cold]
            cold_flag[cold_rows] = True
            out.intervals += [(int(t.start[r]), int(t.end[r]), f"{name} (cold)") for r in cold_rows]
            apart = {*model.cold, *model.failed}
            # Only calls with work recorded in them are compared: where the op level ended
            # early, the steady calls after its end have none, and subtracting nothing would
            # make every op of the cold calls look like extra time.
            cold_worked = [r for r in cold_rows if r in markers]
            steady_worked = [r for i, r in enumerate(rows) if i not in apart and r in markers]
            if cold_worked and steady_worked:
                weight[cold_worked] = 1.0
                weight[steady_worked] = -len(cold_worked) / len(steady_worked)
    if not cold_flag.any():
        return out
    inside = cold_flag | tree.ancestor_or(cold_flag)
    out.rows = np.nonzero(inside)[0].astype(np.int64)
    if spent:
        out.spent = _spent(t, tree.parent, key, names, owner, weight)
    return out


def _one_time_markers(key: np.ndarray, names: list[str], owner: np.ndarray) -> dict[int, set[int] | None]:
    """Per model call row: the keys of one-time names inside it (None: no work recorded in it)."""
    import numpy as np

    matched = np.fromiter((bool(category_of(n)) for n in names), dtype=bool, count=len(names))
    has_work = (key >= 0) & (owner >= 0)
    out: dict[int, set[int] | None] = {int(r): set() for r in np.unique(owner[has_work]).tolist()}
    rows = np.nonzero(has_work & matched[np.maximum(key, 0)])[0]
    for o, k in zip(owner[rows].tolist(), key[rows].tolist()):
        found = out[o]
        assert found is not None
        found.add(k)
    return out  # type: ignore[return-value]


def _model_calls(
    name: str, rows: list[int], t: SpanTable, markers: dict[int, set[int] | None], names: list[str], rule: ColdRule
) -> ModelCalls:
    import numpy as np

    at = np.asarray(rows, dtype=np.int64)
    durations = np.maximum(t.end[at] - t.start[at], 0).tolist()
    attrs = [t.attr_set(k) for k in t.attr[at].tolist()]
    raised = {i for i, a in enumerate(attrs) if FAILED_ATTR in a}
    traced = [i for i, a in enumerate(attrs) if a.get(JIT_TRACE_ATTR) is True and i not in raised]
    apart = raised.union(traced)
    ok = [i for i in range(len(rows)) if i not in apart]  # the calls that returned, no graph recorded
    seen = [markers.get(r) for r in rows]
    counts: dict[int, int] = {}
    for i in ok:
        for k in seen[i] or ():
            counts[k] = counts.get(k, 0) + 1
    rare = {k for k, c in counts.items() if 2 * c < len(ok)}  # one-time: in fewer than half the calls
    one_time = [None if (s := seen[i]) is None else bool(s & rare) for i in ok]
    compiled = [any(category_of(names[k]) == "compile" for k in (seen[i] or set()) & rare) for i in ok]
    kinds = call_kinds(attrs)
    cpu = [_cpu_ns(attrs[i]) for i in ok]
    cold = cold_by_kind([durations[i] for i in ok], one_time, [kinds[i] for i in ok], rule, compiled, cpu)
    model = ModelCalls(name, durations, sorted([ok[j] for j in cold] + traced), failed=sorted(raised), kinds=kinds)
    if traced:
        model.one_time.setdefault(JIT_TRACE_WORK[0], []).append(JIT_TRACE_WORK[1])
    for i in model.cold:
        for k in sorted(seen[i] or ()):
            found = model.one_time.setdefault(category_of(names[k]), [])
            if names[k] not in found:
                found.append(names[k])
    return model


def _cpu_ns(attrs: dict[str, Any]) -> int | None:
    """A model call's thread CPU time (``ml.thread.cpu_ns``), None where it has none."""
    value = attrs.get(CPU_ATTR)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def call_kind(attrs: dict[str, Any]) -> str:
    """A model call's kind, from its attributes: its ``ml.generate.phase`` (prefill, decode),
    else the Keras method it ran through (``ml.keras.method``: predict, __call__, tf.function,
    saved_model…), else ""."""
    for key in ("ml.generate.phase", "ml.keras.method"):
        kind = attrs.get(key)
        if isinstance(kind, str):
            return kind
    return ""


#: Beyond this many batch sizes among a model's calls, the batch size is no kind of call: sizes
#: that change call to call (a dynamic batcher, a sequence-first model whose leading dimension is
#: the sequence length) would make kinds of a call or two, which the cold rule cannot judge.
MAX_BATCH_KINDS = 8
#: Joins the parts of a kind of call ("eval, batch 250").
KIND_SEP = ", "


def call_mode(attrs: dict[str, Any]) -> str:
    """A torch model call's mode, from ``ml.model.training`` (``module.training``) and
    ``ml.grad.enabled`` (autograd on) at the call: "train", "eval", "eval with grad" (no
    ``torch.no_grad()`` around an evaluation), "train without grad"; "" where not recorded."""
    training, grad = attrs.get("ml.model.training"), attrs.get("ml.grad.enabled")
    if not isinstance(training, bool) or not isinstance(grad, bool):
        return ""
    if training:
        return "train" if grad else "train without grad"
    return "eval with grad" if grad else "eval"


def call_batch(attrs: dict[str, Any]) -> int | None:
    """A model call's batch size: the leading dimension of its first input (``ml.input.shapes``:
    a torch model's first positional tensor, else its first keyword tensor, as in
    ``model(**batch)``), None where it has no input shape or its first input is a scalar."""
    shapes = attrs.get("ml.input.shapes")
    if not isinstance(shapes, list) or not shapes or not isinstance(shapes[0], list) or not shapes[0]:
        return None
    first = shapes[0][0]
    return first if isinstance(first, int) and not isinstance(first, bool) else None


#: The modes ``call_mode`` names.
MODES = ("train", "eval", "eval with grad", "train without grad")


def kind_parts(kind: str) -> tuple[str, str, int | None]:
    """A kind of call (``call_kinds``) taken apart: its ``call_kind`` ("" where the kind has
    none), its mode ("" likewise) and its batch size (None likewise)."""
    how, mode, batch = "", "", None
    for part in kind.split(KIND_SEP) if kind else ():
        size = part.removeprefix("batch ")
        if size != part and size.isdigit():
            batch = int(size)
        elif part in MODES:
            mode = part
        else:
            how = part
    return how, mode, batch


def call_kinds(attrs: Sequence[dict[str, Any]]) -> list[str]:
    """Every call's kind among one model's calls (``attrs``: each call's attributes, in start
    order): its ``call_kind``, its mode (``call_mode``: train, eval) and its batch size
    (``call_batch``: "batch 64"), joined by ``KIND_SEP``. A part the same in every call is left
    out (a model only evaluated at batch 1 has one kind, ""), and so is the batch size where the
    calls have more than ``MAX_BATCH_KINDS`` of them. A sequence length is never a kind: the
    dimensions after the leading one are not read."""
    batches = [call_batch(a) for a in attrs]
    parts = [
        [call_kind(a) for a in attrs],
        [call_mode(a) for a in attrs],
        [f"batch {b}" if b is not None else "" for b in batches] if len(set(batches)) <= MAX_BATCH_KINDS else [],
    ]
    varying = [column for column in parts if len(set(column)) > 1]
    return [KIND_SEP.join(p for p in (column[i] for column in varying) if p) for i in range(len(attrs))]


def _spent(t: SpanTable, parent: np.ndarray, key: np.ndarray, names: list[str], owner: np.ndarray, weight: np.ndarray) -> list[Spent]:
    """Excess self time per name of the cold calls over as many steady calls."""
    import numpy as np

    self_ns = _self_ns(t, parent, key)
    # Each work row counts for its outermost model call: propagate the call's weight down.
    w = np.zeros(len(t), dtype=np.float64)
    rows = np.nonzero((key >= 0) & (owner >= 0))[0]
    w[rows] = weight[owner[rows]]
    rows = rows[w[rows] != 0]
    if not len(rows):
        return []
    excess = np.bincount(key[rows], weights=self_ns[rows] * w[rows], minlength=len(names))
    top = np.argsort(-excess)[:_TOP_SPENT]
    return [Spent(names[k], category_of(names[k], _SPENT), int(excess[k])) for k in top.tolist() if excess[k] > 0]


def left_out_note(cold_calls: int) -> str:
    """What counts over the steady calls leave out, as the report's header says it
    (" (the 2 cold calls and their spans left out)"; "" for no cold calls)."""
    if not cold_calls:
        return ""
    one = cold_calls == 1
    return f" (the {cold_calls} cold {'call' if one else 'calls'} and {'its' if one else 'their'} spans left out)"


def without_rows(run: Run, rows: np.ndarray) -> Run:
    """``run`` without the spans in ``rows`` of its table (tracks and metadata kept)."""
    import numpy as np

    from mltrace.run.table import SpanTable

    t = run.table
    keep = np.ones(len(t), dtype=bool)
    keep[rows] = False
    columns = {c: getattr(t, c)[keep] for c in ("id", "parent_id", "level", "name", "start", "end", "track", "flops", "has_flops")}
    sets, inverse = np.unique(t.attr[keep], return_inverse=True)
    columns["attr"] = inverse.astype(np.int32)
    table = SpanTable(columns, t.names, attr_sets=[t.attr_set(int(k)) for k in sets.tolist()])
    return run.replace(spans=None, table=table)
