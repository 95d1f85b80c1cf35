"""Sends a run's spans to an OTLP receiver (Jaeger, an OpenTelemetry Collector, …).

The mapping (ids, trace grouping, parents, links, attributes, resource) lives
here and is shared with the Jaeger JSON exporter, so a trace uploaded as JSON
and the same trace sent over OTLP carry the same ids:

- every span becomes one OTLP span with its exact start and end (epoch ns,
  converted through the run's clock anchor) and its parent;
- span ids (64 bits) and trace ids (128 bits) are derived from the run id and
  the mltrace span id, so sending a run twice sends the same ids (receivers
  deduplicate, nothing doubles);
- one trace per model invocation by default (``trace_per="invocation"``) or one
  per run (``"run"``); see docs/CONVENTIONS.md for the rules;
- flows become span links; attribute names follow docs/CONVENTIONS.md.

Spans are handed in size-bounded chunks to the OpenTelemetry SDK's own
``OTLPSpanExporter`` (gRPC or HTTP/protobuf), whose constructors honour the
standard ``OTEL_EXPORTER_OTLP_*`` variables. Nothing is queued, so nothing is
dropped silently: a chunk is either acknowledged by the receiver or counted in
``OtlpExportResult.dropped``.

Importing this module imports neither grpc nor opentelemetry; they are imported
when spans are actually sent (the ``otlp`` extra).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field
from typing import Any

from mltrace._version import __version__
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run, dumps
from mltrace.tracer.otel_context import EXTERNAL_ATTR, OTEL_PARENT_ATTR

log = logging.getLogger("mltrace")


def _json(value: Any) -> str:
    """A non-scalar attribute value as JSON text (``store.dumps``: orjson where installed, and
    what JSON cannot hold written as text)."""
    return dumps(value).decode()


PROTOCOLS = ("grpc", "http/protobuf")
"""OTLP transports this exporter speaks."""

TRACE_PER = ("invocation", "run")
"""Ways of grouping spans into traces."""

DEFAULT_TIMEOUT_S = 5.0
"""Default bound (s) on how long a down or stalled receiver can delay the caller."""

DEFAULT_SERVICE_NAME = "mltrace"
"""``service.name`` when neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES sets one."""

#: Most spans per request. Receivers cap request size (Jaeger and the Collector
#: accept 4 MiB per gRPC message by default), so chunks are also cut by size.
MAX_BATCH_SPANS = 2048
#: Estimated serialized bytes per request before a chunk is cut (half the usual
#: 4 MiB receive limit, so the estimate can be off by 2x and still fit).
MAX_BATCH_BYTES = 2 * 1024 * 1024

_INSTALL_HINT = "OTLP export needs the otlp extra: pip install 'mltrace[otlp]'"
_M64 = (1 << 64) - 1
_M128 = (1 << 128) - 1
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # odd, so multiplying by it is a bijection mod 2**64
_GOLDEN_INVERSE = pow(_GOLDEN, -1, 1 << 64)
_LABELS = {lv: lv.label for lv in Level}

#: Loggers of the SDK exporters whose retry chatter is folded into one warning.
_SDK_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.exporter.otlp.proto.common._internal",
)


# -- result ----------------------------------------------------------------


@dataclass
class OtlpExportResult:
    """What one export did.

    Attributes:
        endpoint: where the spans were sent (URL or host:port).
        protocol: "grpc" or "http/protobuf".
        spans_total: spans in the run.
        spans_sent: spans the receiver acknowledged.
        batches: requests acknowledged.
        traces: distinct trace ids among the spans.
        links: span links (flows, cut parents) attached.
        dropped: spans not delivered (a failed request, or never sent after one).
        errors: one line per failure.
        elapsed_ns: wall time of the whole export (ns), mapping included.
        not_sent: events that OTLP traces do not carry, by kind (instants,
            counter samples); they stay in the run directory and Perfetto trace.
    """

    endpoint: str
    protocol: str
    spans_total: int = 0
    spans_sent: int = 0
    batches: int = 0
    traces: int = 0
    links: int = 0
    dropped: int = 0
    errors: list[str] = field(default_factory=list)
    elapsed_ns: int = 0
    not_sent: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether every span arrived."""
        return not self.errors and self.dropped == 0

    def summary(self) -> str:
        """One line for the terminal."""
        secs = self.elapsed_ns / 1e9
        line = (
            f"sent {self.spans_sent} of {self.spans_total} spans in {self.batches} requests "
            f"({self.traces} traces) to {self.endpoint} over {self.protocol} in {secs:.2f} s"
        )
        if self.dropped:
            line += f"; {self.dropped} not delivered"
        return line

    def status_line(self) -> str:
        """One line for stderr after a traced program: how many spans reached which endpoint, or why none did.

        ``OTLP: 1234 spans sent to http://localhost:4317 (grpc)``; ``OTLP: 1000 of 1234 spans sent
        to … (grpc); 234 not delivered: <reason>``; ``OTLP: not sent to …: <reason>``.
        """
        where = self.endpoint or "(unresolved endpoint)"
        reason = self.errors[0] if self.errors else "unknown error"
        if self.ok:
            return f"OTLP: {self.spans_sent} spans sent to {where} ({self.protocol})"
        if self.spans_sent:
            return (
                f"OTLP: {self.spans_sent} of {self.spans_total} spans sent to {where} ({self.protocol}); "
                f"{self.dropped} not delivered: {reason}"
            )
        return f"OTLP: not sent to {where}: {reason}"


