"""Kernel level for any CUDA program, through NVIDIA's ``cupti-python``.

``CuptiSource`` records, with CUPTI's activity API, what every CUDA program does on the GPU
whatever its framework (ONNX Runtime's CUDA EP, TensorFlow, CuPy, Numba, hand-written CUDA):
kernels, memcpys, memsets, CUDA runtime and driver API calls and synchronisations. It is a
post-hoc source: ``_Collector`` copies CUPTI's completed buffers into plain dicts, and
``stop()`` flushes CUPTI and converts the records (``cupti_records_to_events``) into the
events ``kineto.py`` makes, on the session clock (``CuptiClock``).

Kineto (torch.profiler) uses CUPTI too, so ``CuptiSource.start`` chooses one kernel path per
session (ARCHITECTURE.md, "Kernel path"). ``available()`` names a missing package, driver or
device; ``start()`` raises one line for CUPTI's errors (``cupti_error_message``).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import importlib.util
import json
import os
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

from mltrace.run.events import Event, Flow, Instant, Span, Track
from mltrace.run.levels import Level
from mltrace.settings import CUPTI_DUMP, KERNEL_PATH
from mltrace.tracer.cuda_exit import keep_primary_contexts_at_exit
from mltrace.tracer.sources.base import Source
from mltrace.tracer.tracks import TrackRegistry

if TYPE_CHECKING:
    from mltrace.tracer.sources.base import SessionView

NOT_INSTALLED = "cupti-python not installed (pip install cupti-python, or mltrace[gpu])"
NO_DRIVER = "CUDA driver not found (libcuda.so.1 could not be loaded)"
NO_DEVICE = "no CUDA device (cuDeviceGetCount = 0)"
#: The message for a second CUPTI subscriber (CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED).
IN_USE = (
    "CUPTI already in use by another subscriber (e.g. torch.profiler with CUDA activities, Nsight Systems): "
    "kernels come from Kineto instead when torch.profiler records them, else stop the other profiler"
)

PATHS = ("auto", "kineto", "cupti-python")


def requested_kernel_path() -> str:
    """The kernel path asked for in the environment (``$MLTRACE_KERNEL_PATH``, else "auto").

    torch.profiler's source reads it before its profiler starts: with
    "cupti-python" it must leave CUDA activity out from the start.
    """
    return (KERNEL_PATH.get() or "auto").strip().lower()


# -- CUPTI enums (values checked against cupti-python 13.4's cupti.cupti enums) -------------

#: ``CUpti_ActivityKind`` values of the kinds this module reads.
ACTIVITY_KINDS: dict[int, str] = {
    1: "MEMCPY",
    2: "MEMSET",
    3: "KERNEL",
    4: "DRIVER",
    5: "RUNTIME",
    10: "CONCURRENT_KERNEL",
    38: "SYNCHRONIZATION",
}
#: The kinds enabled by ``CuptiSource``, in order; only the first is required.
ENABLED_KINDS = ("CONCURRENT_KERNEL", "MEMCPY", "MEMSET", "RUNTIME", "DRIVER", "SYNCHRONIZATION")
#: ``CUpti_ActivityMemcpyKind``.
MEMCPY_KINDS = {0: "Unknown", 1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA", 8: "DtoD", 9: "HtoH", 10: "PtoP"}
#: ``CUpti_ActivityMemoryKind``.
MEMORY_KINDS = {
    0: "Unknown",
    1: "Pageable",
    2: "Pinned",
    3: "Device",
    4: "Array",
    5: "Managed",
    6: "Device Static",
    7: "Managed Static",
}
#: ``CUpti_ActivitySynchronizationType``, named as Kineto names its ``cuda_sync`` events.
SYNC_TYPES = {0: "Unknown", 1: "Event Sync", 2: "Stream Wait Event", 3: "Stream Sync", 4: "Context Sync"}
#: The stream id of context-wide synchronisations (uint32 -1).
_ALL_STREAMS = 0xFFFFFFFF
#: ``CUpti_ActivityThreadIdType`` SYSTEM: records carry gettid() ids.
_THREAD_ID_SYSTEM = 1

#: ``CUptiResult`` codes → (name, what it means and how to fix it).
CUPTI_ERRORS: dict[int, tuple[str, str]] = {
    1: ("CUPTI_ERROR_INVALID_PARAMETER", "invalid parameter (a bug in mltrace's CUPTI calls; please report it)"),
    2: ("CUPTI_ERROR_INVALID_DEVICE", "invalid device"),
    3: ("CUPTI_ERROR_INVALID_CONTEXT", "invalid CUDA context"),
    7: ("CUPTI_ERROR_INVALID_OPERATION", "operation not allowed now (is another profiler active?)"),
    8: ("CUPTI_ERROR_OUT_OF_MEMORY", "CUPTI ran out of memory"),
    9: ("CUPTI_ERROR_HARDWARE", "GPU hardware error"),
    14: (
        "CUPTI_ERROR_NOT_COMPATIBLE",
        "this CUPTI does not match the driver; install the cupti-python whose major version is the driver's CUDA version",
    ),
    15: ("CUPTI_ERROR_NOT_INITIALIZED", "CUPTI could not initialise: the CUDA driver is missing or too old for this CUPTI"),
    21: ("CUPTI_ERROR_INVALID_KIND", "this CUPTI does not know the activity kind"),
    26: ("CUPTI_ERROR_HARDWARE_BUSY", "the GPU's profiling hardware is busy (another profiler is running)"),
    27: ("CUPTI_ERROR_NOT_SUPPORTED", "not supported on this device, driver or platform"),
    33: ("CUPTI_ERROR_VIRTUALIZED_DEVICE_NOT_SUPPORTED", "tracing is not supported on this virtualized GPU"),
    35: (
        "CUPTI_ERROR_INSUFFICIENT_PRIVILEGES",
        "this user may not profile the GPU; run as root, or set the driver option NVreg_RestrictProfilingToAdminUsers=0 "
        "(see https://developer.nvidia.com/ERR_NVGPUCTRPERM)",
    ),
    36: ("CUPTI_ERROR_OLD_PROFILER_API_INITIALIZED", "a legacy CUDA profiler (nvprof, the old profiler API) is active in this process"),
    39: ("CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED", IN_USE),
    40: (
        "CUPTI_ERROR_VIRTUALIZED_DEVICE_INSUFFICIENT_PRIVILEGES",
        "profiling is not enabled for this virtual GPU (enable it for the VM on the hypervisor)",
    ),
    41: ("CUPTI_ERROR_CONFIDENTIAL_COMPUTING_NOT_SUPPORTED", "profiling is not supported with confidential computing on"),
    42: ("CUPTI_ERROR_CMP_DEVICE_NOT_SUPPORTED", "profiling is not supported on CMP devices"),
    43: ("CUPTI_ERROR_MIG_DEVICE_NOT_SUPPORTED", "this activity is not supported on a MIG instance"),
    44: ("CUPTI_ERROR_SLI_DEVICE_NOT_SUPPORTED", "profiling is not supported on SLI devices"),
    45: ("CUPTI_ERROR_WSL_DEVICE_NOT_SUPPORTED", "this activity is not supported under WSL"),
    999: ("CUPTI_ERROR_UNKNOWN", "unknown CUPTI error"),
}
#: Errors for which a kind other than kernels is skipped rather than failing the source.
_SKIPPABLE = frozenset({21, 27, 33, 43, 45})

#: ``CUresult`` codes of ``cuInit`` / ``cuDeviceGetCount`` → reason.
CUDA_INIT_ERRORS: dict[int, str] = {
    3: "CUDA driver not initialised (CUDA_ERROR_NOT_INITIALIZED)",
    35: "CUDA driver too old for the installed CUDA (CUDA_ERROR_INSUFFICIENT_DRIVER); update the NVIDIA driver",
    46: "CUDA devices busy or unavailable (CUDA_ERROR_DEVICE_UNAVAILABLE; exclusive-process mode?)",
    100: "no CUDA device (cuInit: CUDA_ERROR_NO_DEVICE)",
    101: "invalid CUDA device (CUDA_ERROR_INVALID_DEVICE; check CUDA_VISIBLE_DEVICES)",
    304: "the CUDA driver could not be loaded by the OS (CUDA_ERROR_OPERATING_SYSTEM)",
    804: "CUDA forward compatibility is not supported on this GPU (CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE)",
    999: "the CUDA driver failed to initialise (CUDA_ERROR_UNKNOWN)",
}


def cupti_error_message(status: int) -> str:
    """One line for a CUPTI error code: its name, what it means, how to fix it.

    Args:
        status: a ``CUptiResult`` value (``cuptiError.status`` in cupti-python).

    Returns:
        ``"CUPTI_ERROR_…: <explanation>"``; unknown codes are named by number.
    """
    known = CUPTI_ERRORS.get(status)
    if known is None:
        return f"CUPTI error {status}"
    return f"{known[0]}: {known[1]}"


def cuda_init_reason(code: int) -> str:
    """Why the CUDA driver cannot be used, from a failing ``cuInit`` code."""
    return CUDA_INIT_ERRORS.get(code, f"cuInit failed (CUresult {code})")


def describe_cupti_exception(exc: BaseException) -> str:
    """One line for an exception raised by a cupti-python call.

    ``cuptiError`` carries the CUPTI code in ``status``; cupti-python raises
    ``NotSupportedError("CUDA driver is not found (…)")`` when libcuda is
    missing (observed here, cupti-python 13.4 without a driver).
    """
    status = getattr(exc, "status", None)
    if isinstance(status, int) and not isinstance(status, bool):
        return cupti_error_message(status)
    text = str(exc)
    if "driver is not found" in text or "libcuda" in text:
        return f"{NO_DRIVER} ({text})"
    return f"{type(exc).__name__}: {text}"


def cuda_driver_reason(load: Callable[[str], Any] = ctypes.CDLL) -> str | None:
    """Checks for a usable CUDA driver and device without importing CUDA libraries.

    Loads libcuda.so.1 and calls ``cuInit(0)`` and ``cuDeviceGetCount``: the
    driver is initialised in this process as it would be by the first CUDA
    call of the program (so a program that forks after this, and uses CUDA in
    the child, must use the spawn start method — as it must with any CUDA
    program).

    Args:
        load: loads a shared library (``ctypes.CDLL``; tests pass another).

    Returns:
        None when there is at least one device, else the reason.
    """
    if not sys.platform.startswith("linux"):
        return f"the cupti source supports Linux only (this is {sys.platform})"
    try:
        lib = load("libcuda.so.1")
    except OSError:
        return NO_DRIVER
    try:
        rc = int(lib.cuInit(0))
        if rc != 0:
            return cuda_init_reason(rc)
        count = ctypes.c_int(0)
        rc = int(lib.cuDeviceGetCount(ctypes.byref(count)))
        if rc != 0:
            return cuda_init_reason(rc)
    except Exception as exc:  # a broken driver install: say so, never raise
        return f"CUDA driver unusable: {exc}"
    return NO_DEVICE if count.value <= 0 else None


# -- clock -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClockPair:
    """A CUPTI timestamp read between two session-clock readings.

    Attributes:
        cupti_ns: ``cupti.get_timestamp()`` (ns, CUPTI's clock).
        session_ns: the midpoint of the two ``time.monotonic_ns()`` readings (ns).
        uncertainty_ns: half the bracket: the error bound of ``offset_ns`` (ns).
    """

    cupti_ns: int
    session_ns: int
    uncertainty_ns: int

    @property
    def offset_ns(self) -> int:
        """session − CUPTI (ns): add it to a CUPTI timestamp."""
        return self.session_ns - self.cupti_ns


def sample_clock_pair(get_timestamp: Callable[[], int], now: Callable[[], int] = time.monotonic_ns, samples: int = 16) -> ClockPair:
    """Reads the CUPTI clock between two session-clock readings, keeping the tightest.

    Args:
        get_timestamp: ``cupti.get_timestamp`` (ns).
        now: the session clock (ns).
        samples: how many brackets to try.

    Returns:
        The pair whose bracket was narrowest.
    """
    best: tuple[int, int, int] | None = None
    for _ in range(max(1, samples)):
        t0 = now()
        c = int(get_timestamp())
        t1 = now()
        if best is None or t1 - t0 < best[2]:
            best = (c, (t0 + t1) // 2, t1 - t0)
    assert best is not None
    return ClockPair(best[0], best[1], (best[2] + 1) // 2)


@dataclass(frozen=True)
class CuptiClock:
    """Converts CUPTI timestamps to the session clock.

    A linear map through the pairs taken at start and stop: CUPTI's clock
    may run at a slightly different rate, or count other units altogether —
    once torch.profiler has started, Kineto's timestamp callback makes
    CUPTI stamp records in TSC ticks (2.1 ticks a nanosecond on an H100
    machine). Without a stop pair, or with one too close to the start to
    give a rate, the start offset is used alone.

    Attributes:
        start: the pair taken when recording began.
        stop: the pair taken when it ended, if any.
    """

    start: ClockPair
    stop: ClockPair | None = None

    @property
    def rate(self) -> float:
        """Session ns per CUPTI clock unit (1.0 when CUPTI counts ns, or without a usable stop pair)."""
        a, b = self.start, self.stop
        if b is None or b.cupti_ns - a.cupti_ns < MIN_RATE_SPAN or b.session_ns <= a.session_ns:
            return 1.0
        return (b.session_ns - a.session_ns) / (b.cupti_ns - a.cupti_ns)

    def to_session(self, cupti_ns: int) -> int:
        """A CUPTI timestamp on the session clock (ns)."""
        a = self.start
        return a.session_ns + round((cupti_ns - a.cupti_ns) * self.rate)

    @property
    def uncertainty_ns(self) -> int:
        """The larger of the two pairs' uncertainties (ns)."""
        return max(self.start.uncertainty_ns, self.stop.uncertainty_ns if self.stop else 0)

    @property
    def drift_ns(self) -> int | None:
        """How much the offset changed between start and stop (ns; meaningful where the rate is about 1)."""
        return None if self.stop is None else self.stop.offset_ns - self.start.offset_ns

    def as_dict(self) -> dict[str, Any]:
        """For run.json: offsets, rate, uncertainty and drift (ns)."""
        return {
            "domain": "CUPTI get_timestamp",
            "offset_start_ns": self.start.offset_ns,
            "offset_stop_ns": self.stop.offset_ns if self.stop else None,
            "session_ns_per_cupti_unit": self.rate,
            "pairs": [[p.cupti_ns, p.session_ns] for p in (self.start, self.stop) if p is not None],
            "uncertainty_ns": self.uncertainty_ns,
            "drift_ns": self.drift_ns,
            "method": "cupti.get_timestamp() between two time.monotonic_ns() readings, tightest of 16, "
            "when recording began and ended; a linear map through the two",
        }


#: The shortest CUPTI-clock span between the two pairs that gives a rate (units; 1 ms in ns).
MIN_RATE_SPAN = 1_000_000


# -- names -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _cxa_demangle() -> Callable[..., Any] | None:
    try:
        lib = ctypes.CDLL("libstdc++.so.6")
        fn = lib.__cxa_demangle
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)]
    return fn  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=1)
