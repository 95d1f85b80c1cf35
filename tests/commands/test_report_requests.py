"""``mltrace report`` on services traced by ``mltrace python``: a threaded HTTP server with its
own OpenTelemetry server spans (tests/scripts/otel_server.py, its spans sent to an in-process
OTLP receiver) and a plain script with ``mltrace.span("request")`` (tests/scripts/span_requests.py):
request count, latency percentiles, and where the slowest requests' time went."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from analysis.schema_check import errors
from conftest import SCRIPTS, run_cli
from mltrace.analysis.report_schema import REPORT_SCHEMA

REQUESTS, CONCURRENCY = 8, 4


def _reports(run: Path) -> tuple[dict[str, Any], str, str]:
    """The run's report as JSON, text and Markdown."""
    out = []
    for fmt in ("json", "text", "md"):
        res = run_cli("report", str(run), "--format", fmt)
        assert res.returncode == 0, res.stderr.decode()
        out.append(res.stdout.decode())
    data = json.loads(out[0])
    assert errors(data, REPORT_SCHEMA) == []
    return data, out[1], out[2]


def _check_slowest(req: dict[str, Any], labels: set[str]) -> None:
    """Each explained request: one model call, a split of its time that adds up, ops outside the model."""
    durations = [r["total_ns"] for r in req["slowest"]]
    assert len(durations) == 3 and durations == sorted(durations, reverse=True)
    assert req["p50_ns"] <= req["p90_ns"] <= req["p99_ns"] <= durations[0]
    for r in req["slowest"]:
        assert r["label"] in labels and r["model_calls"] == 1 and 0 < r["model_ns"] < r["total_ns"]
        assert r["before_model_ns"] + r["between_models_ns"] + r["after_model_ns"] == r["outside_ns"]
        assert r["outside_ops_ns"] > 0  # torch.randn and argmax ran in the request, outside the model
        assert {x["type"] for x in r["layers"]} <= {"Linear", "ReLU"} and r["layers"]
        assert r["ops"] and all(x["name"].startswith("aten::") for x in r["ops"])
    assert len({r["label"] for r in req["slowest"]}) == 3


def test_threaded_otel_service(tmp_path: Path) -> None:
    pytest.importorskip("grpc")
    pytest.importorskip("opentelemetry.sdk")
    from support.otlp_receiver import GrpcReceiver

    receiver = GrpcReceiver()
    try:
        args = (str(SCRIPTS / "otel_server.py"), receiver.url, str(REQUESTS), str(CONCURRENCY))
        res = run_cli("python", "-q", "-o", str(tmp_path / "run"), *args, cwd=tmp_path, timeout=300)
    finally:
        receiver.close()
    assert res.returncode == 0 and res.stdout.decode().split() == ["served", str(REQUESTS), "stopped"], res.stderr.decode()
    data, text, md = _reports(tmp_path / "run")
    req = data["requests"]
    assert (req["source"], req["names"], req["count"]) == ("otel-server", ["POST /predict"], REQUESTS)
    _check_slowest(req, {f"r{i}" for i in range(REQUESTS)})
    assert data["ranks"] is None
    assert f"Requests: {REQUESTS} requests (OpenTelemetry server spans: POST /predict): p50 " in text
    assert "Slowest 3 requests: where the time went" in text
    assert "### Requests" in md


def test_plain_script_with_mltrace_span(tmp_path: Path) -> None:
    res = run_cli("python", "-q", "-o", str(tmp_path / "run"), str(SCRIPTS / "span_requests.py"), cwd=tmp_path, timeout=300)
    assert res.returncode == 0 and res.stdout == b"done\n", res.stderr.decode()
    data, text, _ = _reports(tmp_path / "run")
    req = data["requests"]
    assert (req["source"], req["names"], req["count"]) == ("user", ["request"], 5)
    _check_slowest(req, {f"q{i}" for i in range(5)})
    assert "Requests: 5 requests (user spans around model calls: request)" in text
    script = SCRIPTS / "span_requests.py"
    line = next(i for i, t in enumerate(script.read_text().splitlines(), 1) if t.strip().startswith("with mltrace.span("))
    assert {r["source"] for r in req["slowest"]} == {f"{script}:{line}"}  # the with line that started each request
    assert f"span_requests.py:{line}" in text