# -- mapping (shared with jaeger_json) ----------------------------------------


@dataclass(slots=True)
class MappedSpan:
    """One mltrace span in OpenTelemetry terms (plain data, no SDK objects).

    Attributes:
        name: span name.
        trace_id: 128-bit trace id.
        span_id: 64-bit span id.
        parent_span_id: 64-bit id of the parent span, or 0 for a root.
        start_ns: start, Unix epoch (ns).
        end_ns: end, Unix epoch (ns).
        attributes: OTLP-typed attributes (str, bool, int64, float, or a tuple
            of one of those); anything else is a JSON string.
        links: ``(trace_id, span_id, attributes)`` per link.
        pid: the process the span ran in (selects the resource).
    """

    name: str
    trace_id: int
    span_id: int
    parent_span_id: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[tuple[int, int, dict[str, Any]]]
    pid: int


def run_key(run: Run) -> str:
    """The string every id of ``run`` is derived from (its run id when recorded)."""
    meta = run.meta
    rid = meta.get("run_id")
    if rid:
        return str(rid)
    host = _dict(meta.get("host"))
    started = meta.get("started_at_epoch_ns") or _dict(meta.get("clock")).get("anchor_epoch_ns")
    return f"{meta.get('name', '')}|{host.get('hostname', '')}|{meta.get('pid', '')}|{started}"


def run_id(run: Run) -> str:
    """The run's id: ``meta["run_id"]`` or, for runs without one, a stable hash (32 hex)."""
    rid = run.meta.get("run_id")
    return str(rid) if rid else hashlib.blake2b(run_key(run).encode(), digest_size=16).hexdigest()


def epoch_offset_ns(run: Run) -> int:
    """What to add to a session timestamp (ns) to get Unix-epoch ns."""
    clock = run.meta.get("clock") or {}
    try:
        return int(clock["anchor_epoch_ns"]) - int(clock["anchor_monotonic_ns"])
    except (KeyError, TypeError, ValueError):
        log.warning("run %s has no clock anchor; OTLP times are session-clock ns, not epoch", run.path)
        return 0


def _hash_id(key: str, nbytes: int) -> int:
    value = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=nbytes).digest(), "big")
    return value or 1  # 0 is the invalid id in OpenTelemetry


def parse_otel_parent(value: Any) -> tuple[int, int] | None:
    """Parses a stored OpenTelemetry parent into ``(trace_id, span_id)``.

    Accepts ``{"trace_id": hex, "span_id": hex}``, ``[hex, hex]`` or
    ``"<trace hex>-<span hex>"``; returns None for anything else or invalid ids.
    """
    try:
        if isinstance(value, dict):
            t, s = value["trace_id"], value["span_id"]
        elif isinstance(value, (list, tuple)):
            t, s = value
        elif isinstance(value, str):
            t, s = value.split("-")
        else:
            return None
        tid, sid = int(str(t), 16), int(str(s), 16)
    except (KeyError, TypeError, ValueError):
        return None
    if 0 < tid <= _M128 and 0 < sid <= _M64:
        return tid, sid
    return None


def parse_traceparent(value: Any) -> tuple[int, int] | None:
    """Parses a W3C ``traceparent`` (``00-<32 hex>-<16 hex>-<2 hex>``) into ``(trace_id, span_id)``;
    None for anything else or invalid ids."""
    if not isinstance(value, str):
        return None
    parts = value.strip().split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    return parse_otel_parent(parts[1:3])


def process_parents(meta: dict[str, Any]) -> dict[int, tuple[int, int]]:
    """Process id → ``(trace_id, span_id)`` of the span current in its parent when it started,
    for the followed children of run.json's ``processes`` that recorded one (``parent_span``)."""
    out: dict[int, tuple[int, int]] = {}
    processes = meta.get("processes")
    for p in processes if isinstance(processes, list) else ():
        parent = parse_traceparent(p.get("parent_span")) if isinstance(p, dict) else None
        if parent is not None and isinstance(p.get("pid"), int):
            out[p["pid"]] = parent
    return out


def otlp_value(value: Any) -> Any:
    """Converts a JSON attribute value to an OTLP-typed one (None: leave it out).

    Flat lists of one primitive type become arrays; nested or mixed lists and
    objects become compact JSON strings; integers outside int64 become strings.
    """
    t = type(value)
    if t is str or t is bool or t is float:
        return value
    if t is int:
        return value if _INT64_MIN <= value <= _INT64_MAX else str(value)
    if value is None:
        return None
    if t is list or t is tuple:
        if not value:
            return ()
        first = type(value[0])
        if first in (str, bool, float) and all(type(v) is first for v in value):
            return tuple(value)
        if first is int and all(type(v) is int and _INT64_MIN <= v <= _INT64_MAX for v in value):
            return tuple(value)
        return _json(value)
    if t is dict:
        return _json(value)
    return str(value)


