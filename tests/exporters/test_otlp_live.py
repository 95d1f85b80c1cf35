"""The live OTLP export against a real in-process gRPC OTLP receiver, with a threaded torch service
(tests/scripts/otel_server.py) traced at the default level by ``mltrace python --otlp``."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("grpc")
pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("torch")

from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan  # noqa: E402

from mltrace.exporters.otlp_live import BatchSettings  # noqa: E402
from support.otlp_receiver import GrpcReceiver, attrs_of, spans_of  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "otel_server.py"
REQUESTS, CONCURRENCY = 24, 6


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MLTRACE_"))}
    env.update(extra)
    return env


def _model_spans(r: GrpcReceiver) -> list[Any]:
    return [sp for scope, _res, sp in spans_of(r.snapshot()) if scope == "mltrace" and attrs_of(sp.attributes)["mltrace.level"] == "model"]


def _serve(r: GrpcReceiver, tmp_path: Path, *flags: str) -> tuple[int, subprocess.CompletedProcess[str]]:
    """Runs the service traced; returns the model spans received while it still served, and the run."""
    cmd = [sys.executable, "-m", "mltrace", "python", "-q", f"--otlp={r.url}", "-o", str(tmp_path / "run"), str(SCRIPT)]
    env = _env(OTEL_BSP_SCHEDULE_DELAY="1000")
    proc = subprocess.Popen(
        [*cmd, r.url, str(REQUESTS), str(CONCURRENCY), *flags],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == f"served {REQUESTS}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_model_spans(r)) < REQUESTS:
        time.sleep(0.2)
    live = len(_model_spans(r))  # the service is still serving: it waits for stdin
    out, err = proc.communicate("\n", timeout=300)
    return live, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _outside_parent(spans: list[Any]) -> list[str]:
    by_id = {(sp.trace_id, sp.span_id): sp for sp in spans}
    bad = []
    for sp in spans:
        up = by_id.get((sp.trace_id, sp.parent_span_id)) if sp.parent_span_id else None
        if up is not None and not (up.start_time_unix_nano <= sp.start_time_unix_nano and sp.end_time_unix_nano <= up.end_time_unix_nano):
            bad.append(f"{sp.name} outside {up.name}")
    return bad


def test_threaded_otel_service_spans_arrive_while_it_serves(tmp_path: Path) -> None:
    r = GrpcReceiver()
    try:
        live, done = _serve(r, tmp_path)
        got = spans_of(r.snapshot())
    finally:
        r.close()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped"
    assert live >= REQUESTS  # every model span arrived while the service still served
    requests = {sp.trace_id: sp for scope, _res, sp in got if scope == "otel-server" and sp.kind == PbSpan.SPAN_KIND_SERVER}
    assert len(requests) == REQUESTS
    ours = [sp for scope, _res, sp in got if scope == "mltrace"]
    ids = collections.Counter(attrs_of(sp.attributes)["mltrace.span.id"] for sp in ours)
    assert max(ids.values()) == 1  # the end sent only what had not arrived
    models = [sp for sp in ours if attrs_of(sp.attributes)["mltrace.level"] == "model"]
    assert len(models) == REQUESTS
    for model in models:  # each model call in its request's trace, under the request span
        assert model.trace_id in requests and model.parent_span_id == requests[model.trace_id].span_id
    assert len({m.trace_id for m in models}) == REQUESTS
    assert _outside_parent([sp for _scope, _res, sp in got]) == []
    others = {sp.trace_id for sp in ours} - set(requests)
    startup = {sp.trace_id for sp in ours if sp.trace_id in others and attrs_of(sp.attributes).get("thread.name") == "MainThread"}
    assert others == startup and len(others) <= 1  # start-up work on the main thread, nothing else
    request_ops = [sp.name for sp in ours if sp.trace_id in requests]
    assert request_ops.count("aten::randn") == REQUESTS  # ops inside the request, outside the model
    line = next(ln for ln in done.stderr.splitlines() if ln.startswith("mltrace: OTLP:"))
    assert f"{len(ours)} spans sent to {r.url}" in line and "0 dropped, 0 failed" in line


def test_mltrace_span_parents_the_model_without_otel(tmp_path: Path) -> None:
    r = GrpcReceiver()
    try:
        live, done = _serve(r, tmp_path, "--no-otel")
        ours = [sp for scope, _res, sp in spans_of(r.snapshot()) if scope == "mltrace"]
    finally:
        r.close()
    assert done.returncode == 0, done.stderr
    assert live >= REQUESTS
    requests = {sp.span_id: sp for sp in ours if sp.name == "handle_request"}
    models = [sp for sp in ours if attrs_of(sp.attributes)["mltrace.level"] == "model"]
    assert len(requests) == len(models) == REQUESTS
    for model in models:  # one hop: the model is the request span's child, in its trace
        up = requests[model.parent_span_id]
        assert model.trace_id == up.trace_id and not up.parent_span_id
    assert _outside_parent(ours) == []


def test_batch_settings_honour_otel_bsp(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "250")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "100")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "500")
    monkeypatch.setenv("OTEL_BSP_EXPORT_TIMEOUT", "soon")
    s = BatchSettings.from_env()
    assert (s.schedule_delay_s, s.max_queue_size, s.max_export_batch_size, s.export_timeout_s) == (0.25, 100, 100, 30.0)
    assert capsys.readouterr().err.count("OTEL_BSP_EXPORT_TIMEOUT") == 1