def _free() -> Callable[..., Any]:
    fn = ctypes.CDLL(None).free
    fn.argtypes = [ctypes.c_void_p]
    fn.restype = None
    return fn  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=4096)
def demangle(name: str) -> str:
    """The C++ name of an Itanium-mangled symbol (``_ZN…``), else ``name`` as it is.

    Uses libstdc++'s ``__cxa_demangle`` (as Kineto does); names that are not
    mangled (Triton's, cuBLAS's SASS kernels) come back unchanged.
    """
    if not name.startswith("_Z"):
        return name
    fn = _cxa_demangle()
    if fn is None:
        return name
    status = ctypes.c_int(0)
    try:
        ptr = fn(name.encode(), None, None, ctypes.byref(status))
    except Exception:
        return name
    if not ptr:
        return name
    try:
        return ctypes.string_at(ptr).decode("utf-8", "replace") if status.value == 0 else name
    finally:
        _free()(ptr)


_VERSION_SUFFIX = re.compile(r"_v\d+$")


def api_display_name(callback_name: str) -> str:
    """``cudaLaunchKernel_v7000`` → ``cudaLaunchKernel`` (CUPTI's callback names carry the API version)."""
    return _VERSION_SUFFIX.sub("", callback_name)


def unnamed_api_call(api: str, cbid: int | None, cuda_major: int | None = None) -> str:
    """The name of an API record that arrived without one: the generated cbid table's
    (``cuda_cbids``, the newest CUDA's when ``cuda_major`` is None), else ``runtime API cbid N``."""
    from mltrace.formats.cuda_cbids import api_name

    return (api_name(api, cbid, cuda_major) if cbid is not None else None) or f"{api} API cbid {cbid}"


