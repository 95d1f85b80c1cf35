"""Sends model, layer and user spans over OTLP while the traced program runs.

The session's flusher hands every events.jsonl line it writes to the session's batch sinks
(``Session.batch_sinks``); ``LiveExport`` is one. It decodes the line, keeps the finished
model, layer and user spans, places each in its trace (``otlp.TraceRule``, so they get the
ids the export at the end would give them) and puts it in a bounded queue. A background
thread sends the queue in batches with the OpenTelemetry batch span processor's settings
(``OTEL_BSP_SCHEDULE_DELAY``, ``OTEL_BSP_MAX_QUEUE_SIZE``, ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``,
``OTEL_BSP_EXPORT_TIMEOUT``; the SDK's defaults otherwise). The program's threads never wait
on it: the flusher only appends, and a full queue drops the span (counted).

A span is placed once its parent is: children end, and reach the stream, before their
parents, so a model call's layers wait for the model span, and a model call inside an
``mltrace.span`` waits for that span to end (a request). What waits is bounded too.

The export at the end (``export_otlp(skip=sent_ids())``) sends every span this did not
deliver: op, library and kernel spans (known only once their profilers are converted and the
run correlated), and whatever was dropped, failed or still waiting. A killed program loses
what was queued since the last batch.

Importing this module imports neither grpc nor opentelemetry.
"""

from __future__ import annotations

import copy
import os
import sys
import threading
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mltrace.exporters.otlp import (
    MappedSpan,
    Placement,
    Requests,
    SdkSpans,
    TraceRule,
    epoch_offset_ns,
    map_span,
    parse_otel_parent,
    resolve_endpoint,
    resolve_protocol,
    run_key,
    track_info,
)
from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.run.store import Run, decode_batch

#: Levels sent while the program runs (their spans are final when recorded).
LIVE_LEVELS = frozenset({Level.MODEL, Level.LAYER, Level.USER})

#: The batch span processor's settings: environment variable, default, unit.
BSP_SETTINGS = {
    "schedule_delay_s": ("OTEL_BSP_SCHEDULE_DELAY", 5000, 1e-3),
    "max_queue_size": ("OTEL_BSP_MAX_QUEUE_SIZE", 2048, 1),
    "max_export_batch_size": ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512, 1),
    "export_timeout_s": ("OTEL_BSP_EXPORT_TIMEOUT", 30000, 1e-3),
}

#: Placements of recently placed spans kept for children that arrive after their parent.
_RECENT = 4096

#: Variables that, set, turn the OTLP export on without ``--otlp``.
_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def _say(text: str) -> None:
    try:
        sys.stderr.write(f"mltrace: {text}\n")
        sys.stderr.flush()
    except Exception:  # stderr closed by the program: nothing else to do
        pass


@dataclass(frozen=True)
class BatchSettings:
    """How the live export batches (the OpenTelemetry batch span processor's settings)."""

    schedule_delay_s: float = 5.0
    max_queue_size: int = 2048
    max_export_batch_size: int = 512
    export_timeout_s: float = 30.0

    @classmethod
    def from_env(cls) -> BatchSettings:
        """Reads ``OTEL_BSP_*``; a value that is not a positive number is ignored with one warning."""
        values: dict[str, Any] = {}
        for name, (var, default, unit) in BSP_SETTINGS.items():
            raw = os.environ.get(var, "").strip()
            number = float(default)
            if raw:
                try:
                    number = float(raw)
                    if not number > 0:
                        raise ValueError
                except ValueError:
                    _say(f"warning: ignoring {var}={raw!r} (not a positive number); using {default}")
                    number = float(default)
            values[name] = number * unit if unit != 1 else max(1, int(number))
        if values["max_export_batch_size"] > values["max_queue_size"]:
            values["max_export_batch_size"] = values["max_queue_size"]
        return cls(**values)


