"""Kineto trace conversion, checked against the raw JSON of real traces.

The fixtures in tests/data/kineto/ are real torch.profiler traces (three from
A100 GPUs, from HolisticTraceAnalysis's test data, and one CPU trace made by
make_cpu_fixture.py). Expected values are computed here from the raw JSON
with the standard library, independently of the code under test.
"""

from __future__ import annotations

import gzip
import itertools
import json
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from mltrace.formats.aten_flops import own_arguments
from mltrace.formats.kineto import KinetoEvents, interpreted_ops, kineto_to_events, load_kineto_json, trace_cuda_major
from mltrace.run.events import Span, TrackKind
from mltrace.run.levels import Level
from mltrace.run.ranges import torch_range_kind
from mltrace.run.store import Run, RunError
from mltrace.tracer.passes.gpu_library import attribute_gpu_library
from mltrace.tracer.passes.nesting import attach_gpu_to_launch, nest_by_containment
from mltrace.tracer.tracks import TrackRegistry

DATA = Path(__file__).resolve().parents[1] / "data" / "kineto"
GPU_FIXTURES = [
    "a100_alexnet_train.json.gz",
    "a100_sampled_rank0.json.gz",
    "a100_triton_kernel.json.gz",
    "h100_cuda_models.json.gz",
]
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
API_CATS = ("cuda_runtime", "cuda_driver")


def raw(name: str) -> dict[str, Any]:
    with gzip.open(DATA / name, "rt", encoding="utf-8") as f:
        return json.load(f)


def complete_events(trace: dict[str, Any], *cats: str) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and (not cats or e.get("cat") in cats)]


def epoch_ns(trace: dict[str, Any], ts: float) -> int:
    """ts (µs) → epoch ns, exactly, the way the trace format defines it."""
    return int(Decimal(str(ts)) * 1000) + int(trace.get("baseTimeNanoseconds", 0))


def convert(name: str) -> tuple[KinetoEvents, Run]:
    trace = load_kineto_json(DATA / name)
    ids = itertools.count(1)
    result = kineto_to_events(trace, TrackRegistry(pid=1), lambda: next(ids), lambda ns: ns)
    run = Run(
        path=Path("."),
        meta={},
        tracks={t.id: t for t in result.tracks},
        spans=list(result.spans),
        instants=list(result.instants),
        flows=list(result.flows),
    )
    return result, attribute_gpu_library(attach_gpu_to_launch(nest_by_containment(run)))


def op_ancestor(span: Span, by_id: dict[int, Span]) -> Span | None:
    cur = by_id.get(span.parent_id) if span.parent_id is not None else None
    while cur is not None and cur.level is not Level.OP:
        cur = by_id.get(cur.parent_id) if cur.parent_id is not None else None
    return cur


@pytest.mark.parametrize("name", GPU_FIXTURES)
def test_span_counts_match_raw_json(name: str) -> None:
    trace = raw(name)
    expected = Counter(e["cat"] for e in complete_events(trace))
    result, run = convert(name)
    spans = run.spans
    # torch's own ranges that torch records as ops (torch.compile's region) are user spans
    ranges_as_ops = sum(1 for e in complete_events(trace, "cpu_op") if torch_range_kind(e["name"]))
    assert sum(s.level is Level.OP for s in spans) == expected["cpu_op"] - ranges_as_ops
    assert sum(s.level is Level.USER for s in spans) == expected["user_annotation"] + expected["gpu_user_annotation"] + ranges_as_ops
    assert sum(s.attrs.get("torch.range") == "torch.compile" for s in spans) >= ranges_as_ops
    assert sum("cuda.api.name" in s.attrs for s in spans) == expected["cuda_runtime"] + expected["cuda_driver"]
    for cat in GPU_CATS:
        assert sum(s.attrs.get("gpu.activity") == cat for s in spans) == expected[cat], cat
    assert result.stats.events_by_category == dict(expected)
    assert result.stats.gpu_activities == sum(expected[c] for c in GPU_CATS)