@functools.cache
def _cupti_major() -> int | None:
    """The CUDA major version of the installed cupti-python (N.x is built for CUPTI of CUDA N),
    or None when unknown."""
    try:
        from importlib.metadata import version

        return int(version("cupti-python").split(".")[0])
    except Exception:
        return None


# -- records → events (pure) -----------------------------------------------------------------

#: The fields ``record_to_dict`` copies from each kind of cupti-python record (attribute names
#: of cupti-python 13.4's classes, read by 13.0.1 on an H100: ARCHITECTURE.md, "Kernel path").
_TIMES = ("start", "end", "correlation_id")
_PLACE = ("device_id", "context_id", "stream_id")
RECORD_FIELDS: dict[str, tuple[str, ...]] = {
    "CONCURRENT_KERNEL": (
        *_TIMES,
        *_PLACE,
        "name",
        "grid_x",
        "grid_y",
        "grid_z",
        "block_x",
        "block_y",
        "block_z",
        "registers_per_thread",
        "static_shared_memory",
        "dynamic_shared_memory",
        "graph_id",
        "graph_node_id",
    ),
    "MEMCPY": (*_TIMES, *_PLACE, "copy_kind", "src_kind", "dst_kind", "bytes", "graph_id"),
    "MEMSET": (*_TIMES, *_PLACE, "bytes", "value", "memory_kind", "graph_id"),
    "RUNTIME": (*_TIMES, "cbid", "process_id", "thread_id", "return_value"),
    "SYNCHRONIZATION": (*_TIMES, "context_id", "stream_id", "type", "cuda_event_id"),
}
RECORD_FIELDS["KERNEL"] = RECORD_FIELDS["CONCURRENT_KERNEL"]
RECORD_FIELDS["DRIVER"] = RECORD_FIELDS["RUNTIME"]

_GPU_ACTIVITY = {"CONCURRENT_KERNEL": "kernel", "KERNEL": "kernel", "MEMCPY": "gpu_memcpy", "MEMSET": "gpu_memset"}
_API = {"RUNTIME": "runtime", "DRIVER": "driver"}


