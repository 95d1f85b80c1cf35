"""What is wrong with a run: verdicts per layer, op and type, and run-wide findings.

Two parts:

- ``classify``: the verdict rules, a pure function of plain numbers (times in
  ns, FLOP, bytes, peaks). docs/ANALYSIS.md states the rules; tests check them
  from tables.
- ``analyze``: those numbers per layer, per layer type, per op name, per
  library and per kernel name, and the run-wide findings (idle gaps,
  data-movement share, framework overhead, launch overhead), gathered from the
  run's span table by ``span_pass.gather`` (numpy, no per-span Python). It also
  rebuilds the plain ``Breakdown`` (same definitions as ``analysis.breakdown``,
  which stays the simple reference implementation the tests compare against).

Nothing here draws; viewers render ``Analysis``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from mltrace.analysis.breakdown import Breakdown, LayerStat, LevelTime, TypeStat, layers_named_by_model
from mltrace.analysis.coldstart import (
    ColdStart,
    KindTotals,
    call_durations,
    find_cold_start,
    left_out_note,
    percentile_ns,
    without_rows,
)
from mltrace.analysis.flushes import flushes_of
from mltrace.analysis.gcpauses import GcTime, gc_by_row, gc_note
from mltrace.analysis.generation import GenerateCall, generate_calls
from mltrace.analysis.memory import MemoryReport, memory_report
from mltrace.analysis.pauses import TRACER_PAUSE, Pauses
from mltrace.analysis.peaks import Peaks, PeakSet, raised
from mltrace.analysis.processes import ProcessRow, process_rows
from mltrace.analysis.ranks import RankTimes, rank_times
from mltrace.analysis.requests import Requests, find_requests
from mltrace.analysis.roofline import IO, roofline_time_ns
from mltrace.analysis.units import fmt_ns
from mltrace.run.events import TrackKind
from mltrace.run.levels import HIERARCHY, Level
from mltrace.run.ranges import DATALOADER
from mltrace.run.store import Run

if TYPE_CHECKING:
    import numpy as np

    from mltrace.analysis.span_pass import Gathered, NameAcc

# -- verdict rules -------------------------------------------------------------


class Bound(str, enum.Enum):
    """What limits a piece of work."""

    COMPUTE = "compute-bound"
    MEMORY = "memory-bound"
    OVERHEAD = "overhead-bound"
    UNKNOWN = "unknown"

    @property
    def short(self) -> str:
        """One word: compute, memory, overhead, unknown."""
        return self.value.split("-")[0]


@dataclass(frozen=True)
class Thresholds:
    """The constants of the verdict rules (docs/ANALYSIS.md explains each).

    Attributes:
        min_efficiency: below this fraction of the roofline, fixed costs dominate.
        tiny_efficiency: with many tiny ops, below this fraction already.
        launch_ratio: CPU time at least this many times the device time is launch-bound.
        tiny_op_ns: ops or kernels at most this long on average are "tiny" (ns).
        many_ops_per_call: at least this many ops per call are "many".
    """

    min_efficiency: float = 0.02
    tiny_efficiency: float = 0.10
    launch_ratio: float = 2.0
    tiny_op_ns: int = 20_000
    many_ops_per_call: float = 8.0


THRESHOLDS = Thresholds()


@dataclass(frozen=True)
class Verdict:
    """A verdict and the numbers behind it.

    Attributes:
        bound: the verdict.
        reason: one line saying why, with the numbers.
        intensity: arithmetic intensity (FLOP/byte), when work is known.
        efficiency: roofline time ÷ measured time (0..1, can exceed 1 when the
            peaks are conservative), when work is known.
        achieved_flops: FLOP/s reached, when FLOPs are known.
        basis: where the work numbers come from ("formula", "ops", "io", …).
    """

    bound: Bound
    reason: str
    intensity: float | None = None
    efficiency: float | None = None
    achieved_flops: float | None = None
    basis: str = ""


def _us(ns: float) -> str:
    return f"{ns / 1e3:.1f} µs"


def classify(
    *,
    time_ns: float,
    flops: float,
    moved_bytes: float,
    peak_flops: float,
    peak_bytes: float,
    work_known: bool = True,
    calls: int = 1,
    ops: int = 0,
    op_ns: float = 0,
    kernels: int = 0,
    device_ns: float = 0,
    basis: str = "",
    th: Thresholds = THRESHOLDS,
    ridge_bytes: float = 0.0,
) -> Verdict:
    """The verdict for one piece of work, from plain numbers.

    Rules, first match wins (docs/ANALYSIS.md):

    1. no time → unknown.
    2. launch-bound: GPU kernels ran (``device_ns > 0``) and the CPU time is at
       least ``launch_ratio`` × the device time → overhead-bound.
    3. no work estimate → overhead-bound if many tiny ops, else unknown; a known
       zero (a view, an identity) → overhead-bound.
    3c. roofline efficiency (below) above 1: faster than the roofs allow, so the
       work estimate (or a roof) is wrong → unknown, with no efficiency.
    4. roofline efficiency e = max(FLOP/peak, bytes/bandwidth) ÷ time (device
       time when kernels ran): many tiny ops and e < ``tiny_efficiency``, or
       e < ``min_efficiency`` → overhead-bound.
    5. intensity FLOP/byte ≥ the ridge peak/bandwidth → compute-bound, else memory-bound.

    Args:
        time_ns: wall time of the work on the CPU (ns), summed over calls.
        flops: FLOP, summed over calls.
        moved_bytes: bytes read and written, summed over calls.
        peak_flops: the device's peak (FLOP/s) for the work's data type.
        peak_bytes: the device's memory bandwidth (bytes/s).
        work_known: False when nothing estimates the work (then flops and
            bytes are ignored).
        calls: number of calls.
        ops: top-level ops inside, over all calls.
        op_ns: their summed duration (ns).
        kernels: GPU kernels launched inside, over all calls.
        device_ns: their summed duration on the GPU (ns).
        basis: where the work numbers come from (copied into the verdict).
        th: thresholds.
        ridge_bytes: the bandwidth of rule 5's ridge (bytes/s; ``Peaks.bound_bytes_per_s``:
            the measured memory bandwidth where the roof was raised); 0: ``peak_bytes``.
    """
    if time_ns <= 0:
        return Verdict(Bound.UNKNOWN, "no time recorded", basis=basis)
    if device_ns > 0 and time_ns >= th.launch_ratio * device_ns:
        mean = device_ns / kernels if kernels else device_ns
        return Verdict(
            Bound.OVERHEAD,
            f"launch-bound: CPU time is {time_ns / device_ns:.1f}× the GPU time ({kernels} kernels, mean {_us(mean)})",
            basis=basis,
        )
    many_tiny = ops > 0 and ops >= th.many_ops_per_call * max(calls, 1) and op_ns / ops <= th.tiny_op_ns
    tiny_text = f"{ops / max(calls, 1):.0f} ops per call, mean {_us(op_ns / ops)}" if ops else ""
    if not work_known or (flops <= 0 and moved_bytes <= 0):
        if many_tiny:
            return Verdict(Bound.OVERHEAD, f"many tiny ops: {tiny_text}", basis=basis)
        if work_known:
            return Verdict(Bound.OVERHEAD, "computes nothing and moves no data: the time is call overhead", basis=basis)
        return Verdict(Bound.UNKNOWN, "no FLOP estimate (unknown layer type, no op FLOPs)", basis=basis)
    t = device_ns if device_ns > 0 else time_ns
    t_roof = roofline_time_ns(flops, moved_bytes, peak_flops, peak_bytes)
    eff = t_roof / t
    intensity = flops / moved_bytes if moved_bytes > 0 else float("inf")
    achieved = flops / (t * 1e-9) if flops > 0 else None
    if eff > 1.0:  # faster than the roofline allows: the work estimate (or a roof) is wrong
        return Verdict(Bound.UNKNOWN, f"the work estimate needs {_us(t_roof)} at the roofline, more than its {_us(t)}", basis=basis)
    if many_tiny and eff < th.tiny_efficiency:
        return Verdict(Bound.OVERHEAD, f"many tiny ops: {tiny_text}; {100 * eff:.2g}% of the roofline", intensity, eff, achieved, basis)
    if eff < th.min_efficiency:
        return Verdict(
            Bound.OVERHEAD,
            f"at {100 * eff:.2g}% of the roofline: fixed per-call costs dominate the work",
            intensity,
            eff,
            achieved,
            basis,
        )
    ridge_bw = ridge_bytes or peak_bytes
    ridge = peak_flops / ridge_bw if ridge_bw > 0 else float("inf")
    if intensity >= ridge:
        return Verdict(
            Bound.COMPUTE,
            f"{_intensity_text(intensity)} FLOP/B ≥ ridge {ridge:.1f}; at {100 * eff:.0f}% of the roofline",
            intensity,
            eff,
            achieved,
            basis,
        )
    return Verdict(
        Bound.MEMORY,
        f"{_intensity_text(intensity)} FLOP/B < ridge {ridge:.1f}; at {100 * eff:.0f}% of the roofline",
        intensity,
        eff,
        achieved,
        basis,
    )


def _intensity_text(x: float) -> str:
    return "∞" if x == float("inf") else f"{x:.3g}"


# -- analysis data ----------------------------------------------------------------


@dataclass
class NameTime:
    """Calls and time of one name (an op, a library, a kernel) inside something.

    Attributes:
        name: the name.
        calls: number of spans.
        total_ns: their summed duration (ns).
    """

    name: str
    calls: int = 0
    total_ns: int = 0


@dataclass(frozen=True)
class KnownWork:
    """The calls of a row whose work is known in full, where they are fewer than all its calls
    (the op level ended early): its verdict and achieved FLOP/s are over these calls alone.

    Attributes:
        calls: their number.
        time_ns: their summed durations (ns).
        flops: their FLOPs.
        bytes: their bytes.
    """

    calls: int
    time_ns: int
    flops: float
    bytes: float


def known_work(calls: int, known_calls: int, time_ns: int, flops: float, moved: float) -> KnownWork | None:
    """The calls whose work is known in full, or None where that is every call."""
    return None if known_calls >= calls else KnownWork(known_calls, time_ns, flops, moved)


@dataclass
class LayerRow:
    """One layer (or model), aggregated over its calls, with its verdict.

    Attributes:
        stat: calls, total and self time, type, source location and direct ops
            (as in ``Breakdown``).
        flops: FLOP over all calls (subtree included).
        bytes: bytes moved over all calls.
        work_source: where flops/bytes come from (``roofline`` source names).
        op_ns: time of the top-level ops in the subtree (ns).
        op_count: number of those ops.
        framework_ns: self time not covered by the layer's direct ops (ns);
            None when the run has no ops.
        op_calls: calls made while the op level recorded: all of them, unless it
            ended early (``--op-inferences``, the memory budget).
        op_calls_ns: their summed durations (ns).
        layer_calls: calls made while the layer level recorded: all of them, unless
            it ended early (run.json ``layer_window``).
        layer_calls_ns: their summed durations (ns).
        libraries: library calls in the subtree, by name, largest first.
        kernels: GPU kernels in the subtree, by name, largest first.
        kernel_ns: their summed GPU time (ns).
        kernel_count: their number.
        known: where the op level ended early and some calls' work is not known in full
            (docs/ANALYSIS.md), the calls whose work is: the verdict and achieved FLOP/s are
            over them alone. None where every call's work is known.
        has_child_layers: whether any call contained layer spans.
        dtype: data type of the first input of the first call ("" if unknown).
        verdict: the verdict, or None when no peaks were given.
        median_ns: median duration of its calls (ns).
        p90_ns: 90th percentile of its calls' durations (ns).
        achieved_flops: FLOP/s reached over its kernels' GPU time when kernels ran,
            else over its CPU time; None without FLOPs or peaks.
        peak_share: that as a fraction of the FLOP/s peak of its device and dtype (≤ 1).
        gc: the program's garbage collections charged to its own calls (the innermost call
            running then), which its self time includes; None where none was.
        gc_within: those inside its calls at any depth, which its total time includes; the
            verdict and achieved FLOP/s leave them out.
        kinds: a model's row whose counted calls are of several kinds of call
            (``coldstart.call_kinds``: train and eval, batch sizes): its calls per kind, whose
            median and p90 its own would mix; empty otherwise, and for a layer's row.
    """

    stat: LayerStat
    flops: float = 0.0
    bytes: float = 0.0
    work_source: str = ""
    op_ns: int = 0
    op_count: int = 0
    framework_ns: int | None = None
    op_calls: int = 0
    op_calls_ns: int = 0
    layer_calls: int = 0
    layer_calls_ns: int = 0
    libraries: list[NameTime] = field(default_factory=list)
    kernels: list[NameTime] = field(default_factory=list)
    kernel_ns: int = 0
    kernel_count: int = 0
    known: KnownWork | None = None
    has_child_layers: bool = False
    dtype: str = ""
    verdict: Verdict | None = None
    median_ns: int | None = None
    p90_ns: int | None = None
    achieved_flops: float | None = None
    peak_share: float | None = None
    gc: GcTime | None = None
    gc_within: GcTime | None = None
    kinds: list[KindTotals] = field(default_factory=list)

    @property
    def own_ns(self) -> int:
        """Its self time less the garbage collections charged to its own calls (ns)."""
        return self.stat.self_ns - (self.gc.ns if self.gc is not None else 0)


@dataclass
class TypeRow:
    """All layers of one type together (leaf and container calls alike), each call with what it
    does itself: a container's row holds its own time and its own ops' work, none of its
    children's, so that no work is counted in two rows (docs/ANALYSIS.md, "Aggregations").

    Attributes:
        type: the layer type.
        calls: number of calls.
        total_ns: summed durations of its calls that are in no other call of its type (ns).
        self_ns: summed self times (ns).
        flops: FLOP of its calls' own ops (their work less their child layers').
        bytes: bytes of the same.
        known: the calls whose work is known in full (as ``LayerRow.known``; their self time
            and own work).
        verdict: the verdict over the self time and own work (of those calls), or None without
            peaks.
        op_ns: time of its calls' own top-level ops (ns).
        op_count: their number.
        kernel_ns: GPU time of the kernels those ops launched (ns).
        kernel_count: their number.
    """

    type: str
    calls: int = 0
    total_ns: int = 0
    self_ns: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    known: KnownWork | None = None
    verdict: Verdict | None = None
    op_ns: int = 0
    op_count: int = 0
    kernel_ns: int = 0
    kernel_count: int = 0


@dataclass
class NameRow:
    """One op, library or kernel name, aggregated over the run.

    Attributes:
        name: the name.
        calls: number of spans.
        total_ns: summed durations (ns).
        self_ns: summed durations minus their children on the same track (ns).
        flops: summed ``ml.flops`` (FLOP); 0 when not recorded.
        bytes: estimated bytes moved (ops only; estimated from up to 256 calls).
        device_ns: GPU time of the kernels they launched (ns).
        kernels: number of those kernels.
        detail: one extra word (the library of a library call or a kernel, a GPU activity kind).
        verdict: the verdict, or None.
    """

    name: str
    calls: int = 0
    total_ns: int = 0
    self_ns: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    device_ns: int = 0
    kernels: int = 0
    detail: str = ""
    verdict: Verdict | None = None
    achieved_flops: float | None = None
    peak_share: float | None = None

    @property
    def mean_ns(self) -> float:
        """Mean duration per call (ns)."""
        return self.total_ns / self.calls if self.calls else 0.0


@dataclass
class Gap:
    """An idle interval between two pieces of work on one timeline.

    Attributes:
        start_ns, end_ns: the gap (ns).
        where: the timeline ("between model calls", "GPU 0").
        before, after: names of the work either side.
    """

    start_ns: int
    end_ns: int
    where: str
    before: str
    after: str

    @property
    def duration_ns(self) -> int:
        """Length of the gap (ns)."""
        return self.end_ns - self.start_ns


@dataclass
class Idle:
    """Idle time on one timeline within its active window.

    Attributes:
        where: "between model calls", "GPU 0", …
        window_ns: first start to last end of the work on it (ns).
        busy_ns: union of the work's intervals (ns).
        gaps: the largest gaps, longest first (at most 5).
        tracer_ns: time in the window that mltrace itself held the program's thread outside
            the work (torch.profiler's cycle switches, run.json ``torch_profiler.pauses``):
            neither busy nor idle (ns).
        loading_ns: of the idle time, the time inside torch's DataLoader batches (ns): the
            model waited for its input.
        ops_ns: of the rest of the idle time, the time the program's process ran ops outside
            every model call and user span (ns): its own tensor code (a training step's
            backward pass and optimizer, pre- and post-processing).
        unrecorded_ns: of the idle time, the part after the op level ended early (ns), where
            no op was recorded: ``ops_ns`` cannot count the program's tensor code there.
    """

    where: str
    window_ns: int
    busy_ns: int
    gaps: list[Gap] = field(default_factory=list)
    tracer_ns: int = 0
    loading_ns: int = 0
    ops_ns: int = 0
    unrecorded_ns: int = 0

    @property
    def idle_ns(self) -> int:
        """Window minus busy time and mltrace's own pauses (ns)."""
        return self.window_ns - self.busy_ns - self.tracer_ns

    def headline(self) -> str:
        """The finding's text up to its largest gap: how long the work on it was idle, of what
        window, and what the program did meanwhile (``spent_text``)."""
        return f"Idle {self.where}: {fmt_ns(self.idle_ns)} ({100 * self.idle_share:.1f}% of {fmt_ns(self.window_ns)})" + self.spent_text()

    def tracer_text(self) -> str:
        """The clause on mltrace's own pauses in the window ("" when there were none)."""
        if not self.tracer_ns:
            return ""
        return f"; mltrace's own pauses (the op level's cycle switches, waits and early end) {fmt_ns(self.tracer_ns)} more, left out"

    def spent_text(self) -> str:
        """The clauses on what the program did in the idle time: load input, run ops of its own
        ("" when neither)."""
        out = ""
        for ns, what in (
            (self.loading_ns, "in DataLoader batches: the model waits for its input"),
            (self.ops_ns, "in ops outside model calls (the program's own tensor code: backward, optimizer, pre- and post-processing)"),
        ):
            if ns:
                share = 100 * ns / self.idle_ns if self.idle_ns > 0 else 100.0
                out += f"; {fmt_ns(ns)} of it ({share:.0f}%) {what}"
        if self.unrecorded_ns:
            share = 100 * self.unrecorded_ns / self.idle_ns if self.idle_ns > 0 else 100.0
            out += (
                f"; {fmt_ns(self.unrecorded_ns)} of it ({share:.0f}%) after the op level ended, where the program's ops were not recorded"
            )
        return out

    @property
    def idle_share(self) -> float:
        """Idle time as a fraction of the window."""
        return self.idle_ns / self.window_ns if self.window_ns else 0.0


@dataclass
class Findings:
    """Run-wide findings.

    Attributes:
        basis: what the bound shares are over: "leaf layers", "ops" or "" (nothing).
        bound_ns: time per verdict over that basis (ns).
        idle: idle time per timeline (between model calls; per GPU).
        data_movement_ns: time of copy/layout ops (outermost only) and GPU
            memcpy/memset (ns).
        data_movement_base_ns: what that is a share of: op time, plus GPU time (ns).
        data_movement_top: the largest data-movement items.
        framework_ns: layer self time not covered by the layers' ops (ns);
            None when the run has no ops or no layers.
        framework_base_ns: model time, the base of that share (ns).
        cpu_ns: CPU time of the work that launched kernels (model time, or op time) (ns).
        device_ns: GPU busy time (union per device, summed) (ns).
        notes: caveats worth printing.
    """

    basis: str = ""
    bound_ns: dict[Bound, int] = field(default_factory=dict)
    idle: list[Idle] = field(default_factory=list)
    data_movement_ns: int = 0
    data_movement_base_ns: int = 0
    data_movement_top: list[NameTime] = field(default_factory=list)
    framework_ns: int | None = None
    framework_base_ns: int = 0
    cpu_ns: int = 0
    device_ns: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def dominant(self) -> Bound:
        """The verdict holding the most time (unknown when none is known)."""
        known = {b: t for b, t in self.bound_ns.items() if b is not Bound.UNKNOWN and t > 0}
        return max(known, key=lambda b: known[b]) if known else Bound.UNKNOWN

    @property
    def mostly(self) -> bool:
        """Whether the dominant verdict holds more than half the time of every verdict, unknown
        included: the headline says "Mostly" then, else "Mixed" and the largest known."""
        return 2 * self.bound_ns.get(self.dominant, 0) > sum(self.bound_ns.values())


@dataclass
class RooflinePoint:
    """One point of the roofline plot.

    Attributes:
        label: what it is (a layer path, a layer type).
        kind: "layer" or "type".
        device: "cpu" or "gpu" (which roofs apply).
        intensity: FLOP/byte.
        flops_per_s: achieved FLOP/s.
        time_ns: the time it took (ns), to size the marker.
        bound: its verdict.
    """

    label: str
    kind: str
    device: str
    intensity: float
    flops_per_s: float
    time_ns: int
    bound: Bound


@dataclass
class Analysis:
    """Everything the bottleneck report shows.

    Attributes:
        breakdown: time per level, layers and types (``analysis.breakdown``).
        layers: every layer and model, by total time, largest first.
        types: layer types, by self time, largest first.
        ops: op names, by self time, largest first.
        libraries: library calls by name, by total time.
        kernels: GPU kernels by name, by total time.
        runtime: CPU-side kernel-level calls (CUDA API) by name, by total time.
        findings: run-wide findings.
        roofline: points for the roofline plot.
        peaks: the peaks the verdicts used, or None (no verdicts).
        levels: the levels present in the run.
        unscoped_ops: ops that ran outside every model, layer and user span (model
            construction, weight init, the program's own tensor code), and the time of the
            outermost of them (ns); the name tables and data movement leave them out. (0, 0)
            in a run with no such spans, whose tables count everything.
        unscoped_ops_elsewhere: of those ops, the ones in processes other than the program's
            (followed children: DataLoader workers, subprocesses).
        unscoped_ops_roles: the roles of those processes (``rank 1``, ``DataLoader worker 0``).
        unscoped_ops_loading: of those ops, the ones inside torch's DataLoader batches.
        unscoped_ops_compile: of those ops, the ones torch.compile ran while compiling.
        compile_ops: the ops torch.compile ran while compiling (``run/ranges.py``: TorchDynamo's
            tracing on fake tensors, AOTAutograd, Inductor) inside the model calls and user spans
            the tables count, and the time of the outermost compile-time spans (ns): the name
            tables, FLOPs, ops per call and data movement leave them out. (0, 0) when none ran.
        torch_ranges: torch's own ``record_function`` ranges (``run/ranges.py``), which are
            not counted as user spans: each kind's count and time (ns).
        level_ns_in_scope: each level's time (as in ``breakdown.levels``) counting only
            what ran inside a model, layer or user span (everything, in a run with none).
        cold: each model's cold and steady calls (``analysis.coldstart``).
        include_cold: whether the tables count the cold calls; when False every
            table, verdict and finding is over the steady calls only.
        generation: the run's ``generate()`` calls (``analysis.generation``).
        memory: allocations and peaks per layer and op (``analysis.memory``), or None in a
            run recorded without ``--memory``.
        requests: the service's requests, their latency and where the slowest spent their
            time (``analysis.requests``, over every call, cold or steady), or None in a run
            with no request span.
        ranks: each torch.distributed rank's model and collective time and the straggler
            (``analysis.ranks``), or None in a run with no rank.
        processes: each process's model calls and spans (``analysis.processes``), or None in
            a run of one process.
        counted: the run the tables count: the recorded run with each layer path that several
            models share named after its model (``layers_named_by_model``), without its cold
            calls unless ``include_cold``; None in an analysis built by hand. The cross-stack
            chains and hot lines read it (``tables_run``), so they count the calls the tables do.
    """

    breakdown: Breakdown
    layers: list[LayerRow]
    types: list[TypeRow]
    ops: list[NameRow]
    libraries: list[NameRow]
    kernels: list[NameRow]
    runtime: list[NameRow]
    findings: Findings
    roofline: list[RooflinePoint]
    peaks: PeakSet | None
    levels: list[Level]
    unscoped_ops: tuple[int, int] = (0, 0)
    unscoped_ops_elsewhere: int = 0
    unscoped_ops_roles: list[str] = field(default_factory=list)
    unscoped_ops_loading: int = 0
    unscoped_ops_compile: int = 0
    compile_ops: tuple[int, int] = (0, 0)
    torch_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    level_ns_in_scope: dict[Level, int] = field(default_factory=dict)
    cold: ColdStart = field(default_factory=ColdStart)
    include_cold: bool = True
    generation: list[GenerateCall] = field(default_factory=list)
    memory: MemoryReport | None = None
    requests: Requests | None = None
    ranks: RankTimes | None = None
    processes: list[ProcessRow] | None = None
    counted: Run | None = None

    def tables_run(self, run: Run) -> Run:
        """The run the tables count (``counted``), or ``run`` where the analysis names none."""
        return self.counted if self.counted is not None else run

    def counts_note(self) -> str:
        """What the header's span and model-call counts leave out ("" when they count every call)."""
        return "" if self.include_cold else left_out_note(self.cold.cold_calls)

    def cold_text(self) -> str:
        """One line on the cold calls and whether the tables count them ("" when there are none)."""
        c = self.cold
        if not c.cold_calls:
            return ""
        calls = "call" if c.cold_calls == 1 else "calls"
        where = "counted in the tables" if self.include_cold else "left out of the tables (--include-cold counts them)"
        return f"{c.cold_calls} cold {calls} ({c.cold_ns / 1e6:.2f} ms) {where}"

    def unscoped_text(self) -> str:
        """One line on the ops the name tables leave out ("" when none were)."""
        count, ns = self.unscoped_ops
        if not count:
            return ""
        elsewhere = self.unscoped_ops_elsewhere
        what = "model construction, weight init, the program's own tensor code"
        if elsewhere:
            roles = self.unscoped_ops_roles
            named = ", ".join(roles[:4]) + (f" and {len(roles) - 4} more" if len(roles) > 4 else "")
            what += f"; {elsewhere} of them in the program's child processes" + (f" ({named})" if roles else "")
        if self.unscoped_ops_loading:
            what += f"; {self.unscoped_ops_loading} of them in DataLoader batches"
        if self.unscoped_ops_compile:
            what += f"; {self.unscoped_ops_compile} of them torch.compile compiling"
        tables = "left out of the op, library and kernel tables"
        return f"{count} ops outside every model call and user span ({ns / 1e6:.2f} ms: {what}), {tables}"

    def compile_text(self) -> str:
        """One line on the ops torch.compile ran while compiling inside the counted calls ("" when none did)."""
        count, ns = self.compile_ops
        if not count:
            return ""
        return (
            f"{count} ops ran while torch.compile compiled ({ns / 1e6:.2f} ms: TorchDynamo tracing, AOTAutograd, Inductor), "
            "left out of the op, library and kernel tables, FLOPs and data movement"
        )

    def torch_ranges_text(self) -> str:
        """One line on torch's own ranges, which the user level leaves out ("" when there were none)."""
        if not self.torch_ranges:
            return ""
        by_time = sorted(self.torch_ranges.items(), key=lambda kv: -kv[1][1])
        kinds = ", ".join(f"{_RANGE_LABELS.get(kind, kind)} {count} ({fmt_ns(ns)})" for kind, (count, ns) in by_time)
        b = self.breakdown
        window = ""
        if b.op_model_calls is not None and b.op_model_calls < b.model_calls:  # torch.profiler records them
            window = f" (recorded while the op level ran: the first {b.op_model_calls} of {b.model_calls} model calls)"
        return f"torch's own record_function ranges, not counted as user spans: {kinds}{window}"

    def top_by_self(self, n: int) -> list[LayerRow]:
        """The ``n`` layers (not models) with the most self time, the program's garbage
        collections in it left out (``LayerRow.own_ns``): a collection is not the layer's work."""
        rows = [r for r in self.layers if r.stat.level is Level.LAYER]
        return sorted(rows, key=lambda r: (-r.own_ns, r.stat.name))[:n]


# -- the analysis -------------------------------------------------------------------

#: How the report names each kind of torch's own ranges (``run/ranges.py``).
_RANGE_LABELS = {DATALOADER: "DataLoader batches", "optimizer": "optimizer steps", "profiler step": "profiler steps"}

_ROOFLINE_LAYERS = 40


def _name_times(table: dict[str, list[int]] | None) -> list[NameTime]:
    if not table:
        return []
    return sorted((NameTime(k, v[0], v[1]) for k, v in table.items()), key=lambda x: (-x.total_ns, x.name))


def _union(intervals: list[tuple[int, int, str]]) -> tuple[int, list[tuple[int, int, str, str]]]:
    """Busy time of intervals and the gaps between them: (busy ns, [(start, end, before, after)])."""
    intervals.sort(key=lambda x: (x[0], x[1]))
    busy = 0
    gaps: list[tuple[int, int, str, str]] = []
    cur_s, cur_e, cur_name = intervals[0]
    for s, e, name in intervals[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((cur_e, s, cur_name, name))
            cur_s, cur_e, cur_name = s, e, name
        elif e > cur_e:
            cur_e, cur_name = e, name
    busy += cur_e - cur_s
    return busy, gaps


def _idle(
    where: str,
    intervals: list[tuple[int, int, str]],
    keep: int = 5,
    pauses: Pauses | None = None,
    loading: list[tuple[int, int]] | None = None,
    outside_ops: tuple[np.ndarray, np.ndarray] | None = None,
    ops_end_ns: int | None = None,
) -> Idle:
    """Idle time of ``intervals``' window; ``pauses`` (mltrace's own, session ns) inside the
    window and outside the intervals are neither busy nor idle, and end no gap; of the idle
    time, what ``loading`` (the DataLoader's batches) covers is counted as ``loading_ns``, and
    what ``outside_ops`` (starts, ends: ops outside model calls) covers of the rest as ``ops_ns``;
    what lies after ``ops_end_ns`` (the op level's early end) as ``unrecorded_ns``."""
    begin, end = min(s for s, _, _ in intervals), max(e for _, e, _ in intervals)
    inside = [(max(s, begin), min(e, end), TRACER_PAUSE) for s, e in (pauses.intervals if pauses else ()) if s < end and e > begin]
    busy, gaps = _union(list(intervals))
    if inside:
        with_pauses, gaps = _union([*intervals, *inside])
    else:
        with_pauses = busy
    accounted = [(s, e) for s, e, _ in (*intervals, *inside)]
    loading_ns = _covered_ns(accounted, _as_arrays(loading or []), begin, end)
    ops_ns = _covered_ns([*accounted, *(loading or [])], outside_ops, begin, end) if outside_ops is not None else 0
    unrecorded_ns = sum(max(0, e - max(s, ops_end_ns)) for s, e, _, _ in gaps) if ops_end_ns is not None else 0
    gaps.sort(key=lambda g: (g[0] - g[1], g[0]))
    kept = [Gap(s, e, where, b, a) for s, e, b, a in gaps[:keep]]
    return Idle(
        where, end - begin, busy, kept, tracer_ns=with_pauses - busy, loading_ns=loading_ns, ops_ns=ops_ns, unrecorded_ns=unrecorded_ns
    )


def _as_arrays(intervals: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of ``intervals``."""
    import numpy as np

    arr = np.asarray(intervals, dtype=np.int64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


def _covered_ns(accounted: list[tuple[int, int]], more: tuple[np.ndarray, np.ndarray], begin: int, end: int) -> int:
    """How much of ``[begin, end)`` that ``accounted`` leaves uncovered the intervals ``more``
    (starts, ends) cover (ns)."""
    if not len(more[0]):
        return 0
    import numpy as np

    from mltrace.analysis.span_pass import union_ns

    def clipped(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        starts, ends = np.clip(starts, begin, end), np.clip(ends, begin, end)
        keep = ends > starts
        return starts[keep], ends[keep]

    a_starts, a_ends = _as_arrays(accounted)
    with_more = clipped(np.concatenate([a_starts, more[0]]), np.concatenate([a_ends, more[1]]))
    return union_ns(*with_more) - union_ns(*clipped(a_starts, a_ends))


def _rows(table: dict[str, NameAcc]) -> list[NameRow]:
    return [
        NameRow(k, a.calls, a.total_ns, a.self_ns, a.flops, a.bytes, a.device_ns, a.kernels, a.detail) for k, a in table.items() if a.calls
    ]


#: The note of a run without a span.
NOTHING_RECORDED = (
    "nothing was recorded: the program called no PyTorch, TensorFlow or ONNX Runtime model and opened no mltrace.span or OpenTelemetry span"
)


def fx_symbolic_text(meta: dict[str, Any]) -> str:
    """One line on the PyTorch module calls on torch.fx proxies that were left out (run.json
    ``sources.torch.modules.fx_symbolic_calls``), "" where there were none."""
    sources = meta.get("sources")
    source = sources.get("torch.modules") if isinstance(sources, dict) else None
    n = source.get("fx_symbolic_calls") if isinstance(source, dict) else None
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        return ""
    calls = "call" if n == 1 else "calls"
    return f"{n} module {calls} on torch.fx proxies left out: a call on proxies records a graph, no inference (no model or layer spans)"


def analyze(run: Run, peaks: PeakSet | None = None, th: Thresholds = THRESHOLDS, include_cold: bool = True) -> Analysis:
    """Builds the bottleneck report's data from a run (``span_pass.gather`` does the counting).

    Args:
        run: a loaded run (any mix of levels; recorded or imported).
        peaks: the roofs to judge by; None leaves every verdict None.
        th: the verdict thresholds.
        include_cold: count the models' cold calls (``analysis.coldstart``) in the
            tables, verdicts and findings; ``mltrace report`` passes False unless
            ``--include-cold``.

    Returns:
        The analysis; ``analysis.breakdown`` follows the definitions of
        ``analysis/breakdown.py`` (of the run without its cold calls when ``include_cold``
        is False).
    """

    from mltrace.analysis.span_pass import gather  # numpy: imported when a report is made

    run = layers_named_by_model(run)
    cold = find_cold_start(run)
    generation = generate_calls(run, cold.intervals)  # a generate() call's first model call is its prefill, cold or not
    whole = run
    if not include_cold and cold.rows is not None:
        run = without_rows(run, cold.rows)
    g = gather(run)
    if not include_cold:  # a cold call left out is busy time between the calls, not idle
        g.model_intervals += cold.intervals
    ops = _rows(g.ops)
    has_ops = g.counts.get(int(Level.OP), 0) > 0
    layer_rows, type_rows = _layer_rows(g, has_ops, None, th)
    _charge_gc(run, g, layer_rows)
    _per_call(run, layer_rows)
    _per_kind(layer_rows, cold, include_cold)
    if peaks is not None:
        peaks = fit_peaks(peaks, layer_rows, ops)
        _judge(layer_rows, type_rows, peaks, th)
    models = [r for r in layer_rows if r.stat.level is Level.MODEL]
    model_ns = sum(r.stat.total_ns for r in models)
    layer_ended = g.layer_end_ns is not None
    op_ended = layer_ended or g.op_ends.partial
    order = [*HIERARCHY, Level.USER]
    breakdown = Breakdown(
        levels=[LevelTime(lv, g.counts[int(lv)], g.level_ns[int(lv)]) for lv in order if g.counts.get(int(lv))],
        layers=[r.stat for r in layer_rows],
        types=sorted((TypeStat(t.type, t.calls, t.self_ns) for t in type_rows), key=lambda x: (-x.self_ns, x.type)),
        model_calls=sum(r.stat.calls for r in models),
        model_ns=model_ns,
        wall_ns=g.wall_ns,
        span_count=g.span_count,
        ops_outside_layers=g.ops_outside_layers,
        ops_outside_layers_ns=g.ops_outside_layers_ns,
        ops_outside_models=g.ops_outside_models,
        reads_outside_layers=g.reads_outside_layers,
        reads_outside_layers_ns=g.reads_outside_layers_ns,
        layer_ops_outside_layers=g.layer_ops_outside_layers,
        layer_ops_outside_layers_ns=g.layer_ops_outside_layers_ns,
        layer_model_calls=sum(r.layer_calls for r in models) if layer_ended else None,
        layer_model_ns=sum(r.layer_calls_ns for r in models) if layer_ended else None,
        op_model_ns=sum(r.op_calls_ns for r in models) if op_ended else None,
        op_model_calls=sum(r.op_calls for r in models) if op_ended else None,
    )
    ops.sort(key=lambda r: (-r.self_ns, r.name))
    if peaks is not None:
        for row in ops:
            row.verdict = _op_verdict(row, peaks, th)
            roofs = peaks.gpu if row.kernels > 0 else peaks.cpu
            t = row.device_ns if row.kernels > 0 else row.total_ns
            if roofs is not None and row.flops > 0 and t > 0:
                row.achieved_flops = row.flops / (t * 1e-9)
                row.peak_share = _share_or_none(row.achieved_flops, roofs.top_flops_per_s)
    findings = _findings(g, layer_rows, ops, peaks, model_ns, has_ops, Pauses.of_run(run.meta))
    if not whole.spans:
        findings.notes.insert(0, NOTHING_RECORDED)
    if cold.failed_calls:
        findings.notes.append(cold.failed_text())
    unplaced = unplaced_library_text(whole)
    if unplaced:
        findings.notes.append(unplaced)
    symbolic = fx_symbolic_text(run.meta)
    if symbolic:
        findings.notes.append(symbolic)
    collections = gc_note(
        [(r.stat.name, r.gc_within) for r in models if r.gc_within is not None],
        [(r.stat.name, r.gc) for r in layer_rows if r.stat.level is Level.LAYER and r.gc is not None],
    )
    if collections:
        findings.notes.append(collections)
    flushes = flushes_of(whole, cold.models)
    if flushes is not None:
        findings.notes.append(flushes.text())
    leaf = [r for r in layer_rows if r.stat.level is Level.LAYER and not r.has_child_layers]
    type_rows.sort(key=lambda t: (-t.self_ns, t.type))
    return Analysis(
        breakdown=breakdown,
        layers=layer_rows,
        types=type_rows,
        ops=ops,
        libraries=sorted(_rows(g.libs), key=lambda r: (-r.total_ns, r.name)),
        kernels=sorted(_rows(g.kernels), key=lambda r: (-r.total_ns, r.name)),
        runtime=sorted(_rows(g.runtime), key=lambda r: (-r.total_ns, r.name)),
        findings=findings,
        roofline=_roofline_points(leaf, type_rows),
        peaks=peaks,
        levels=[lv for lv in order if g.counts.get(int(lv))],
        unscoped_ops=(g.unscoped_ops, g.unscoped_ops_ns),
        unscoped_ops_elsewhere=g.unscoped_ops_elsewhere,
        unscoped_ops_roles=g.unscoped_ops_roles,
        unscoped_ops_loading=g.unscoped_ops_loading,
        unscoped_ops_compile=g.unscoped_ops_compile,
        compile_ops=(g.compile_ops, g.compile_ns),
        torch_ranges=g.torch_ranges,
        level_ns_in_scope={lv: g.scoped_level_ns.get(int(lv), 0) for lv in order if g.counts.get(int(lv))},
        cold=cold,
        include_cold=include_cold,
        generation=generation,
        memory=memory_report(whole, run),
        requests=find_requests(run=whole),
        ranks=rank_times(run=whole),
        processes=process_rows(run=whole),
        counted=run,
    )


def unplaced_library_text(run: Run) -> str:
    """One line on the CPU library calls that no op could be shown to have issued (their spans
    have ``ml.library.placement = "unplaced"``: ``tracer/passes/library.py`` sets them apart on
    a lane of their own, outside every model call), "" when every call was placed."""
    import numpy as np

    t = run.table
    if not len(t):
        return ""
    rows = np.flatnonzero(t.level == int(Level.LIBRARY))
    sets, counts = np.unique(t.attr[rows], return_counts=True)
    unplaced = cpu = 0
    for k, n in zip(sets.tolist(), counts.tolist()):
        attrs = t.attr_set(k)
        cpu += n if attrs.get("ml.library.name") in ("MKL", "oneDNN") else 0
        unplaced += n if attrs.get("ml.library.placement") == "unplaced" else 0
    if not unplaced:
        return ""
    return (
        f"{unplaced} of {cpu} CPU library calls (MKL, oneDNN) could not be placed under the op that issued them "
        "(their log lines name no thread): set apart on a lane of their own, outside every model call, and left out of "
        "the layer, op and library tables"
    )


def _work_time_ns(kernels: int, device_ns: int, total_ns: int) -> int:
    """The time work is judged over: its kernels' GPU time when kernels ran, else its CPU time (ns)."""
    return device_ns if kernels > 0 else total_ns


def fit_peaks(peaks: PeakSet, rows: list[LayerRow], ops: list[NameRow]) -> PeakSet:
    """The peaks, a measured bandwidth roof raised to the highest bytes/s a layer or op reached
    on its device (a raised roof carries a note); FLOP roofs are never raised."""
    reached = {"cpu": 0.0, "gpu": 0.0}  # bytes/s
    work = [(o.kernels, o.device_ns, o.total_ns, o.bytes) for o in ops]
    for r in rows:
        time_ns, _, moved = _judged(r.stat.total_ns, r.flops, r.bytes, r.known)
        work.append((r.kernel_count, r.kernel_ns, time_ns, moved))
    for kernels, device_ns, total_ns, moved in work:
        t = _work_time_ns(kernels, device_ns, total_ns)
        if t > 0:
            where = "gpu" if kernels else "cpu"
            reached[where] = max(reached[where], moved / (t * 1e-9))

    def fit(p: Peaks | None, got: float) -> Peaks | None:
        # Datasheet roofs and FLOP roofs (the CPU's is the ISA's bound) are not raised: a point
        # above one is an estimate's error. A measured copy bandwidth is DRAM's, which work whose
        # data stays in cache beats; it alone is raised.
        if p is None or p.source == "table":
            return p
        return raised(p, 0.0, 0.0, got, "this run's layers and ops")

    cpu = fit(peaks.cpu, reached["cpu"])
    assert cpu is not None
    return PeakSet(cpu=cpu, gpu=fit(peaks.gpu, reached["gpu"]))


def _share_or_none(achieved: float, peak: float) -> float | None:
    """achieved ÷ peak, or None above 1 (a work estimate above a datasheet roof is wrong, not fast)."""
    share = achieved / peak if peak > 0 else None
    return share if share is not None and share <= 1.0 else None


def _judge(rows: list[LayerRow], types: list[TypeRow], peaks: PeakSet, th: Thresholds) -> None:
    """Sets the verdicts and achieved FLOP/s of layers and layer types."""
    members: dict[str, list[LayerRow]] = {}
    for row in rows:
        row.verdict = _layer_verdict(row, peaks, th)
        roofs = _peaks_for(row.kernel_count, peaks)
        time_ns, flops, _ = _judged(row.stat.total_ns, row.flops, row.bytes, row.known)
        t = _work_time_ns(row.kernel_count, row.kernel_ns, time_ns - _gc_judged_ns(row))
        if roofs is not None and flops > 0 and t > 0:
            row.achieved_flops = flops / (t * 1e-9)
            peak = roofs.flops_for(row.dtype) if row.dtype else roofs.top_flops_per_s
            row.peak_share = _share_or_none(row.achieved_flops, peak)
        if row.stat.level is Level.LAYER:
            members.setdefault(row.stat.type, []).append(row)
    for t_row in types:
        t_row.verdict = _type_verdict(t_row, members.get(t_row.type, []), peaks, th)


def _charge_gc(run: Run, g: Gathered, rows: list[LayerRow]) -> None:
    """Sets the program's garbage collections of each row (run.json ``gc``, ``analysis/gcpauses``)."""
    charged = gc_by_row(g.table, run.tracks, run.meta)
    if not charged.within:
        return
    for r in rows:
        key = (r.stat.name, r.stat.level)
        r.gc, r.gc_within = charged.own.get(key), charged.within.get(key)


def _gc_judged_ns(row: LayerRow) -> int:
    """The garbage collections left out of the time a row is judged over: those inside its
    calls, where it is judged over all of them (a collection is not told apart by whether its
    call's work is known)."""
    return row.gc_within.ns if row.gc_within is not None and row.known is None else 0


def _with_gc(v: Verdict, gc: GcTime | None, left_out: bool) -> Verdict:
    """The verdict, its reason saying how much of the time was the program's garbage collection."""
    if gc is None:
        return v
    how = ", left out of this verdict" if left_out else ""
    return replace(v, reason=f"{v.reason}; its time includes {gc.text()}{how}")


def _per_call(run: Run, rows: list[LayerRow]) -> None:
    """Sets each row's median and 90th percentile call duration (ns)."""
    durations = call_durations(run, [(r.stat.name, r.stat.level) for r in rows])
    for r in rows:
        calls = durations.get((r.stat.name, r.stat.level), [])
        r.median_ns, r.p90_ns = percentile_ns(calls, 50), percentile_ns(calls, 90)


def _per_kind(rows: list[LayerRow], cold: ColdStart, include_cold: bool) -> None:
    """Sets each model row's calls per kind of call, where the calls it counts are of several."""
    for r in rows:
        if r.stat.level is Level.MODEL:
            calls = cold.model(r.stat.name)
            r.kinds = calls.counted_by_kind(include_cold) if calls is not None else []


def _findings(
    p: Gathered,
    layer_rows: list[LayerRow],
    ops: list[NameRow],
    peaks: PeakSet | None,
    model_ns: int,
    has_ops: bool,
    pauses: Pauses,
) -> Findings:
    findings = Findings()
    leaf = [r for r in layer_rows if r.stat.level is Level.LAYER and not r.has_child_layers]
    if peaks is not None:
        if leaf:
            findings.basis = "leaf layers (total time)"
            covered = sum(r.stat.total_ns for r in leaf)
            if model_ns and covered < model_ns / 2:  # most of the work is in no leaf layer: say so
                findings.basis = f"leaf layers (total time; {100 * covered / model_ns:.2g}% of model time)"
            for r in leaf:  # a layer's share is its time less the program's collections in it, as its verdict's
                if r.verdict is not None:
                    findings.bound_ns[r.verdict.bound] = findings.bound_ns.get(r.verdict.bound, 0) + r.stat.total_ns - _gc_judged_ns(r)
        elif ops:
            findings.basis = "ops (self time)"
            for row in ops:
                if row.verdict is not None:
                    findings.bound_ns[row.verdict.bound] = findings.bound_ns.get(row.verdict.bound, 0) + row.self_ns
    if len(p.model_intervals) >= 2:
        ends = [e for e in (p.op_ends.default, *p.op_ends.by_framework.values()) if e is not None]
        findings.idle.append(
            _idle(
                "between model calls",
                p.model_intervals,
                pauses=pauses,
                loading=p.loading_intervals,
                outside_ops=p.outside_op_intervals,
                ops_end_ns=min(ends) if ends else None,
            )
        )
    for device in sorted(p.gpu_busy):
        idle = _idle(f"GPU {device}", p.gpu_busy[device])
        findings.idle.append(idle)
        findings.device_ns += idle.busy_ns
    if p.gpu_busy:
        findings.cpu_ns = model_ns or p.top_op_ns
    kernel_total = sum(a.total_ns for a in p.kernels.values())
    findings.data_movement_ns = sum(v[1] for v in p.moves.values())
    findings.data_movement_base_ns = p.top_op_ns + kernel_total
    findings.data_movement_top = _name_times(p.moves)[:5]
    models = [r for r in layer_rows if r.stat.level is Level.MODEL]
    calls = sum(r.stat.calls for r in models)
    if has_ops and layer_rows:
        findings.framework_ns = sum(r.framework_ns or 0 for r in layer_rows)
        findings.framework_base_ns = model_ns or sum(r.stat.self_ns for r in layer_rows)
        if p.op_ends.partial or p.layer_end_ns is not None:  # only the calls with ops in layers
            findings.framework_base_ns = sum(r.op_calls_ns for r in models) or sum(
                r.op_calls_ns for r in layer_rows if not r.has_child_layers
            )
            if not findings.framework_base_ns:  # no counted call ran with ops: nothing measured it
                findings.framework_ns = None
        if p.op_ends.partial:
            by_framework: dict[str, list[int]] = {}
            for r in models:
                counts = by_framework.setdefault(r.stat.framework or "?", [0, 0])
                counts[0] += r.op_calls
                counts[1] += r.stat.calls
            each = ""
            if len(by_framework) > 1:  # each framework's op level ends after its own calls
                each = " (" + ", ".join(f"{fw}: {n} of {m}" for fw, (n, m) in sorted(by_framework.items())) + ")"
            recorded = sum(r.op_calls for r in models)
            counted = "count those calls only" if recorded else "are not measured"
            why = "ended early" if p.op_ends.ended else "paused while its converter caught up"
            if p.op_ends.ended and p.op_ends.paused:
                why += " (and paused while its converter caught up)"
            findings.notes.append(
                f"the op level {why}: ops were recorded in {recorded} of {calls} model "
                f"calls{each}; framework overhead and ops per call {counted}"
            )
    elif layer_rows:
        findings.notes.append("no op spans: FLOPs come from layer formulas; framework overhead is not measured")
    if p.layer_end_ns is not None:
        findings.notes.append(
            f"the layer level ended early: layers were recorded in {sum(r.layer_calls for r in models)} of {calls} "
            "model calls; layer shares are of those calls' time"
        )
    if peaks is not None and peaks.cpu.note:
        findings.notes.append(f"CPU peaks {peaks.cpu.note}")
    if p.gpu_busy and (peaks is None or peaks.gpu is None):
        findings.notes.append("GPU not in the table of known GPUs (or its name was not recorded): GPU roofline verdicts are unknown")
    return findings


def _layer_rows(g: Gathered, has_ops: bool, peaks: PeakSet | None, th: Thresholds) -> tuple[list[LayerRow], list[TypeRow]]:
    """Report rows per layer name and per layer type, with their verdicts."""
    table = g.table  # the one gather used: a run in memory would build a new one
    rows: list[LayerRow] = []
    for acc in g.rows:
        attrs = table.attrs(acc.first)
        site = table.attrs(acc.site) if acc.site >= 0 else attrs  # the most frequent call site
        stat = LayerStat(
            acc.name,
            acc.level,
            acc.type,
            calls=acc.calls,
            total_ns=acc.total_ns,
            self_ns=acc.self_ns,
            file=site.get("code.file.path"),
            line=site.get("code.line.number"),
            framework=str(attrs.get("ml.framework", "")),
            ops=acc.direct_ops,
            defined_file=attrs.get("ml.defined.file.path"),
            defined_line=attrs.get("ml.defined.line.number"),
        )
        dtypes = attrs.get("ml.input.dtypes")
        row = LayerRow(
            stat,
            flops=acc.flops,
            bytes=acc.bytes,
            work_source=acc.work_source,
            op_ns=acc.op_ns,
            op_count=acc.op_count,
            framework_ns=acc.framework_ns if has_ops else None,
            op_calls=acc.op_calls,
            op_calls_ns=acc.op_calls_ns,
            layer_calls=acc.layer_calls,
            layer_calls_ns=acc.layer_calls_ns,
            libraries=_name_times(acc.libraries),
            kernels=_name_times(acc.kernels),
            kernel_ns=acc.kernel_ns,
            kernel_count=acc.kernel_count,
            known=known_work(acc.calls, acc.known_calls, acc.known_ns, acc.known_flops, acc.known_bytes),
            has_child_layers=acc.has_child_layers,
            dtype=str(dtypes[0]) if isinstance(dtypes, list) and dtypes else "",
        )
        if peaks is not None:
            row.verdict = _layer_verdict(row, peaks, th)
        rows.append(row)
    types = [
        TypeRow(
            name,
            t.calls,
            t.total_ns,
            t.self_ns,
            t.flops,
            t.bytes,
            known_work(t.calls, t.known_calls, t.known_ns, t.known_flops, t.known_bytes),
            op_ns=t.op_ns,
            op_count=t.op_count,
            kernel_ns=t.kernel_ns,
            kernel_count=t.kernel_count,
        )
        for name, t in g.types.items()
    ]
    if peaks is not None:
        members: dict[str, list[LayerRow]] = {}
        for row in rows:
            if row.stat.level is Level.LAYER:
                members.setdefault(row.stat.type, []).append(row)
        for t in types:
            t.verdict = _type_verdict(t, members.get(t.type, []), peaks, th)
    return sorted(rows, key=lambda r: (-r.stat.total_ns, r.stat.name)), types


def _peaks_for(row_kernels: int, peaks: PeakSet) -> Peaks | None:
    if row_kernels > 0:
        return peaks.gpu
    return peaks.cpu


def _judged(total_ns: int, flops: float, moved: float, known: KnownWork | None) -> tuple[int, float, float]:
    """(time ns, FLOPs, bytes) a row is judged over: those of its calls whose work is known in
    full (``known``), else of all its calls."""
    return (total_ns, flops, moved) if known is None else (known.time_ns, known.flops, known.bytes)


def _basis_text(source: str, calls: int, known: KnownWork | None) -> str:
    """A verdict's basis: the work's source, and how many calls it is over where not all."""
    return source if known is None else f"{source} ({known.calls} of {calls} calls)"


def _over_known(v: Verdict, calls: int, known: KnownWork | None) -> Verdict:
    """The verdict, its reason saying what calls it is over where not all of them."""
    if known is None:
        return v
    return replace(v, reason=f"{v.reason}; over the {known.calls} of {calls} calls whose work is known in full")


def _no_known_calls(calls: int, basis: str) -> Verdict:
    """The verdict of a row none of whose calls has its work known in full."""
    return Verdict(Bound.UNKNOWN, f"no work estimate: the op level ended before any of its {calls} calls did", basis=basis)


def _layer_verdict(row: LayerRow, peaks: PeakSet, th: Thresholds) -> Verdict:
    roofs = _peaks_for(row.kernel_count, peaks)
    known = row.work_source != IO  # inputs and outputs alone give bytes, and no FLOPs: not the work
    calls = row.stat.calls
    basis = _basis_text(row.work_source, calls, row.known)
    if row.known is not None and row.known.calls == 0:
        return _no_known_calls(calls, basis)
    time_ns, flops, moved = _judged(row.stat.total_ns, row.flops, row.bytes, row.known)
    gc_ns = _gc_judged_ns(row)
    time_ns -= gc_ns
    if roofs is None:  # kernels on a GPU not in the table: only the launch rule can speak
        v = classify(
            time_ns=time_ns,
            flops=0,
            moved_bytes=0,
            peak_flops=1,
            peak_bytes=1,
            work_known=False,
            calls=calls,
            kernels=row.kernel_count,
            device_ns=row.kernel_ns,
            basis=basis,
            th=th,
        )
        return _with_gc(_over_known(v, calls, row.known), row.gc_within, gc_ns > 0)
    v = classify(
        time_ns=time_ns,
        flops=flops,
        moved_bytes=moved,
        peak_flops=roofs.flops_for(row.dtype),
        peak_bytes=roofs.bytes_per_s,
        ridge_bytes=roofs.bound_bytes_per_s,
        work_known=known,
        calls=row.op_calls,  # the ops-per-call rule: calls without recorded ops do not count
        ops=row.op_count,
        op_ns=row.op_ns,
        kernels=row.kernel_count,
        device_ns=row.kernel_ns,
        basis=basis,
        th=th,
    )
    return _with_gc(_over_known(v, calls, row.known), row.gc_within, gc_ns > 0)


def _type_verdict(t: TypeRow, members: list[LayerRow], peaks: PeakSet, th: Thresholds) -> Verdict:
    """A layer type's verdict over its calls' self time and own work (``TypeRow``)."""
    roofs = _peaks_for(t.kernel_count, peaks)
    sources = {r.work_source for r in members}
    source = sources.pop() if len(sources) == 1 else "mixed"
    basis = _basis_text(source, t.calls, t.known)
    if t.known is not None and t.known.calls == 0:
        return _no_known_calls(t.calls, basis)
    time_ns, flops, moved = _judged(t.self_ns, t.flops, t.bytes, t.known)
    gc = _members_gc(members)
    gc_ns = gc.ns if gc is not None and t.known is None else 0
    v = classify(
        time_ns=time_ns - gc_ns,
        flops=flops if roofs is not None else 0,
        moved_bytes=moved if roofs is not None else 0,
        peak_flops=roofs.flops_for(members[0].dtype if members else None) if roofs is not None else 1,
        peak_bytes=roofs.bytes_per_s if roofs is not None else 1,
        ridge_bytes=roofs.bound_bytes_per_s if roofs is not None else 0.0,
        work_known=roofs is not None and source != IO,
        calls=t.calls,
        ops=t.op_count,
        op_ns=t.op_ns,
        kernels=t.kernel_count,
        device_ns=t.kernel_ns,
        basis=basis,
        th=th,
    )
    return _with_gc(_over_known(v, t.calls, t.known), gc, gc_ns > 0)


def _members_gc(members: list[LayerRow]) -> GcTime | None:
    """The garbage collections charged to the calls of a layer type's layers themselves (part of
    their self time), summed."""
    own = [r.gc for r in members if r.gc is not None]
    if not own:
        return None
    return GcTime(sum(g.count for g in own), sum(g.ns for g in own), sum(g.full for g in own))


def _op_verdict(row: NameRow, peaks: PeakSet, th: Thresholds) -> Verdict:
    roofs = peaks.gpu if row.kernels > 0 else peaks.cpu
    return classify(
        time_ns=row.total_ns,
        flops=row.flops if roofs is not None else 0,
        moved_bytes=row.bytes if roofs is not None else 0,
        peak_flops=roofs.top_flops_per_s if roofs is not None else 1,  # an op's dtype is not known: the top roof
        peak_bytes=roofs.bytes_per_s if roofs is not None else 1,
        ridge_bytes=roofs.bound_bytes_per_s if roofs is not None else 0.0,
        work_known=roofs is not None and (row.flops > 0 or row.bytes > 0),
        calls=row.calls,
        kernels=row.kernels,
        device_ns=row.device_ns,
        basis="op shapes",
        th=th,
    )


def _roofline_points(leaf: Iterable[LayerRow], types: Iterable[TypeRow]) -> list[RooflinePoint]:
    points: list[RooflinePoint] = []
    for r in sorted(leaf, key=lambda r: -r.stat.total_ns)[:_ROOFLINE_LAYERS]:
        v = r.verdict
        if v is None or v.intensity is None or not v.achieved_flops:
            continue
        device = "gpu" if r.kernel_count else "cpu"
        points.append(RooflinePoint(r.stat.name, "layer", device, v.intensity, v.achieved_flops, r.stat.total_ns, v.bound))
    for t in types:
        v = t.verdict
        if v is None or v.intensity is None or not v.achieved_flops:
            continue
        device = "gpu" if t.kernel_count else "cpu"
        points.append(RooflinePoint(t.type, "type", device, v.intensity, v.achieved_flops, t.self_ns, v.bound))
    return points


# -- timeline overview ------------------------------------------------------------


@dataclass
class Lane:
    """How busy one level is on one track, over time.

    Attributes:
        track: the track's display name ("MainThread", "GPU 0 stream 7").
        kind: the track kind ("thread", "gpu_stream", …).
        level: the level drawn.
        busy: per time bin, the fraction (0..1) covered by spans of this level.
        spans: number of spans in the lane.
    """

    track: str
    kind: str
    level: Level
    busy: list[float]
    spans: int


@dataclass
class Timeline:
    """A coarse overview of a run: lanes of busy fractions over equal time bins.

    Attributes:
        start_ns, end_ns: the window (ns).
        bins: number of bins.
        lanes: the lanes, threads first then GPU streams, outer levels first.
        models: model calls as (start ns, end ns, name), at most ``max_models``.
    """

    start_ns: int
    end_ns: int
    bins: int
    lanes: list[Lane] = field(default_factory=list)
    models: list[tuple[int, int, str]] = field(default_factory=list)

    @property
    def bin_ns(self) -> float:
        """Width of one bin (ns)."""
        return (self.end_ns - self.start_ns) / self.bins if self.bins else 0.0


def timeline(run: Run, bins: int = 600, max_lanes: int = 24, max_models: int = 400) -> Timeline:
    """Bins a run's spans into lanes (track × level) of busy fractions.

    Args:
        run: the run.
        bins: number of time bins over the whole run.
        max_lanes: lanes kept (the busiest, in track and level order).
        max_models: model calls listed for markers.

    Returns:
        The overview; empty when the run has no spans.
    """
    import numpy as np

    t = run.table
    if not len(t):
        return Timeline(0, 0, bins)
    start = int(t.start.min())
    end = int(t.end.max())
    out = Timeline(start, max(end, start + 1), bins)
    # Relative to the start: epoch nanoseconds (~1.7e18) are coarser than 1 ns as floats.
    edges = np.arange(bins + 1, dtype=np.float64) * out.bin_ns
    level = t.level.astype(np.int64)
    for r in np.nonzero(level == int(Level.MODEL))[0][:max_models].tolist():
        out.models.append((int(t.start[r]), int(t.end[r]), t.names[int(t.name[r])]))
    keep = (level != int(Level.SOURCE)) & (t.end >= t.start)
    rows = np.nonzero(keep)[0]
    group = t.track[rows].astype(np.int64) * 16 + level[rows]
    order = np.lexsort((t.end[rows], t.start[rows], group))
    rows, group = rows[order], group[order]
    bounds = np.flatnonzero(np.diff(group)) + 1
    rank = {lv: i for i, lv in enumerate((*HIERARCHY, Level.USER))}
    lanes: list[tuple[tuple[int, int, int], Lane, int]] = []
    for part in np.split(np.arange(len(rows)), bounds):
        if not len(part):
            continue
        track_id, level_value = divmod(int(group[part[0]]), 16)
        lv = Level(level_value)
        merged_s, merged_e = _merge_sorted(t.start[rows[part]] - start, t.end[rows[part]] - start)
        covered = np.concatenate(([0], np.cumsum(merged_e - merged_s)))

        def busy_until(x: np.ndarray, ms: np.ndarray = merged_s, me: np.ndarray = merged_e, cov: np.ndarray = covered) -> np.ndarray:
            k = np.searchsorted(ms, x, side="right")  # intervals starting at or before x
            last = np.maximum(k - 1, 0)
            return np.where(k > 0, cov[k] - np.maximum(me[last] - x, 0), 0)

        busy = np.diff(busy_until(edges)) / out.bin_ns
        track = run.tracks.get(track_id)
        kind = track.kind if track is not None else TrackKind.THREAD
        name = _track_label(track) if track is not None else f"track {track_id}"
        key = (0 if kind == TrackKind.THREAD else 1 if kind == TrackKind.GPU_STREAM else 2, track_id, rank.get(lv, 99))
        lane = Lane(name, kind, lv, np.minimum(busy, 1.0).tolist(), len(part))
        lanes.append((key, lane, int(covered[-1])))
    kept = {id(lane) for _, lane, _ in sorted(lanes, key=lambda x: -x[2])[:max_lanes]}
    out.lanes = [lane for _, lane, _ in sorted(lanes, key=lambda x: x[0]) if id(lane) in kept]
    return out


def _merge_sorted(starts: Any, ends: Any) -> tuple[Any, Any]:
    """Disjoint intervals covering ``[starts, ends)`` sorted by start: (starts, ends)."""
    import numpy as np

    reach = np.maximum.accumulate(ends)
    new = np.ones(len(starts), dtype=bool)
    new[1:] = starts[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.concatenate((first[1:] - 1, [len(starts) - 1]))
    return starts[first].astype(np.int64), reach[last].astype(np.int64)


def _track_label(track: Any) -> str:
    if track.kind == TrackKind.GPU_STREAM:
        return f"GPU {track.device} stream {track.stream}"
    if track.kind == TrackKind.THREAD:
        return f"{track.name} ({track.tid})" if track.tid else str(track.name)
    return str(track.name)
