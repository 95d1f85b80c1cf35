"""GPU time per layer, per op and per kernel (XSP's layer and kernel tables).

``attribute_gpu_activities`` accounts every GPU activity (a span with ``gpu.activity``:
kernel, memcpy or memset, from Kineto or from cupti-python) to one launch call, one op and
one layer; ``gpu_tables`` sums them per layer and per op (``GpuGroupStat``) and per kernel
name (``KernelStat``). An activity with no launch, op or layer is counted as unattributed in
that table, so each table's GPU time plus its unattributed GPU time is the run's. GPU time is
device busy time (overlapping kernels on several streams each count, as in XSP), not wall
time; times are in ns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.run.store import Run

#: Values of ``gpu.activity`` that are GPU work.
GPU_ACTIVITIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_MAX_DEPTH = 256  # bound on parent chains: a cyclic chain must not hang the analysis


@dataclass(frozen=True)
class Attribution:
    """Where one GPU activity came from (span ids; None when not found)."""

    activity: int
    launch: int | None
    op: int | None
    layer: int | None


@dataclass
class KernelStat:
    """One kernel (or memcpy / memset) name over the whole run.

    Attributes:
        name: the kernel's name (``gpu.kernel.name``) or the memcpy/memset name.
        activity: "kernel", "gpu_memcpy" or "gpu_memset".
        library: ``ml.library.name`` (cuDNN, cuBLAS, …) or "".
        count: number of executions.
        total_ns: summed duration (ns).
        min_ns, max_ns: shortest and longest execution (ns).
    """

    name: str
    activity: str
    library: str = ""
    count: int = 0
    total_ns: int = 0
    min_ns: int = 0
    max_ns: int = 0

    @property
    def mean_ns(self) -> float:
        """Mean duration (ns)."""
        return self.total_ns / self.count if self.count else 0.0


@dataclass
class GpuGroupStat:
    """GPU work accounted to one layer (by path) or one op (by name), over all its calls.

    Attributes:
        name: the layer path / model class, or the op name.
        level: MODEL, LAYER or OP.
        calls: number of spans of this name.
        cpu_ns: summed duration of those spans (ns).
        gpu_ns: summed duration of the GPU activities accounted to it (ns).
        gpu_inclusive_ns: layers: ``gpu_ns`` plus that of nested layers (ns);
            ops: equal to ``gpu_ns``.
        launches: distinct launch calls accounted to it (one ``cudaGraphLaunch`` launching
            40 kernels is one launch).
        activities: GPU activities accounted to it.
        memcpy_ns, memset_ns: the part of ``gpu_ns`` spent in memcpys and memsets (ns).
        flops: FLOP of its calls, as counted by the framework (0 when unknown; layers:
            ``_flops_of_layers``).
        kernels: kernel name → [count, total ns], for kernels accounted to it.
    """

    name: str
    level: Level
    calls: int = 0
    cpu_ns: int = 0
    gpu_ns: int = 0
    gpu_inclusive_ns: int = 0
    launches: int = 0
    activities: int = 0
    memcpy_ns: int = 0
    memset_ns: int = 0
    flops: float = 0.0
    kernels: dict[str, list[int]] = field(default_factory=dict)

    @property
    def flops_per_s(self) -> float | None:
        """FLOP per second of GPU time, or None where no FLOP is known or the GPU time is 0."""
        if not self.flops or self.gpu_ns <= 0:
            return None
        return self.flops / (self.gpu_ns * 1e-9)

    def top_kernels(self, n: int = 5) -> list[tuple[str, int, int]]:
        """The ``n`` kernels with the most GPU time: (name, count, total ns)."""
        items = sorted(self.kernels.items(), key=lambda kv: (-kv[1][1], kv[0]))[:n]
        return [(k, v[0], v[1]) for k, v in items]


@dataclass
class GpuTables:
    """The result of ``gpu_tables``.

    Attributes:
        layers: every layer (and model), by inclusive GPU time, largest first
            (layers that launched nothing included, with 0).
        ops: op names that GPU work is accounted to, by GPU time, largest first.
        kernels: per kernel name, by total time, largest first.
        gpu_ns: total GPU time of all activities (ns).
        activities: number of GPU activities.
        unattributed_to_op: activities with no op above their launch.
        unattributed_to_layer: activities with no layer or model above their launch.
        unattributed_op_ns, unattributed_layer_ns: their GPU time (ns).
        unlaunched: activities with no launch call (no flow, no API parent).
    """

    layers: list[GpuGroupStat]
    ops: list[GpuGroupStat]
    kernels: list[KernelStat]
    gpu_ns: int
    activities: int
    unattributed_to_op: int
    unattributed_to_layer: int
    unattributed_op_ns: int
    unattributed_layer_ns: int
    unlaunched: int


def is_gpu_activity(span: Span) -> bool:
    """Whether ``span`` is GPU work (kernel, memcpy, memset)."""
    activity = span.attrs.get("gpu.activity")
    return isinstance(activity, str) and activity in GPU_ACTIVITIES


def attribute_gpu_activities(run: Run) -> dict[int, Attribution]:
    """Finds the launch, op and layer of every GPU activity of ``run``.

    Its *launch* is the CUDA API call at the other end of its ``Flow(kind="launch")``, or
    failing a flow, its parent when that is an API call (``cuda.api.name``); its *op* is the
    innermost ``Level.OP`` span above the launch in the parent chain (after
    ``nest_by_containment`` an op contains its launch calls); its *layer* the innermost
    ``Level.LAYER`` or ``Level.MODEL`` span above the launch.

    Args:
        run: a correlated run (as loaded from a finished run directory).

    Returns:
        Activity span id → its attribution.
    """
    by_id = run.span_by_id()
    launch_of: dict[int, int] = {}
    for f in run.flows:
        if f.kind == "launch" and f.from_span in by_id:
            launch_of.setdefault(f.to_span, f.from_span)
    memo: dict[int, tuple[int | None, int | None]] = {}  # launch id → (op, layer)

    def enclosing(span_id: int) -> tuple[int | None, int | None]:
        if span_id in memo:
            return memo[span_id]
        op: int | None = None
        layer: int | None = None
        cur = by_id.get(span_id)
        for _ in range(_MAX_DEPTH):
            if cur is None or (op is not None and layer is not None):
                break
            if op is None and cur.level is Level.OP:
                op = cur.id
            if layer is None and cur.level in (Level.LAYER, Level.MODEL):
                layer = cur.id
            cur = by_id.get(cur.parent_id) if cur.parent_id is not None else None
        memo[span_id] = (op, layer)
        return op, layer

    out: dict[int, Attribution] = {}
    for s in run.spans:
        if not is_gpu_activity(s):
            continue
        launch = launch_of.get(s.id)
        if launch is None and s.parent_id is not None:
            parent = by_id.get(s.parent_id)
            if parent is not None and "cuda.api.name" in parent.attrs:
                launch = parent.id
        op, layer = enclosing(launch) if launch is not None else (None, None)
        out[s.id] = Attribution(s.id, launch, op, layer)
    return out


def _activity_name(s: Span) -> str:
    name = s.attrs.get("gpu.kernel.name")
    return name if isinstance(name, str) else s.name


def _flops_of_layers(run: Run, by_id: dict[int, Span]) -> dict[int, float]:
    """FLOP per layer/model span id: the span's own ``ml.flops`` when set, else the sum of
    ``ml.flops`` of the ops inside it that have no enclosing op with ``ml.flops`` (so
    ``aten::linear`` and the ``aten::addmm`` under it are not counted twice)."""
    out: dict[int, float] = {}
    for s in run.spans:
        if s.level in (Level.LAYER, Level.MODEL):
            f = s.attrs.get("ml.flops")
            if isinstance(f, (int, float)) and not isinstance(f, bool):
                out[s.id] = float(f)
    explicit = set(out)
    for s in run.spans:
        f = s.attrs.get("ml.flops")
        if s.level is not Level.OP or not isinstance(f, (int, float)) or isinstance(f, bool):
            continue
        cur = by_id.get(s.parent_id) if s.parent_id is not None else None
        counted_above = False
        for _ in range(_MAX_DEPTH):
            if cur is None or cur.level in (Level.LAYER, Level.MODEL):
                break
            if cur.level is Level.OP and isinstance(cur.attrs.get("ml.flops"), (int, float)):
                counted_above = True
                break
            cur = by_id.get(cur.parent_id) if cur.parent_id is not None else None
        if counted_above:
            continue
        # Every layer above the op gets its FLOP (inclusive), unless it set its own.
        for _ in range(_MAX_DEPTH):
            if cur is None:
                break
            if cur.level in (Level.LAYER, Level.MODEL) and cur.id not in explicit:
                out[cur.id] = out.get(cur.id, 0.0) + float(f)
            cur = by_id.get(cur.parent_id) if cur.parent_id is not None else None
    return out


def gpu_tables(run: Run) -> GpuTables:
    """Computes the per-layer, per-op and per-kernel GPU tables of a run.

    Args:
        run: a finished (correlated) run.

    Returns:
        The tables; empty lists where the run has no GPU activity.
    """
    by_id = run.span_by_id()
    attributions = attribute_gpu_activities(run)
    layers: dict[tuple[str, Level], GpuGroupStat] = {}
    ops: dict[str, GpuGroupStat] = {}
    kernels: dict[tuple[str, str], KernelStat] = {}
    layer_flops = _flops_of_layers(run, by_id)

    for s in run.spans:
        if s.level in (Level.LAYER, Level.MODEL):
            g = layers.setdefault((s.name, s.level), GpuGroupStat(s.name, s.level))
            g.calls += 1
            g.cpu_ns += s.duration_ns
            g.flops += layer_flops.get(s.id, 0.0)
        elif s.level is Level.OP:
            op_name = s.attrs.get("ml.op.name")
            name = op_name if isinstance(op_name, str) else s.name
            g = ops.setdefault(name, GpuGroupStat(name, Level.OP))
            g.calls += 1
            g.cpu_ns += s.duration_ns
            f = s.attrs.get("ml.flops")
            if isinstance(f, (int, float)) and not isinstance(f, bool):
                g.flops += float(f)

    def group_of_layer(span_id: int) -> GpuGroupStat:
        sp = by_id[span_id]
        return layers[(sp.name, sp.level)]

    def group_of_op(span_id: int) -> GpuGroupStat:
        sp = by_id[span_id]
        op_name = sp.attrs.get("ml.op.name")
        return ops[op_name if isinstance(op_name, str) else sp.name]

    launches_seen: dict[int, set[int]] = {}  # id(group) → launch ids
    gpu_total = unattr_op = unattr_layer = unattr_op_ns = unattr_layer_ns = unlaunched = 0

    def account(g: GpuGroupStat, s: Span, name: str, launch: int | None) -> None:
        d = s.duration_ns
        g.gpu_ns += d
        g.gpu_inclusive_ns += d
        g.activities += 1
        activity = s.attrs.get("gpu.activity")
        if activity == "gpu_memcpy":
            g.memcpy_ns += d
        elif activity == "gpu_memset":
            g.memset_ns += d
        agg = g.kernels.setdefault(name, [0, 0])
        agg[0] += 1
        agg[1] += d
        if launch is not None:
            launches_seen.setdefault(id(g), set()).add(launch)

    for s in run.spans:
        a = attributions.get(s.id)
        if a is None:
            continue
        d = s.duration_ns
        name = _activity_name(s)
        gpu_total += d
        activity = str(s.attrs.get("gpu.activity"))
        lib = s.attrs.get("ml.library.name")
        ks = kernels.get((name, activity))
        if ks is None:
            ks = kernels[(name, activity)] = KernelStat(name, activity, lib if isinstance(lib, str) else "", min_ns=d, max_ns=d)
        ks.count += 1
        ks.total_ns += d
        ks.min_ns = min(ks.min_ns, d)
        ks.max_ns = max(ks.max_ns, d)
        if a.launch is None:
            unlaunched += 1
        if a.op is None:
            unattr_op += 1
            unattr_op_ns += d
        else:
            account(group_of_op(a.op), s, name, a.launch)
        if a.layer is None:
            unattr_layer += 1
            unattr_layer_ns += d
        else:
            account(group_of_layer(a.layer), s, name, a.launch)
            # Enclosing layers get it in their inclusive time.
            inner = by_id[a.layer]
            seen: set[tuple[str, Level]] = {(inner.name, inner.level)}
            cur = by_id.get(inner.parent_id) if inner.parent_id is not None else None
            for _ in range(_MAX_DEPTH):
                if cur is None:
                    break
                key = (cur.name, cur.level)
                if cur.level in (Level.LAYER, Level.MODEL) and key not in seen:  # recursion: count once
                    seen.add(key)
                    layers[key].gpu_inclusive_ns += d
                cur = by_id.get(cur.parent_id) if cur.parent_id is not None else None

    for g in (*layers.values(), *ops.values()):
        g.launches = len(launches_seen.get(id(g), ()))
    return GpuTables(
        layers=sorted(layers.values(), key=lambda g: (-g.gpu_inclusive_ns, g.name)),
        ops=sorted((g for g in ops.values() if g.activities), key=lambda g: (-g.gpu_ns, g.name)),
        kernels=sorted(kernels.values(), key=lambda k: (-k.total_ns, k.name)),
        gpu_ns=gpu_total,
        activities=len(attributions),
        unattributed_to_op=unattr_op,
        unattributed_to_layer=unattr_layer,
        unattributed_op_ns=unattr_op_ns,
        unattributed_layer_ns=unattr_layer_ns,
        unlaunched=unlaunched,
    )