@pytest.mark.parametrize("name", GPU_FIXTURES)
def test_every_gpu_activity_is_present_with_its_times_and_stream(name: str) -> None:
    trace = raw(name)
    expected = Counter(
        (
            e["name"],
            e["args"]["correlation"],
            e["args"]["device"],
            e["args"]["stream"],
            epoch_ns(trace, e["ts"]),
            epoch_ns(trace, e["ts"]) + int(Decimal(str(e["dur"])) * 1000),
        )
        for e in complete_events(trace, *GPU_CATS)
    )
    _, run = convert(name)
    got = Counter()
    for s in run.spans:
        if s.attrs.get("gpu.activity") in GPU_CATS:
            track = run.tracks[s.track_id]
            assert track.kind == TrackKind.GPU_STREAM
            assert s.level is Level.KERNEL
            got[(s.name, s.attrs["gpu.correlation_id"], track.device, track.stream, s.start_ns, s.end_ns)] += 1
    assert got == expected


@pytest.mark.parametrize("name", GPU_FIXTURES)
def test_gpu_activities_link_to_their_launch_call(name: str) -> None:
    trace = raw(name)
    api_corr = {e["args"]["correlation"] for e in complete_events(trace, *API_CATS) if "correlation" in e["args"]}
    gpu = complete_events(trace, *GPU_CATS)
    launched_in_raw = sum(e["args"]["correlation"] in api_corr for e in gpu)
    assert launched_in_raw >= 0.99 * len(gpu)  # the fixtures are complete enough to demand 99 %

    result, run = convert(name)
    by_id = run.span_by_id()
    launch_of = {f.to_span: f.from_span for f in run.flows if f.kind == "launch"}
    linked = 0
    for s in run.spans:
        if s.attrs.get("gpu.activity") not in GPU_CATS:
            continue
        launch_id = launch_of.get(s.id)
        if launch_id is None:
            continue
        launch = by_id[launch_id]
        assert launch.attrs["cuda.api.name"] == launch.name
        assert launch.attrs["gpu.correlation_id"] == s.attrs["gpu.correlation_id"]
        assert s.parent_id == launch.id  # attach_gpu_to_launch
        assert run.tracks[launch.track_id].kind == TrackKind.THREAD
        linked += 1
    assert linked == launched_in_raw
    assert linked >= 0.99 * len(gpu)
    assert result.stats.gpu_activities_launched == linked
    assert result.stats.unmatched_correlation_ids == len(gpu) - linked


@pytest.mark.parametrize("name", GPU_FIXTURES)
def test_launch_call_nests_in_its_op(name: str) -> None:
    """The op above each launch call is the innermost cpu_op around it on its thread."""
    trace = raw(name)
    ops = complete_events(trace, "cpu_op")

    def innermost_op(api: dict[str, Any]) -> tuple[str, int] | None:
        s, e = epoch_ns(trace, api["ts"]), epoch_ns(trace, api["ts"]) + int(Decimal(str(api["dur"])) * 1000)
        best = None
        for op in ops:
            if op["pid"] != api["pid"] or op["tid"] != api["tid"]:
                continue
            os_ = epoch_ns(trace, op["ts"])
            oe = os_ + int(Decimal(str(op["dur"])) * 1000)
            # Innermost: latest start, then earliest end; among identical
            # intervals (aten::matmul → aten::mm) the later event in the file.
            if os_ <= s and e <= oe and (best is None or (os_, -oe) >= (best[1], -best[2])):
                best = (op["name"], os_, oe)
        return (best[0], best[1]) if best else None

    gpu_corr = {e["args"]["correlation"] for e in complete_events(trace, *GPU_CATS)}
    expected = Counter(innermost_op(e) for e in complete_events(trace, *API_CATS) if e["args"].get("correlation") in gpu_corr)
    # The sampled trace dropped a few ops (HTA sampling): 16 of its 1204 launches have none.
    assert expected[None] <= 0.02 * sum(expected.values())

    _, run = convert(name)
    by_id = run.span_by_id()
    launch_ids = {f.from_span for f in run.flows if f.kind == "launch"}
    got = Counter()
    for lid in launch_ids:
        op = op_ancestor(by_id[lid], by_id)
        got[(op.name, op.start_ns) if op else None] += 1
    assert got == expected  # one entry per launch call on both sides


