"""One trace across processes: the OTLP export of a followed run (tests/follow/traced_children.py,
spawn, fork and DataLoader children with a small torch model) against a real in-process gRPC OTLP
receiver. A child started while a span was current in the parent has its model span under that
span, in its trace; one started with nothing current has a trace of its own; one started under the
program's own OpenTelemetry span is in that span's trace, under it."""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("grpc")
pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("torch")

from conftest import run_cli  # noqa: E402
from support.otlp_receiver import GrpcReceiver, attrs_of, spans_of  # noqa: E402

PROGRAM = Path(__file__).resolve().parent / "traced_children.py"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("follow-otlp")
    receiver = GrpcReceiver()
    try:
        env = {k: "" for k in os.environ if k.startswith("OTEL_")}
        traced = run_cli("python", "-q", f"--otlp={receiver.url}", "-o", str(tmp / "run"), str(PROGRAM), cwd=tmp, timeout=400, env=env)
        received = spans_of(receiver.snapshot())
    finally:
        receiver.close()
    assert traced.returncode == 0, traced.stderr.decode()[-3000:]
    otel = re.search(rb"^otel ([0-9a-f]{32}) ([0-9a-f]{16})$", traced.stdout, re.M)
    assert otel is not None, traced.stdout
    models: dict[str, list[Any]] = defaultdict(list)
    for _scope, res, sp in received:
        if attrs_of(sp.attributes)["mltrace.level"] == "model":
            models[sp.name].append((res["process.pid"], sp))
    return {
        "spans": [sp for _scope, _res, sp in received],
        "pids": {sp.span_id: res["process.pid"] for _scope, res, sp in received},
        "models": models,
        "otel": (bytes.fromhex(otel.group(1).decode()), bytes.fromhex(otel.group(2).decode())),
        "stdout": traced.stdout,
    }


def _request(exported: dict[str, Any]) -> Any:
    (request,) = [sp for sp in exported["spans"] if sp.name == "request"]
    return request


@pytest.mark.parametrize("case,count", [("SpawnUnder", 1), ("ForkUnder", 1), ("Worker", 2)])
def test_child_under_the_span_current_at_its_start(exported: dict[str, Any], case: str, count: int) -> None:
    request = _request(exported)
    children = exported["models"][case]
    assert len(children) == count
    for pid, model in children:
        assert pid != exported["pids"][request.span_id]  # another process
        assert model.trace_id == request.trace_id
        assert model.parent_span_id == request.span_id


def test_child_with_nothing_current_has_its_own_trace(exported: dict[str, Any]) -> None:
    ((_pid, model),) = exported["models"]["SpawnAlone"]
    assert model.trace_id != _request(exported).trace_id
    assert model.trace_id != exported["otel"][0]
    assert not model.parent_span_id


def test_program_opentelemetry_span_honoured_in_the_child(exported: dict[str, Any]) -> None:
    ((_pid, model),) = exported["models"]["SpawnOtel"]
    assert (model.trace_id, model.parent_span_id) == exported["otel"]


def test_every_span_in_its_parents_trace(exported: dict[str, Any]) -> None:
    by_id = {sp.span_id: sp for sp in exported["spans"]}
    crossing = [sp.name for sp in exported["spans"] if sp.parent_span_id in by_id and by_id[sp.parent_span_id].trace_id != sp.trace_id]
    assert crossing == []
    layers = [sp for sp in exported["spans"] if exported["pids"][sp.span_id] != exported["pids"][_request(exported).span_id]]
    assert {attrs_of(sp.attributes)["mltrace.level"] for sp in layers} >= {"model", "layer"}
