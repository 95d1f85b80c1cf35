"""OTLP export against real receivers on 127.0.0.1: a grpcio TraceService and an HTTP server.

Runs are written as run directories (run.json + events.jsonl) and loaded with
``load_run``, exactly as ``mltrace export`` does.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import socket
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("opentelemetry.sdk")

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

from mltrace.exporters.otlp import (  # noqa: E402
    export_otlp,
    resolve_endpoint,
    resolve_protocol,
)
from mltrace.run import store  # noqa: E402
from mltrace.run.events import Flow, Span, Track, TrackKind  # noqa: E402
from mltrace.run.levels import Level  # noqa: E402
from mltrace.run.store import Run, load_run  # noqa: E402
from mltrace.tracer.otel_context import OTEL_PARENT_ATTR, capture_otel_parent, otel_parent_meta  # noqa: E402
from support.otlp_receiver import GrpcReceiver, attrs_of  # noqa: E402

ANCHOR_MONO = 1_000_000_000
ANCHOR_EPOCH = 1_700_000_000_123_456_789
OFFSET = ANCHOR_EPOCH - ANCHOR_MONO

# Values of every type a source writes, including the awkward ones.
RICH_ATTRS: dict[str, Any] = {
    "ml.framework": "pytorch",
    "ml.layer.params": 9408,
    "ml.flops": 118013952.5,
    "mltrace.truncated": False,
    "ml.input.shapes": [[8, 3, 224, 224]],
    "ml.input.dtypes": ["float32"],
    "ml.custom.ints": [1, 2, 3],
    "ml.custom.floats": [0.5, 1.5],
    "ml.custom.bools": [True, False],
    "ml.custom.empty": [],
    "ml.custom.mixed": [1, "a", 2.5],
    "ml.custom.object": {"k": [1, 2], "s": "v"},
    "ml.custom.huge": (1 << 64) - 1,  # beyond int64: sent as a string
    "ml.custom.negative": -(1 << 40),
    "ml.custom.unicode": "Ωmega → ✓",
}


# -- receivers -----------------------------------------------------------------


class HttpReceiver:
    """An OTLP/HTTP (protobuf) receiver on 127.0.0.1: POST /v1/traces."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metadata: list[dict[str, str]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's method name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                receiver.requests.append(request)
                receiver.metadata.append({k.lower(): v for k, v in self.headers.items()})
                payload = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


PROTOCOLS: dict[str, Any] = {"grpc": GrpcReceiver, "http/protobuf": HttpReceiver}


@pytest.fixture(params=sorted(PROTOCOLS))
def receiver(request: pytest.FixtureRequest) -> Iterator[Any]:
    r = PROTOCOLS[request.param]()
    r.protocol = request.param
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(autouse=True)
def _clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OTEL_") or name.startswith("MLTRACE_"):
            monkeypatch.delenv(name)


# -- decoding what arrived ---------------------------------------------------------


def received(requests: list[Any]) -> list[tuple[dict[str, Any], Any]]:
    """(resource attributes, span) for every span of every request."""
    out = []
    for req in requests:
        for rs in req.resource_spans:
            res = attrs_of(rs.resource.attributes)
            for ss in rs.scope_spans:
                assert ss.scope.name == "mltrace"
                for sp in ss.spans:
                    out.append((res, sp))
    return out


# -- runs ------------------------------------------------------------------------


def write_run(path: Path, spans: list[Span], tracks: list[Track], flows: Sequence[Flow] = (), **meta: Any) -> Run:
    path.mkdir(parents=True)
    base = {
        "format": "mltrace-run",
        "format_version": 1,
        "mltrace_version": "0.1.0",
        "name": "resnet_infer",
        "run_id": f"run-{path.name}",
        "command": ["mltrace", "python", "resnet_infer.py", "--batch", "8"],
        "pid": 4242,
        "host": {"hostname": "gpu-node-7", "os": "Linux 6.8.0", "machine": "x86_64", "cpu": "Xeon", "cpu_count": 2, "python": "3.11.9"},
        "versions": {"torch": "2.4.1", "numpy": "1.26.4"},
        "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3"}],
        "levels": {"model": {"recorded": True}, "layer": {"recorded": True}, "op": {"recorded": True}, "kernel": {"recorded": False}},
        "clock": {"domain": "CLOCK_MONOTONIC", "unit": "ns", "anchor_monotonic_ns": ANCHOR_MONO, "anchor_epoch_ns": ANCHOR_EPOCH},
        "complete": True,
    }
    base.update(meta)
    store.write_meta(path, base)
    with open(path / store.EVENTS_FILE, "wb") as f:
        f.write(store.encode_batch(tracks=tracks))
        # children are written before their parents, as the live recorder does
        for i in range(0, len(spans), 1000):
            f.write(store.encode_batch(spans=spans[i : i + 1000]))
        f.write(store.encode_batch(flows=flows))
    return load_run(path)


