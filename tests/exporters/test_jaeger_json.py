"""Jaeger JSON: the structure the Jaeger UI's "Upload JSON" reads, with the OTLP exporter's ids."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mltrace.exporters.jaeger_json import export_jaeger_json, jaeger_tag
from mltrace.exporters.otlp import SpanMapper
from mltrace.run import store
from mltrace.run.events import Flow, Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run, load_run

ANCHOR_MONO = 5_000_000_000
ANCHOR_EPOCH = 1_700_000_000_987_654_321
OFFSET = ANCHOR_EPOCH - ANCHOR_MONO
SRC = Path(__file__).resolve().parents[2] / "src"

HEX32 = re.compile(r"^[0-9a-f]{32}$")
HEX16 = re.compile(r"^[0-9a-f]{16}$")
JAEGER_TYPES = {"string", "bool", "int64", "float64", "binary"}


def write_run(path: Path, with_user_root: bool = False) -> Run:
    """Two invocations (model → conv/relu layers → ops → a kernel launched by a flow)."""
    path.mkdir(parents=True)
    meta = {
        "format": "mltrace-run",
        "name": "resnet_infer",
        "run_id": "0123abcd",
        "pid": 77,
        "host": {"hostname": "node-1", "os": "Linux 6.8", "machine": "x86_64", "python": "3.11.9"},
        "versions": {"torch": "2.4.1"},
        "clock": {"anchor_monotonic_ns": ANCHOR_MONO, "anchor_epoch_ns": ANCHOR_EPOCH},
        "complete": True,
    }
    store.write_meta(path, meta)
    tracks = [
        Track(1, TrackKind.THREAD, "MainThread", 77, tid=77),
        Track(2, TrackKind.GPU_STREAM, "GPU 0 stream 7", 77, device=0, stream=7),
    ]
    spans: list[Span] = []
    flows: list[Flow] = []
    for base, t0 in ((10, ANCHOR_MONO + 1_000_000), (20, ANCHOR_MONO + 3_000_000)):
        spans += [
            Span(base, 1 if with_user_root else None, Level.MODEL, "ResNet", t0, t0 + 900_500, 1, {"ml.input.shapes": [[4, 3, 32, 32]]}),
            Span(
                base + 1,
                base,
                Level.LAYER,
                "conv1",
                t0 + 1_000,
                t0 + 500_000,
                1,
                {
                    "ml.layer.type": "Conv2d",
                    "ml.layer.params": 9408,
                    "ml.flops": 1.5e9,
                    "mltrace.truncated": False,
                    "ml.input.shapes": [[4, 3, 32, 32]],
                    "ml.input.dtypes": ["float32"],
                },
            ),
            Span(base + 2, base + 1, Level.OP, "aten::conv2d", t0 + 2_000, t0 + 400_000, 1, {"ml.op.name": "aten::conv2d"}),
            Span(base + 3, base + 2, Level.KERNEL, "cudaLaunchKernel", t0 + 3_000, t0 + 3_400, 1, {}),
            Span(base + 4, base + 2, Level.KERNEL, "implicit_gemm", t0 + 5_000, t0 + 5_700, 2, {"gpu.kernel.name": "implicit_gemm"}),
            Span(base + 5, base, Level.LAYER, "relu", t0 + 600_000, t0 + 800_000, 1, {"ml.layer.type": "ReLU"}),
        ]
        flows.append(Flow(base, base + 3, base + 4, "launch"))
    if with_user_root:
        spans.append(Span(1, None, Level.USER, "serve", ANCHOR_MONO, ANCHOR_MONO + 5_000_000, 1, {}))
    with open(path / store.EVENTS_FILE, "wb") as f:
        f.write(store.encode_batch(tracks=tracks, spans=spans, flows=flows))
    return load_run(path)


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return write_run(tmp_path / "run")


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def test_structure_is_what_the_jaeger_ui_reads(run: Run, tmp_path: Path) -> None:
    doc = load(export_jaeger_json(run, tmp_path / "out.json"))
    assert set(doc) == {"data", "total", "limit", "offset", "errors"}
    assert len(doc["data"]) == 2  # one entry per model invocation
    local = run.span_by_id()
    seen: set[int] = set()
    for trace in doc["data"]:
        assert HEX32.match(trace["traceID"])
        assert set(trace) == {"traceID", "spans", "processes", "warnings"}
        span_ids = {s["spanID"] for s in trace["spans"]}
        for s in trace["spans"]:
            assert s["traceID"] == trace["traceID"]
            assert HEX16.match(s["spanID"])
            assert s["processID"] in trace["processes"]
            assert isinstance(s["startTime"], int) and isinstance(s["duration"], int)
            tags = {t["key"]: t for t in s["tags"]}
            assert all(t["type"] in JAEGER_TYPES for t in s["tags"])
            mid = tags["mltrace.span.id"]["value"]
            seen.add(mid)
            sp = local[mid]
            assert s["operationName"] == sp.name
            assert s["startTime"] == (sp.start_ns + OFFSET) // 1000
            assert s["startTime"] + s["duration"] == (sp.end_ns + OFFSET) // 1000
            assert tags["mltrace.level"]["value"] == sp.level.label
            child_of = [r for r in s["references"] if r["refType"] == "CHILD_OF"]
            if sp.parent_id is None:
                assert child_of == []
            else:
                assert s["references"][0]["refType"] == "CHILD_OF"  # the UI's parent is the first reference
                assert child_of[0]["spanID"] in span_ids
        proc = next(iter(trace["processes"].values()))
        assert proc["serviceName"] == "mltrace"
        ptags = {t["key"]: t["value"] for t in proc["tags"]}
        assert ptags["host.name"] == "node-1" and ptags["process.pid"] == 77 and ptags["mltrace.run.id"] == "0123abcd"
    assert seen == set(local)


def test_tags_are_typed(run: Run, tmp_path: Path) -> None:
    doc = load(export_jaeger_json(run, tmp_path / "out.json"))
    conv = next(s for t in doc["data"] for s in t["spans"] if s["operationName"] == "conv1")
    tags = {t["key"]: (t["type"], t["value"]) for t in conv["tags"]}
    assert tags["ml.layer.type"] == ("string", "Conv2d")
    assert tags["ml.layer.params"] == ("int64", 9408)
    assert tags["ml.flops"] == ("float64", 1.5e9)
    assert tags["mltrace.truncated"] == ("bool", False)
    assert tags["ml.input.shapes"] == ("string", "[[4,3,32,32]]")
    assert tags["ml.input.dtypes"] == ("string", '["float32"]')
    assert tags["span.kind"] == ("string", "internal")
    model = next(s for t in doc["data"] for s in t["spans"] if s["operationName"] == "ResNet")
    assert {t["key"]: t["value"] for t in model["tags"]}["ml.batch_size"] == 4
    assert jaeger_tag("x", float("nan")) == {"key": "x", "type": "string", "value": "nan"}


def test_a_span_that_raised_has_the_error_tags(run: Run, tmp_path: Path) -> None:
    """A span with ``error.type`` (a call that raised) has Jaeger's ``error`` tag; no other has."""
    next(s for s in run.spans if s.id == 20).attrs["error.type"] = "ValueError"  # the second model call
    doc = load(export_jaeger_json(run, tmp_path / "out.json"))
    flagged = [
        {t["key"]: t["value"] for t in s["tags"]}["mltrace.span.id"]
        for trace in doc["data"]
        for s in trace["spans"]
        if {"key": "error", "type": "bool", "value": True} in s["tags"]
    ]
    assert flagged == [20]