def _batch_size(attrs: dict[str, Any]) -> int | None:
    shapes = attrs.get("ml.input.shapes")
    if isinstance(shapes, list) and shapes and isinstance(shapes[0], list) and shapes[0]:
        dim = shapes[0][0]
        if type(dim) is int and dim >= 0:
            return dim
    return None


def _env_resource_attributes() -> dict[str, str]:
    """OTEL_RESOURCE_ATTRIBUTES (``k=v,k2=v2``, values percent-encoded) plus OTEL_SERVICE_NAME."""
    out: dict[str, str] = {}
    for item in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            out[key.strip()] = urllib.parse.unquote(value.strip())
    service = os.environ.get("OTEL_SERVICE_NAME", "").strip()
    if service:
        out["service.name"] = service
    return out


def _dict(value: Any) -> dict[str, Any]:
    """A run.json section, or {} where a hand-edited or foreign file has something else there."""
    return value if isinstance(value, dict) else {}


def _gpu_names(meta: dict[str, Any]) -> list[str]:
    gpus = meta.get("gpus")
    if gpus is None:
        gpus = _dict(meta.get("host")).get("gpus")
    names: list[str] = []
    if isinstance(gpus, list):
        for g in gpus:
            if isinstance(g, dict) and g.get("name"):
                names.append(str(g["name"]))
            elif isinstance(g, str):
                names.append(g)
    return names


def _process_entry(meta: dict[str, Any], pid: Any) -> dict[str, Any]:
    """run.json's ``processes`` entry of ``pid`` ({} where it lists none)."""
    for entry in meta.get("processes") or []:
        if isinstance(entry, dict) and isinstance(pid, int) and entry.get("pid") == pid:
            return entry
    return {}


def _process_attributes(entry: dict[str, Any]) -> dict[str, Any]:
    """A followed process's own resource attributes (run.json ``processes[]``): its command
    line, its role (``rank 1``, ``DataLoader worker 0``) and its torch.distributed rank."""
    attrs: dict[str, Any] = {}
    command = entry.get("command")
    if isinstance(command, list) and command:
        attrs["process.command_args"] = tuple(str(c) for c in command)
    if isinstance(entry.get("role"), str) and entry["role"]:
        attrs["mltrace.process.role"] = entry["role"]
    dist = _dict(entry.get("distributed"))
    for key in ("rank", "world_size"):
        if isinstance(dist.get(key), int) and not isinstance(dist.get(key), bool):
            attrs[f"ml.distributed.{key}"] = dist[key]
    if isinstance(dist.get("backend"), str) and dist["backend"]:
        attrs["ml.distributed.backend"] = dist["backend"]
    return attrs


def resource_attributes(run: Run, pid: int | None = None) -> dict[str, Any]:
    """The resource of ``run`` (process ``pid``): host, process, GPUs, versions, run id; a
    process run.json lists under ``processes`` (a followed child, a torchrun rank) has its
    own command line, role and rank (``_process_attributes``).

    OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME override what mltrace derives.
    """
    meta = run.meta
    host = _dict(meta.get("host"))
    attrs: dict[str, Any] = {"service.name": DEFAULT_SERVICE_NAME}
    for key, src in (("host.name", "hostname"), ("host.arch", "machine"), ("os.description", "os"), ("host.cpu.model.name", "cpu")):
        if host.get(src):
            attrs[key] = str(host[src])
    if host.get("os"):
        attrs["os.type"] = str(host["os"]).split()[0].lower()
    if isinstance(host.get("cpu_count"), int):
        attrs["host.cpu.count"] = host["cpu_count"]
    if host.get("python"):
        attrs["process.runtime.name"] = str(host.get("python_implementation") or "CPython").lower()
        attrs["process.runtime.version"] = str(host["python"])
    p = pid if pid is not None else meta.get("pid")
    if isinstance(p, int):
        attrs["process.pid"] = p
    command = meta.get("command")
    if isinstance(command, list) and command:
        attrs["process.command_args"] = tuple(str(c) for c in command)
    attrs.update(_process_attributes(_process_entry(meta, p)))
    gpus = _gpu_names(meta)
    if gpus:
        attrs["host.gpu.count"] = len(gpus)
        attrs["host.gpu.model"] = gpus[0]
        attrs["host.gpu.names"] = tuple(gpus)
    for dist, version in sorted(_dict(meta.get("versions")).items()):
        attrs[f"ml.version.{dist}"] = str(version)
    levels = meta.get("levels")
    if isinstance(levels, dict):
        recorded = [lv for lv, st in levels.items() if isinstance(st, dict) and st.get("recorded")]
        attrs["mltrace.levels"] = tuple(recorded)
    attrs["mltrace.run.id"] = run_id(run)
    if meta.get("name"):
        attrs["mltrace.run.name"] = str(meta["name"])
    attrs["mltrace.version"] = str(meta.get("mltrace_version") or __version__)
    attrs.update(_env_resource_attributes())
    return attrs