MAIN = Track(1, TrackKind.THREAD, "MainThread", 4242, tid=4242)
GPU = Track(2, TrackKind.GPU_STREAM, "GPU 0 stream 7", 4242, device=0, stream=7)


def invocation(first_id: int, t0: int, batch: int) -> tuple[list[Span], list[Flow]]:
    """model → 2 layers (Conv2d, ReLU) → ops → one GPU kernel with a launch flow (7 spans)."""
    i = first_id
    model = Span(i, None, Level.MODEL, "ResNet", t0, t0 + 1000, 1, {"ml.framework": "pytorch", "ml.input.shapes": [[batch, 3, 224, 224]]})
    conv = Span(i + 1, i, Level.LAYER, "conv1", t0 + 10, t0 + 500, 1, {**RICH_ATTRS, "ml.layer.type": "Conv2d", "ml.layer.path": "conv1"})
    relu = Span(i + 2, i, Level.LAYER, "relu", t0 + 510, t0 + 900, 1, {"ml.layer.type": "ReLU", "ml.layer.path": "relu"})
    op1 = Span(i + 3, i + 1, Level.OP, "aten::conv2d", t0 + 20, t0 + 400, 1, {"ml.op.name": "aten::conv2d"})
    op2 = Span(i + 4, i + 2, Level.OP, "aten::relu", t0 + 520, t0 + 890, 1, {"ml.op.name": "aten::relu"})
    launch = Span(i + 5, i + 3, Level.KERNEL, "cudaLaunchKernel", t0 + 30, t0 + 40, 1, {})
    kernel_attrs = {"gpu.kernel.name": "implicit_gemm", "gpu.correlation_id": 77}
    kernel = Span(i + 6, i + 3, Level.KERNEL, "implicit_gemm", t0 + 50, t0 + 390, 2, kernel_attrs)
    flow = Flow(first_id * 100, launch.id, kernel.id, "launch")
    # leaf-first, as recorded
    return [launch, kernel, op1, conv, op2, relu, model], [flow]


@pytest.fixture
def two_invocations(tmp_path: Path) -> Run:
    a, fa = invocation(1, ANCHOR_MONO + 5_000, 8)
    b, fb = invocation(101, ANCHOR_MONO + 9_000, 16)
    return write_run(tmp_path / "run", a + b, [MAIN, GPU], fa + fb)


def expected_value(v: Any) -> Any:
    """What a local attribute value looks like after OTLP: JSON strings for nested or mixed lists."""
    if isinstance(v, dict):
        return json.dumps(v, separators=(",", ":"))
    if isinstance(v, list) and v and (len({type(x) for x in v}) > 1 or isinstance(v[0], list)):
        return json.dumps(v, separators=(",", ":"))
    if isinstance(v, int) and not isinstance(v, bool) and not -(1 << 63) <= v < (1 << 63):
        return str(v)
    return v


# -- tests -------------------------------------------------------------------------


