"""Scenario sweeps: the protocol, percentiles, throughput, the table, the SVG plot and the manifest."""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from mltrace.analysis.sweep import ScenarioResult, ScenarioSpec, SweepResult, build_manifest, percentile, scenario_result, sweep_csv
from mltrace.bench import Scenario, scenario
from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.viewers.bench import render_sweep_svg

SVG = "{http://www.w3.org/2000/svg}"


@pytest.mark.parametrize(
    ("q", "expected"),
    [(0, 10.0), (50, 30.0), (90, 46.0), (99, 49.6), (100, 50.0)],
)
def test_percentile_interpolates(q: float, expected: float) -> None:
    assert percentile([50, 10, 40, 20, 30], q) == pytest.approx(expected)


def test_percentile_errors() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_scenario_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("MLTRACE_BATCH", "MLTRACE_PRECISION", "MLTRACE_THREADS", "MLTRACE_ITERS"):
        monkeypatch.delenv(k, raising=False)
    assert scenario() == Scenario(1, "fp32", None, None)
    assert scenario(batch=4, iters=7).iters_or(3) == 7
    monkeypatch.setenv("MLTRACE_BATCH", "8")
    monkeypatch.setenv("MLTRACE_PRECISION", "BF16")
    monkeypatch.setenv("MLTRACE_THREADS", "2")
    monkeypatch.setenv("MLTRACE_ITERS", "12")
    sc = scenario(batch=4)
    assert sc == Scenario(8, "bf16", 2, 12)
    assert Scenario().iters_or(5) == 5


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [("MLTRACE_BATCH", "0", "at least 1"), ("MLTRACE_THREADS", "two", "integer"), ("MLTRACE_PRECISION", "fp8", "unknown precision")],
)
def test_scenario_rejects_bad_values(monkeypatch: pytest.MonkeyPatch, var: str, value: str, message: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=message):
        scenario()


def test_scenario_torch_dtype() -> None:
    import torch

    assert Scenario(precision="bf16").torch_dtype() is torch.bfloat16
    assert Scenario(precision="fp16").torch_dtype() is torch.float16
    assert Scenario(precision="int8").torch_dtype() is torch.float32


def _run(durations_ms: list[float], name: str = "Net", extra: list[float] | None = None) -> Run:
    ids = itertools.count(1)
    spans = []
    t = 0
    for i, d in enumerate(durations_ms):
        attrs: dict[str, Any] = {
            "ml.call.file.path": "/w/s.py",
            "ml.call.line.number": 5,
            "ml.framework": "pytorch",
            "ml.layer.params": 1234,
            "ml.input.shapes": [[2, 3]],
            "ml.input.dtypes": ["float32"],
            "code.file.path": "/w/s.py",
            "code.line.number": 1,
        }
        mid = next(ids)
        spans.append(Span(mid, None, Level.MODEL, name, t, t + int(d * 1e6), 1, attrs))
        spans.append(Span(next(ids), mid, Level.LAYER, "fc", t + 1, t + 2, 1, {}))
        t += int(d * 1e6) + 1000
        if extra and i < len(extra):
            spans.append(Span(next(ids), None, Level.MODEL, "Other", t, t + int(extra[i] * 1e6), 1, {}))
            t += int(extra[i] * 1e6) + 1000
    return Run(path=Path("."), meta={"format": "mltrace-run"}, spans=spans)


def test_scenario_latency_and_throughput() -> None:
    run = _run([100.0, 10.0, 20.0, 30.0, 40.0], extra=[1.0, 2.0])
    res = scenario_result(ScenarioSpec(4, "fp32", 2), run, warmup=1, wall_s=1.5)
    net, other = res.models
    assert net.model == "Net (s.py:5)" and net.calls == 4 and net.batch == 4
    assert net.p50_ms == pytest.approx(25.0) and net.p90_ms == pytest.approx(37.0) and net.p99_ms == pytest.approx(39.7)
    assert net.mean_ms == pytest.approx(25.0)
    assert net.throughput == pytest.approx(4 * 4 / 0.1)  # 4 calls of batch 4 in 100 ms
    assert other.model == "Other" and other.calls == 1  # the first call of each model is warm-up
    assert ScenarioSpec(4, "fp32", None).label == "b4-fp32-tdefault"