#: Length of one "program" trace's time window (ns): spans outside every model call and
#: request are grouped per thread and window.
PROGRAM_WINDOW_NS = 60_000_000_000


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one span goes: its trace, its parent's OpenTelemetry span id (0: a root), the
    span id its children take as parent (for an external span, the program's own), and the
    span id of the innermost OpenTelemetry span known to hold it (``context``; 0: none)."""

    trace_id: int
    parent_span_id: int
    span_id: int
    external: bool = False
    context: int = 0


class TraceRule:
    """Decides each span's trace and OpenTelemetry parent; shared by the export at the end
    (``SpanMapper``) and the live export (``exporters/otlp_live.py``), so both give a span the
    same ids. Rules (docs/CONVENTIONS.md):

    - an external span (the program's own OpenTelemetry span, recorded by the ``otel`` source)
      is not sent; its children take its trace and span id as parent;
    - a span whose parent is in the run joins its parent's trace under it (a model call inside
      an ``mltrace.span`` is its child, as it would be of an OpenTelemetry span), unless the
      OpenTelemetry span current when it began (``mltrace.otel.parent``) is not the one its
      parent runs in: that span was opened inside the parent, and holds it (an
      ``mltrace.span`` around a request's OpenTelemetry span around the model);
    - a span without one (or under an external span) goes under the OpenTelemetry span current
      when it began, else the external parent, else its process's parent (a followed child's
      ``traceparent``, ``processes``), else the session's OpenTelemetry parent, else: one trace
      per run (``trace_per="run"``); its own trace for a model or user span (an invocation, a
      request); the "program" trace of its thread and minute for anything else (start-up ops,
      work between requests).

    Args:
        key: the run key ids are derived from (``run_key``).
        trace_per: "invocation" or "run".
        parent: the session's OpenTelemetry parent ``(trace_id, span_id)``, or None.
        tracks: the run's tracks (for the program trace's thread and a span's process).
        processes: process id → the OpenTelemetry parent ``(trace_id, span_id)`` of the spans of
            that process that have no other (a followed child's ``traceparent``).
    """

    def __init__(
        self,
        key: str,
        trace_per: str,
        parent: tuple[int, int] | None,
        tracks: dict[int, Track],
        processes: dict[int, tuple[int, int]] | None = None,
    ) -> None:
        if trace_per not in TRACE_PER:
            raise ValueError(f"trace_per must be one of {', '.join(TRACE_PER)}, not {trace_per!r}")
        self.key = key
        self.trace_per = trace_per
        self.parent = parent
        self.tracks = tracks
        self.processes = processes or {}
        self._salt = _hash_id(key + "|span", 8)

    def span_id(self, mltrace_id: int) -> int:
        """The 64-bit OpenTelemetry span id of mltrace span ``mltrace_id``."""
        sid = ((mltrace_id * _GOLDEN) & _M64) ^ self._salt
        return sid or _hash_id(f"{self.key}|span0|{mltrace_id}", 8)

    def place(self, s: Span, up: Placement | None) -> Placement:
        """The placement of ``s``, given its parent's (None: no parent in the run)."""
        if EXTERNAL_ATTR in s.attrs:
            ext = parse_otel_parent(s.attrs[EXTERNAL_ATTR])
            if ext is not None:
                return Placement(ext[0], 0, ext[1], external=True, context=ext[1])
        sid = self.span_id(s.id)
        otel = parse_otel_parent(s.attrs[OTEL_PARENT_ATTR]) if OTEL_PARENT_ATTR in s.attrs else None
        if up is not None and not up.external:
            if otel is None or otel[1] == up.context:
                return Placement(up.trace_id, up.span_id, sid, context=up.context)
            return Placement(otel[0], otel[1], sid, context=otel[1])  # opened inside the parent
        if otel is None and up is not None:
            otel = (up.trace_id, up.span_id)
        if otel is None:
            otel = self._process_parent(s)
        if otel is not None:
            return Placement(otel[0], otel[1], sid, context=otel[1])
        if self.trace_per == "run":
            return Placement(_hash_id(self.key + "|run", 16), 0, sid)
        if s.level is Level.MODEL or s.level is Level.USER:
            return Placement(_hash_id(f"{self.key}|invocation|{s.id}", 16), 0, sid)
        return Placement(self._program_trace(s), 0, sid)

    def _process_parent(self, s: Span) -> tuple[int, int] | None:
        """The OpenTelemetry parent of a span with no other: its process's, else the session's."""
        if self.processes:
            track = self.tracks.get(s.track_id)
            if track is not None and track.pid in self.processes:
                return self.processes[track.pid]
        return self.parent

    def mltrace_id(self, span_id: int) -> int:
        """The mltrace id whose OpenTelemetry span id is ``span_id`` (``span_id``'s inverse)."""
        return (((span_id ^ self._salt) & _M64) * _GOLDEN_INVERSE) & _M64

    def _program_trace(self, s: Span) -> int:
        track = self.tracks.get(s.track_id)
        lane = s.track_id
        if track is not None and track.kind == TrackKind.ASYNC and track.parent_track >= 0:
            lane = track.parent_track
        return _hash_id(f"{self.key}|program|{lane}|{s.start_ns // PROGRAM_WINDOW_NS}", 16)


class SpanMapper:
    """Maps the spans of one run to OpenTelemetry ids, traces, parents and links (``TraceRule``).

    Args:
        run: the loaded run.
        trace_per: "invocation" (one trace per model invocation or request) or "run".
        parent: ``(trace_id, span_id)`` of an enclosing OpenTelemetry span;
            None uses ``run.meta["otel_parent"]`` when recorded.

    Raises:
        ValueError: for an unknown ``trace_per``.
    """

    def __init__(self, run: Run, trace_per: str = "invocation", parent: tuple[int, int] | None = None) -> None:
        self.run = run
        self.trace_per = trace_per
        self.parent = parent if parent is not None else parse_otel_parent(run.meta.get("otel_parent"))
        self.key = run_key(run)
        processes = process_parents(run.meta)
        self.rule = TraceRule(self.key, trace_per, self.parent, run.tracks, processes)
        self.offset_ns = epoch_offset_ns(run)
        self.by_id: dict[int, Span] = run.span_by_id()
        self._process_up = self._process_spans(processes)
        meta_pid = run.meta.get("pid")
        self.default_pid: int = meta_pid if isinstance(meta_pid, int) else 0
        self._places = self._place_all()
        self._tracks: dict[int, tuple[int, tuple[tuple[str, Any], ...]]] = {}
        self.flow_links: dict[int, list[tuple[int, str, int]]] = {}
        self.flows_skipped = 0
        for f in run.flows:
            if f.from_span in self.by_id and f.to_span in self.by_id:
                self.flow_links.setdefault(f.to_span, []).append((f.from_span, f.kind, f.id))
            else:
                self.flows_skipped += 1

    def span_id(self, mltrace_id: int) -> int:
        """The 64-bit OpenTelemetry span id of mltrace span ``mltrace_id``."""
        return self.rule.span_id(mltrace_id)

    def _process_spans(self, processes: dict[int, tuple[int, int]]) -> dict[int, int]:
        """Process id → the mltrace id of the span its ``traceparent`` names, where that span is
        another process's span of this run: the process's spans without a parent go under it."""
        out: dict[int, int] = {}
        for pid, (_trace, span_id) in processes.items():
            up = self.by_id.get(self.rule.mltrace_id(span_id))
            track = self.run.tracks.get(up.track_id) if up is not None else None
            if up is not None and track is not None and track.pid != pid:
                out[pid] = up.id
        return out

    def _up_id(self, s: Span) -> int | None:
        """The id of ``s``'s parent: its own, else, in a followed child, the span current in the
        parent process when the child started (``_process_spans``)."""
        if s.parent_id is not None or not self._process_up:
            return s.parent_id
        track = self.run.tracks.get(s.track_id)
        return self._process_up.get(track.pid) if track is not None else None

    def _place_all(self) -> dict[int, Placement]:
        """Span id → its placement, parents before children (a parent cycle is cut)."""
        by_id = self.by_id
        places: dict[int, Placement] = {}
        for s in self.run.spans:
            if s.id in places:
                continue
            chain: list[Span] = []
            cur: Span | None = s
            seen: set[int] = set()
            while cur is not None and cur.id not in places and cur.id not in seen:
                seen.add(cur.id)
                chain.append(cur)
                up_id = self._up_id(cur)
                cur = by_id.get(up_id) if up_id is not None else None
            for sp in reversed(chain):  # ancestors first
                up_id = self._up_id(sp)
                places[sp.id] = self.rule.place(sp, places.get(up_id) if up_id is not None else None)
        return places

    def exported(self, s: Span) -> bool:
        """Whether ``s`` is sent (the program's own OpenTelemetry spans are not)."""
        return not self._places[s.id].external

    def trace_id(self, mltrace_id: int) -> int:
        """The 128-bit trace id of the span ``mltrace_id``."""
        return self._places[mltrace_id].trace_id

    def _track_info(self, track_id: int) -> tuple[int, tuple[tuple[str, Any], ...]]:
        """The process id and the attributes a span inherits from its track."""
        info = self._tracks.get(track_id)
        if info is None:
            track = self.run.tracks.get(track_id)
            info = self._tracks[track_id] = track_info(track, self.default_pid)
        return info

    def map(self, s: Span) -> MappedSpan:
        """Maps one span (which must belong to the run)."""
        place = self._places[s.id]
        links: list[tuple[int, int, dict[str, Any]]] = []
        for from_id, kind, flow_id in self.flow_links.get(s.id, ()):
            link_attrs = {"mltrace.link.kind": "flow", "mltrace.flow.kind": kind, "mltrace.flow.id": flow_id}
            links.append((self.trace_id(from_id), self.span_id(from_id), link_attrs))
        return map_span(s, place, self._track_info(s.track_id), self.offset_ns, links)

    def __iter__(self) -> Iterator[MappedSpan]:
        for s in self.run.spans:
            if self.exported(s):
                yield self.map(s)


def track_info(track: Track | None, default_pid: int) -> tuple[int, tuple[tuple[str, Any], ...]]:
    """The process id and the attributes a span on ``track`` inherits from it."""
    extra: tuple[tuple[str, Any], ...] = ()
    pid = default_pid
    if track is not None:
        pid = track.pid
        if track.kind in (TrackKind.THREAD, TrackKind.ASYNC) and track.tid:
            extra = (("thread.id", track.tid), ("thread.name", track.name))
        elif track.kind == TrackKind.GPU_STREAM:
            extra = (("gpu.device", track.device), ("gpu.stream", track.stream))
    return pid, extra


def map_span(
    s: Span,
    place: Placement,
    track: tuple[int, tuple[tuple[str, Any], ...]],
    offset_ns: int,
    links: list[tuple[int, int, dict[str, Any]]],
) -> MappedSpan:
    """One span in OpenTelemetry terms, at ``place``, with its track's attributes and ``links``."""
    attrs: dict[str, Any] = {}
    for k, v in s.attrs.items():
        ov = otlp_value(v)
        if ov is not None:
            attrs[k] = ov
    attrs["mltrace.level"] = _LABELS[s.level]
    attrs["mltrace.span.id"] = s.id
    pid, track_attrs = track
    for k, v in track_attrs:
        if k not in attrs:
            attrs[k] = v
    if s.level is Level.MODEL:
        attrs.setdefault("ml.model.name", s.name)
        batch = _batch_size(s.attrs)
        if batch is not None:
            attrs.setdefault("ml.batch_size", batch)
    end = s.end_ns
    if end < s.start_ns:  # still open when the run was cut short
        end = s.start_ns
        attrs["mltrace.truncated"] = True
    return MappedSpan(
        name=s.name,
        trace_id=place.trace_id,
        span_id=place.span_id,
        parent_span_id=place.parent_span_id,
        start_ns=s.start_ns + offset_ns,
        end_ns=end + offset_ns,
        attributes=attrs,
        links=links,
        pid=pid,
    )


# -- configuration ------------------------------------------------------------


def resolve_protocol(protocol: str | None, endpoint: str | None) -> str:
    """The transport: the argument, else OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL, else from the URL.

    A URL on port 4318 or ending in ``/v1/traces`` means HTTP; anything else gRPC.

    Raises:
        ValueError: for a protocol this exporter does not speak (e.g. http/json).
    """
    env = os.environ
    chosen = protocol or env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if not chosen:
        url = endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or ""
        parsed = urllib.parse.urlparse(url if "://" in url else f"http://{url}")
        try:
            port = parsed.port
        except ValueError:
            port = None
        return "http/protobuf" if port == 4318 or parsed.path.rstrip("/").endswith("/v1/traces") else "grpc"
    chosen = chosen.strip().lower()
    if chosen in ("http", "http/protobuf"):
        return "http/protobuf"
    if chosen == "grpc":
        return "grpc"
    raise ValueError(f"unsupported OTLP protocol {chosen!r} (use grpc or http/protobuf)")


def resolve_endpoint(endpoint: str | None, protocol: str) -> str:
    """The URL requests go to, resolved as the SDK would (argument, then OTEL_* variables).

    An explicit gRPC address without a scheme is taken as plaintext
    (``host:4317`` → ``http://host:4317``); an explicit HTTP URL without a
    path gets ``/v1/traces``.
    """
    env = os.environ
    if protocol == "grpc":
        if endpoint:
            return endpoint if "://" in endpoint else f"http://{endpoint}"
        return env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4317"
    if endpoint:
        url = endpoint if "://" in endpoint else f"http://{endpoint}"
        parsed = urllib.parse.urlparse(url)
        if parsed.path in ("", "/"):
            url = url.rstrip("/") + "/v1/traces"
        return url
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318"
    return base.rstrip("/") + "/v1/traces"


def resolve_timeout(timeout_s: float | None) -> float:
    """The argument, else OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT (seconds, as the Python SDK reads it), else 5 s."""
    if timeout_s is not None:
        return max(float(timeout_s), 0.001)
    for name in ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"):
        raw = os.environ.get(name)
        if raw:
            try:
                return max(float(raw), 0.001)
            except ValueError:
                log.warning("ignoring %s=%r (not a number of seconds)", name, raw)
    return DEFAULT_TIMEOUT_S


# -- sending ----------------------------------------------------------------


class _Capture(logging.Filter):
    """Holds back the SDK's per-retry log records on one thread; keeps the last error."""

    def __init__(self, thread: int) -> None:
        super().__init__()
        self.thread = thread
        self.last: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self.thread:
            return True
        if record.levelno >= logging.ERROR:
            try:
                self.last = record.getMessage()
            except Exception:
                self.last = str(record.msg)
        return record.levelno < logging.WARNING


def _make_exporter(protocol: str, endpoint: str, timeout_s: float) -> Any:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint, timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=endpoint, timeout=timeout_s)


def _chunks(mapper: SpanMapper, skip: Container[int]) -> Iterator[list[MappedSpan]]:
    """The spans to send, mapped, in chunks bounded by count and estimated serialized size."""
    try:
        import orjson

        dumps: Any = orjson.dumps
    except ImportError:  # pragma: no cover - orjson is a core dependency
        dumps = lambda o: json.dumps(o, default=str)  # noqa: E731
    chunk: list[MappedSpan] = []
    size = 0
    for s in mapper.run.spans:
        if s.id in skip or not mapper.exported(s):
            continue
        # protobuf is about as compact as JSON for these attributes; the fixed part covers
        # ids, times, level and thread attributes
        est = 160 + len(s.name) + len(dumps(s.attrs)) + 96 * len(mapper.flow_links.get(s.id, ()))
        if chunk and (len(chunk) >= MAX_BATCH_SPANS or size + est > MAX_BATCH_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(mapper.map(s))
        size += est
    if chunk:
        yield chunk


def export_otlp(
    run: Run,
    endpoint: str | None = None,
    *,
    protocol: str | None = None,
    trace_per: str = "invocation",
    timeout_s: float | None = None,
    parent: tuple[int, int] | None = None,
    log_failure: bool = True,
    skip: Container[int] = (),
    progress: Callable[[int, int], None] | None = None,
) -> OtlpExportResult:
    """Sends every span of ``run`` to an OTLP receiver. Never raises.

    Args:
        run: a loaded run (see ``mltrace.run.store.load_run``).
        endpoint: receiver URL (``http://host:4317`` for gRPC,
            ``http://host:4318[/v1/traces]`` for HTTP); None or "" uses
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT,
            then the OTLP default for the protocol.
        protocol: "grpc" or "http/protobuf" ("http" accepted); None uses
            OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL, else guesses from the URL
            (port 4318 or a ``/v1/traces`` path: HTTP), else gRPC.
        trace_per: "invocation" (one trace per outermost model span or request) or "run".
        timeout_s: the deadline (s) of the whole export, encoding, requests and
            retries included: each request gets what is left of it, and the first
            one that does not complete in time ends the export (it and the rest
            are counted as not delivered; a receiver that answered late may still
            have that request). None: OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT (seconds,
            as the Python SDK reads it), else 5 s.
        parent: ``(trace_id, span_id)`` of an OpenTelemetry span to hang the
            run's root spans under (same trace); None uses ``run.meta["otel_parent"]``.
        log_failure: log a failure as one warning; False leaves reporting it to the
            caller (``OtlpExportResult.status_line``).
        skip: mltrace ids of spans not to send (those the live export delivered).
        progress: called with (spans sent, spans to send) after each request of a
            send of more than one request.

    Returns:
        What was sent, dropped and why. ``spans_total`` counts the spans to send: the
        program's own OpenTelemetry spans and ``skip`` are not among them.
    """
    t0 = time.monotonic_ns()
    result = OtlpExportResult(endpoint=endpoint or "", protocol=protocol or "")
    result.spans_total = sum(1 for s in run.spans if s.id not in skip and EXTERNAL_ATTR not in s.attrs)
    if run.instants:
        result.not_sent["instants"] = len(run.instants)
    if run.counters:
        result.not_sent["counters"] = len(run.counters)
    try:
        _send(run, endpoint or None, protocol, trace_per, timeout_s, parent, result, skip, progress)
    except Exception as exc:  # never into the user's program
        result.errors.append(f"{type(exc).__name__}: {exc}" if not isinstance(exc, (ValueError, ImportError)) else str(exc))
    result.dropped = result.spans_total - result.spans_sent
    result.elapsed_ns = time.monotonic_ns() - t0
    if log_failure and (result.errors or result.dropped):
        reason = result.errors[0] if result.errors else "unknown error"
        log.warning(
            "mltrace: OTLP export to %s failed (%d of %d spans not delivered): %s",
            result.endpoint or "(unresolved endpoint)",
            result.dropped,
            result.spans_total,
            reason,
        )
    return result


class SdkSpans:
    """Turns ``MappedSpan``s into the SDK's ``ReadableSpan``s, one resource per process.

    Args:
        run: the run whose metadata makes the resources (``resource_attributes``).

    Raises:
        ImportError: with the install hint, where the otlp extra is missing.
    """

    def __init__(self, run: Run) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import ReadableSpan
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope
            from opentelemetry.trace import Link, SpanContext, TraceFlags
            from opentelemetry.trace.status import Status, StatusCode
        except ImportError:
            raise ImportError(_INSTALL_HINT) from None

        class _Resource(Resource):
            # The SDK hashes a resource by dumping its attributes to JSON, once per span
            # while encoding; ours never change, so hash once.
            def __init__(self, attributes: dict[str, Any]) -> None:
                super().__init__(attributes)
                self._mltrace_hash = super().__hash__()

            def __hash__(self) -> int:
                return self._mltrace_hash

        self._run = run
        self._resource_type = _Resource
        self._readable, self._link, self._context = ReadableSpan, Link, SpanContext
        self._resources: dict[int, Any] = {}
        self._scope = InstrumentationScope("mltrace", __version__)
        self._sampled = TraceFlags(TraceFlags.SAMPLED)
        self._unset, self._error = Status(StatusCode.UNSET), Status(StatusCode.ERROR)
        self.links = 0

    def __call__(self, m: MappedSpan) -> Any:
        """The ``ReadableSpan`` of ``m``; its status is ERROR where it has ``error.type`` (a call
        that raised), as OpenTelemetry's conventions have it."""
        res = self._resources.get(m.pid)
        if res is None:
            res = self._resources[m.pid] = self._resource_type(resource_attributes(self._run, m.pid))
        ctx, sampled = self._context, self._sampled
        links = [self._link(ctx(t, sp, False, sampled), a) for t, sp, a in m.links]
        self.links += len(links)
        return self._readable(
            name=m.name,
            context=ctx(m.trace_id, m.span_id, False, sampled),
            parent=ctx(m.trace_id, m.parent_span_id, False, sampled) if m.parent_span_id else None,
            resource=res,
            attributes=m.attributes,
            links=links,
            instrumentation_scope=self._scope,
            start_time=m.start_ns,
            end_time=m.end_ns,
            status=self._error if "error.type" in m.attributes else self._unset,
        )


class Requests:
    """Sends lists of SDK spans, one request each, within one deadline, on the calling thread;
    the SDK's per-retry log records are folded into the error they end with.

    Args:
        protocol: "grpc" or "http/protobuf".
        url: the resolved endpoint.
        timeout_s: the deadline (s) of everything sent through this object (None: none;
            each request then gets ``request_timeout_s``).
        request_timeout_s: the most one request and its retries may take.
    """

    def __init__(self, protocol: str, url: str, timeout_s: float | None, request_timeout_s: float) -> None:
        self.protocol, self.url = protocol, url
        self.timeout_s = timeout_s
        self.request_timeout_s = request_timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._exporter: Any = None

    def send(self, spans: list[Any]) -> str | None:
        """Sends one request; returns None when acknowledged, else why not."""
        from opentelemetry.sdk.trace.export import SpanExportResult

        left = self.request_timeout_s
        if self.deadline is not None:
            left = min(left, self.deadline - time.monotonic())
            if left <= 0:
                return f"the {self.timeout_s:g} s deadline for the whole export passed"
        # The SDK's timeout bounds one request and its retries: each gets what is left.
        self.close()
        try:
            self._exporter = _make_exporter(self.protocol, self.url, left)
        except ImportError:
            raise ImportError(_INSTALL_HINT) from None
        capture = _Capture(threading.get_ident())
        loggers = [logging.getLogger(name) for name in _SDK_LOGGERS]
        for lg in loggers:
            lg.addFilter(capture)
        try:
            outcome = self._exporter.export(spans)
        finally:
            for lg in loggers:
                lg.removeFilter(capture)
        if outcome is SpanExportResult.SUCCESS:
            return None
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return f"not acknowledged within the {self.timeout_s:g} s deadline for the whole export (the receiver may still have it)"
        return capture.last or "the receiver did not accept the request"

    def close(self) -> None:
        """Closes the current channel."""
        exporter, self._exporter = self._exporter, None
        if exporter is not None:
            try:
                exporter.shutdown()
            except Exception:  # closing a broken channel: nothing left to do
                pass


def _send(
    run: Run,
    endpoint: str | None,
    protocol: str | None,
    trace_per: str,
    timeout_s: float | None,
    parent: tuple[int, int] | None,
    result: OtlpExportResult,
    skip: Container[int],
    progress: Callable[[int, int], None] | None,
) -> None:
    result.protocol = proto = resolve_protocol(protocol, endpoint)
    result.endpoint = url = resolve_endpoint(endpoint, proto)
    timeout = resolve_timeout(timeout_s)
    mapper = SpanMapper(run, trace_per, parent)
    todo = [s for s in run.spans if s.id not in skip and mapper.exported(s)]
    result.traces = len({mapper.trace_id(s.id) for s in todo})
    if not todo:
        return
    readable = SdkSpans(run)
    requests = Requests(proto, url, timeout, timeout)
    try:
        for chunk in _chunks(mapper, skip):
            why = requests.send([readable(m) for m in chunk])
            if why is not None:
                result.errors.append(f"request {result.batches + 1} ({len(chunk)} spans): {why}")
                break
            result.spans_sent += len(chunk)
            result.batches += 1
            if progress is not None and result.spans_sent < result.spans_total:
                progress(result.spans_sent, result.spans_total)
    finally:
        requests.close()
        result.links = readable.links
