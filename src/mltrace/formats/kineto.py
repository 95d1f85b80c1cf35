"""Kineto (``torch.profiler``) Chrome-trace JSON → mltrace events.

Kineto writes one JSON object whose ``traceEvents`` are Chrome trace events.
What this module reads, as found in real traces (PyTorch 2.0 – 2.13, A100 and
CPU runs, see tests/data/kineto/):

- ``ph: "X"`` complete events with ``ts`` and ``dur`` in µs. Newer Kineto
  writes floats with three decimals (ns resolution) and a top-level
  ``baseTimeNanoseconds``; then ``ts * 1000 + baseTimeNanoseconds`` is Unix
  epoch ns. Older traces have no base and ``ts`` is already epoch µs.
- ``cat`` (category) decides the mapping:

  ===================== ==========================================================
  ``cpu_op``            ``Level.OP`` span on the thread's track (``ml.op.name``,
                        ``ml.input.shapes`` from ``Input Dims``, ``ml.input.dtypes``
                        from ``Input type``, ``ml.flops`` from Kineto's
                        ``flops`` or else counted from the shapes,
                        ``aten_flops``); torch's own ranges recorded as
                        ops (torch.compile's region) as ``user_annotation``
  ``user_annotation``   ``Level.USER`` span (``record_function``, ProfilerStep#N);
                        torch's own ranges carry ``torch.range`` (``run/ranges.py``)
  ``gpu_user_annotation`` ``Level.USER`` span on the GPU stream's track
  ``python_function``   only ``nn.Module: <Type>_<n>`` frames (``with_modules``):
                        ``Level.LAYER`` spans, the outermost one ``Level.MODEL``,
                        parents set explicitly through ``Python parent id``
  ``cuda_runtime``,     the CPU-side CUDA API call: ``Level.KERNEL`` span on the
  ``cuda_driver``       calling thread's track with ``cuda.api.name``
  ``kernel``,           ``Level.KERNEL`` span on ``tracks.gpu_stream(device,
  ``gpu_memcpy``,       stream)``, with a ``Flow(kind="launch")`` from the API call
  ``gpu_memset``        that has the same ``correlation`` id
  ``cuda_sync``         (GPU-side waits) ``Instant`` on the stream's track, with
                        its duration in ``cuda.sync.duration_ns``: they overlap
                        kernels on the same stream, so they cannot be slices there
  ===================== ==========================================================

  Everything else (``Trace``, ``ac2g`` flow events, ``fwdbwd``, metadata,
  other ``python_function`` frames, instants) is counted in the stats and
  not converted, except:

- ``ph: "i"`` instants named ``[memory]`` (``profile_memory=True``): one per
  allocation or free, on the thread that made it, with ``Bytes`` (negative for a
  free), ``Total Allocated`` and ``Total Reserved`` of the device after it
  (bytes) and ``Device Type``/``Device Id`` (c10's: 0 CPU, 1 CUDA). Each becomes
  an ``Instant`` named ``[memory]`` on the thread's track (``ml.memory.bytes``,
  ``ml.memory.device`` as ``cpu`` or ``cuda:N``, ``ml.memory.total_allocated``,
  ``ml.memory.total_reserved``), which ``passes.memory.attribute_memory`` turns into
  per-span numbers, and a ``CounterSample`` of the device's allocated bytes on the
  counter track ``cpu.memory.allocated`` or ``gpuN.memory.allocated`` (unit bytes).
  On CPU, torch counts only what was allocated while the profiler ran.

Launches are matched by the ``correlation`` argument, not by Kineto's
``ac2g`` flow events: old traces draw ``ac2g`` arrows for API calls that
launched nothing. Every GPU activity launched by a ``cudaGraphLaunch`` shares
that call's correlation id, so each gets a flow from the one launch. Kineto's
own ids stay in attributes (``gpu.correlation_id``, ``kineto.external_id``);
mltrace ids come from ``new_id``.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mltrace.formats.aten_flops import aten_flops, own_arguments
from mltrace.run.events import CounterSample, Event, Flow, Instant, Span, Track
from mltrace.run.levels import Level
from mltrace.run.ranges import torch_range_kind
from mltrace.run.store import RunError

#: Categories of GPU activities that become kernel-level spans on a stream track.
GPU_ACTIVITY_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
#: Categories of CPU-side CUDA API calls.
CUDA_API_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})

_MODULE_PREFIX = "nn.Module: "
_MEMCPY_KIND = re.compile(r"Memcpy (\w+)")
_MODULE_INDEX = re.compile(r"_\d+$")
#: Timestamps (µs) above this are taken as Unix-epoch µs when a trace has no
#: ``baseTimeNanoseconds`` (1e15 µs is 2001-09-09; uptime-based clocks are far lower).
_EPOCH_US_THRESHOLD = 1e15
#: The stream id CUPTI gives context-wide synchronizations (uint32 -1).
_ALL_STREAMS = 0xFFFFFFFF
#: How many unmatched correlation ids the stats keep as examples.
_MAX_EXAMPLES = 20
#: The name of Kineto's allocation and free instants (``profile_memory=True``).
MEMORY_EVENT = "[memory]"
#: c10's ``DeviceType`` numbers → the device names of ``ml.memory.device``.
_DEVICE_TYPES = {0: "cpu", 1: "cuda", 12: "xpu", 13: "mps"}


def link_launches(
    gpu_spans: list[tuple[Span, int | None]],
    launch_by_corr: dict[int, Span],
    new_id: Callable[[], int],
    max_examples: int = _MAX_EXAMPLES,
) -> tuple[list[Flow], int, list[int]]:
    """A launch flow from each GPU activity's launching API call, matched by correlation id.

    Shared by the Kineto and the cupti-python converters.

    Args:
        gpu_spans: (GPU activity span, its correlation id or None).
        launch_by_corr: correlation id → the CPU-side call that launched it.
        new_id: the session's id allocator.
        max_examples: how many unmatched correlation ids to keep as examples.

    Returns:
        (flows, number of activities without a launching call, example unmatched ids).
    """
    flows: list[Flow] = []
    missing = 0
    examples: list[int] = []
    for span, corr in gpu_spans:
        launch = launch_by_corr.get(corr) if corr is not None else None
        if launch is None:
            missing += 1
            if corr is not None and len(examples) < max_examples:
                examples.append(corr)
            continue
        flows.append(Flow(new_id(), launch.id, span.id, "launch"))
    return flows, missing, examples


@dataclass
class KinetoStats:
    """What a conversion found, for run.json and for tests.

    Attributes:
        events_by_category: every ``ph: "X"`` event by ``cat`` (raw counts).
        spans_by_category: spans made, by the ``cat`` they came from.
        instants: instants made (GPU-side ``cuda_sync`` waits, memory events).
        memory_events: ``[memory]`` instants converted (allocations and frees).
        skipped: events not converted, by reason.
        gpu_activities: kernels + memcpys + memsets converted.
        gpu_activities_launched: those linked to their launching API call.
        unmatched_correlation_ids: how many GPU activities had no API call
            with their correlation id (or no id at all).
        unmatched_examples: up to 20 of those correlation ids.
        clock: ``"baseTimeNanoseconds"``, ``"epoch_us"`` or ``"relative"``
            (no base and timestamps too small for epoch µs: the times keep
            the trace's own origin).
        base_time_ns: the trace's ``baseTimeNanoseconds`` (ns), or 0.
    """

    events_by_category: dict[str, int] = field(default_factory=dict)
    spans_by_category: dict[str, int] = field(default_factory=dict)
    instants: int = 0
    memory_events: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    gpu_activities: int = 0
    gpu_activities_launched: int = 0
    unmatched_correlation_ids: int = 0
    unmatched_examples: list[int] = field(default_factory=list)
    clock: str = "relative"
    base_time_ns: int = 0

    def merge(self, other: KinetoStats) -> None:
        """Adds the counts of another conversion (the next cycle of a streamed profiler); the
        clock and base time become the later one's."""
        for mine, theirs in (
            (self.events_by_category, other.events_by_category),
            (self.spans_by_category, other.spans_by_category),
            (self.skipped, other.skipped),
        ):
            for key, n in theirs.items():
                mine[key] = mine.get(key, 0) + n
        self.instants += other.instants
        self.memory_events += other.memory_events
        self.gpu_activities += other.gpu_activities
        self.gpu_activities_launched += other.gpu_activities_launched
        self.unmatched_correlation_ids += other.unmatched_correlation_ids
        self.unmatched_examples = (self.unmatched_examples + other.unmatched_examples)[:20]
        self.clock, self.base_time_ns = other.clock, other.base_time_ns

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KinetoStats:
        """The stats of ``as_dict`` (a converter process's answer)."""
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {
            "events_by_category": dict(self.events_by_category),
            "spans_by_category": dict(self.spans_by_category),
            "instants": self.instants,
            "memory_events": self.memory_events,
            "skipped": dict(self.skipped),
            "gpu_activities": self.gpu_activities,
            "gpu_activities_launched": self.gpu_activities_launched,
            "unmatched_correlation_ids": self.unmatched_correlation_ids,
            "unmatched_examples": list(self.unmatched_examples),
            "clock": self.clock,
            "base_time_ns": self.base_time_ns,
        }


@dataclass
class KinetoEvents:
    """The result of ``kineto_to_events``.

    Attributes:
        spans: every span, in trace order.
        flows: launch flows (API call → GPU activity).
        instants: GPU-side synchronization events and memory events.
        counters: allocated bytes per device, one sample per memory event.
        tracks: the tracks the events use (already in the registry).
        stats: counts of what was converted and linked.
    """

    spans: list[Span] = field(default_factory=list)
    flows: list[Flow] = field(default_factory=list)
    instants: list[Instant] = field(default_factory=list)
    counters: list[CounterSample] = field(default_factory=list)
    tracks: list[Track] = field(default_factory=list)
    stats: KinetoStats = field(default_factory=KinetoStats)

    def events(self, with_tracks: bool = False) -> list[Event]:
        """All events as one list (tracks only when asked: a session's registry
        already queues the tracks it creates)."""
        out: list[Event] = list(self.tracks) if with_tracks else []
        out.extend(self.spans)
        out.extend(self.instants)
        out.extend(self.counters)
        out.extend(self.flows)
        return out


def load_kineto_json(path: str | Path) -> dict[str, Any]:
    """Reads a Kineto trace (``.json`` or ``.json.gz``).

    Args:
        path: the trace file.

    Returns:
        The trace object (a dict with a ``traceEvents`` list). A bare JSON
        array of events is accepted and wrapped.

    Raises:
        RunError: if the file is missing, torn (truncated gzip or JSON) or not
            a Chrome/Kineto trace.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise RunError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise RunError(f"{p}: is a directory, not a Kineto trace file") from None
    except OSError as exc:
        raise RunError(f"{p}: {exc.strerror or exc}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as exc:
            raise RunError(f"{p}: truncated or corrupt gzip data ({exc})") from None
    try:
        import orjson

        obj = orjson.loads(raw)
    except ImportError:  # pragma: no cover - orjson is a dependency
        obj = _json_loads(p, raw)
    except ValueError as exc:
        hint = " (the file looks truncated)" if raw.rstrip()[-1:] not in (b"}", b"]") else ""
        raise RunError(f"{p}: not valid JSON{hint}: {exc}") from None
    if isinstance(obj, list):
        obj = {"traceEvents": obj}
    if not isinstance(obj, dict) or not isinstance(obj.get("traceEvents"), list):
        raise RunError(f"{p}: not a Kineto/Chrome trace (no traceEvents list)")
    return obj


def _json_loads(p: Path, raw: bytes) -> Any:  # pragma: no cover - fallback without orjson
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RunError(f"{p}: not valid JSON: {exc}") from None


def trace_epoch_offset(trace: dict[str, Any]) -> tuple[int, str]:
    """How a trace's ``ts`` (µs) becomes Unix-epoch ns: ``ts * 1000 + offset``.

    Returns:
        ``(offset_ns, clock)``: ``baseTimeNanoseconds`` when present
        (clock ``"baseTimeNanoseconds"``); else 0 with clock ``"epoch_us"``
        when timestamps look like epoch µs, or ``"relative"`` when they do not.
    """
    base = trace.get("baseTimeNanoseconds")
    if isinstance(base, (int, float)) and not isinstance(base, bool):
        return int(base), "baseTimeNanoseconds"
    for e in trace.get("traceEvents", ()):
        if isinstance(e, dict) and e.get("ph") == "X":
            ts = e.get("ts")
            if isinstance(ts, (int, float)):
                return 0, "epoch_us" if ts > _EPOCH_US_THRESHOLD else "relative"
    return 0, "relative"


def _us_to_ns(us: float | int) -> int:
    """µs → ns without losing Kineto's ns fraction on large epoch values."""
    if isinstance(us, int):
        return us * 1000
    whole = int(us)
    frac = (us - whole) * 1000  # the ns fraction; Kineto timestamps are never negative
    return whole * 1000 + int(frac + 0.5 if frac >= 0 else frac - 0.5)


#: Timestamps and durations (µs) beyond this are not a trace's: about 285 years past the epoch.
_MAX_US = 1 << 53


def _well_formed(e: Any) -> bool:
    """Whether a trace event has the types the conversion reads: a dict whose phase, name and
    category are text (or absent) and whose args, if any, are a dict. Others are counted as
    skipped (a foreign or damaged file), not converted."""
    if not isinstance(e, dict):
        return False
    args = e.get("args")
    return (
        isinstance(e.get("ph"), str)
        and isinstance(e.get("name", ""), str)
        and isinstance(e.get("cat", ""), str)
        and (args is None or isinstance(args, dict))
    )


def _as_int(value: Any) -> int | None:
    """An id (pid, tid, stream, correlation) as an int, or None where it is none: text that
    is not a whole number, a float with a fraction, or a value beyond 64 bits."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        out = value
    elif isinstance(value, str):
        try:
            out = int(value)
        except ValueError:
            return None
    elif isinstance(value, float) and value.is_integer():
        out = int(value)
    else:
        return None
    return out if -(1 << 63) <= out < (1 << 63) else None


def _names(events: list[Any]) -> tuple[dict[tuple[int, int], str], int | None]:
    """Thread names by (pid, tid) and the pid labelled "CPU" from metadata events."""
    thread_names: dict[tuple[int, int], str] = {}
    cpu_pid: int | None = None
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "M":
            continue
        args = e.get("args") or {}
        pid, tid = _as_int(e.get("pid")), _as_int(e.get("tid"))
        if pid is None:
            continue
        if e.get("name") == "thread_name" and tid is not None and isinstance(args.get("name"), str):
            thread_names.setdefault((pid, tid), args["name"].strip())
        elif e.get("name") == "process_labels" and args.get("labels") == "CPU" and cpu_pid is None:
            cpu_pid = pid
    return thread_names, cpu_pid


def _module_paths(py_events: list[dict[str, Any]]) -> dict[int, tuple[str, int | None]]:
    """Layer path and enclosing module frame for every ``nn.Module`` frame.

    Kineto names module frames ``nn.Module: <Type>_<n>`` and links every
    Python frame to its caller by ``Python parent id``; the attribute names
    (``encoder.layers.0``) are not in the trace, so paths join the labels
    from the model down (``Net_0.Sequential_0.Linear_0``).

    Returns:
        Python id → (full label path, Python id of the nearest enclosing
        module frame or None for a model).
    """
    parent_of: dict[int, int | None] = {}
    label_of: dict[int, str] = {}
    for e in py_events:
        args = e.get("args") or {}
        pyid = _as_int(args.get("Python id"))
        if pyid is None:
            continue
        parent_of[pyid] = _as_int(args.get("Python parent id"))
        name = e.get("name", "")
        if name.startswith(_MODULE_PREFIX):
            label_of[pyid] = name[len(_MODULE_PREFIX) :]
    enclosing: dict[int, int | None] = {}  # frame → nearest module frame at or above it

    def module_at_or_above(pyid: int | None) -> int | None:
        chain: list[int] = []
        found: int | None = None
        while pyid is not None and len(chain) < 100_000:  # the bound guards against a cyclic trace
            if pyid in label_of:
                found = pyid
                break
            if pyid in enclosing:
                found = enclosing[pyid]
                break
            chain.append(pyid)
            pyid = parent_of.get(pyid)
        for c in chain:
            enclosing[c] = found
        return found

    outer_of: dict[int, int | None] = {}
    for pyid in label_of:
        outer = module_at_or_above(parent_of.get(pyid))
        outer_of[pyid] = outer if outer != pyid else None
    paths: dict[int, str] = {}
    for pyid in label_of:
        chain: list[int] = []
        cur: int | None = pyid
        while cur is not None and cur not in paths:
            if len(chain) > 1000:  # a cyclic trace: cut the path here
                cur = None
                break
            chain.append(cur)
            cur = outer_of[cur]
        prefix = paths[cur] if cur is not None and cur in paths else ""
        for c in reversed(chain):
            prefix = f"{prefix}.{label_of[c]}" if prefix else label_of[c]
            paths[c] = prefix
    return {pyid: (paths[pyid], outer_of[pyid]) for pyid in label_of}


def trace_cuda_major(trace: dict[str, Any]) -> int | None:
    """The CUDA major version a Kineto trace was recorded with (``cuda_runtime_version``, e.g.
    13000 → 13, the CUPTI whose callback ids it carries), or None when it does not say."""
    version = trace.get("cuda_runtime_version")
    if isinstance(version, int) and not isinstance(version, bool) and version >= 1000:
        return version // 1000
    return None


class Tracks(Protocol):
    """What the conversion needs of a track registry (``tracer.tracks.TrackRegistry`` is one;
    a converter process has its own): a track per thread, per GPU stream and per counter."""

    def thread(self, tid: int, name: str = "", pid: int | None = None) -> Track: ...

    def gpu_stream(self, device: int, stream: int, pid: int | None = None) -> Track: ...

    def counter(self, name: str, unit: str = "", device: int = -1) -> Track: ...


def kineto_to_events(
    trace: dict[str, Any],
    tracks: Tracks,
    new_id: Callable[[], int],
    to_session_ns: Callable[[int], int],
    *,
    external_ids: bool = True,
) -> KinetoEvents:
    """Converts a Kineto trace into spans, flows and instants.

    Args:
        trace: the trace object (see ``load_kineto_json``).
        tracks: the registry that allocates thread and GPU stream tracks.
            Thread tracks are keyed by the trace's (pid, tid); GPU stream
            tracks belong to the trace's CPU process.
        new_id: allocates span and flow ids.
        to_session_ns: converts Unix-epoch ns to session ns.
        external_ids: keep Kineto's ``External id`` as ``kineto.external_id`` (an
            imported trace: it names the event in the user's file). A live run drops
            it: its Kineto file is mltrace's own and deleted, and without the id the
            attributes of an op repeat from call to call (stored once, as a template).

    Returns:
        The events and the conversion stats. Parents of ops, API calls and
        GPU activities are left to the correlator passes
        (``nest_by_containment``, ``attach_gpu_to_launch``); module spans get
        explicit parents.
    """
    conversion = _Conversion(trace, tracks, new_id, to_session_ns, external_ids)
    for e in conversion.complete:
        conversion.convert(e)
    for e in conversion.memory_events:
        if not conversion.memory_event(e):
            conversion.skipped["[memory] (bad ts, bytes or pid/tid)"] += 1
    return conversion.finished()


def _busiest_cpu_pid(complete: list[dict[str, Any]]) -> int | None:
    """The pid with the most ``cpu_op`` events (a trace without a "CPU" process label)."""
    pids = Counter(_as_int(e.get("pid")) for e in complete if e.get("cat") == "cpu_op")
    pids.pop(None, None)
    return pids.most_common(1)[0][0] if pids else None


def _checked_times(ts: Any, dur: Any) -> tuple[float, float] | None:
    """A ``ts``/``dur`` pair (µs) where both are numbers within a trace's range, else None."""
    if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)) or isinstance(ts, bool) or isinstance(dur, bool):
        return None
    return (ts, dur) if 0 <= ts < _MAX_US and 0 <= dur < _MAX_US else None  # NaN fails too