def test_every_span_arrives_once_identical_to_local_trace(receiver: Any, two_invocations: Run) -> None:
    run = two_invocations
    result = export_otlp(run, receiver.url, protocol=receiver.protocol, timeout_s=10)

    assert result.ok, result.errors
    assert result.spans_sent == result.spans_total == len(run.spans) == 14
    assert result.traces == 2
    got = received(receiver.requests)
    assert len(got) == len(run.spans)
    by_mltrace_id = {}
    for _res, sp in got:
        mid = attrs_of(sp.attributes)["mltrace.span.id"]
        assert mid not in by_mltrace_id, f"span {mid} arrived twice"
        by_mltrace_id[mid] = sp
    assert set(by_mltrace_id) == {s.id for s in run.spans}
    local = run.span_by_id()
    otel_to_mltrace = {sp.span_id: mid for mid, sp in by_mltrace_id.items()}
    for mid, sp in by_mltrace_id.items():
        s = local[mid]
        assert sp.name == s.name
        assert sp.start_time_unix_nano == s.start_ns + OFFSET
        assert sp.end_time_unix_nano == s.end_ns + OFFSET
        assert len(sp.trace_id) == 16 and len(sp.span_id) == 8
        if s.parent_id is None:
            assert sp.parent_span_id == b""
        else:
            assert otel_to_mltrace[sp.parent_span_id] == s.parent_id
            assert sp.trace_id == by_mltrace_id[s.parent_id].trace_id
        attrs = attrs_of(sp.attributes)
        assert attrs["mltrace.level"] == s.level.label
        for k, v in s.attrs.items():
            assert attrs[k] == expected_value(v), k
    conv = attrs_of(by_mltrace_id[2].attributes)
    assert conv["ml.input.shapes"] == "[[8,3,224,224]]"
    assert json.loads(conv["ml.custom.object"]) == {"k": [1, 2], "s": "v"}
    assert conv["ml.custom.ints"] == [1, 2, 3] and conv["ml.custom.bools"] == [True, False]
    assert conv["thread.id"] == 4242 and conv["thread.name"] == "MainThread"
    kernel = attrs_of(by_mltrace_id[7].attributes)
    assert (kernel["gpu.device"], kernel["gpu.stream"]) == (0, 7)
    model = attrs_of(by_mltrace_id[101].attributes)
    assert (model["ml.batch_size"], model["ml.model.name"]) == (16, "ResNet")


def test_one_trace_per_invocation_with_flow_links(receiver: Any, two_invocations: Run) -> None:
    export_otlp(two_invocations, receiver.url, protocol=receiver.protocol, timeout_s=10)
    spans = {attrs_of(sp.attributes)["mltrace.span.id"]: sp for _r, sp in received(receiver.requests)}
    first = {spans[i].trace_id for i in range(1, 8)}
    second = {spans[i].trace_id for i in range(101, 108)}
    assert len(first) == 1 and len(second) == 1 and first != second
    kernel = spans[7]
    assert len(kernel.links) == 1
    link = kernel.links[0]
    assert (link.trace_id, link.span_id) == (spans[6].trace_id, spans[6].span_id)
    assert attrs_of(link.attributes) == {"mltrace.link.kind": "flow", "mltrace.flow.kind": "launch", "mltrace.flow.id": 100}


def test_resource_describes_host_process_gpu_versions_and_run(receiver: Any, two_invocations: Run) -> None:
    export_otlp(two_invocations, receiver.url, protocol=receiver.protocol, timeout_s=10)
    res = received(receiver.requests)[0][0]
    assert res["service.name"] == "mltrace"
    assert res["host.name"] == "gpu-node-7"
    assert res["process.pid"] == 4242
    assert res["process.command_args"] == ["mltrace", "python", "resnet_infer.py", "--batch", "8"]
    assert res["host.gpu.model"] == "NVIDIA H100 80GB HBM3" and res["host.gpu.count"] == 1
    assert res["ml.version.torch"] == "2.4.1"
    assert res["mltrace.run.id"] == "run-run" and res["mltrace.run.name"] == "resnet_infer"
    assert res["mltrace.levels"] == ["model", "layer", "op"]