def otlp_from_env() -> str | None:
    """Why the environment asks for an OTLP export (the variable that does), or None.

    ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT`` set, or ``OTEL_TRACES_EXPORTER`` naming ``otlp``.
    """
    for var in _ENDPOINT_VARS:
        if os.environ.get(var, "").strip():
            return var
    if "otlp" in [v.strip().lower() for v in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")]:
        return "OTEL_TRACES_EXPORTER"
    return None


@dataclass
class LiveResult:
    """What the live export did.

    Attributes:
        endpoint: where it sent.
        protocol: "grpc" or "http/protobuf".
        sent: spans the receiver acknowledged.
        batches: requests acknowledged.
        dropped: spans not queued because the queue was full (the export at the end sends them).
        failed: spans of requests that failed (the export at the end sends them again).
        waiting: spans still waiting for their parent when it stopped, or given up waiting.
        errors: the first failures, one line each.
        queue_size: the live queue's size.
    """

    endpoint: str
    protocol: str
    queue_size: int = 2048
    sent: int = 0
    batches: int = 0
    dropped: int = 0
    failed: int = 0
    waiting: int = 0
    errors: list[str] = field(default_factory=list)


class IdSet:
    """The mltrace ids sent, as a sorted array (8 bytes an id), for ``export_otlp(skip=)``."""

    def __init__(self, ids: array[int]) -> None:
        import numpy as np

        self._ids = np.unique(np.frombuffer(ids, dtype=np.int64)) if len(ids) else np.zeros(0, dtype=np.int64)

    def __contains__(self, mltrace_id: object) -> bool:
        ids = self._ids
        if not isinstance(mltrace_id, int) or not len(ids):
            return False
        i = int(ids.searchsorted(mltrace_id))
        return i < len(ids) and int(ids[i]) == mltrace_id

    def __len__(self) -> int:
        return len(self._ids)


class LiveExport:
    """A session batch sink that sends finished model, layer and user spans while the program runs.

    Args:
        meta: the session's metadata after ``start`` (run id, clock anchor, host: ids and
            resource come from it; copied).
        endpoint: the receiver (None or "": the OTEL_* variables, then the default).
        protocol: "grpc" or "http/protobuf" (None: from the variables or the URL).
        trace_per: "invocation" or "run" (as the export at the end).
        settings: batching (None: ``BatchSettings.from_env()``).

    Raises:
        ValueError: for an unsupported protocol.
    """

    def __init__(
        self,
        meta: dict[str, Any],
        endpoint: str | None = None,
        *,
        protocol: str | None = None,
        trace_per: str = "invocation",
        settings: BatchSettings | None = None,
    ) -> None:
        self.settings = settings or BatchSettings.from_env()
        proto = resolve_protocol(protocol, endpoint or None)
        self.result = LiveResult(resolve_endpoint(endpoint or None, proto), proto, self.settings.max_queue_size)
        self._run = Run(Path("."), copy.deepcopy(meta))
        self._rule = TraceRule(run_key(self._run), trace_per, parse_otel_parent(meta.get("otel_parent")), self._run.tracks)
        self._offset = epoch_offset_ns(self._run)
        meta_pid = meta.get("pid")
        self._pid = meta_pid if isinstance(meta_pid, int) else os.getpid()
        self._templates: dict[int, tuple[str, dict[str, Any]]] = {}
        self._recent: dict[int, Placement] = {}
        self._pending: dict[int, list[Span]] = {}
        self._pending_count = 0
        self._queue: deque[MappedSpan] = deque()
        self._sent = array("q")
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._work, name="mltrace-otlp", daemon=True)
        self._thread.start()

    # -- the flusher's side ----------------------------------------------------

    def __call__(self, line: bytes) -> None:
        """Takes one events.jsonl line (the flusher's thread): decodes it, places its live
        spans and queues them. Never blocks on the network."""
        if self._closing or b'"spans"' not in line:
            if b'"tracks"' in line:
                self._read(line)
            return
        spans = self._read(line)
        ready: list[MappedSpan] = []
        for s in spans:
            if s.level in LIVE_LEVELS:
                self._arrive(s, ready)
        if ready:
            self._enqueue(ready)

    def _read(self, line: bytes) -> list[Span]:
        run = self._run
        run.spans = []
        try:
            decode_batch(run, line, self._templates)
        except (ValueError, TypeError, KeyError, IndexError):
            return []
        return run.spans

    def _arrive(self, s: Span, ready: list[MappedSpan]) -> None:
        """Places ``s`` if its parent is placed (or it has none), then its waiting children."""
        if s.parent_id is not None:
            up = self._recent.get(s.parent_id)
            if up is None:
                self._wait(s)
                return
        else:
            up = None
        todo = [(s, up)]
        while todo:
            span, parent = todo.pop()
            place = self._rule.place(span, parent)
            self._remember(span.id, place)
            if not place.external:
                info = track_info(self._run.tracks.get(span.track_id), self._pid)
                ready.append(map_span(span, place, info, self._offset, []))
            children = self._pending.pop(span.id, None)
            if children:
                self._pending_count -= len(children)
                todo.extend((c, place) for c in children)

    def _remember(self, span_id: int, place: Placement) -> None:
        recent = self._recent
        recent[span_id] = place
        if len(recent) > _RECENT:
            del recent[next(iter(recent))]

    def _wait(self, s: Span) -> None:
        """Keeps ``s`` until its parent arrives; past the queue's size, the oldest waiting
        spans are given up (the export at the end sends them)."""
        self._pending.setdefault(s.parent_id, []).append(s)  # type: ignore[arg-type]
        self._pending_count += 1
        while self._pending_count > self.settings.max_queue_size and self._pending:
            oldest = next(iter(self._pending))
            self._pending_count -= len(self._pending.pop(oldest))
            self.result.waiting += 1

    def _enqueue(self, spans: list[MappedSpan]) -> None:
        with self._cond:
            room = self.settings.max_queue_size - len(self._queue)
            if room < len(spans):
                self.result.dropped += len(spans) - max(room, 0)
                spans = spans[: max(room, 0)]
            self._queue.extend(spans)
            if len(self._queue) >= self.settings.max_export_batch_size:
                self._cond.notify()

    # -- the sender's side -----------------------------------------------------

    def _work(self) -> None:
        """Sends a batch whenever one is full or the schedule delay has passed, until closed."""
        readable: SdkSpans | None = None
        requests: Requests | None = None
        try:
            while True:
                batch = self._next_batch()
                if batch is None:
                    return
                if readable is None or requests is None:
                    readable = SdkSpans(self._run)
                    requests = Requests(self.result.protocol, self.result.endpoint, None, self.settings.export_timeout_s)
                self._send(batch, readable, requests)
        except Exception as exc:  # the otlp extra missing, a bug: the export at the end says why
            self.result.errors.append(f"{type(exc).__name__}: {exc}" if not isinstance(exc, ImportError) else str(exc))
        finally:
            if requests is not None:
                requests.close()

    def _next_batch(self) -> list[MappedSpan] | None:
        """Waits for a full batch or the schedule delay; None once closed."""
        size = self.settings.max_export_batch_size
        deadline = time.monotonic() + self.settings.schedule_delay_s
        with self._cond:
            while not self._closing and len(self._queue) < size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._closing:
                return None
            n = min(size, len(self._queue))
            return [self._queue.popleft() for _ in range(n)]

    def _send(self, batch: list[MappedSpan], readable: SdkSpans, requests: Requests) -> None:
        if not batch:
            return
        why = requests.send([readable(m) for m in batch])
        result = self.result
        if why is None:
            result.sent += len(batch)
            result.batches += 1
            self._sent.extend(int(m.attributes["mltrace.span.id"]) for m in batch)
            return
        result.failed += len(batch)
        if not result.errors:
            _say(f"warning: OTLP live export to {result.endpoint} failed: {why} (the end sends what did not arrive)")
        if len(result.errors) < 8:
            result.errors.append(why)

    # -- the end ---------------------------------------------------------------

    def stop(self, session: Any) -> None:
        """Takes this export out of ``session`` before it stops, and closes it (the export at
        the end sends the rest)."""
        try:
            session.batch_sinks.remove(self)
        except ValueError:  # removed after a failure
            pass
        self.close()

    def close(self, timeout_s: float | None = None) -> LiveResult:
        """Stops sending (a request in flight completes, within the export timeout); what is
        still queued or waiting is left to the export at the end (``sent_ids``)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(self.settings.export_timeout_s if timeout_s is None else timeout_s)
        self.result.waiting += self._pending_count
        return self.result

    def sent_ids(self) -> IdSet:
        """The mltrace ids of the spans the receiver acknowledged."""
        return IdSet(self._sent)


def status_line(live: LiveResult, end: Any) -> str:
    """The one stderr line after a traced program: spans sent (while it ran, at the end), where,
    dropped, failed. ``end`` is the ``OtlpExportResult`` of the export at the end."""
    sent = live.sent + end.spans_sent
    where = end.endpoint or live.endpoint
    protocol = end.protocol or live.protocol
    line = f"OTLP: {sent} spans sent to {where} ({protocol}): {live.sent} while the program ran, {end.spans_sent} at the end"
    extra = []
    if live.dropped:
        extra.append(f"{live.dropped} over the live queue's {live.queue_size} (sent at the end)")
    if live.failed:
        extra.append(f"{live.failed} failed while running ({live.errors[0] if live.errors else 'unknown error'})")
    if end.dropped:
        extra.append(f"{end.dropped} not delivered: {end.errors[0] if end.errors else 'unknown error'}")
    return line + ("; " + "; ".join(extra) if extra else "; 0 dropped, 0 failed")


def otlp_option(value: str | None) -> str | None:
    """The ``--otlp`` value to use: ``value`` as given, else "" (the OTEL_* endpoint) where
    the environment asks for OTLP (``otlp_from_env``, said once on stderr), else None."""
    if value is not None:
        return value
    var = otlp_from_env()
    if var is None:
        return None
    _say(f"OTLP export on ({var} is set): spans are sent while the program runs")
    return ""


def start_live(session: Any) -> LiveExport | None:
    """Starts the live export of a started session (added to ``session.batch_sinks``) where
    ``--otlp`` or the environment (``otlp_option``, which sets ``session.options.otlp``) asks
    for OTLP; None where neither does, or, with one warning, where it cannot start (the
    export at the end still runs)."""
    options = session.options
    options.otlp = otlp_option(options.otlp)
    if options.otlp is None:
        return None
    try:
        live = LiveExport(session.meta, options.otlp or None)
    except Exception as exc:
        _say(f"warning: no OTLP export while the program runs: {exc}")
        return None
    session.batch_sinks.append(live)
    return live


def send_rest(run_dir: Path, endpoint: str | None, live: LiveExport | None) -> None:
    """Sends what the live export did not deliver from the finished run and prints one stderr
    line: spans sent (while running, at the end), where, dropped, failed. Never raises."""
    from mltrace.exporters.otlp import export_otlp
    from mltrace.run.store import load_run

    last = [time.monotonic()]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 2.0:
            last[0] = now
            _say(f"OTLP: {done:,} of {total:,} spans sent…")

    try:
        skip = live.sent_ids() if live is not None else IdSet(array("q"))
        end = export_otlp(load_run(run_dir), endpoint or None, log_failure=False, skip=skip, progress=progress)
        line = status_line(live.result, end) if live is not None else end.status_line()
    except Exception as exc:
        line = f"OTLP: not sent to {endpoint or 'the default endpoint'}: {type(exc).__name__}: {exc}"
    _say(line)