def _rejected(cat: str, name: str) -> str | None:
    """Why a complete event is not converted, by its category and name alone (None: it may be)."""
    if cat == "python_function" and not name.startswith(_MODULE_PREFIX):
        return "python_function (not a module)"
    if cat not in _HANDLED:
        return cat or "(no category)"
    return None


#: An autograd node's range (``MulBackward0``): the ops of its backward formula are called from C++.
_AUTOGRAD_NODE = re.compile(r"Backward\d*$")


def _is_torchscript_range(e: dict[str, Any]) -> bool:
    """Whether a ``cpu_op`` is the range of a graph that TorchScript's interpreter runs: a
    function or method (``forward``), or the forward or backward graph of a differentiable
    graph (``<forward op>``, ``<backward op>``): an op without an operator namespace
    (``aten::``) that is neither one of torch's own ranges nor an autograd node. (An autograd
    Function's range, ``CompiledFunction``, looks the same.)"""
    name = e.get("name")
    if e.get("cat") != "cpu_op" or not isinstance(name, str) or "::" in name:
        return False
    return torch_range_kind(name) is None and _AUTOGRAD_NODE.search(name) is None


def interpreted_ops(complete: list[dict[str, Any]]) -> set[int]:
    """The ``args`` (by ``id``) of the ``cpu_op`` events that TorchScript's interpreter called:
    those whose innermost enclosing ``cpu_op`` on their thread is a TorchScript range. Their
    records may hold values of the interpreter's stack ahead of their own arguments
    (``aten_flops.own_arguments``); the ops they call in turn are called from C++ and record
    their own arguments only. Empty, at the cost of one pass, where the trace has no such range."""
    ops = [e for e in complete if e.get("cat") == "cpu_op" and isinstance(e.get("args"), dict)]
    if not any(_is_torchscript_range(e) for e in ops):
        return set()
    by_thread: dict[tuple[int | None, int | None], list[tuple[float, float, dict[str, Any]]]] = {}
    for e in ops:
        checked = _checked_times(e.get("ts"), e.get("dur", 0))
        if checked is not None:
            by_thread.setdefault((_as_int(e.get("pid")), _as_int(e.get("tid"))), []).append((checked[0], -checked[1], e))
    found: set[int] = set()
    for events in by_thread.values():
        events.sort(key=lambda t: (t[0], t[1]))
        open_ranges: list[tuple[float, bool]] = []  # (end, is a TorchScript range), outermost first
        for ts, negative_dur, e in events:
            while open_ranges and open_ranges[-1][0] <= ts:
                open_ranges.pop()
            if open_ranges and open_ranges[-1][1]:
                found.add(id(e["args"]))
            open_ranges.append((ts - negative_dur, _is_torchscript_range(e)))
    return found