def _field(record: Any, name: str) -> Any:
    if isinstance(record, Mapping):
        return record.get(name)
    return getattr(record, name, None)


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(value)  # enum members, numpy ints
    except (TypeError, ValueError):
        return None


def kind_name(kind: Any) -> str:
    """A record's ``kind`` as its ``CUpti_ActivityKind`` name (int, enum or name)."""
    if isinstance(kind, str):
        return kind.upper()
    value = _int(kind)
    if value is None:
        return str(kind)
    return ACTIVITY_KINDS.get(value, f"KIND_{value}")


@dataclass
class CuptiStats:
    """What a conversion found (for run.json and tests).

    Attributes:
        records_by_kind: input records by kind name.
        spans_by_kind: spans made, by kind name.
        instants: synchronisation instants made.
        skipped: records not converted, by reason.
        gpu_activities: kernels + memcpys + memsets converted.
        gpu_activities_launched: those linked to their API call by a flow.
        unmatched_correlation_ids: GPU activities without an API call of their id.
        unmatched_examples: up to 20 of those ids.
    """

    records_by_kind: dict[str, int] = field(default_factory=dict)
    spans_by_kind: dict[str, int] = field(default_factory=dict)
    instants: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    gpu_activities: int = 0
    gpu_activities_launched: int = 0
    unmatched_correlation_ids: int = 0
    unmatched_examples: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {
            "records_by_kind": dict(self.records_by_kind),
            "spans_by_kind": dict(self.spans_by_kind),
            "instants": self.instants,
            "skipped": dict(self.skipped),
            "gpu_activities": self.gpu_activities,
            "gpu_activities_launched": self.gpu_activities_launched,
            "unmatched_correlation_ids": self.unmatched_correlation_ids,
            "unmatched_examples": list(self.unmatched_examples),
        }


@dataclass
class CuptiEvents:
    """The result of ``cupti_records_to_events``.

    Attributes:
        spans: GPU activity and API call spans, in record order.
        flows: launch flows (API call → GPU activity).
        instants: synchronisation waits on stream tracks.
        tracks: the tracks used (already in the registry).
        stats: what was converted and linked.
    """

    spans: list[Span] = field(default_factory=list)
    flows: list[Flow] = field(default_factory=list)
    instants: list[Instant] = field(default_factory=list)
    tracks: list[Track] = field(default_factory=list)
    stats: CuptiStats = field(default_factory=CuptiStats)

    def events(self, with_tracks: bool = False) -> list[Event]:
        """All events in one list (tracks only when asked: a session's registry queues its own)."""
        out: list[Event] = list(self.tracks) if with_tracks else []
        out.extend(self.spans)
        out.extend(self.instants)
        out.extend(self.flows)
        return out


