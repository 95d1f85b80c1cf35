"""The program's own OpenTelemetry spans (a service's request spans), recorded as external spans.

Where the program uses the OpenTelemetry SDK, every ``TracerProvider`` made while the session
runs (and the global one made before it) gets a span processor that records each span the
program ends as a USER-level span on the track of the thread that started it, with the
program's ids (``mltrace.otel.span``), its parent (``mltrace.otel.parent``), its kind
(``mltrace.otel.kind``) and its scalar attributes. The correlator then nests what ran inside
it on that thread (ops before and after the model call, library calls) under it by time; the
OTLP export does not send it (the program's exporter does) but puts those spans under it, in
its trace; the report takes server spans as requests.

Times are the session clock's, read when the SDK calls the processor (just after the span's
start and just after its end), so what ran inside the span lies inside the recorded one.
The SDK is never imported by mltrace: the processor is added once the program imports
``opentelemetry.sdk.trace``. A provider keeps the processor after the session (it records
nothing then).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from mltrace.run.events import Event, Span
from mltrace.run.levels import Level
from mltrace.run.redact import needs_redaction, redact_values
from mltrace.tracer.clock import now_ns
from mltrace.tracer.otel_context import EXTERNAL_ATTR, OTEL_PARENT_ATTR
from mltrace.tracer.sources._imports import PostImportHook
from mltrace.tracer.sources.base import Source

if TYPE_CHECKING:
    from mltrace.tracer.sources.base import SessionView

#: The SDK module whose import adds the processor.
SDK_MODULE = "opentelemetry.sdk.trace"

#: Spans started and not yet ended that the processor keeps at most (a program that never
#: ends its spans must not grow the session without bound).
MAX_OPEN = 65536


def _ids(ctx: Any) -> str:
    return f"{int(ctx.trace_id):032x}-{int(ctx.span_id):016x}"


class OtelSpanSource(Source):
    """Records the program's OpenTelemetry spans (see the module docstring)."""

    name = "otel.spans"
    #: No level of its own: USER spans are always recorded, and a source with none is always started.
    levels: tuple[Level, ...] = ()

    def __init__(self) -> None:
        self._session: SessionView | None = None
        self._hook: PostImportHook | None = None
        self._open: dict[int, tuple[int, int]] = {}
        self._patched: tuple[Any, Any] | None = None
        self._lock = threading.Lock()
        self.recorded = 0

    def available(self) -> str | None:
        """Always available: nothing happens unless the program imports the SDK."""
        return None

    def start(self, session: SessionView) -> None:
        """Waits for the program's ``opentelemetry.sdk.trace`` import."""
        self._session = session
        session.recorder.external_open.append(self._open)  # open requests hold back an op cycle's stop
        self._hook = PostImportHook(SDK_MODULE, self._attach)

    def stop(self) -> list[Event]:
        """Stops recording and puts ``TracerProvider.__init__`` back."""
        session, self._session = self._session, None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._patched is not None:
            cls, init = self._patched
            cls.__init__ = init
            self._patched = None
        self._open.clear()
        if session is not None and self.recorded:
            session.meta.setdefault("sources", {})[self.name] = {"spans": self.recorded}
        return []

    def _attach(self, sdk: Any) -> None:
        """Adds the processor to the global provider and to every provider made from now on."""
        try:
            processor = _make_processor(sdk, self)
            provider_cls = sdk.TracerProvider
            init = provider_cls.__init__

            def __init__(provider: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - the patched method
                init(provider, *args, **kwargs)
                if self._session is not None:
                    provider.add_span_processor(processor)

            provider_cls.__init__ = __init__
            self._patched = (provider_cls, init)
            api = __import__("opentelemetry.trace", fromlist=["get_tracer_provider"])
            current = api.get_tracer_provider()
            if isinstance(current, provider_cls):
                current.add_span_processor(processor)
        except Exception as exc:  # an SDK of another shape: the program runs as it would
            if self._session is not None:
                self._session.note_limitation(f"the program's OpenTelemetry spans are not recorded: {exc}")

    def span_started(self, span: Any) -> None:
        """The processor's ``on_start``: the start time and the starting thread's track."""
        session = self._session
        if session is None or len(self._open) >= MAX_OPEN:
            return
        self._open[int(span.get_span_context().span_id)] = (now_ns(), session.tracks.current_thread().id)
        session.recorder.wait_while_switching()  # the request's work waits for a switch under way

    def span_ended(self, span: Any) -> None:
        """The processor's ``on_end``: records the span (a USER span with the program's ids)."""
        end = now_ns()
        session = self._session
        ctx = span.get_span_context()
        opened = self._open.pop(int(ctx.span_id), None)
        if session is None or opened is None:
            return
        attrs: dict[str, Any] = {}
        for key, value in (span.attributes or {}).items():
            if isinstance(value, (str, bool, int, float)):
                attrs[str(key)] = value
        if attrs and session.recorder.redact and needs_redaction(attrs):
            attrs = redact_values(attrs)
        attrs[EXTERNAL_ATTR] = _ids(ctx)
        parent = getattr(span, "parent", None)
        if parent is not None and getattr(parent, "is_valid", False):
            attrs[OTEL_PARENT_ATTR] = _ids(parent)
        kind = getattr(span, "kind", None)
        attrs["mltrace.otel.kind"] = str(getattr(kind, "name", kind)).lower()
        start, track = opened
        session.recorder.done.append(Span(session.new_id(), None, Level.USER, str(span.name), start, end, track, attrs))
        self.recorded += 1


def _make_processor(sdk: Any, source: OtelSpanSource) -> Any:
    """A ``SpanProcessor`` of the program's SDK that hands starts and ends to ``source``."""

    class MltraceSpanProcessor(sdk.SpanProcessor):  # type: ignore[misc,name-defined]
        """Records the program's spans into the running mltrace session."""

        def on_start(self, span: Any, parent_context: Any = None) -> None:
            try:
                source.span_started(span)
            except Exception:  # never into the program's request
                pass

        def on_end(self, span: Any) -> None:
            try:
                source.span_ended(span)
            except Exception:
                pass

        def shutdown(self) -> None:
            return None

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    return MltraceSpanProcessor()
