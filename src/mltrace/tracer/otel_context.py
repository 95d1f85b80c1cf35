"""The OpenTelemetry span current when a model call or a session begins, read from the program's own
OpenTelemetry (never imported here): recorded so that the OTLP export puts mltrace's spans in the
program's trace (``exporters/otlp.py``)."""

from __future__ import annotations

import sys
from contextvars import ContextVar

OTEL_PARENT_ATTR = "mltrace.otel.parent"
"""Span attribute a source may set on a model span: the OpenTelemetry span that
was current when the invocation began, as ``"<32 hex trace id>-<16 hex span id>"``."""

EXTERNAL_ATTR = "mltrace.otel.span"
"""Span attribute of a span the program made itself with OpenTelemetry (recorded by the
``otel`` source, ``tracer/sources/otel_spans.py``): its own ids, ``"<trace hex>-<span hex>"``.
The OTLP export does not send such a span (the program's exporter does) but puts the spans
inside it under it."""


#: The OpenTelemetry span current in the task that handed a function to an executor, set in the
#: worker thread around the call (``sources/asyncio_executor.py``): ``capture_otel_parent``'s
#: answer there where the program's own context has no span.
carried_otel_parent: ContextVar[tuple[int, int] | None] = ContextVar("mltrace_carried_otel_parent", default=None)


def otel_parent_meta(parent: tuple[int, int]) -> dict[str, str]:
    """The run.json form of ``(trace_id, span_id)``: ``{"trace_id": 32 hex, "span_id": 16 hex}``."""
    return {"trace_id": f"{parent[0]:032x}", "span_id": f"{parent[1]:016x}"}


def capture_otel_parent() -> tuple[int, int] | None:
    """The OpenTelemetry span current in the calling context, if the program uses OpenTelemetry.

    Looks only at an ``opentelemetry.trace`` the program has already imported
    (never imports it). Never raises.

    Returns:
        ``(trace_id, span_id)`` of a valid current span, else the span carried into an
        executor's worker thread (``carried_otel_parent``), else None.
    """
    mod = sys.modules.get("opentelemetry.trace")
    if mod is None:
        return carried_otel_parent.get()
    try:
        ctx = mod.get_current_span().get_span_context()
        if not ctx.is_valid:
            return carried_otel_parent.get()
        return int(ctx.trace_id), int(ctx.span_id)
    except Exception:  # a foreign or half-initialised OpenTelemetry: no parent
        return None