def cupti_records_to_events(
    records: Iterable[Any],
    tracks: TrackRegistry,
    new_id: Callable[[], int],
    to_session_ns: Callable[[int], int],
    thread_names: Mapping[int, str] | None = None,
) -> CuptiEvents:
    """Converts CUPTI activity records into spans, launch flows and instants.

    Each record is a mapping (as ``record_to_dict`` makes) or an object with
    the same attributes (a cupti-python record). Fields read, by kind:

    - all: ``kind`` (``CUpti_ActivityKind`` int or its name), ``start``,
      ``end`` (ns, CUPTI clock; both 0 = no timestamps, skipped),
      ``correlation_id``;
    - ``CONCURRENT_KERNEL`` / ``KERNEL``: ``name`` (mangled or not),
      ``device_id``, ``context_id``, ``stream_id``, ``grid_x|y|z``,
      ``block_x|y|z``, ``registers_per_thread``, ``static_shared_memory``,
      ``dynamic_shared_memory`` (bytes), ``graph_id``;
    - ``MEMCPY``: ``copy_kind``, ``src_kind``, ``dst_kind``, ``bytes``, and
      device / context / stream as kernels;
    - ``MEMSET``: ``bytes``, ``value``, ``memory_kind``, device / context / stream;
    - ``RUNTIME`` / ``DRIVER``: ``cbid``, ``thread_id`` (system thread id),
      ``process_id``, ``return_value``, and ``name``: the callback name
      (``cudaLaunchKernel_v7000``) when the caller resolved it;
    - ``SYNCHRONIZATION``: ``type``, ``context_id``, ``stream_id``,
      ``cuda_event_id``; the device comes from other records of the same
      context.

    Other kinds are counted in ``stats.skipped``. The events are those ``kineto.py`` makes, so
    every pass and analysis works on both paths:

    - kernels, memcpys, memsets: ``Level.KERNEL`` spans on ``tracks.gpu_stream(device,
      stream)``, ``gpu.activity`` ``"kernel"``, ``"gpu_memcpy"`` or ``"gpu_memset"``, with
      ``gpu.kernel.name`` (demangled), ``gpu.grid``, ``gpu.block``, ``gpu.memcpy.kind``
      (``"HtoD"``…), ``gpu.bytes``, ``gpu.correlation_id``;
    - runtime and driver calls: ``Level.KERNEL`` spans on the calling thread's track (system
      thread ids, as mltrace's live sources use) with ``cuda.api.name`` and ``cuda.api.kind``
      (``"runtime"`` / ``"driver"``);
    - one ``Flow(kind="launch")`` from the API call to each GPU activity with the same
      correlation id: every kernel of a ``cudaGraphLaunch`` gets one from that call, and where
      a runtime call and the driver call under it share an id, the runtime call is the launch;
    - synchronisations: ``Instant`` on the stream's track with ``cuda.sync.duration_ns``, as
      Kineto's ``cuda_sync`` events.

    Args:
        records: the activity records, in any order.
        tracks: allocates thread and GPU stream tracks.
        new_id: allocates span and flow ids.
        to_session_ns: converts a CUPTI timestamp (ns) to the session clock (ns).
        thread_names: display names of thread tracks created here, by system thread id.

    Returns:
        The events and stats. Parents are left to the correlator passes
        (``nest_by_containment`` for API calls, ``attach_gpu_to_launch`` for
        GPU activities).
    """
    out = CuptiEvents()
    stats = out.stats
    by_kind: Counter[str] = Counter()
    made: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    used: dict[int, Track] = {}
    names = thread_names or {}
    launch_by_corr: dict[int, Span] = {}
    gpu_spans: list[tuple[Span, int | None]] = []
    device_of_context: dict[int, int] = {}
    syncs: list[tuple[Any, int, int]] = []

    for rec in records:
        kind = kind_name(_field(rec, "kind"))
        by_kind[kind] += 1
        if kind not in _GPU_ACTIVITY and kind not in _API and kind != "SYNCHRONIZATION":
            skipped[f"kind {kind}"] += 1
            continue
        start, end = _int(_field(rec, "start")), _int(_field(rec, "end"))
        if start is None or end is None or (start == 0 and end == 0) or end < start:
            skipped["no timestamps"] += 1
            continue
        s0, s1 = to_session_ns(start), to_session_ns(end)
        corr = _int(_field(rec, "correlation_id"))
        if kind == "SYNCHRONIZATION":
            syncs.append((rec, s0, s1))
            continue
        if kind in _API:
            tid = _int(_field(rec, "thread_id"))
            if tid is None:
                skipped["API call without thread_id"] += 1
                continue
            track = tracks.thread(tid, names.get(tid, ""))
            used[track.id] = track
            raw = _field(rec, "name")
            cbid = _int(_field(rec, "cbid"))
            name = api_display_name(raw) if isinstance(raw, str) and raw else unnamed_api_call(_API[kind], cbid)
            attrs: dict[str, Any] = {"cuda.api.name": name, "cuda.api.kind": _API[kind]}
            if cbid is not None:
                attrs["cuda.api.cbid"] = cbid
            if corr is not None:
                attrs["gpu.correlation_id"] = corr
            rv = _int(_field(rec, "return_value"))
            if rv:
                attrs["cuda.api.return_value"] = rv
            span = Span(new_id(), None, Level.KERNEL, name, s0, s1, track.id, attrs)
            out.spans.append(span)
            made[kind] += 1
            if corr is not None and corr != 0:
                known = launch_by_corr.get(corr)
                if known is None or (known.attrs["cuda.api.kind"] == "driver" and kind == "RUNTIME"):
                    launch_by_corr[corr] = span
            continue
        device, stream = _int(_field(rec, "device_id")), _int(_field(rec, "stream_id"))
        if device is None or stream is None:
            skipped["GPU activity without device/stream"] += 1
            continue
        ctx = _int(_field(rec, "context_id"))
        if ctx is not None:
            device_of_context.setdefault(ctx, device)
        track = tracks.gpu_stream(device, stream)
        used[track.id] = track
        activity = _GPU_ACTIVITY[kind]
        attrs = {"gpu.device": device, "gpu.stream": stream, "gpu.activity": activity}
        if activity == "kernel":
            raw = _field(rec, "name")
            name = demangle(raw) if isinstance(raw, str) and raw else "(unnamed kernel)"
            attrs["gpu.kernel.name"] = name
            grid = [_int(_field(rec, f"grid_{a}")) for a in "xyz"]
            block = [_int(_field(rec, f"block_{a}")) for a in "xyz"]
            if all(v is not None for v in grid):
                attrs["gpu.grid"] = grid
            if all(v is not None for v in block):
                attrs["gpu.block"] = block
            regs = _int(_field(rec, "registers_per_thread"))
            if regs is not None:
                attrs["gpu.registers_per_thread"] = regs
            shared = [_int(_field(rec, f)) for f in ("static_shared_memory", "dynamic_shared_memory")]
            if any(v is not None for v in shared):
                attrs["gpu.shared_memory_bytes"] = sum(v for v in shared if v is not None)
        elif activity == "gpu_memcpy":
            copy = MEMCPY_KINDS.get(_int(_field(rec, "copy_kind")) or 0, "Unknown")
            src = MEMORY_KINDS.get(_int(_field(rec, "src_kind")) or 0, "Unknown")
            dst = MEMORY_KINDS.get(_int(_field(rec, "dst_kind")) or 0, "Unknown")
            name = f"Memcpy {copy} ({src} -> {dst})"  # Kineto's naming
            attrs["gpu.memcpy.kind"] = copy
        else:
            mem = MEMORY_KINDS.get(_int(_field(rec, "memory_kind")) or 0, "Unknown")
            name = f"Memset ({mem})"
            value = _int(_field(rec, "value"))
            if value is not None:
                attrs["gpu.memset.value"] = value
        if activity != "kernel":
            nbytes = _int(_field(rec, "bytes"))
            if nbytes is not None:
                attrs["gpu.bytes"] = nbytes
        graph = _int(_field(rec, "graph_id"))
        if graph:
            attrs["gpu.graph.id"] = graph
        if ctx is not None:
            attrs["gpu.context"] = ctx
        if corr is not None:
            attrs["gpu.correlation_id"] = corr
        span = Span(new_id(), None, Level.KERNEL, name, s0, s1, track.id, attrs)
        out.spans.append(span)
        made[kind] += 1
        gpu_spans.append((span, corr))

    for rec, s0, s1 in syncs:
        stream = _int(_field(rec, "stream_id"))
        ctx = _int(_field(rec, "context_id"))
        if stream is None or stream in (-1, _ALL_STREAMS):
            skipped["SYNCHRONIZATION (context-wide)"] += 1  # no stream to draw it on, as in kineto.py
            continue
        device = device_of_context.get(ctx) if ctx is not None else None
        if device is None:
            skipped["SYNCHRONIZATION (device of context unknown)"] += 1
            continue
        track = tracks.gpu_stream(device, stream)
        used[track.id] = track
        sync_name = SYNC_TYPES.get(_int(_field(rec, "type")) or 0, "Unknown")
        attrs = {"cuda.sync.kind": sync_name, "cuda.sync.duration_ns": s1 - s0}
        corr = _int(_field(rec, "correlation_id"))
        if corr is not None:
            attrs["gpu.correlation_id"] = corr
        out.instants.append(Instant(sync_name, s0, track.id, Level.KERNEL, attrs))

    from mltrace.tracer.sources.kineto import link_launches  # the formats' Kineto reader: only where kernels were recorded

    flows, missing, unmatched = link_launches(gpu_spans, launch_by_corr, new_id)
    out.flows.extend(flows)
    stats.gpu_activities_launched += len(flows)
    stats.unmatched_correlation_ids += missing
    stats.gpu_activities = len(gpu_spans)
    stats.instants = len(out.instants)
    stats.unmatched_examples = unmatched
    stats.records_by_kind = dict(sorted(by_kind.items()))
    stats.spans_by_kind = dict(sorted(made.items()))
    stats.skipped = dict(sorted(skipped.items()))
    out.tracks = [used[k] for k in sorted(used)]
    return out