def test_a_followed_process_has_its_own_command_role_and_rank(two_invocations: Run) -> None:
    """torchrun's ranks, followed into the run: each rank's resource names its own command line,
    its role and its torch.distributed rank (they all said the launcher's command, and
    nothing told rank 0 from rank 1 but the pid)."""
    from mltrace.exporters.otlp import resource_attributes

    rank1 = ["/venv/bin/python", "-u", "ddp.py"]
    dist = {"rank": 1, "world_size": 2, "backend": "gloo", "source": "init_process_group"}
    processes = [
        {"pid": 4242, "role": "main", "command": ["mltrace", "python", "-m", "torch.distributed.run", "ddp.py"]},
        {"pid": 4300, "ppid": 4242, "start": "exec", "role": "rank 1", "command": rank1, "distributed": dist},
    ]
    run = two_invocations.replace(meta={**two_invocations.meta, "processes": processes})
    child = resource_attributes(run, 4300)
    assert child["process.pid"] == 4300 and child["process.command_args"] == tuple(rank1)
    assert (child["mltrace.process.role"], child["ml.distributed.rank"], child["ml.distributed.world_size"]) == ("rank 1", 1, 2)
    assert child["ml.distributed.backend"] == "gloo"
    main = resource_attributes(run, 4242)
    assert main["process.command_args"] == tuple(processes[0]["command"]) and main["mltrace.process.role"] == "main"
    assert not any(k.startswith("ml.distributed.") for k in main)
    alone = resource_attributes(two_invocations)  # a run of one process lists none
    assert "mltrace.process.role" not in alone and alone["process.command_args"][2] == "resnet_infer.py"


def test_trace_per_run_and_reexport_is_idempotent(tmp_path: Path, two_invocations: Run) -> None:
    r = GrpcReceiver()
    try:
        export_otlp(two_invocations, r.url, trace_per="run", timeout_s=10)
        export_otlp(two_invocations, r.url, trace_per="run", timeout_s=10)
    finally:
        r.close()
    first, second = r.requests
    a = {(sp.trace_id, sp.span_id, sp.parent_span_id) for _res, sp in received([first])}
    b = {(sp.trace_id, sp.span_id, sp.parent_span_id) for _res, sp in received([second])}
    assert a == b and len(a) == 14
    assert len({t for t, _s, _p in a}) == 1


def test_model_inside_a_user_span_is_its_child(tmp_path: Path) -> None:
    spans, flows = invocation(2, ANCHOR_MONO + 100, 4)
    model = spans[-1]
    model.parent_id = 1
    request = Span(1, None, Level.USER, "handle_request", ANCHOR_MONO, ANCHOR_MONO + 5000, 1, {"http.route": "/predict"})
    run = write_run(tmp_path / "run", [*spans, request], [MAIN, GPU], flows)
    r = GrpcReceiver()
    try:
        export_otlp(run, r.url, timeout_s=10)
        per_invocation = {attrs_of(sp.attributes)["mltrace.span.id"]: sp for _res, sp in received(r.requests)}
        r.requests.clear()
        export_otlp(run, r.url, trace_per="run", timeout_s=10)
        per_run = {attrs_of(sp.attributes)["mltrace.span.id"]: sp for _res, sp in received(r.requests)}
    finally:
        r.close()
    # per invocation: the user span (a request) parents the model span, one hop, in its trace
    m, u = per_invocation[2], per_invocation[1]
    assert m.parent_span_id == u.span_id and m.trace_id == u.trace_id and u.parent_span_id == b""
    assert not m.links and "mltrace.parent.id" not in attrs_of(m.attributes)
    assert len({sp.trace_id for sp in per_invocation.values()}) == 1
    # per run: a plain parent too
    assert per_run[2].parent_span_id == per_run[1].span_id and not per_run[2].links


