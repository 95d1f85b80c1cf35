"""A real OTLP/gRPC TraceService on 127.0.0.1 (grpcio), for the OTLP export tests."""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


class GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC TraceService on 127.0.0.1 that keeps every request and its metadata."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metadata: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the gRPC method name
        with self._lock:
            self.requests.append(request)
            self.metadata.append({k: v for k, v in context.invocation_metadata()})
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[Any]:
        """The requests received so far."""
        with self._lock:
            return list(self.requests)

    def close(self) -> None:
        self.server.stop(grace=None)


def py_value(v: AnyValue) -> Any:
    """An OTLP attribute value as Python."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [py_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: py_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


def attrs_of(kvs: Any) -> dict[str, Any]:
    """OTLP key-values as a dict."""
    return {kv.key: py_value(kv.value) for kv in kvs}


def spans_of(requests: list[Any]) -> list[tuple[str, dict[str, Any], Any]]:
    """(scope name, resource attributes, span) for every span of every request."""
    out = []
    for req in requests:
        for rs in req.resource_spans:
            res = attrs_of(rs.resource.attributes)
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    out.append((ss.scope.name, res, sp))
    return out