# -- the source ------------------------------------------------------------------------------


def _import_cupti() -> ModuleType:
    from cupti import cupti

    return cupti


def _torch_kernel_source(session: SessionView) -> Any:
    """The session's started torch.profiler source if it records kernels (Kineto holds CUPTI), else None."""
    if Level.KERNEL not in session.levels:
        return None
    for s in session.started:
        if s.name == "torch.profiler" and Level.KERNEL in s.levels:
            return s
    return None


def _torch_ops_source(session: SessionView) -> Any:
    """The session's started torch.profiler source (kernels or not), else None."""
    for s in session.started:
        if s.name == "torch.profiler":
            return s
    return None


class _Collector:
    """Receives CUPTI's completed buffers (on CUPTI's thread) as plain dicts.

    Each record is copied, since the record objects may point into CUPTI's buffer, which
    CUPTI reuses; the copying holds the GIL for the time one buffer takes (8 MiB of records
    by default), and the dicts wait in memory until ``stop()``.
    """

    def __init__(self, cupti: ModuleType, buffer_bytes: int) -> None:
        self.cupti = cupti
        self.buffer_bytes = buffer_bytes
        self.records: list[dict[str, Any]] = []
        #: Records of kinds this source does not convert, counted instead of copied (Kineto's
        #: external-correlation records land in our buffers: one per torch op).
        self.not_copied: Counter[str] = Counter()
        self.errors = 0
        self.active = False
        self._lock = threading.Lock()
        self._api_names: dict[tuple[str, int], str | None] = {}

    def buffer_requested(self) -> tuple[int, int]:
        return self.buffer_bytes, 0  # 0: as many records as fit

    def buffer_completed(self, activities: list[Any]) -> None:
        if not self.active:
            return
        batch: list[dict[str, Any]] = []
        not_copied = self.not_copied
        for rec in activities:
            try:
                kind = kind_name(getattr(rec, "kind", None))
                if kind not in RECORD_FIELDS:
                    not_copied[kind] += 1
                    continue
                batch.append(self.record_to_dict(rec, kind))
            except Exception:  # never raise into CUPTI's thread
                self.errors += 1
        with self._lock:
            self.records.extend(batch)

    def take(self) -> list[dict[str, Any]]:
        with self._lock:
            out, self.records = self.records, []
        return out

    def record_to_dict(self, rec: Any, kind: str | None = None) -> dict[str, Any]:
        """Copies a cupti-python record's fields (see ``RECORD_FIELDS``) into a dict."""
        if kind is None:
            kind = kind_name(getattr(rec, "kind", None))
        out: dict[str, Any] = {"kind": kind}
        for f in RECORD_FIELDS.get(kind, ("start", "end", "correlation_id")):
            v = getattr(rec, f, None)
            if v is not None and not isinstance(v, (int, float, str)):
                v = _int(v)
            out[f] = v
        if kind in _API and isinstance(out.get("cbid"), int):
            out["name"] = self.api_name(kind, out["cbid"])
        return out

    def api_name(self, kind: str, cbid: int) -> str | None:
        """CUPTI's name for an API callback id (``cudaLaunchKernel_v7000``), else the generated
        table's for this cupti-python's CUDA major version, else None; cached per id."""
        key = (kind, cbid)
        if key not in self._api_names:
            try:
                c = self.cupti
                domain = c.CallbackDomain.RUNTIME_API if kind == "RUNTIME" else c.CallbackDomain.DRIVER_API
                name = c.get_callback_name(domain, cbid)
                self._api_names[key] = (name.decode() if isinstance(name, bytes) else str(name)) or None
            except Exception:
                self._api_names[key] = None
            if self._api_names[key] is None:  # CUPTI did not say: the generated table's name
                from mltrace.formats.cuda_cbids import api_name

                self._api_names[key] = api_name(_API[kind], cbid, _cupti_major())
        return self._api_names[key]


#: The collector CUPTI's callbacks reach (CUPTI keeps the callbacks after a session; they
#: then find no collector and drop what they get).
_collector: _Collector | None = None


#: cupti-python's module, once this source has registered its buffer callbacks in this process.
_registered_with: ModuleType | None = None


def hand_back_buffers() -> None:
    """Flushes CUPTI if this module's buffer callbacks were ever registered in this process.

    Call it right before another CUPTI user registers its own callbacks
    (torch.profiler's start does): CUPTI completes every buffer to the
    callbacks registered at that moment, and a buffer allocated by
    cupti-python but completed to Kineto is freed by the wrong allocator
    ("free(): invalid size" and segfaults in later sessions, seen on an
    H100 machine). Even a CPU-only torch.profiler keeps CUPTI busy with
    external-correlation records, so buffers are in flight whenever it runs.
    It also runs at exit, while Python still runs: CUPTI users flush again in
    their own exit handlers (Kineto does), and a buffer must not be completed
    into a finalising interpreter.
    """
    cupti = _registered_with
    if cupti is None:
        return
    try:
        cupti.activity_flush_all(1)
    except Exception:
        pass


class _StartError(RuntimeError):
    """A failure ``start()`` has already put in words."""


def _buffer_requested() -> tuple[int, int]:
    c = _collector
    return c.buffer_requested() if c is not None else (8 << 20, 0)


def _buffer_completed(activities: list[Any]) -> None:
    c = _collector
    if c is not None:
        c.buffer_completed(activities)