class _Conversion:
    """The state of one ``kineto_to_events`` call: the trace's events sorted by kind, the
    counts for its stats, the tracks used and the launches seen so far."""

    def __init__(
        self,
        trace: dict[str, Any],
        tracks: Tracks,
        new_id: Callable[[], int],
        to_session_ns: Callable[[int], int],
        external_ids: bool,
    ) -> None:
        given: list[Any] = trace.get("traceEvents") or []
        events = [e for e in given if _well_formed(e)]
        self.offset_ns, clock = trace_epoch_offset(trace)
        stats = KinetoStats(clock=clock, base_time_ns=self.offset_ns if clock == "baseTimeNanoseconds" else 0)
        self.out = KinetoEvents(stats=stats)
        self.tracks, self.new_id, self.to_session_ns, self.external_ids = tracks, new_id, to_session_ns, external_ids
        self.thread_names, cpu_pid = _names(events)
        self.made: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()
        self.complete = [e for e in events if e.get("ph") == "X"]
        self.by_cat: Counter[str] = Counter(str(e.get("cat", "")) for e in self.complete)
        self.cpu_pid = cpu_pid if cpu_pid is not None else _busiest_cpu_pid(self.complete)
        self.memory_events: list[dict[str, Any]] = []
        for e in events:
            if e.get("ph") in ("X", "M"):
                continue
            if _is_memory_event(e):
                self.memory_events.append(e)
            else:
                self.skipped[f"ph={e.get('ph')}"] += 1
        if len(events) < len(given):
            self.skipped["malformed (a name, category, phase or args of another type)"] += len(given) - len(events)
        self.modules = _module_paths([e for e in self.complete if e.get("cat") == "python_function"])
        self.cuda_major = trace_cuda_major(trace)
        self.interpreted = interpreted_ops(self.complete)
        self.module_span = {pyid: new_id() for pyid in self.modules}  # Python id → span id
        self.used_tracks: dict[int, Track] = {}
        self.launch_by_corr: dict[int, Span] = {}
        self.gpu_spans: list[tuple[Span, int | None]] = []
        self._thread_cache: dict[tuple[Any, Any], Track | None] = {}

    def times(self, e: dict[str, Any]) -> tuple[int, int] | None:
        """An event's (start, end) in session ns, or None where its ``ts``/``dur`` are not numbers in range."""
        checked = _checked_times(e.get("ts"), e.get("dur", 0))
        if checked is None:
            return None
        ts, dur = checked
        start = self.to_session_ns(_us_to_ns(ts) + self.offset_ns)
        return start, start + _us_to_ns(dur)

    def thread_track(self, e: dict[str, Any]) -> Track | None:
        """The track of an event's (pid, tid), or None where either is missing."""
        key = pid, tid = _as_int(e.get("pid")), _as_int(e.get("tid"))
        if key in self._thread_cache:
            return self._thread_cache[key]
        t = None
        if pid is not None and tid is not None:
            t = self.tracks.thread(tid, self.thread_names.get((pid, tid), ""), pid=pid)
            self.used_tracks[t.id] = t
        self._thread_cache[key] = t
        return t

    def stream_track(self, e: dict[str, Any], args: dict[str, Any]) -> Track | None:
        """The track of a GPU-side event's stream (``device``/``stream`` args, else pid/tid)."""
        device = _as_int(args.get("device"))
        stream = _as_int(args.get("stream"))
        if device is None:
            device = _as_int(e.get("pid"))
        if stream is None:
            stream = _as_int(e.get("tid"))
        if device is None or stream is None:
            return None
        t = self.tracks.gpu_stream(device, stream, pid=self.cpu_pid)
        self.used_tracks[t.id] = t
        return t

    def convert(self, e: dict[str, Any]) -> None:
        """Converts one complete (``ph: "X"``) event, or counts why not."""
        cat = str(e.get("cat", ""))
        name = str(e.get("name", ""))
        args = e.get("args") or {}
        reason = _rejected(cat, name)
        when = self.times(e) if reason is None else None
        if reason is None and when is None:
            reason = "bad ts/dur"
        elif reason is None and cat == "cuda_sync" and _as_int(args.get("stream")) in (-1, _ALL_STREAMS):
            reason = "cuda_sync (context-wide)"  # no stream to draw it on
        track = None
        if reason is None:
            track = self.stream_track(e, args) if cat in _GPU_SIDE else self.thread_track(e)
            reason = "no pid/tid" if track is None else None
        if reason is not None or track is None or when is None:
            self.skipped[reason or ""] += 1
            return
        _CONVERT[cat](self, cat, name, args, when, track)

    def sync(self, cat: str, name: str, args: dict[str, Any], when: tuple[int, int], track: Track) -> None:
        """A GPU-side wait: an instant on its stream with its duration."""
        start, end = when
        attrs = {"cuda.sync.kind": args.get("cuda_sync_kind", name), "cuda.sync.duration_ns": end - start}
        corr = _as_int(args.get("correlation"))
        if corr is not None:
            attrs["gpu.correlation_id"] = corr
        self.out.instants.append(Instant(name, start, track.id, Level.KERNEL, attrs))

    def module(self, cat: str, name: str, args: dict[str, Any], when: tuple[int, int], track: Track) -> None:
        """An ``nn.Module`` frame: the model span (outermost) or a layer span under its module."""
        frame_id = _as_int(args.get("Python id"))
        if frame_id is None or frame_id not in self.modules:
            self.skipped["python_function (no Python id)"] += 1
            return
        full_path, outer = self.modules[frame_id]
        type_name = _MODULE_INDEX.sub("", name[len(_MODULE_PREFIX) :])
        attrs = {"ml.framework": "pytorch", "ml.layer.type": type_name}
        parent: int | None = None
        if outer is None:  # as the torch.modules source does: the model span is named by its class
            level, span_name = Level.MODEL, type_name
        else:  # layer paths are relative to the model, as in torch.modules
            level, span_name = Level.LAYER, full_path.split(".", 1)[1]
            parent = self.module_span[outer]
            attrs["ml.layer.path"] = span_name
        self.out.spans.append(Span(self.module_span[frame_id], parent, level, span_name, when[0], when[1], track.id, attrs))
        self.made[cat] += 1

    def span(self, cat: str, name: str, args: dict[str, Any], when: tuple[int, int], track: Track) -> None:
        """An op, user range, CUDA API call or GPU activity: a span, linked for launches later."""
        corr = _as_int(args.get("correlation"))
        level, name, attrs = _ATTRIBUTES[cat](self, cat, name, args, track)
        if corr is not None and cat not in _NO_CORRELATION:
            attrs["gpu.correlation_id"] = corr
        ext = _as_int(args.get("External id"))
        if self.external_ids and ext is not None:
            attrs["kineto.external_id"] = ext
        span = Span(self.new_id(), None, level, name, when[0], when[1], track.id, attrs)
        self.out.spans.append(span)
        self.made[cat] += 1
        if cat in CUDA_API_CATEGORIES and corr is not None:
            known = self.launch_by_corr.get(corr)
            # One correlation id can tag a runtime call and the driver call it made;
            # the runtime call is what the program called, so it is the launch.
            if known is None or (known.attrs["cuda.api.kind"] == "driver" and cat == "cuda_runtime"):
                self.launch_by_corr[corr] = span
        elif cat in GPU_ACTIVITY_CATEGORIES:
            self.gpu_spans.append((span, corr))

    def memory_event(self, e: dict[str, Any]) -> bool:
        """Converts one ``[memory]`` instant: an ``Instant`` on its thread and a sample of its
        device's allocated bytes. False (nothing made) when it lacks a field."""
        args = e.get("args") or {}
        checked = _checked_times(e.get("ts"), 0)
        size, total = _as_int(args.get("Bytes")), _as_int(args.get("Total Allocated"))
        if checked is None or size is None or total is None:
            return False
        ts = checked[0]
        track = self.thread_track(e)
        if track is None:
            return False
        kind = _as_int(args.get("Device Type"))
        index = max(_as_int(args.get("Device Id")) or 0, 0)
        name = _DEVICE_TYPES.get(kind if kind is not None else 0, f"device{kind}")
        device = name if name == "cpu" else f"{name}:{index}"
        ts_ns = self.to_session_ns(_us_to_ns(ts) + self.offset_ns)
        attrs = {"ml.memory.bytes": size, "ml.memory.device": device, "ml.memory.total_allocated": total}
        reserved = _as_int(args.get("Total Reserved"))
        if reserved is not None:
            attrs["ml.memory.total_reserved"] = reserved
        self.out.instants.append(Instant(MEMORY_EVENT, ts_ns, track.id, Level.OP, attrs))
        counter = self.tracks.counter(memory_counter_name(device), "bytes", -1 if name == "cpu" else index)
        self.used_tracks[counter.id] = counter
        self.out.counters.append(CounterSample(counter.id, ts_ns, float(total)))
        return True

    def finished(self) -> KinetoEvents:
        """Links the launches and fills the stats: the conversion's result."""
        out, stats = self.out, self.out.stats
        stats.memory_events = len(out.counters)
        flows, missing, unmatched = link_launches(self.gpu_spans, self.launch_by_corr, self.new_id)
        out.flows.extend(flows)
        stats.gpu_activities_launched += len(flows)
        stats.unmatched_correlation_ids += missing
        stats.gpu_activities = len(self.gpu_spans)
        stats.instants = len(out.instants)
        stats.unmatched_examples = unmatched
        stats.events_by_category = dict(sorted(self.by_cat.items()))
        stats.spans_by_category = dict(sorted(self.made.items()))
        stats.skipped = dict(sorted(self.skipped.items()))
        out.tracks = [self.used_tracks[k] for k in sorted(self.used_tracks)]
        return out


