"""Writes a run as Jaeger's native JSON, the file the Jaeger UI opens with "Upload JSON".

The layout is that of Jaeger's query API (``GET /api/traces``)::

    {"data": [{"traceID": "<32 hex>", "spans": [...], "processes": {"p1": {...}}, "warnings": null}],
     "total": 0, "limit": 0, "offset": 0, "errors": null}

one entry per trace. Ids, trace grouping, parents (``CHILD_OF``), links
(``FOLLOWS_FROM``) and tags are those the OTLP exporter sends (see
``mltrace.exporters.otlp.SpanMapper``), so a run uploaded as JSON and the same
run sent over OTLP show the same traces. Jaeger counts time in whole
microseconds: starts are truncated to µs and durations are end − start in
truncated µs, so children stay inside their parents; the exact ns stay in the
run directory. Needs no OpenTelemetry package.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from mltrace._version import __version__
from mltrace.exporters.otlp import MappedSpan, SpanMapper, resource_attributes
from mltrace.run.jsoncodec import dumps as _dumps  # orjson where installed; what JSON cannot hold as text
from mltrace.run.store import Run


def jaeger_tag(key: str, value: Any) -> dict[str, Any]:
    """One Jaeger tag from an OTLP-typed value (arrays become JSON strings, as Jaeger does)."""
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        if math.isfinite(value):
            return {"key": key, "type": "float64", "value": value}
        return {"key": key, "type": "string", "value": str(value)}
    if isinstance(value, (tuple, list)):
        return {"key": key, "type": "string", "value": json.dumps(list(value), separators=(",", ":"))}
    return {"key": key, "type": "string", "value": str(value)}


def _span_json(m: MappedSpan, process_id: str) -> dict[str, Any]:
    trace_hex = f"{m.trace_id:032x}"
    refs: list[dict[str, str]] = []
    # The Jaeger UI takes the first reference as the parent, so CHILD_OF goes first.
    if m.parent_span_id:
        refs.append({"refType": "CHILD_OF", "traceID": trace_hex, "spanID": f"{m.parent_span_id:016x}"})
    for t, s, _attrs in m.links:
        refs.append({"refType": "FOLLOWS_FROM", "traceID": f"{t:032x}", "spanID": f"{s:016x}"})
    tags = [jaeger_tag(k, v) for k, v in m.attributes.items()]
    tags.append({"key": "span.kind", "type": "string", "value": "internal"})
    tags.append({"key": "otel.scope.name", "type": "string", "value": "mltrace"})
    tags.append({"key": "otel.scope.version", "type": "string", "value": __version__})
    if "error.type" in m.attributes:  # a call that raised: Jaeger's error tag, as its OTLP receiver sets it
        tags.append({"key": "otel.status_code", "type": "string", "value": "ERROR"})
        tags.append({"key": "error", "type": "bool", "value": True})
    start_us = m.start_ns // 1000
    return {
        "traceID": trace_hex,
        "spanID": f"{m.span_id:016x}",
        "flags": 1,
        "operationName": m.name,
        "references": refs,
        "startTime": start_us,
        "duration": max(m.end_ns // 1000 - start_us, 0),
        "tags": tags,
        "logs": [],
        "processID": process_id,
        "warnings": None,
    }


def _grouped(run: Run, trace_per: str, parent: tuple[int, int] | None) -> list[tuple[SpanMapper, list[Any]]]:
    mapper = SpanMapper(run, trace_per, parent)
    groups: dict[int, list[Any]] = {}
    for s in run.spans:
        groups.setdefault(mapper.trace_id(s.id), []).append(s)
    ordered = sorted(groups.values(), key=lambda spans: min(s.start_ns for s in spans))
    return [(mapper, spans) for spans in ordered]


def _trace_json(run: Run, mapper: SpanMapper, spans: list[Any]) -> dict[str, Any]:
    mapped = [mapper.map(s) for s in sorted(spans, key=lambda s: (s.start_ns, s.id))]
    process_ids: dict[int, str] = {}
    processes: dict[str, Any] = {}
    out_spans = []
    for m in mapped:
        pid = process_ids.get(m.pid)
        if pid is None:
            pid = process_ids[m.pid] = f"p{len(process_ids) + 1}"
            res = resource_attributes(run, m.pid)
            service = str(res.pop("service.name"))
            processes[pid] = {"serviceName": service, "tags": [jaeger_tag(k, v) for k, v in res.items()]}
        out_spans.append(_span_json(m, pid))
    return {"traceID": f"{mapped[0].trace_id:032x}", "spans": out_spans, "processes": processes, "warnings": None}


def export_jaeger_json(
    run: Run,
    dest: Path,
    *,
    trace_per: str = "invocation",
    parent: tuple[int, int] | None = None,
) -> Path:
    """Writes ``run`` to ``dest`` as Jaeger JSON; never replaces an existing file.

    The file appears complete or not at all (written beside it, then linked
    into place).

    Args:
        run: a loaded run.
        dest: the file to create.
        trace_per: "invocation" (one trace per model invocation) or "run".
        parent: ``(trace_id, span_id)`` of an enclosing OpenTelemetry span;
            None uses ``run.meta["otel_parent"]``.

    Returns:
        ``dest``.

    Raises:
        FileExistsError: if ``dest`` exists.
        OSError: if it cannot be written.
        ValueError: for an unknown ``trace_per``.
    """
    dest = Path(dest)
    if dest.exists():
        raise FileExistsError(f"{dest} exists")
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(b'{"data":[')
            for i, (mapper, spans) in enumerate(_grouped(run, trace_per, parent)):
                if i:
                    f.write(b",\n")
                f.write(_dumps(_trace_json(run, mapper, spans)))
            f.write(b'],"total":0,"limit":0,"offset":0,"errors":null}\n')
        os.link(tmp, dest)  # fails instead of replacing a file created meanwhile
    finally:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
    return dest