class CuptiSource(Source):
    """Kernels, memcpys, memsets and CUDA API calls of any CUDA program (cupti-python).

    Attributes:
        name: "cupti".
        levels: ``(Level.KERNEL,)``.
        path: after ``start``: ``"cupti-python"``, ``"kineto"`` (torch.profiler
            holds CUPTI) or None before.
        stats: the conversion stats of the last ``stop()``.
        clock: the clock mapping of the last session.
    """

    name = "cupti"
    levels: tuple[Level, ...] = (Level.KERNEL,)

    def __init__(
        self,
        buffer_bytes: int = 8 << 20,
        dump_records: str | os.PathLike[str] | None = None,
        prefer: str | None = None,
        load: Callable[[], ModuleType] = _import_cupti,
    ) -> None:
        """Creates the source.

        Args:
            buffer_bytes: size of each activity buffer handed to CUPTI (bytes).
            dump_records: a JSON file to write the raw records to at stop
                (default: ``$MLTRACE_CUPTI_DUMP`` if set).
            prefer: the kernel path rule, "auto", "kineto" or "cupti-python"
                (default: ``$MLTRACE_KERNEL_PATH``, else "auto"); see ``start``.
            load: imports and returns the ``cupti.cupti`` module.
        """
        self.buffer_bytes = int(buffer_bytes)
        self.prefer = prefer.strip().lower() if prefer is not None else requested_kernel_path()
        dump = dump_records if dump_records is not None else CUPTI_DUMP.get()
        self.dump_records = Path(dump) if dump else None
        self._load = load
        self._session: SessionView | None = None
        self._cupti: ModuleType | None = None
        self._enabled: list[Any] = []
        self._collector: _Collector | None = None
        self._subscribed = False
        #: Closed stretches of recording: each one's clock and raw records.
        self._segments: list[tuple[CuptiClock, list[dict[str, Any]]]] = []
        self.path: str | None = None
        self.stats: CuptiStats | None = None
        self.clock: CuptiClock | None = None

    def available(self) -> str | None:
        """None where cupti-python, the CUDA driver and a device are present, else why not."""
        if importlib.util.find_spec("cupti") is None:
            return NOT_INSTALLED
        return cuda_driver_reason()

    def start(self, session: SessionView) -> None:
        """Subscribes to CUPTI, unless torch.profiler records kernels through Kineto.

        CUPTI's activity buffers and callbacks are per process, and Kineto uses them even
        with CPU activity only, so one path is chosen per session (run.json's
        ``kernel_path``):

        - ``"kineto"`` (``prefer`` "auto" with the session's torch.profiler source recording
          kernels, or "kineto"): this source does not subscribe. Kineto records the whole
          process, but a program that never imports torch (CuPy, ONNX Runtime) then gets no
          kernels: ``MLTRACE_KERNEL_PATH=cupti-python`` is for it. A torch.profiler that
          already records kernels keeps CUPTI whatever ``prefer`` says.
        - ``"cupti-python"`` otherwise: torch.profiler leaves CUDA activity out
          (``record_kernels``), and torch ops still nest kernels through their launch calls.
          Buffers change hands only empty (``hand_back_buffers``, ``_close_segment``); when
          torch.profiler starts mid-session, this source closes its stretch before and
          subscribes again after (``_pause``, ``_resume``), each stretch on its own clock.

        Raises:
            RuntimeError: one line naming the CUPTI error and its fix; the
                session warns with it and records it in run.json.
        """
        self._session = session
        keep_primary_contexts_at_exit()  # no CUPTI callback may run while C++ statics are destroyed
        info = session.meta.setdefault("sources", {}).setdefault(self.name, {})
        if self.prefer not in PATHS:
            self._fail(info, f"{KERNEL_PATH.name}={self.prefer!r}: choose auto, kineto or cupti-python")
        torch_source = _torch_kernel_source(session)
        if torch_source is not None and torch_source.profiling and getattr(torch_source, "record_kernels", True):
            # torch.profiler already records CUDA activity (CuptiSource(prefer="cupti-python")
            # with torch imported and MLTRACE_KERNEL_PATH unset): CUPTI is Kineto's now. Two
            # users of its buffers crashed the process on an H100 machine.
            self.path = "kineto"
            session.meta["kernel_path"] = "kineto"
            info["path"] = "kineto: torch.profiler was already recording kernels; cupti-python not subscribed"
            return
        if self.prefer == "kineto" or (self.prefer == "auto" and torch_source is not None):
            self.path = "kineto"
            session.meta["kernel_path"] = "kineto"
            info["path"] = "kineto: torch.profiler records kernels through Kineto, which holds CUPTI; cupti-python not subscribed"
            if torch_source is None:
                info["path"] = f"kineto ({KERNEL_PATH.name}=kineto): cupti-python not subscribed"
            return
        try:
            cupti = self._load()
        except ImportError as exc:
            self._fail(info, f"cupti-python could not be imported: {exc}")
        try:
            self._subscribe(cupti)
        except Exception as exc:
            self._unsubscribe(cupti)
            self._fail(info, str(exc) if isinstance(exc, _StartError) else describe_cupti_exception(exc))
        self._cupti = cupti
        self.path = "cupti-python"
        session.meta["kernel_path"] = "cupti-python"
        info["path"] = "cupti-python"
        ops_source = _torch_ops_source(session)
        if torch_source is not None and hasattr(torch_source, "record_kernels"):
            # Keep Kineto's CUDA activity off CUPTI: torch.profiler records ops only (its
            # profiler starts after the program's `import torch`, and reads this flag then).
            torch_source.record_kernels = False
            info["path"] = f"cupti-python ({KERNEL_PATH.name}=cupti-python): torch.profiler records ops only"
        if ops_source is not None and not ops_source.recording_ops:
            # Even a CPU-only torch.profiler takes CUPTI's activity callbacks when it starts
            # (Kineto registers its own, enables external correlation records and its
            # timestamp callback): hand CUPTI over empty before, take it back after.
            ops_source.around_profiler_start(self._pause, self._resume)

    def _pause(self) -> None:
        """Before torch.profiler starts: closes the current stretch, leaving no buffer with CUPTI."""
        if self._cupti is not None and self._subscribed:
            self._close_segment(self._cupti)

    def _resume(self) -> None:
        """After torch.profiler started: subscribes again (a new stretch, on CUPTI's new clock)."""
        cupti, session = self._cupti, self._session
        if cupti is None or session is None or self._subscribed:
            return
        try:
            self._subscribe(cupti)
        except Exception as exc:
            self._unsubscribe(cupti)
            message = str(exc) if isinstance(exc, _StartError) else describe_cupti_exception(exc)
            session.errors.append(f"{self.name}: could not subscribe again after torch.profiler started: {message}")
            session.note_limitation(f"kernel level: no kernels after torch.profiler started ({message})")

    def _fail(self, info: dict[str, Any], message: str) -> NoReturn:
        """Records that no kernels will be recorded, and why; raises the one-line message."""
        assert self._session is not None
        self._session.meta["kernel_path"] = "none"
        info["path"] = f"none: {message}"
        raise RuntimeError(message)

    def _subscribe(self, cupti: ModuleType) -> None:
        global _collector, _registered_with
        start_pair = sample_clock_pair(cupti.get_timestamp)
        self.clock = CuptiClock(start_pair)
        try:
            cupti.set_thread_id_type(_THREAD_ID_SYSTEM)
        except Exception as exc:  # thread ids would be pthread ids: API calls would land on wrong tracks
            raise _StartError(f"could not ask CUPTI for system thread ids: {describe_cupti_exception(exc)}") from None
        collector = self._collector or _Collector(cupti, self.buffer_bytes)
        _collector = collector
        # Registered at every start, as Kineto does: another CUPTI user since the last
        # session (torch.profiler run by the program) may have put its own callbacks there.
        # Its buffers in flight go back to it first (see hand_back_buffers).
        cupti.activity_flush_all(1)
        cupti.activity_register_callbacks(_buffer_requested, _buffer_completed)
        if _registered_with is None:  # the first registration in this process
            atexit.register(hand_back_buffers)
        _registered_with = cupti
        collector.active = True
        self._collector = collector
        self._subscribed = True
        skipped: list[str] = []
        for kind_label in ENABLED_KINDS:
            kind = getattr(cupti.ActivityKind, kind_label)
            try:
                cupti.activity_enable(kind)
            except Exception as exc:
                status = getattr(exc, "status", None)
                if kind_label != "CONCURRENT_KERNEL" and status in _SKIPPABLE:
                    skipped.append(f"{kind_label}: {describe_cupti_exception(exc)}")
                    continue
                raise
            self._enabled.append(kind)
        if skipped and self._session is not None and not self._segments:
            for s in skipped:
                self._session.note_limitation(f"kernel level: CUPTI activity {s}")

    def _disable_kinds(self, cupti: ModuleType) -> None:
        for kind in reversed(self._enabled):
            try:
                cupti.activity_disable(kind)
            except Exception:
                pass
        self._enabled = []

    def _unsubscribe(self, cupti: ModuleType) -> None:
        global _collector
        self._disable_kinds(cupti)
        self._subscribed = False
        if self._collector is not None:
            self._collector.active = False
        if _collector is self._collector:
            _collector = None

    def _flush(self, cupti: ModuleType, when: str) -> None:
        try:
            cupti.activity_flush_all(1)  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED: also incomplete buffers
        except Exception as exc:
            if self._session is not None:
                self._session.errors.append(f"{self.name}: activity_flush_all {when} failed: {describe_cupti_exception(exc)}")

    def _close_segment(self, cupti: ModuleType) -> None:
        """Flushes, disables the kinds and flushes again, so that CUPTI keeps none of
        this source's buffers (another CUPTI user would be handed them: Kineto reports
        "bufferCompleted called with unknown buffer"); keeps the records and their clock."""
        self._flush(cupti, "before disabling")
        clock = self.clock
        try:
            if clock is not None:
                clock = CuptiClock(clock.start, sample_clock_pair(cupti.get_timestamp))
        except Exception as exc:
            if self._session is not None:
                self._session.errors.append(f"{self.name}: could not read the CUPTI clock: {describe_cupti_exception(exc)}")
        collector = self._collector
        self._disable_kinds(cupti)
        self._flush(cupti, "after disabling")  # records completed between the flush and the disable
        self._unsubscribe(cupti)
        assert clock is not None and collector is not None
        self.clock = clock
        self._segments.append((clock, collector.take()))

    def sealed_until_ns(self) -> int | None:
        """0: kernels and API calls come from CUPTI's buffers at ``stop()``."""
        return 0

    def stop(self) -> list[Event]:
        """Flushes CUPTI, disables the activity kinds and returns the converted events.

        Runs before torch.profiler's own stop (sources stop in reverse start
        order): a profiler stopped first, with this source's buffers still
        at CUPTI, hung the process on an H100 machine.
        """
        cupti, self._cupti = self._cupti, None
        session = self._session
        if cupti is None or session is None:
            return []
        collector = self._collector
        assert collector is not None
        info = session.meta.setdefault("sources", {}).setdefault(self.name, {})
        if self._subscribed:
            self._close_segment(cupti)
        segments, self._segments = self._segments, []
        if collector.errors:
            info["records_not_copied"] = collector.errors
        if collector.not_copied:
            info["records_of_other_kinds"] = dict(collector.not_copied)
        if self.dump_records is not None:
            _dump(self.dump_records, segments, session)
        records = [r for clock, recs in segments for r in _on_session_clock(recs, clock)]
        names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
        result = cupti_records_to_events(records, session.tracks, session.new_id, _same, names)
        self.stats = result.stats
        meta: dict[str, Any] = {}
        if segments:
            meta["clock"] = segments[-1][0].as_dict()
        if len(segments) > 1:
            meta["clock_segments"] = [clock.as_dict() for clock, _ in segments]
        session.meta["cupti"] = {**meta, **result.stats.as_dict()}
        return result.events(with_tracks=False)