def _op_attrs(c: _Conversion, cat: str, name: str, args: dict[str, Any], track: Track) -> tuple[Level, str, dict[str, Any]]:
    """A ``cpu_op``: an op span with its shapes, dtypes and FLOPs (Kineto's, else counted); one
    of torch's own ranges (``run/ranges.py``: torch.compile's region, recorded as an op) is a
    user span as its ``user_annotation`` ranges are."""
    if torch_range_kind(name) is not None:
        return _user_attrs(c, cat, name, args, track)
    attrs: dict[str, Any] = {"ml.framework": "pytorch", "ml.op.name": name}
    if id(args) in c.interpreted:
        args = own_arguments(name, args)
    if "Input Dims" in args:
        attrs["ml.input.shapes"] = args["Input Dims"]
    if "Input type" in args:
        attrs["ml.input.dtypes"] = args["Input type"]
    flops = args.get("flops")
    if not (isinstance(flops, (int, float)) and flops > 0):
        flops = aten_flops(name, args)
    if flops:
        attrs["ml.flops"] = flops
    return Level.OP, name, attrs


def _user_attrs(c: _Conversion, cat: str, name: str, args: dict[str, Any], track: Track) -> tuple[Level, str, dict[str, Any]]:
    """A ``record_function`` range (CPU or GPU side): a user span; one torch opens itself
    (``run/ranges.py``) says its kind in ``torch.range``."""
    kind = torch_range_kind(name)
    return Level.USER, name, ({"torch.range": kind} if kind else {})


