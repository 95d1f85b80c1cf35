"""One deadline for the whole OTLP export (``OTEL_EXPORTER_OTLP_TIMEOUT``), against a real
gRPC receiver that answers each request late."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("opentelemetry.sdk")

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from mltrace.exporters.otlp import export_otlp  # noqa: E402
from mltrace.run import store  # noqa: E402
from mltrace.run.events import Span, Track, TrackKind  # noqa: E402
from mltrace.run.levels import Level  # noqa: E402
from mltrace.run.store import Run, load_run  # noqa: E402


class SlowReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC receiver on 127.0.0.1 that takes ``delay_s`` to answer each request."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.received = 0
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.url = f"http://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the gRPC method name
        with self._lock:
            self.received += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        time.sleep(self.delay_s)
        return trace_service_pb2.ExportTraceServiceResponse()


def _run(path: Path, n: int) -> Run:
    path.mkdir()
    meta = {
        "format": "mltrace-run",
        "name": "many",
        "run_id": "deadline",
        "clock": {"anchor_monotonic_ns": 0, "anchor_epoch_ns": 1_700_000_000_000_000_000},
        "complete": False,
    }
    store.write_meta(path, meta)
    track = Track(1, TrackKind.THREAD, "MainThread", 4242, tid=4242)
    spans = [Span(i + 1, None, Level.MODEL, "Net", i * 10, i * 10 + 5, 1, {}) for i in range(n)]
    (path / store.EVENTS_FILE).write_bytes(store.encode_batch(tracks=[track], spans=spans))
    return load_run(path)


def test_the_timeout_bounds_the_whole_export(tmp_path: Path) -> None:
    """Five requests of 2,048 spans to a receiver that answers each after 1 s, with a 2.5 s
    deadline: the first two (one, where encoding and sending the first are slow on a loaded
    machine) are acknowledged and counted, the export then stops (each request alone was
    within the old per-request bound, so all five went, 5 s in all)."""
    receiver = SlowReceiver(delay_s=1.0)
    try:
        result = export_otlp(_run(tmp_path / "run", 5 * 2048), receiver.url, protocol="grpc", timeout_s=2.5, log_failure=False)
    finally:
        receiver.server.stop(grace=None)
    assert result.spans_total == 10_240
    assert result.batches in (1, 2) and result.spans_sent == result.batches * 2048
    sent = result.spans_sent
    assert result.dropped == 10_240 - sent
    assert "deadline for the whole export" in result.errors[0]
    assert f"{sent} of 10240 spans sent" in result.status_line() and f"{10_240 - sent} not delivered" in result.status_line()
    assert result.elapsed_ns < 10e9  # a hang bound, not a timing claim