def _same(ns: int) -> int:
    return ns


def _on_session_clock(records: list[dict[str, Any]], clock: CuptiClock) -> list[dict[str, Any]]:
    """Copies of the records with ``start`` and ``end`` on the session clock (records without timestamps kept as they are)."""
    out = []
    for rec in records:
        start, end = _int(rec.get("start")), _int(rec.get("end"))
        if start and end:
            rec = {**rec, "start": clock.to_session(start), "end": clock.to_session(end)}
        out.append(rec)
    return out


def _dump(path: Path, segments: list[tuple[CuptiClock, list[dict[str, Any]]]], session: SessionView) -> None:
    """Writes the raw records (CUPTI clock) and each stretch's clock to ``path`` as JSON;
    failures are recorded, not raised. ``clock`` is the last stretch's, ``segments`` says
    which records each clock converts (by count, in order)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "clock": segments[-1][0].as_dict() if segments else None,
            "records": [r for _, recs in segments for r in recs],
            "segments": [{"clock": clock.as_dict(), "records": len(recs)} for clock, recs in segments],
        }
        path.write_text(json.dumps(doc, indent=None, separators=(",", ":")), encoding="utf-8")
    except (OSError, TypeError, ValueError) as exc:
        session.errors.append(f"cupti: could not dump records to {path}: {exc}")