def test_a_span_that_raised_arrives_with_the_error_status(tmp_path: Path) -> None:
    """A span with ``error.type`` (a model call or user span that raised) has status ERROR;
    the others have none set."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    spans, flows = invocation(2, ANCHOR_MONO + 100, 4)
    failed = spans[-1]
    failed.attrs["error.type"] = "ValueError"
    run = write_run(tmp_path / "run", spans, [MAIN, GPU], flows)
    r = GrpcReceiver()
    try:
        export_otlp(run, r.url, timeout_s=10)
        status = {attrs_of(sp.attributes)["mltrace.span.id"]: sp.status.code for _res, sp in received(r.requests)}
    finally:
        r.close()
    assert status.pop(failed.id) == Status.STATUS_CODE_ERROR
    assert set(status.values()) == {Status.STATUS_CODE_UNSET}


def test_enclosing_otel_span_becomes_the_parent(tmp_path: Path) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("serving")
    assert capture_otel_parent() is None
    with tracer.start_as_current_span("POST /predict") as request_span:
        parent = capture_otel_parent()
    ctx = request_span.get_span_context()
    assert parent == (ctx.trace_id, ctx.span_id)

    a, fa = invocation(1, ANCHOR_MONO + 5_000, 8)
    b, fb = invocation(101, ANCHOR_MONO + 9_000, 8)
    run = write_run(tmp_path / "run", a + b, [MAIN, GPU], fa + fb, otel_parent=otel_parent_meta(parent))
    r = GrpcReceiver()
    try:
        result = export_otlp(run, r.url, timeout_s=10)
    finally:
        r.close()
    assert result.ok and result.traces == 1
    spans = {attrs_of(sp.attributes)["mltrace.span.id"]: sp for _res, sp in received(r.requests)}
    assert {sp.trace_id for sp in spans.values()} == {ctx.trace_id.to_bytes(16, "big")}
    assert spans[1].parent_span_id == spans[101].parent_span_id == ctx.span_id.to_bytes(8, "big")


def test_per_invocation_otel_parent_attribute(tmp_path: Path) -> None:
    a, fa = invocation(1, ANCHOR_MONO + 5_000, 8)
    b, fb = invocation(101, ANCHOR_MONO + 9_000, 8)
    a[-1].attrs[OTEL_PARENT_ATTR] = f"{0xABC:032x}-{0xDEF:016x}"
    run = write_run(tmp_path / "run", a + b, [MAIN, GPU], fa + fb)
    r = GrpcReceiver()
    try:
        export_otlp(run, r.url, timeout_s=10)
    finally:
        r.close()
    spans = {attrs_of(sp.attributes)["mltrace.span.id"]: sp for _res, sp in received(r.requests)}
    assert {spans[i].trace_id for i in range(1, 8)} == {(0xABC).to_bytes(16, "big")}
    assert spans[1].parent_span_id == (0xDEF).to_bytes(8, "big")
    assert spans[101].trace_id != spans[1].trace_id and spans[101].parent_span_id == b""


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_standard_otel_variables(protocol: str, two_invocations: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    r = PROTOCOLS[protocol]()
    try:
        base = f"http://127.0.0.1:{r.port}"
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", base)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=s3cret,x-tenant=ml%20team")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "resnet-serving")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging,service.name=ignored")
        result = export_otlp(two_invocations)  # endpoint and protocol from the environment
    finally:
        r.close()
    assert result.ok, result.errors
    assert result.protocol == protocol
    assert result.endpoint == (base if protocol == "grpc" else base + "/v1/traces")
    assert r.metadata and all(m["x-api-key"] == "s3cret" for m in r.metadata)
    res = received(r.requests)[0][0]
    assert res["service.name"] == "resnet-serving"
    assert res["deployment.environment"] == "staging"
    if protocol == "http/protobuf":
        assert r.metadata[0]["content-encoding"] == "gzip"


def test_traces_variants_take_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:9999/custom")
    assert resolve_protocol(None, None) == "http/protobuf"
    assert resolve_endpoint(None, "http/protobuf") == "http://traces:9999/custom"
    assert resolve_protocol("grpc", None) == "grpc"


def test_protocol_and_endpoint_defaults() -> None:
    assert resolve_protocol(None, None) == "grpc"
    assert resolve_protocol(None, "http://jaeger:4318") == "http/protobuf"
    assert resolve_protocol(None, "jaeger:4317") == "grpc"
    assert resolve_protocol("http", None) == "http/protobuf"
    assert resolve_endpoint("jaeger:4317", "grpc") == "http://jaeger:4317"
    assert resolve_endpoint("http://jaeger:4318", "http/protobuf") == "http://jaeger:4318/v1/traces"
    assert resolve_endpoint(None, "http/protobuf") == "http://localhost:4318/v1/traces"
    with pytest.raises(ValueError, match="http/json"):
        resolve_protocol("http/json", None)


def test_unsupported_protocol_is_reported_not_raised(two_invocations: Run, caplog: pytest.LogCaptureFixture) -> None:
    result = export_otlp(two_invocations, "http://127.0.0.1:1", protocol="http/json")
    assert not result.ok and "http/json" in result.errors[0]
    assert result.dropped == 14
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_endpoint_down_returns_within_the_bound(protocol: str, two_invocations: Run, caplog: pytest.LogCaptureFixture) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    t0 = time.monotonic()
    result = export_otlp(two_invocations, url, protocol=protocol, timeout_s=2.0)
    elapsed = time.monotonic() - t0
    assert elapsed < 10  # configured 2 s; generous for a loaded machine
    assert not result.ok and result.errors
    assert result.spans_sent == 0 and result.dropped == 14
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].name == "mltrace"
    assert "14 of 14 spans not delivered" in warnings[0].getMessage()


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_stalled_endpoint_returns_within_the_bound(protocol: str, two_invocations: Run, caplog: pytest.LogCaptureFixture) -> None:
    # A socket that listens but never answers: connections complete, replies never come.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    try:
        t0 = time.monotonic()
        result = export_otlp(two_invocations, f"http://127.0.0.1:{s.getsockname()[1]}", protocol=protocol, timeout_s=1.0)
        elapsed = time.monotonic() - t0
    finally:
        s.close()
    assert elapsed < 10
    assert not result.ok and result.dropped == 14
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_importing_or_capturing_loads_no_grpc_or_opentelemetry() -> None:
    import subprocess
    import sys

    code = (
        "import sys, mltrace.exporters.otlp, mltrace.exporters.jaeger_json, mltrace.commands.export, mltrace.tracer.otel_context\n"
        "assert mltrace.tracer.otel_context.capture_otel_parent() is None\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'grpc', 'opentelemetry'}))"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": src}, check=True)
    assert out.stdout.strip() == "[]"


def big_run(path: Path, invocations: int = 2000, layers: int = 33, ops: int = 2) -> Run:
    """``invocations * (1 + layers * (1 + ops))`` spans, ~200,000 with the defaults."""
    spans: list[Span] = []
    sid = 1
    t = ANCHOR_MONO
    for _ in range(invocations):
        model_id = sid
        sid += 1
        children: list[Span] = []
        for layer in range(layers):
            layer_id = sid
            sid += 1
            for _ in range(ops):
                op_attrs = {"ml.op.name": "aten::addmm", "ml.input.shapes": [[32, 512], [512, 512]]}
                children.append(Span(sid, layer_id, Level.OP, "aten::addmm", t + 2, t + 3, 1, op_attrs))
                sid += 1
                t += 4
            layer_attrs = {"ml.layer.type": "Linear", "ml.layer.path": f"blocks.{layer}", "ml.layer.params": 262656}
            children.append(Span(layer_id, model_id, Level.LAYER, f"blocks.{layer}", t - 4 * ops, t, 1, layer_attrs))
        spans.extend(children)
        spans.append(Span(model_id, None, Level.MODEL, "MLP", t - 4 * ops * layers - 1, t + 1, 1, {"ml.input.shapes": [[32, 512]]}))
        t += 10
    return write_run(path, spans, [MAIN])


def _span_id_attr(sp: Any) -> int:
    return next(kv.value.int_value for kv in sp.attributes if kv.key == "mltrace.span.id")


@pytest.mark.slow
def test_200k_span_run_arrives_whole(tmp_path: Path) -> None:
    # gRPC only: the HTTP path shares every step but the transport, and benchmarks/otlp_throughput.py runs it at this size
    run = big_run(tmp_path / "big")
    assert len(run.spans) == 200_000
    r = GrpcReceiver()
    try:
        result = export_otlp(run, r.url, protocol="grpc", timeout_s=30)
    finally:
        r.close()
    assert result.ok, result.errors
    assert result.spans_sent == 200_000 and result.traces == 2000
    ids = [_span_id_attr(sp) for _res, sp in received(r.requests)]
    assert len(ids) == 200_000 and set(ids) == {s.id for s in run.spans}
    assert result.batches == len(r.requests) > 1
    assert max(req.ByteSize() for req in r.requests) < 4 * 1024 * 1024  # Jaeger's default gRPC receive limit


def test_large_attributes_are_split_under_the_receive_limit(tmp_path: Path) -> None:
    # ~20 MB of attributes: one request would exceed the 4 MiB a gRPC receiver accepts by default
    text = "x" * 8000
    t0 = ANCHOR_MONO
    spans = [Span(i, None, Level.MODEL, "Big", t0 + i * 10, t0 + i * 10 + 5, 1, {"ml.note": text}) for i in range(1, 2501)]
    run = write_run(tmp_path / "run", spans, [MAIN])
    r = GrpcReceiver()
    try:
        result = export_otlp(run, r.url, timeout_s=10)
    finally:
        r.close()
    assert result.ok, result.errors
    assert result.spans_sent == 2500 and result.batches >= 5
    got = received(r.requests)
    assert len(got) == 2500 and all(attrs_of(sp.attributes)["ml.note"] == text for _res, sp in got)
    assert max(req.ByteSize() for req in r.requests) < 4 * 1024 * 1024


def _mltrace_cli(*args: str) -> Any:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src")
    return subprocess.run([sys.executable, "-m", "mltrace", *args], capture_output=True, text=True, env=env, timeout=120)


def test_cli_export_sends_a_finished_run(two_invocations: Run) -> None:
    r = HttpReceiver()
    try:
        out = _mltrace_cli("export", str(two_invocations.path), "--otlp", f"http://127.0.0.1:{r.port}", "--protocol", "http")
    finally:
        r.close()
    assert out.returncode == 0, out.stderr
    assert "sent 14 of 14 spans" in out.stdout and "http/protobuf" in out.stdout
    assert len(received(r.requests)) == 14


def test_cli_export_to_a_down_endpoint_warns_once_and_fails(two_invocations: Run) -> None:
    out = _mltrace_cli("export", str(two_invocations.path), "--otlp", f"http://127.0.0.1:{_closed_port()}", "--timeout", "1")
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "14 of 14 spans not delivered" in out.stderr


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_live_run_sends_every_span_identical_to_local_trace(protocol: str, tmp_path: Path) -> None:
    """`mltrace python --otlp=URL` on a real torch model: the receiver gets the run's spans exactly once."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "tiny_models.py"
    r = PROTOCOLS[protocol]()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["OTEL_EXPORTER_OTLP_PROTOCOL"] = protocol
        import subprocess
        import sys

        out = subprocess.run(
            [sys.executable, "-m", "mltrace", "python", "-q", "--level", "op", f"--otlp={r.url}"]
            + ["-o", str(tmp_path / "run"), str(script), "1"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
    finally:
        r.close()
    assert out.returncode == 0, out.stderr
    assert "warning" not in out.stderr
    run = load_run(tmp_path / "run")
    got = received(r.requests)
    ids = [_span_id_attr(sp) for _res, sp in got]
    assert sorted(ids) == sorted(s.id for s in run.spans)  # every span, exactly once
    from mltrace.exporters.otlp import epoch_offset_ns

    offset = epoch_offset_ns(run)
    by_id = run.span_by_id()
    sent_by_mltrace_id = {_span_id_attr(sp): sp for _res, sp in got}
    span_id_of = {mid: sp.span_id for mid, sp in sent_by_mltrace_id.items()}
    for mid, sp in sent_by_mltrace_id.items():
        local = by_id[mid]
        assert sp.start_time_unix_nano == local.start_ns + offset
        assert sp.end_time_unix_nano == local.end_ns + offset
        assert sp.name == local.name
        attrs = attrs_of(sp.attributes)
        assert attrs["mltrace.level"] == local.level.label
        if local.parent_id is not None and local.level.label != "model":
            assert sp.parent_span_id == span_id_of[local.parent_id]
    assert {attrs_of(sp.attributes)["mltrace.level"] for _r, sp in got} >= {"model", "layer", "op"}


# -- `mltrace python --otlp URL` and `--otlp=URL` --------------------------------------------

USER_SPANS_SCRIPT = """\
import sys
import mltrace
for i in range(3):
    with mltrace.span(f"step{i}", index=i):
        pass
print("argv", sys.argv[1:])
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 0)
"""


def _trace_cli(tmp_path: Path, otlp: list[str], *script_args: str, command: str = "python", timeout_s: str = "1") -> Any:
    """``mltrace COMMAND -q OTLP… -o RUN script.py ARGS…`` with 3 user spans, OTEL_* cleared, a 1 s
    export deadline unless told otherwise."""
    import subprocess
    import sys

    script = tmp_path / "user_spans.py"
    script.write_text(USER_SPANS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MLTRACE_"))}
    env["OTEL_EXPORTER_OTLP_TIMEOUT"] = timeout_s
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src")
    cmd = [sys.executable, "-m", "mltrace", command, "-q", *otlp, "-o", str(tmp_path / "run"), str(script), *script_args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)


def _otlp_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "OTLP" in line]


def _assert_sent_line(stderr: str, spans: int, url: str) -> None:
    """The CLI's one OTLP line: every span sent, split into those sent while the program ran
    and at the end, nothing dropped or failed."""
    lines = _otlp_lines(stderr)
    assert len(lines) == 1, stderr
    head = f"mltrace: OTLP: {spans} spans sent to {url} (grpc): "
    assert lines[0].startswith(head), lines[0]
    live, _, rest = lines[0][len(head) :].partition(" while the program ran, ")
    end, _, tail = rest.partition(" at the end; ")
    assert int(live) + int(end) == spans and tail == "0 dropped, 0 failed", lines[0]


@pytest.mark.parametrize("spelling", ["--otlp URL", "--otlp=URL", "--otlp HOST:PORT"])
def test_trace_command_sends_with_either_spelling(spelling: str, tmp_path: Path) -> None:
    r = GrpcReceiver()
    try:
        value = f"127.0.0.1:{r.port}" if "HOST" in spelling else r.url
        otlp = [f"--otlp={value}"] if "=" in spelling else ["--otlp", value]
        # the script's own arguments look like mltrace options and must reach it untouched
        out = _trace_cli(tmp_path, otlp, "3", "--otlp", r.url, "-q", "--level", "op")
    finally:
        r.close()
    assert out.returncode == 3, out.stderr  # the script's own status
    assert out.stdout.strip() == f"argv ['3', '--otlp', '{r.url}', '-q', '--level', 'op']"
    run = load_run(tmp_path / "run")
    got = received(r.requests)
    assert sorted(_span_id_attr(sp) for _res, sp in got) == sorted(s.id for s in run.spans)
    assert {sp.name for _res, sp in got} >= {"step0", "step1", "step2"}
    _assert_sent_line(out.stderr, len(run.spans), r.url)
    assert "warning" not in out.stderr


def test_trace_command_with_a_down_receiver_says_why_and_keeps_the_status(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    # A refused connection answers at once, but a loaded machine can take over 1 s to see it;
    # with 3 s the answer (UNAVAILABLE) comes before the deadline, and the exporter's retries
    # of it (1 s backoff, doubling) end at the deadline.
    out = _trace_cli(tmp_path, ["--otlp", url], "5", command="run", timeout_s="3")  # `mltrace run` is `mltrace python`
    assert out.returncode == 5, out.stderr
    assert out.stdout.strip() == "argv ['5']"
    lines = _otlp_lines(out.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"mltrace: OTLP: 0 spans sent to {url} (grpc): "), out.stderr
    n = len(load_run(tmp_path / "run").spans)
    # how many, and why: the refusal, or, where a loaded machine saw no answer within the
    # deadline, that deadline (the send's own words either way)
    why = ("UNAVAILABLE", "not acknowledged within the 3 s deadline")
    assert f"; {n} not delivered: " in lines[0] and any(w in lines[0] for w in why), lines[0]
    assert load_run(tmp_path / "run").complete


def test_bare_otlp_leaves_the_next_word_to_be_the_script(tmp_path: Path) -> None:
    r = GrpcReceiver()
    try:
        env_url = r.url
        import subprocess
        import sys

        script = tmp_path / "user_spans.py"
        script.write_text(USER_SPANS_SCRIPT)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MLTRACE_"))}
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = env_url
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src")
        out = subprocess.run(
            [sys.executable, "-m", "mltrace", "python", "-q", "-o", str(tmp_path / "run"), "--otlp", str(script), "a"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
    finally:
        r.close()
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "argv ['a']"
    n = len(load_run(tmp_path / "run").spans)
    assert len(received(r.requests)) == n
    _assert_sent_line(out.stderr, n, env_url)