def _sweep() -> SweepResult:
    scen = []
    for prec, batch, lat in [("fp32", 1, [5, 4, 4, 6]), ("fp32", 2, [9, 8, 8, 8]), ("bf16", 1, [7, 6, 6, 6]), ("bf16", 2, [])]:
        spec = ScenarioSpec(batch, prec, 1)
        if lat:
            r = scenario_result(spec, _run(lat), warmup=1)
            r.run_dir = f"scenarios/{spec.label}"
        else:
            r = ScenarioResult(spec, status=1, error="Traceback …\nRuntimeError: bf16 unsupported")
        scen.append(r)
    return SweepResult(scenarios=scen, n=3, warmup=1)


def test_series_table_and_csv() -> None:
    sweep = _sweep()
    series = sweep.series()
    assert list(series) == ["Net (s.py:5) · fp32 · 1 threads", "Net (s.py:5) · bf16 · 1 threads"]
    assert [p.batch if p else None for p in series["Net (s.py:5) · bf16 · 1 threads"]] == [1, None]
    rows = list(csv.DictReader(io.StringIO(sweep_csv(sweep))))
    assert [(r["scenario"], r["status"], r["model"]) for r in rows] == [
        ("b1-fp32-t1", "0", "Net (s.py:5)"),
        ("b2-fp32-t1", "0", "Net (s.py:5)"),
        ("b1-bf16-t1", "0", "Net (s.py:5)"),
        ("b2-bf16-t1", "1", ""),
    ]
    assert float(rows[0]["p50_ms"]) == pytest.approx(4.0)
    doc = sweep.to_json()
    assert doc["scenarios"][3]["error"].endswith("bf16 unsupported") and doc["scenarios"][0]["models"][0]["calls"] == 3


def test_svg_plot_is_valid_and_has_every_point() -> None:
    svg = render_sweep_svg(_sweep(), title="net <sweep>")
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    points = root.findall(f".//{SVG}circle")
    # 3 scenarios that ran × (p50, p90, p99 in the latency panel + throughput panel)
    assert len(points) == 3 * 4
    tips = [c.find(f"{SVG}title").text for c in points]  # type: ignore[union-attr]
    assert any("bf16 · 1 threads batch 1" in t and "samples/s" in t for t in tips if t)
    lines = root.findall(f".//{SVG}polyline")
    assert len(lines) == 4  # fp32 has two batch sizes: p50, p90, p99 and throughput lines; bf16 has one point
    assert "net &lt;sweep&gt;" in svg


def test_manifest_records_what_reproduces_the_evaluation(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("print(1)\n")
    meta = {
        "mltrace_version": "9.9",
        "versions": {"torch": "2.13.0+cpu", "numpy": "2.0"},
        "host": {"cpu": "Some CPU", "cpu_count": 2},
        "environment": {"MLTRACE_BATCH": "1", "OMP_NUM_THREADS": "1", "ONEDNN_VERBOSE": "0"},
    }
    man = build_manifest(
        _sweep(), script=str(script), args=["--x"], run_meta=meta, command=["mltrace", "bench"], model_spans=_run([1.0]).spans
    )
    assert man["manifest"] == "mltrace-evaluation"
    assert man["framework"] == [{"name": "pytorch", "version": "2.13.0+cpu"}]
    (m,) = man["models"]
    assert (m["name"], m["parameters"], m["input_shapes"], m["called_at"]) == ("Net", 1234, [[2, 3]], "/w/s.py:5")
    assert man["hardware"]["cpu"] == "Some CPU"
    assert man["workload"]["sha256"] == hashlib.sha256(b"print(1)\n").hexdigest()
    assert man["workload"]["args"] == ["--x"] and man["workload"]["script"] == str(script)
    assert man["parameters"] == {
        "batch": [1, 2],
        "precision": ["fp32", "bf16"],
        "threads": [1],
        "measured_calls": 3,
        "warmup_calls": 1,
        "trace_level": "model",
    }
    assert man["environment"] == {"ONEDNN_VERBOSE": "0"}  # scenario variables are parameters, not environment
    assert [s["status"] for s in man["scenarios"]] == [0, 0, 0, 1]


def test_svg_switches_to_log_scale_for_wide_ranges() -> None:
    calm = scenario_result(ScenarioSpec(1, "fp32", 1), _run([1, 1, 1]), warmup=1)
    contended = scenario_result(ScenarioSpec(2, "fp32", 1), _run([1, 500, 900]), warmup=1)
    svg = render_sweep_svg(SweepResult([calm, contended], n=2, warmup=1))
    assert "latency (ms), log scale" in svg
    assert "log scale" not in render_sweep_svg(_sweep())
    ys = [float(c.get("cy", "0")) for c in ET.fromstring(svg).iter(f"{SVG}circle")]
    assert all(60 <= y <= 360 for y in ys)  # every point inside its panel