def test_triton_fixture_driver_launch_and_base_time() -> None:
    trace = raw("a100_triton_kernel.json.gz")
    assert trace["baseTimeNanoseconds"] == 1727743122000000000
    result, run = convert("a100_triton_kernel.json.gz")
    assert result.stats.clock == "baseTimeNanoseconds"
    kernel = next(s for s in run.spans if s.attrs.get("gpu.activity") == "kernel")
    # ts 2413669097444.592 µs after the base: 2024-10-28 in epoch ns.
    assert kernel.start_ns == 2413669097444592 + 1727743122000000000
    launch = run.span_by_id()[kernel.parent_id]
    assert launch.name == "cuLaunchKernel"
    assert launch.attrs["cuda.api.kind"] == "driver"
    assert kernel.attrs["ml.library.name"] == "Triton"
    assert kernel.attrs["gpu.grid"] == [1, 1, 1]
    assert kernel.attrs["gpu.block"] == [128, 1, 1]
    assert kernel.attrs["gpu.registers_per_thread"] == 16
    op = op_ancestor(kernel, run.span_by_id())
    assert op is not None and op.name == "triton_poi_fused_add_cos_sin_0"


def test_old_trace_without_base_time_is_epoch_us() -> None:
    result, run = convert("a100_alexnet_train.json.gz")
    assert result.stats.clock == "epoch_us"
    first = min(s.start_ns for s in run.spans)
    assert 1_695_000_000 * 10**9 < first < 1_696_000_000 * 10**9  # 2023-09-27


def test_memcpy_attributes_and_context_syncs() -> None:
    trace = raw("a100_alexnet_train.json.gz")
    syncs = complete_events(trace, "cuda_sync")
    context_wide = [e for e in syncs if e["args"]["stream"] == 0xFFFFFFFF]
    result, run = convert("a100_alexnet_train.json.gz")
    assert len(run.instants) == len(syncs) - len(context_wide)
    assert result.stats.skipped["cuda_sync (context-wide)"] == len(context_wide)
    memcpy = [s for s in run.spans if s.attrs.get("gpu.activity") == "gpu_memcpy"]
    raw_memcpy = complete_events(trace, "gpu_memcpy")
    assert Counter(s.attrs["gpu.memcpy.kind"] for s in memcpy) == Counter(e["name"].split()[1] for e in raw_memcpy)
    assert sum(s.attrs["gpu.bytes"] for s in memcpy) == sum(e["args"]["bytes"] for e in raw_memcpy)


def test_op_attributes() -> None:
    trace = raw("a100_sampled_rank0.json.gz")
    with_dims = [e for e in complete_events(trace, "cpu_op") if "Input Dims" in e["args"]]
    _, run = convert("a100_sampled_rank0.json.gz")
    ops = [s for s in run.spans if s.level is Level.OP]
    shaped = Counter((s.name, json.dumps(s.attrs["ml.input.shapes"])) for s in ops if "ml.input.shapes" in s.attrs)
    # The model is a TorchScript model: the ops its interpreter called drop the values of its
    # stack recorded ahead of their own arguments (36 of them: 20 linear, 14 matmul, 2 mul).
    interpreted = interpreted_ops(complete_events(trace, "cpu_op"))
    own = [
        (e["name"], own_arguments(e["name"], e["args"])["Input Dims"] if id(e["args"]) in interpreted else e["args"]["Input Dims"])
        for e in with_dims
    ]
    trimmed = Counter(name for (name, dims), e in zip(own, with_dims) if dims != e["args"]["Input Dims"])
    assert trimmed == {"aten::linear": 20, "aten::matmul": 14, "aten::mul": 2}
    assert shaped == Counter((name, json.dumps(dims)) for name, dims in own)
    assert all(s.attrs["ml.op.name"] == s.name and s.attrs["ml.framework"] == "pytorch" for s in ops)


