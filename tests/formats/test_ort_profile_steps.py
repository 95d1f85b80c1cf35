"""The steps of ``ort_profile_to_events``, one table each.

Every input is a record as ONNX Runtime 1.31 wrote it in tests/data/onnxruntime/
(``*.profile.json``; memory statistics left out), or, for GPU events, as the CUDA
EP's ``cupti_manager.cc`` writes them (numbers as strings, ``-1`` grids for copies).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from mltrace.formats.ort_profile import (
    LiveRun,
    TorchOrigin,
    add_threadpool_totals,
    copy_activity,
    event_kind,
    event_times,
    gpu_kernel_attrs,
    kernel_parent,
    match_live_runs,
    origin_attrs,
    run_index,
    split_profile,
    threadpool_attrs,
)

START_NS = 1_795_322_000_000_000_000  # the profiler's start (epoch ns), as a .start_ns file holds it


def node(name: str, ts: int, dur: int, tid: int = 3533, **args: Any) -> dict[str, Any]:
    return {"cat": "Node", "pid": 3533, "tid": tid, "dur": dur, "ts": ts, "ph": "X", "name": name, "args": args}


def session(name: str, ts: int, dur: int, tid: int = 3533) -> dict[str, Any]:
    return {"cat": "Session", "pid": 3533, "tid": tid, "dur": dur, "ts": ts, "ph": "X", "name": name, "args": {}}


def kernel(name: str, ts: int, dur: int, **args: Any) -> dict[str, Any]:
    return {"cat": "Kernel", "pid": -1, "tid": -1, "dur": dur, "ts": ts, "ph": "X", "name": name, "args": args}


@pytest.mark.parametrize(
    ("cat", "name", "expected"),
    [
        ("Node", "relu_nchwc_kernel_time", ("node", "")),
        ("Node", "node_Conv_292_kernel_time", ("node", "")),
        ("Node", "relu_nchwc_fence_before", (None, "fence")),
        ("Node", "relu_nchwc_fence_after", (None, "fence")),
        ("Node", "relu_nchwc_something", (None, "node event something")),
        ("Session", "model_run", ("run", "")),
        ("Session", "model_loading_uri", ("session", "")),
        ("Session", "session_initialization", ("session", "")),
        ("Session", "SequentialExecutor::Execute", (None, "SequentialExecutor::Execute")),
        ("Kernel", "implicit_convolve_sgemm", ("kernel", "")),
        ("Kernel", "Memcpy HtoD", ("kernel", "")),
        ("Api", "OrtRun", (None, "category Api")),
        ("", "x", (None, "category ")),
    ],
)
def test_event_kind(cat: str, name: str, expected: tuple[str | None, str]) -> None:
    assert event_kind(cat, name) == expected


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (session("model_run", 11387, 513), (START_NS + 11_387_000, START_NS + 11_900_000)),
        (node("relu_nchwc_kernel_time", 11403, 76), (START_NS + 11_403_000, START_NS + 11_479_000)),
        (kernel("Memcpy HtoD", 0, 0), (START_NS, START_NS)),
        ({**session("model_run", 3, 837), "ts": "3"}, (START_NS + 3_000, START_NS + 840_000)),
        ({**session("model_run", 3, 837), "dur": -1}, None),
        ({"cat": "Session", "name": "model_run"}, None),
    ],
)
def test_event_times(event: dict[str, Any], expected: tuple[int, int] | None) -> None:
    assert event_times(event, START_NS, lambda ns: ns) == expected


def test_event_times_go_through_the_session_clock() -> None:
    assert event_times(node("relu_nchwc_kernel_time", 11403, 76), START_NS, lambda ns: ns - START_NS) == (11_403_000, 11_479_000)


def test_split_profile_sorts_and_counts() -> None:
    load = session("model_loading_uri", 3, 837)
    run = session("model_run", 11387, 513)
    execute = session("SequentialExecutor::Execute", 11401, 495)
    conv = node("relu_nchwc_kernel_time", 11403, 76, op_name="Conv")
    fence = node("relu_nchwc_fence_before", 11402, 1)
    gemm = kernel("implicit_convolve_sgemm", 11410, 40, stream="13")
    early = kernel("Memcpy HtoD", 11390, 5, stream="13")
    begin = {**run, "ph": "B"}
    untimed = {**conv, "dur": None}
    parts = split_profile([load, run, early, execute, begin, conv, fence, gemm, untimed], lambda e: event_times(e, 0, lambda ns: ns))
    assert parts.session == [(3_000, 840_000, load)]
    assert parts.runs == [(11_387_000, 11_900_000, run)]
    assert parts.nodes == [(11_403_000, 11_479_000, conv)]
    # each GPU event keeps the index of the node event written before it (-1: none)
    assert parts.gpu == [(-1, 11_390_000, 11_395_000, early), (0, 11_410_000, 11_450_000, gemm)]
    assert parts.categories == Counter({"Session": 4, "Node": 3, "Kernel": 2})
    assert list(parts.skipped.items()) == [("SequentialExecutor::Execute", 1), ("not a complete event", 1), ("fence", 1), ("no time", 1)]


def test_split_profile_of_nothing() -> None:
    parts = split_profile([], lambda e: (0, 0))
    assert (parts.runs, parts.nodes, parts.session, parts.gpu, dict(parts.categories), dict(parts.skipped)) == ([], [], [], [], {}, {})


RUN_A = (11_387_000, 11_900_000, session("model_run", 11387, 513))
RUN_B = (12_000_000, 12_400_000, session("model_run", 12000, 400))
RUN_OTHER_THREAD = (12_000_000, 12_400_000, session("model_run", 12000, 400, tid=3600))


@pytest.mark.parametrize(
    ("runs", "live", "expected"),
    [
        # the live span around each run, 50 µs either side, on the same thread
        ([RUN_A, RUN_B], [LiveRun(1, 11_337_000, 11_950_000, 3533), LiveRun(2, 11_950_000, 12_450_000, 3533)], [1, 2]),
        # live spans listed out of order are matched by time
        ([RUN_A, RUN_B], [LiveRun(2, 11_950_000, 12_450_000, 3533), LiveRun(1, 11_337_000, 11_950_000, 3533)], [1, 2]),
        # a live span is taken once: the second run overlaps it less and gets none
        ([RUN_A, RUN_B], [LiveRun(1, 11_337_000, 12_100_000, 3533)], [1, None]),
        # another thread's live span is never taken
        ([RUN_OTHER_THREAD], [LiveRun(1, 11_950_000, 12_450_000, 3533)], [None]),
        ([RUN_A], [], [None]),
        # the one that overlaps most wins
        ([RUN_A], [LiveRun(1, 11_000_000, 11_400_000, 3533), LiveRun(2, 11_400_000, 11_950_000, 3533)], [2]),
    ],
)
def test_match_live_runs(runs: list[Any], live: list[LiveRun], expected: list[int | None]) -> None:
    assert [m.span_id if m is not None else None for m in match_live_runs(runs, live)] == expected


@pytest.mark.parametrize(
    ("start", "end", "tid", "expected"),
    [
        (11_403_000, 11_479_000, 3533, 0),
        (12_010_000, 12_020_000, 3533, 1),
        (12_010_000, 12_020_000, 3600, 2),  # the run on its own thread
        (12_010_000, 12_020_000, 4000, 2),  # no run on its thread: the latest that holds it
        (11_380_000, 11_479_000, 3533, None),  # starts before every run
        (11_850_000, 11_950_000, 3533, None),  # sticks out of run A
    ],
)
def test_run_index(start: int, end: int, tid: int, expected: int | None) -> None:
    runs = [RUN_A, RUN_B, RUN_OTHER_THREAD]
    assert run_index(runs, [r[0] for r in runs], start, end, tid) == expected


@pytest.mark.parametrize(
    ("origin", "node_name", "expected"),
    [
        (
            TorchOrigin("layer1.0.conv1", "torch.nn.modules.conv.Conv2d", "metadata", "node_conv2d_1", "/srv/models.py", 29),
            "node_conv2d_1",
            {
                "ml.torch.module_path": "layer1.0.conv1",
                "ml.torch.mapping": "metadata",
                "ml.torch.module_class": "torch.nn.modules.conv.Conv2d",
                "code.file.path": "/srv/models.py",
                "code.line.number": 29,
            },
        ),
        (
            TorchOrigin("stem.2", None, "fused", "node_relu"),
            "relu_nchwc",
            {"ml.torch.module_path": "stem.2", "ml.torch.mapping": "fused", "ml.onnx.node": "node_relu"},
        ),
        (
            TorchOrigin("layer1.0", None, "scope_name", "/layer1/layer1.0/Add"),
            "/layer1/layer1.0/Add",
            {"ml.torch.module_path": "layer1.0", "ml.torch.mapping": "scope_name"},
        ),
        (TorchOrigin("layer1", None, "neighbours"), "ReorderOutput", {"ml.torch.module_path": "layer1", "ml.torch.mapping": "neighbours"}),
    ],
)
def test_origin_attrs(origin: TorchOrigin, node_name: str, expected: dict[str, Any]) -> None:
    assert origin_attrs(origin, node_name) == expected


@pytest.mark.parametrize(
    ("name", "activity"),
    [("Memcpy HtoD", "gpu_memcpy"), ("Memcpy DtoH", "gpu_memcpy"), ("Memset", "gpu_memset"), ("implicit_convolve_sgemm", "kernel")],
)
def test_copy_activity(name: str, activity: str) -> None:
    assert copy_activity(name) == activity


GRID = {"grid_x": "32", "grid_y": "1", "grid_z": "1", "block_x": "128", "block_y": "1", "block_z": "1"}
NO_GRID = {"grid_x": "-1", "grid_y": "-1", "grid_z": "-1", "block_x": "-1", "block_y": "-1", "block_z": "-1"}


@pytest.mark.parametrize(
    ("name", "args", "expected"),
    [
        (
            "implicit_convolve_sgemm",
            {"stream": "13", **GRID, "op_name": "Conv", "parent_name": "conv_kernel_time"},
            {
                "ml.framework": "onnxruntime",
                "gpu.kernel.name": "implicit_convolve_sgemm",
                "gpu.device": 1,
                "gpu.stream": 13,
                "gpu.grid": [32, 1, 1],
                "gpu.block": [128, 1, 1],
                "gpu.activity": "kernel",
                "ml.op.name": "Conv",
            },
        ),
        (
            "Memcpy HtoD",
            {"stream": "13", **NO_GRID},
            {
                "ml.framework": "onnxruntime",
                "gpu.kernel.name": "Memcpy HtoD",
                "gpu.device": 1,
                "gpu.stream": 13,
                "gpu.activity": "gpu_memcpy",
            },
        ),
        ("kernel", {}, {"ml.framework": "onnxruntime", "gpu.kernel.name": "kernel", "gpu.device": 1, "gpu.activity": "kernel"}),
    ],
)
def test_gpu_kernel_attrs(name: str, args: dict[str, Any], expected: dict[str, Any]) -> None:
    assert gpu_kernel_attrs(name, args, 1) == expected


OPS = {"conv_kernel_time": [(1_000_000, 7), (2_000_000, 9)]}  # node event name → [(op span start, id)]


@pytest.mark.parametrize(
    ("parent_name", "start", "prev_node", "expected"),
    [
        ("conv_kernel_time", 1_050_000, 0, 7),  # the node's latest op span started before the kernel
        ("conv_kernel_time", 2_050_000, 0, 9),
        ("conv_kernel_time", 500_000, 0, 7),  # before every one: the first
        ("gemm_kernel_time", 1_050_000, 1, 8),  # a parent never made: the node event written before it
        (None, 1_050_000, 1, 8),
        (None, 1_050_000, -1, None),
    ],
)
def test_kernel_parent(parent_name: str | None, start: int, prev_node: int, expected: int | None) -> None:
    assert kernel_parent(parent_name, start, prev_node, OPS, [7, 8]) == expected


STATS = {
    "main_thread": {
        "thread_pool_name": "session-2-intra-op",
        "thread_id": "139990940183424",
        "block_size": [1],
        "core": 0,
        "Distribution": 1,
        "DistributionEnqueue": 0,
        "Run": 15,
        "Wait": 2,
        "WaitRevoke": 0,
    },
    "sub_threads": {"139990210762432": {"num_run": 1, "core": 1}},
}


def test_threadpool_totals_add_up() -> None:
    totals: Counter[str] = Counter()
    attrs = threadpool_attrs(STATS)
    assert attrs == {
        "ml.ort.threadpool.name": "session-2-intra-op",
        "ml.ort.threadpool.block_size": [1],
        "ml.ort.threadpool.distribution_ns": 1_000,
        "ml.ort.threadpool.distribution_enqueue_ns": 0,
        "ml.ort.threadpool.run_ns": 15_000,
        "ml.ort.threadpool.wait_ns": 2_000,
        "ml.ort.threadpool.wait_revoke_ns": 0,
        "ml.ort.threadpool.sub_threads": 1,
        "ml.ort.threadpool.sub_thread_runs": 1,
    }
    add_threadpool_totals(totals, attrs)
    add_threadpool_totals(totals, attrs)
    add_threadpool_totals(totals, {})
    assert totals == {"run_ns": 30_000, "wait_ns": 4_000, "distribution_ns": 2_000, "sub_thread_runs": 2}


def test_graph_reader_reads_subgraphs_and_skips_unnamed_nodes() -> None:
    """An ``If`` holds its branches as graph attributes; their nodes are the model's too."""
    from onnx import TensorProto, helper

    from mltrace.formats.ort_profile import parse_onnx_graph

    def branch(name: str, op: str, out: str) -> Any:
        return helper.make_graph(
            [helper.make_node(op, ["x"], [out], name=name)], name, [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, [2])]
        )

    choose = helper.make_node(
        "If", ["c"], ["y"], name="node_if", then_branch=branch("then", "Relu", "y1"), else_branch=branch("else", "Neg", "y2")
    )
    unnamed = helper.make_node("Relu", ["y"], ["z"])
    graph = helper.make_graph([choose, unnamed], "main_graph", [], [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])])
    parsed = parse_onnx_graph(helper.make_model(graph, producer_name="pytorch").SerializeToString())
    assert list(parsed.nodes) == ["node_if", "else", "then"]  # helper.make_node writes attributes sorted by name
    assert parsed.producer_of == {"y": "node_if", "y1": "then", "y2": "else"}
    assert parsed.from_pytorch and not parsed.torch_metadata
