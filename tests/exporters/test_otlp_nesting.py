"""An ``mltrace.span`` around the program's own OpenTelemetry span around the model: the model sent
while the program runs is in the OpenTelemetry span's trace, under it, as are its layers and the
ops sent at the end (a real in-process gRPC OTLP receiver, tests/scripts/nested_otel.py traced by
``mltrace python --otlp``); and the rule itself for both orders of the two spans."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mltrace.exporters.otlp import SpanMapper, TraceRule
from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.run.store import load_run
from mltrace.tracer.otel_context import OTEL_PARENT_ATTR

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "nested_otel.py"
O_TRACE, O_SPAN = 0xABC, 0x123


def _placements(outer_attrs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The user span, the model inside it (run while the OpenTelemetry span O was current) and
    a layer of the model, placed as the export places them."""
    rule = TraceRule("run-key", "invocation", None, {})
    user = Span(1, None, Level.USER, "outer", 0, 10, 0, outer_attrs)
    model = Span(2, 1, Level.MODEL, "M", 1, 9, 0, {OTEL_PARENT_ATTR: f"{O_TRACE:032x}-{O_SPAN:016x}"})
    layer = Span(3, 2, Level.LAYER, "0", 2, 8, 0, {})
    up = rule.place(user, None)
    mid = rule.place(model, up)
    return up, mid, rule.place(layer, mid)


def test_otel_span_opened_inside_the_mltrace_span_holds_the_model() -> None:
    user, model, layer = _placements({})
    assert (model.trace_id, model.parent_span_id) == (O_TRACE, O_SPAN)
    assert user.trace_id != O_TRACE
    assert (layer.trace_id, layer.parent_span_id) == (O_TRACE, model.span_id)


def test_mltrace_span_opened_inside_the_otel_span_holds_the_model() -> None:
    user, model, layer = _placements({OTEL_PARENT_ATTR: f"{O_TRACE:032x}-{O_SPAN:016x}"})
    assert (user.trace_id, user.parent_span_id) == (O_TRACE, O_SPAN)
    assert (model.trace_id, model.parent_span_id) == (O_TRACE, user.span_id)
    assert (layer.trace_id, layer.parent_span_id) == (O_TRACE, model.span_id)


def test_live_model_in_the_trace_of_its_ops(tmp_path: Path) -> None:
    pytest.importorskip("grpc")
    pytest.importorskip("opentelemetry.sdk")
    pytest.importorskip("torch")
    from support.otlp_receiver import GrpcReceiver, attrs_of, spans_of

    def models() -> list[Any]:
        return [sp for _s, _r, sp in spans_of(r.snapshot()) if attrs_of(sp.attributes)["mltrace.level"] == "model"]

    r = GrpcReceiver()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MLTRACE_"))}
        env["OTEL_BSP_SCHEDULE_DELAY"] = "200"
        cmd = [sys.executable, "-m", "mltrace", "python", "-q", f"--otlp={r.url}", "-o", str(tmp_path / "run"), str(SCRIPT)]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert proc.stdout is not None
        otel = [tuple(bytes.fromhex(h) for h in proc.stdout.readline().split()[1:]) for _ in range(3)]
        assert proc.stdout.readline().strip() == "ran"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(models()) < 3:
            time.sleep(0.1)
        live = models()  # sent while the program runs: it waits for stdin
        sent_live = {attrs_of(sp.attributes)["mltrace.span.id"]: attrs_of(sp.attributes) for _s, _r, sp in spans_of(r.snapshot())}
        _out, err = proc.communicate("\n", timeout=120)
        spans = [sp for _s, _r, sp in spans_of(r.snapshot())]
    finally:
        r.close()
    assert proc.returncode == 0, err
    assert sorted((m.trace_id, m.parent_span_id) for m in live) == sorted(otel)
    by_id = {sp.span_id: sp for sp in spans}
    ops = [sp for sp in spans if attrs_of(sp.attributes)["mltrace.level"] == "op" and sp.name == "aten::linear"]
    assert len(ops) == 6
    for op in ops:  # up through the layers to the live model: one trace
        up = by_id[op.parent_span_id]
        while attrs_of(up.attributes)["mltrace.level"] != "model":
            assert up.trace_id == op.trace_id
            up = by_id[up.parent_span_id]
        assert (up.trace_id, up.parent_span_id) in otel and op.trace_id == up.trace_id
    mapper = SpanMapper(load_run(tmp_path / "run"))
    final = {s.id: mapper.map(s).attributes for s in mapper.run.spans if s.id in sent_live}
    assert len(final) == len(sent_live) >= 3 + 9
    for span_id, attrs in final.items():  # without --memory or --py-spy a live span is complete
        assert sent_live[span_id] == {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.items()}