def test_cpu_trace_module_hierarchy_and_op_nesting() -> None:
    trace = raw("cpu_modules_torch.json.gz")
    module_frames = [e for e in complete_events(trace, "python_function") if e["name"].startswith("nn.Module: ")]
    result, run = convert("cpu_modules_torch.json.gz")
    by_id = run.span_by_id()
    modules = [s for s in run.spans if s.level in (Level.MODEL, Level.LAYER)]
    assert len(modules) == len(module_frames) == 6
    assert {s.name: s.level for s in modules} == {
        "Net": Level.MODEL,
        "Conv2d_0": Level.LAYER,
        "Sequential_0": Level.LAYER,
        "Sequential_0.ReLU_0": Level.LAYER,
        "Sequential_0.Flatten_0": Level.LAYER,
        "Sequential_0.Linear_0": Level.LAYER,
    }
    name_of = {s.id: s.name for s in run.spans}
    parents = {s.name: name_of.get(s.parent_id) for s in modules}
    assert parents["Conv2d_0"] == "Net"
    assert parents["Sequential_0.Linear_0"] == "Sequential_0"
    assert parents["Net"] == "inference"  # the record_function range around the call
    assert by_id[next(s.id for s in modules if s.name == "Net")].attrs["ml.layer.type"] == "Net"

    def layer_of(op_name: str) -> str:
        op = next(s for s in run.spans if s.name == op_name)
        cur = by_id[op.parent_id]
        while cur.level is Level.OP:
            cur = by_id[cur.parent_id]
        return cur.name

    assert layer_of("aten::conv2d") == "Conv2d_0"
    assert layer_of("aten::relu") == "Sequential_0.ReLU_0"
    assert layer_of("aten::linear") == "Sequential_0.Linear_0"
    assert layer_of("aten::addmm") == "Sequential_0.Linear_0"
    for s in run.spans:
        if s.level is Level.OP:
            p = by_id[s.parent_id]
            assert p.start_ns <= s.start_ns and s.end_ns <= p.end_ns
    assert result.stats.skipped["python_function (not a module)"] == len(complete_events(trace, "python_function")) - 6


