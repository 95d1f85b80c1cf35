"""A threaded inference service with its own OpenTelemetry request spans, for the live OTLP tests.

Usage: otel_server.py OTLP_URL REQUESTS CONCURRENCY [--no-otel]

Serves a small torch MLP with ``ThreadingHTTPServer``. Each request's handler opens a SERVER
span (exported by the program's own OTLP exporter to OTLP_URL), makes its input with
``torch.randn``, runs the model and takes the ``argmax``, outside the model but inside the
request. With ``--no-otel`` the handler marks the request with ``mltrace.span`` instead.
A client in the same process sends REQUESTS requests, CONCURRENCY at a time, then prints
``served N`` and keeps serving until a line arrives on stdin.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torch import nn

URL, REQUESTS, CONCURRENCY = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
USE_OTEL = "--no-otel" not in sys.argv

torch.manual_seed(0)
torch.set_num_threads(1)
MODEL = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)).eval()

if USE_OTEL:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "otel-server"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=URL, insecure=True)))
    trace.set_tracer_provider(provider)
    TRACER = trace.get_tracer("otel-server")


def request_span(request_id: str) -> AbstractContextManager[Any]:
    """The request's span: the program's own OpenTelemetry span, or an mltrace.span."""
    if USE_OTEL:
        from opentelemetry.trace import SpanKind

        return TRACER.start_as_current_span("POST /predict", kind=SpanKind.SERVER, attributes={"app.request.id": request_id})
    try:
        import mltrace

        return mltrace.span("handle_request", request_id=request_id)
    except ImportError:
        return nullcontext()


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's method name
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        request_id = json.loads(body)["id"]
        with request_span(request_id):
            x = torch.randn(4, 64)
            with torch.no_grad():
                y = MODEL(x)
            label = int(torch.argmax(y[0]))
        payload = json.dumps({"id": request_id, "label": label}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def post(port: int, i: int) -> int:
    data = json.dumps({"id": f"r{i}"}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/predict", data=data), timeout=60) as r:
        return int(json.loads(r.read())["label"])


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        labels = list(pool.map(lambda i: post(port, i), range(REQUESTS)))
    print(f"served {len(labels)}", flush=True)
    sys.stdin.readline()
    server.shutdown()
    server.server_close()
    if USE_OTEL:
        provider.shutdown()
    print("stopped", flush=True)


if __name__ == "__main__":
    main()