def test_flows_are_follows_from_and_ids_match_otlp(run: Run, tmp_path: Path) -> None:
    doc = load(export_jaeger_json(run, tmp_path / "out.json"))
    mapper = SpanMapper(run)
    spans = {int(next(t["value"] for t in s["tags"] if t["key"] == "mltrace.span.id")): s for tr in doc["data"] for s in tr["spans"]}
    for mid, s in spans.items():
        assert s["spanID"] == f"{mapper.span_id(mid):016x}"
        assert s["traceID"] == f"{mapper.trace_id(mid):032x}"
    kernel = spans[14]
    assert [r["refType"] for r in kernel["references"]] == ["CHILD_OF", "FOLLOWS_FROM"]
    assert kernel["references"][1]["spanID"] == spans[13]["spanID"]


def test_trace_per_run_gives_one_entry(run: Run, tmp_path: Path) -> None:
    doc = load(export_jaeger_json(run, tmp_path / "out.json", trace_per="run"))
    assert len(doc["data"]) == 1 and len(doc["data"][0]["spans"]) == len(run.spans)


def test_model_under_user_span_is_its_child(tmp_path: Path) -> None:
    """An mltrace.span parents the model calls inside it, one hop, in its trace (as an
    OpenTelemetry span would), not as a separate trace linked back."""
    run = write_run(tmp_path / "run", with_user_root=True)
    doc = load(export_jaeger_json(run, tmp_path / "out.json"))
    assert len(doc["data"]) == 1
    spans = doc["data"][0]["spans"]
    user = next(s for s in spans if s["operationName"] == "serve")
    models = [s for s in spans if s["operationName"] == "ResNet"]
    assert len(models) == 2
    for model in models:
        assert model["references"] == [{"refType": "CHILD_OF", "traceID": user["traceID"], "spanID": user["spanID"]}]


def test_never_overwrites(run: Run, tmp_path: Path) -> None:
    dest = tmp_path / "out.json"
    dest.write_text("keep me")
    with pytest.raises(FileExistsError):
        export_jaeger_json(run, dest)
    assert dest.read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def mltrace(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run([sys.executable, "-m", "mltrace", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def test_cli_export_jaeger_json(run: Run, tmp_path: Path) -> None:
    first = mltrace("export", str(run.path), "--format", "jaeger-json", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    dest = run.path / "trace.jaeger.json"
    assert str(dest) in first.stdout
    assert len(load(dest)["data"]) == 2
    again = mltrace("export", str(run.path), "--format", "jaeger-json", cwd=tmp_path)
    assert again.returncode == 2 and "exists" in again.stderr and again.stderr.count("\n") == 1
    one = str(tmp_path / "one.json")
    other = mltrace("export", str(run.path), "--format", "jaeger-json", "--trace-per", "run", "-o", one, cwd=tmp_path)
    assert other.returncode == 0, other.stderr
    assert len(load(tmp_path / "one.json")["data"]) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "nothing to export"),
        (("--otlp", "http://x:4317", "-o", "f.json"), "-o needs --format"),
    ],
)
def test_cli_usage_errors(run: Run, tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    out = mltrace("export", str(run.path), *args, cwd=tmp_path)
    assert out.returncode == 2 and message in out.stderr


def test_cli_rejects_a_non_run(tmp_path: Path) -> None:
    out = mltrace("export", str(tmp_path), "--format", "jaeger-json", cwd=tmp_path)
    assert out.returncode == 2 and "not an mltrace run directory" in out.stderr