def _tiny_trace(events: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    return {"traceEvents": events, **top}


def test_graph_launch_and_ex_launches_by_correlation() -> None:
    def api(name: str, ts: float, corr: int, cat: str = "cuda_runtime") -> dict[str, Any]:
        return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": 7, "ts": ts, "dur": 2.0, "args": {"correlation": corr}}

    def kernel(name: str, ts: float, corr: int) -> dict[str, Any]:
        args = {"correlation": corr, "device": 0, "stream": 7}
        return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": 1.0, "args": args}

    op = {"ph": "X", "cat": "cpu_op", "name": "aten::graph_replay", "pid": 7, "tid": 7, "ts": 0.0, "dur": 50.0, "args": {}}
    trace = _tiny_trace(
        [
            op,
            api("cudaGraphLaunch", 1.0, 10),
            kernel("k1", 5.0, 10),
            kernel("k2", 6.5, 10),
            kernel("k3", 8.0, 10),
            api("cudaLaunchKernelExC", 20.0, 11),
            kernel("k4", 23.0, 11),
            api("cuLaunchKernelEx", 30.0, 12, "cuda_driver"),
            kernel("k5", 33.0, 12),
            kernel("orphan", 40.0, 99),
        ],
        baseTimeNanoseconds=1_000_000_000,
    )
    ids = itertools.count(1)
    result = kineto_to_events(trace, TrackRegistry(pid=7), lambda: next(ids), lambda ns: ns - 1_000_000_000)
    run = attach_gpu_to_launch(
        nest_by_containment(Run(path=Path("."), meta={}, tracks={t.id: t for t in result.tracks}, spans=result.spans, flows=result.flows))
    )
    by_name = {s.name: s for s in run.spans}
    graph = by_name["cudaGraphLaunch"]
    assert [by_name[k].parent_id for k in ("k1", "k2", "k3")] == [graph.id] * 3
    assert sum(f.from_span == graph.id for f in run.flows) == 3
    assert by_name["k4"].parent_id == by_name["cudaLaunchKernelExC"].id
    assert by_name["k5"].parent_id == by_name["cuLaunchKernelEx"].id
    assert by_name["orphan"].parent_id is None
    for call in ("cudaGraphLaunch", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
        assert by_name[call].parent_id == by_name["aten::graph_replay"].id
    assert result.stats.unmatched_correlation_ids == 1 and result.stats.unmatched_examples == [99]
    assert by_name["k1"].start_ns == 5000  # the session clock given by to_session_ns
    assert by_name["aten::graph_replay"].end_ns == 50000


def test_relative_clock_without_base() -> None:
    trace = _tiny_trace([{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 2, "ts": 12.345, "dur": 1.5}])
    ids = itertools.count(1)
    result = kineto_to_events(trace, TrackRegistry(pid=1), lambda: next(ids), lambda ns: ns)
    assert result.stats.clock == "relative"
    assert (result.spans[0].start_ns, result.spans[0].end_ns) == (12345, 13845)


def test_load_accepts_plain_json_and_event_arrays(tmp_path: Path) -> None:
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1, "dur": 1}]
    (tmp_path / "a.json").write_text(json.dumps({"traceEvents": events}))
    (tmp_path / "b.json").write_text(json.dumps(events))
    assert load_kineto_json(tmp_path / "a.json")["traceEvents"] == events
    assert load_kineto_json(tmp_path / "b.json")["traceEvents"] == events


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (gzip.compress(b'{"traceEvents": []}')[:-12], "truncated or corrupt gzip"),
        (b'{"traceEvents": [{"ph": "X", "ts": 1', "looks truncated"),
        (b'{"format": "mltrace-run"}', "no traceEvents"),
        (b"\x00\x01binary", "not valid JSON"),
    ],
)
def test_load_rejects_torn_and_foreign_files(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "trace.json"
    path.write_bytes(content)
    with pytest.raises(RunError, match=message):
        load_kineto_json(path)


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="no such file"):
        load_kineto_json(tmp_path / "absent.json.gz")


def test_h100_trace_every_kernel_reaches_its_module_through_op_and_launch() -> None:
    """A live CUDA run recorded on an H100 by scripts/gpu_check.sh (with_modules): a CNN and
    a TransformerEncoder. Every kernel hangs under its launch call, an op, and a module frame."""
    trace = raw("h100_cuda_models.json.gz")
    raw_kernels = complete_events(trace, "kernel")
    _, run = convert("h100_cuda_models.json.gz")
    by_id = run.span_by_id()
    kernels = [s for s in run.spans if s.attrs.get("gpu.activity") == "kernel"]
    assert len(kernels) == len(raw_kernels) > 0

    def ancestors(s: Span) -> list[Span]:
        out, cur = [], by_id.get(s.parent_id) if s.parent_id is not None else None
        while cur is not None:
            out.append(cur)
            cur = by_id.get(cur.parent_id) if cur.parent_id is not None else None
        return out

    for k in kernels:
        chain = ancestors(k)
        assert "cuda.api.name" in chain[0].attrs or chain[0].level is Level.KERNEL  # the launch call
        levels = [a.level for a in chain]
        assert Level.OP in levels and (Level.LAYER in levels or Level.MODEL in levels), k.name
        launch = chain[0]
        assert launch.start_ns <= k.start_ns  # no kernel starts before its launch
    library = Counter(k.attrs.get("ml.library.name") for k in kernels if "xmma_fprop" in k.name or "cudnn::" in k.name)
    assert set(library) == {"cuDNN"}
    models = {s.name for s in run.spans if s.level is Level.MODEL}
    assert {"Cnn", "TransformerEncoder"} <= models


