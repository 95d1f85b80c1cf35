"""OTLP export throughput: a 200,000-span run sent to in-process receivers on 127.0.0.1.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/otlp_throughput.py [--invocations 2000] [--repeat 1]

Builds a run directory of ``invocations * 100`` spans (model → 33 Linear layers →
2 ops each, realistic attributes), loads it as ``mltrace export`` does, then
sends it with ``export_otlp`` to a grpcio TraceService and to an HTTP/protobuf
receiver in this process, and prints spans/s for each. The receivers only parse
and count, so the figures are the exporter's cost (mapping, the OpenTelemetry
SDK's encoder, the transport), on whatever CPU is free: the receivers share it.
Also times the Jaeger JSON export of the same run for comparison.
"""

from __future__ import annotations

import argparse
import gzip
import platform
import sys
import tempfile
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from mltrace.exporters.jaeger_json import export_jaeger_json
from mltrace.exporters.otlp import export_otlp
from mltrace.run import store
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run, load_run


class GrpcCounter(trace_service_pb2_grpc.TraceServiceServicer):
    """A gRPC TraceService that parses each request and counts its spans."""

    def __init__(self) -> None:
        self.spans = 0
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.url = f"http://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the gRPC method name
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.spans += n
        return trace_service_pb2.ExportTraceServiceResponse()

    def close(self) -> None:
        self.server.stop(grace=None)


class HttpCounter:
    """An OTLP/HTTP receiver (POST /v1/traces, protobuf) that counts spans."""

    def __init__(self) -> None:
        self.spans = 0
        counter = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's method name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if (self.headers.get("Content-Encoding") or "").lower() == "gzip":
                    body = gzip.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                counter.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                payload = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def build_run(path: Path, invocations: int) -> Run:
    """``invocations`` model calls of 100 spans each (model, 33 layers, 66 ops)."""
    path.mkdir(parents=True)
    anchor = 1_000_000_000
    store.write_meta(
        path,
        {
            "format": "mltrace-run",
            "name": "mlp_infer",
            "run_id": "benchmark",
            "pid": 1,
            "host": {"hostname": platform.node(), "os": platform.platform(), "python": platform.python_version()},
            "versions": {"torch": "2.4.1"},
            "clock": {"anchor_monotonic_ns": anchor, "anchor_epoch_ns": time.time_ns()},
            "complete": True,
        },
    )
    spans: list[Span] = []
    sid, t = 1, anchor
    for _ in range(invocations):
        model_id, sid = sid, sid + 1
        start = t
        for layer in range(33):
            layer_id, sid = sid, sid + 1
            layer_start = t
            for _op in range(2):
                op_attrs: dict[str, Any] = {"ml.op.name": "aten::addmm", "ml.input.shapes": [[32, 512], [512, 512]]}
                spans.append(Span(sid, layer_id, Level.OP, "aten::addmm", t + 1, t + 3, 1, op_attrs))
                sid, t = sid + 1, t + 4
            layer_attrs: dict[str, Any] = {
                "ml.framework": "pytorch",
                "ml.layer.type": "Linear",
                "ml.layer.path": f"blocks.{layer}",
                "ml.layer.params": 262656,
                "code.file.path": "/srv/model.py",
                "code.line.number": 42,
            }
            spans.append(Span(layer_id, model_id, Level.LAYER, f"blocks.{layer}", layer_start, t, 1, layer_attrs))
        model_attrs = {"ml.framework": "pytorch", "ml.input.shapes": [[32, 512]], "ml.input.dtypes": ["float32"]}
        spans.append(Span(model_id, None, Level.MODEL, "MLP", start - 1, t + 1, 1, model_attrs))
        t += 10
    with open(path / store.EVENTS_FILE, "wb") as f:
        f.write(store.encode_batch(tracks=[Track(1, TrackKind.THREAD, "MainThread", 1, tid=1)]))
        for i in range(0, len(spans), 20000):
            f.write(store.encode_batch(spans=spans[i : i + 20000]))
    return load_run(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--invocations", type=int, default=2000, help="model calls (100 spans each; default 2000 = 200,000 spans)")
    parser.add_argument("--repeat", type=int, default=1, help="exports per protocol (the best is reported)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(Path(tmp) / "run", args.invocations)
        n = len(run.spans)
        print(f"run: {n} spans in {args.invocations} invocations; Python {platform.python_version()} on {platform.machine()}")
        for protocol, receiver_cls in (("grpc", GrpcCounter), ("http/protobuf", HttpCounter)):
            best = None
            for _ in range(args.repeat):
                receiver = receiver_cls()
                try:
                    result = export_otlp(run, receiver.url, protocol=protocol, timeout_s=30)
                finally:
                    receiver.close()
                if not result.ok or receiver.spans != n:
                    print(f"{protocol}: FAILED ({receiver.spans} of {n} arrived): {result.errors}", file=sys.stderr)
                    return 1
                best = result.elapsed_ns if best is None else min(best, result.elapsed_ns)
            assert best is not None
            print(f"{protocol:>14}: {n / (best / 1e9):>9,.0f} spans/s  ({best / 1e9:.2f} s, {result.batches} requests, all {n} arrived)")
        t0 = time.perf_counter()
        export_jaeger_json(run, Path(tmp) / "trace.jaeger.json")
        secs = time.perf_counter() - t0
        size = (Path(tmp) / "trace.jaeger.json").stat().st_size
        print(f"{'jaeger-json':>14}: {n / secs:>9,.0f} spans/s  ({secs:.2f} s, {size / 1e6:.0f} MB file)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