def _api_attrs(c: _Conversion, cat: str, name: str, args: dict[str, Any], track: Track) -> tuple[Level, str, dict[str, Any]]:
    """A CUDA runtime or driver call: a kernel-level span named by the call."""
    kind = "runtime" if cat == "cuda_runtime" else "driver"
    cbid = args.get("cbid")
    if name == "INVALID" and isinstance(cbid, int):
        # Kineto's own table lacks the callback ids of newer CUDA releases (on an H100
        # with CUDA 13, cbid 468 is cudaGetDriverEntryPointByVersion): the generated one has them.
        from mltrace.formats.cuda_cbids import api_name

        name = api_name(kind, cbid, c.cuda_major) or f"CUDA {kind} API call (cbid {cbid})"
    attrs: dict[str, Any] = {"cuda.api.name": name, "cuda.api.kind": kind}
    if isinstance(cbid, int):
        attrs["cuda.api.cbid"] = cbid
    return Level.KERNEL, name, attrs


def _activity_attrs(c: _Conversion, cat: str, name: str, args: dict[str, Any], track: Track) -> tuple[Level, str, dict[str, Any]]:
    """A kernel, memcpy or memset on its stream."""
    return Level.KERNEL, name, _gpu_attrs(cat, name, args, track)


_Attributes = Callable[[_Conversion, str, str, dict[str, Any], Track], tuple[Level, str, dict[str, Any]]]
#: How each category that becomes an ordinary span gets its level, name and attributes.
_ATTRIBUTES: dict[str, _Attributes] = {
    "cpu_op": _op_attrs,
    "user_annotation": _user_attrs,
    "gpu_user_annotation": _user_attrs,
    **{cat: _api_attrs for cat in ("cuda_runtime", "cuda_driver")},
    **{cat: _activity_attrs for cat in ("kernel", "gpu_memcpy", "gpu_memset")},
}
#: Categories whose spans do not carry the correlation id.
_NO_CORRELATION = frozenset({"cpu_op", "user_annotation", "gpu_user_annotation"})
#: Categories drawn on a GPU stream's track rather than a thread's.
_GPU_SIDE = GPU_ACTIVITY_CATEGORIES | {"gpu_user_annotation", "cuda_sync"}
_Convert = Callable[[_Conversion, str, str, dict[str, Any], tuple[int, int], Track], None]
#: What each handled category becomes.
_CONVERT: dict[str, _Convert] = {
    **{cat: _Conversion.span for cat in _ATTRIBUTES},
    "python_function": _Conversion.module,
    "cuda_sync": _Conversion.sync,
}