def test_h100_convolutions_count_the_flops_of_the_conv2d_they_serve() -> None:
    """On the H100 run, ``aten::conv2d`` → ``convolution`` → ``_convolution`` →
    ``cudnn_convolution``: every op of the chain carries the same count (cuDNN's argument
    order differs from the others'), so each op row is judged with its work."""
    _, run = convert("h100_cuda_models.json.gz")
    by_id = run.span_by_id()
    chain = ("aten::convolution", "aten::_convolution", "aten::cudnn_convolution")
    checked = Counter()
    for s in run.spans:
        if s.name in chain:
            conv2d = op_ancestor(s, by_id)
            while conv2d is not None and conv2d.name != "aten::conv2d":
                conv2d = op_ancestor(conv2d, by_id)
            assert conv2d is not None and s.attrs["ml.flops"] == conv2d.attrs["ml.flops"] > 0, s.name
            checked[s.name] += 1
    assert set(checked) == set(chain) and min(checked.values()) >= 9


def test_api_calls_kineto_cannot_name_get_their_cuda_name() -> None:
    """Kineto of torch 2.11 names cbid 468 (cudaGetDriverEntryPointByVersion, CUDA 13) "INVALID"."""
    trace = raw("h100_cuda_models.json.gz")
    assert trace_cuda_major(trace) == 13
    invalid = [e for e in complete_events(trace, "cuda_runtime") if e["name"] == "INVALID"]
    assert invalid and {e["args"]["cbid"] for e in invalid} == {468}
    _, run = convert("h100_cuda_models.json.gz")
    named = [s for s in run.spans if s.attrs.get("cuda.api.cbid") == 468]
    assert len(named) == len(invalid)
    assert {s.name for s in named} == {s.attrs["cuda.api.name"] for s in named} == {"cudaGetDriverEntryPointByVersion"}
    calls = [s for s in run.spans if "cuda.api.kind" in s.attrs]
    assert len(calls) == len(complete_events(trace, "cuda_runtime", "cuda_driver"))
    assert not [s for s in calls if s.name == "INVALID" or "cbid" in s.name]  # no unnamed API call left


@pytest.mark.parametrize(
    ("version", "expected"),
    [(12040, "cudaGetDeviceProperties_v2"), (13000, "cudaGetDeviceProperties"), (None, "cudaGetDeviceProperties")],
)
def test_unnamed_api_call_takes_the_traces_cuda_version(version: int | None, expected: str) -> None:
    event = {"ph": "X", "cat": "cuda_runtime", "name": "INVALID", "pid": 1, "tid": 1, "ts": 10, "dur": 2}
    trace: dict[str, Any] = {"traceEvents": [{**event, "args": {"cbid": 440, "correlation": 5}}]}
    trace.update({} if version is None else {"cuda_runtime_version": version})
    ids = itertools.count(1)
    result = kineto_to_events(trace, TrackRegistry(pid=1), lambda: next(ids), lambda ns: ns)
    assert [(s.name, s.attrs["cuda.api.cbid"]) for s in result.spans] == [(expected, 440)]
    unknown = {"traceEvents": [{**event, "args": {"cbid": 99999}}]}
    result = kineto_to_events(unknown, TrackRegistry(pid=1), lambda: next(ids), lambda ns: ns)
    assert [s.name for s in result.spans] == ["CUDA runtime API call (cbid 99999)"]