def _is_memory_event(e: dict[str, Any]) -> bool:
    return e.get("ph") == "i" and e.get("name") == MEMORY_EVENT


def memory_counter_name(device: str) -> str:
    """The counter track of a device's allocated bytes: ``cpu.memory.allocated``,
    ``gpu0.memory.allocated`` for ``cuda:0`` (beside NVML's ``gpu0.*``), else
    ``<device>.memory.allocated``."""
    if device.startswith("cuda:"):
        device = "gpu" + device[5:]
    return f"{device}.memory.allocated"


_HANDLED = frozenset(
    {"cpu_op", "user_annotation", "gpu_user_annotation", "python_function", "cuda_sync"} | CUDA_API_CATEGORIES | GPU_ACTIVITY_CATEGORIES
)


def _gpu_attrs(cat: str, name: str, args: dict[str, Any], track: Track) -> dict[str, Any]:
    """Attributes of a kernel, memcpy or memset (units: bytes, registers, threads)."""
    attrs: dict[str, Any] = {"gpu.device": track.device, "gpu.stream": track.stream, "gpu.activity": cat}
    if cat == "kernel":
        attrs["gpu.kernel.name"] = name
        for key, attr in (
            ("grid", "gpu.grid"),
            ("block", "gpu.block"),
            ("registers per thread", "gpu.registers_per_thread"),
            ("shared memory", "gpu.shared_memory_bytes"),
            ("blocks per SM", "gpu.blocks_per_sm"),
            ("warps per SM", "gpu.warps_per_sm"),
            ("est. achieved occupancy %", "gpu.estimated_occupancy_pct"),
        ):
            if key in args:
                attrs[attr] = args[key]
    else:
        if cat == "gpu_memcpy":
            m = _MEMCPY_KIND.match(name)
            if m:
                attrs["gpu.memcpy.kind"] = m.group(1)
        if "bytes" in args:
            attrs["gpu.bytes"] = args["bytes"]
    return attrs
