"""ONNX Runtime profile conversion and ONNX-node → torch-module mapping.

The fixtures in tests/data/onnxruntime/ are real: small ResNet and Transformer
models exported from examples/models.py with ``torch.onnx.export`` (dynamo and
TorchScript exporters) and the profiles ONNX Runtime 1.31 wrote for two runs
each, with graph optimisations off and on (make_fixtures.py regenerates them).
Expected values come from the raw JSON and from the ``onnx`` package's own
parser, independently of the code under test.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import onnx
import pytest

from mltrace.formats.ort_profile import (
    LiveRun,
    OnnxGraph,
    OnnxNode,
    TorchModuleMapper,
    TorchOrigin,
    align_shift,
    common_module,
    fill_from_neighbours,
    line_up_by_module_path,
    load_ort_profile,
    name_candidates,
    node_op_table,
    origin_from_metadata,
    origin_from_scope_name,
    ort_profile_to_events,
    parse_onnx_graph,
    read_onnx_graph,
    scope_prefixes,
    source_of_stack_trace,
    threadpool_attrs,
    type_shapes,
)
from mltrace.run.events import Span, TrackKind
from mltrace.run.levels import HIERARCHY, Level
from mltrace.tracer.tracks import TrackRegistry

DATA = Path(__file__).resolve().parents[1] / "data" / "onnxruntime"
PID = 4242  # a pid no profile uses, so tracks made here are the profile's own


def profile(model: str, level: str) -> tuple[list[dict[str, Any]], int]:
    events = json.loads((DATA / f"{model}.{level}.profile.json").read_text())
    return events, int((DATA / f"{model}.{level}.start_ns").read_text())


def convert(model: str, level: str, **kwargs: Any) -> Any:
    events, start = profile(model, level)
    ids = itertools.count(1_000_000)
    defaults: dict[str, Any] = {
        "start_ns": start,
        "to_session_ns": lambda ns: ns,
        "tracks": TrackRegistry(pid=PID),
        "new_id": lambda: next(ids),
        "levels": frozenset(HIERARCHY),
        "mapper": TorchModuleMapper(read_onnx_graph(DATA / f"{model}.onnx")),
    }
    defaults.update(kwargs)
    return convert_events(events, defaults)


def convert_events(events: list[dict[str, Any]], kwargs: dict[str, Any]) -> Any:
    return ort_profile_to_events(events, **kwargs)


def live_runs_around(events: list[dict[str, Any]], start: int, margin_ns: int = 50_000) -> list[LiveRun]:
    """Model spans as the live wrapper records them: around each model_run, on its thread."""
    runs = [e for e in events if e["cat"] == "Session" and e["name"] == "model_run"]
    return [
        LiveRun(
            span_id=i + 1, start_ns=start + e["ts"] * 1000 - margin_ns, end_ns=start + (e["ts"] + e["dur"]) * 1000 + margin_ns, tid=e["tid"]
        )
        for i, e in enumerate(runs)
    ]


# -- ONNX graph reader ---------------------------------------------------------------


@pytest.mark.parametrize("model", ["resnet_tiny_dynamo", "resnet_tiny_legacy", "encoder_tiny_dynamo"])
def test_graph_reader_agrees_with_onnx(model: str) -> None:
    path = DATA / f"{model}.onnx"
    proto = onnx.load(str(path), load_external_data=False)
    graph = read_onnx_graph(path)
    assert graph.producer_name == proto.producer_name == "pytorch"
    assert graph.producer_version == proto.producer_version
    assert graph.graph_name == proto.graph.name
    assert list(graph.nodes) == [n.name for n in proto.graph.node]
    for n in proto.graph.node:
        node = graph.nodes[n.name]
        assert node.op_type == n.op_type
        assert node.inputs == tuple(n.input)
        assert node.outputs == tuple(n.output)
        assert dict(node.metadata) == {p.key: p.value for p in n.metadata_props}
        for out in n.output:
            assert graph.producer_of[out] == n.name
    assert read_onnx_graph(path.read_bytes()).nodes == graph.nodes


def test_graph_reader_rejects_torn_and_foreign_data() -> None:
    data = (DATA / "resnet_tiny_dynamo.onnx").read_bytes()
    with pytest.raises(ValueError):
        parse_onnx_graph(data[: len(data) // 2])
    with pytest.raises(ValueError):
        parse_onnx_graph(b"\xff" * 64)


def test_torch_root_class_and_metadata() -> None:
    assert read_onnx_graph(DATA / "resnet_tiny_dynamo.onnx").torch_root_class() == "ResNet"
    assert read_onnx_graph(DATA / "encoder_tiny_dynamo.onnx").torch_root_class() == "TextEncoder"
    assert read_onnx_graph(DATA / "resnet_tiny_legacy.onnx").torch_root_class() is None  # no metadata
    md = {
        "pkg.torch.onnx.name_scopes": "['', 'layer1', 'layer1.0', 'layer1.0.conv1', 'conv2d_1']",
        "pkg.torch.onnx.class_hierarchy": "['m.ResNet', 'torch.nn.Sequential', 'm.BasicBlock', 'torch.nn.Conv2d', 'aten.conv2d.default']",
    }
    assert origin_from_metadata(md) == ("layer1.0.conv1", "torch.nn.Conv2d")
    ns = {"namespace": ": m.ResNet/fc: torch.nn.modules.linear.Linear/linear: aten.linear.default"}
    assert origin_from_metadata(ns) == ("fc", "torch.nn.modules.linear.Linear")
    assert origin_from_metadata({"pkg.torch.onnx.name_scopes": "['', 'view']"}) == ("", None)
    assert origin_from_metadata({"pkg.torch.onnx.name_scopes": "not a list"}) is None
    assert origin_from_metadata({}) is None


def test_source_line_from_stack_trace() -> None:
    trace = (
        'File "/srv/models.py", line 57, in forward\n    x = self.layer1(x)\n'
        'File "/venv/lib/python3.11/site-packages/torch/nn/modules/container.py", line 253, in forward\n    input = module(input)\n'
        'File "/srv/models.py", line 29, in forward\n    out = self.relu(self.bn1(self.conv1(x)))\n'
        'File "/venv/lib/python3.11/site-packages/torch/nn/modules/conv.py", line 548, in forward\n    return self._conv_forward(x)'
    )
    assert source_of_stack_trace(trace) == ("/srv/models.py", 29)
    assert source_of_stack_trace("") is None


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("/layer1/layer1.0/conv1/Conv", "layer1.0.conv1"),
        ("/layer2/layer2.0/downsample/downsample.0/Conv", "layer2.0.downsample.0"),
        ("/encoder/layers.0/self_attn/MatMul", "encoder.layers.0.self_attn"),
        ("/layer1/layer1.0/relu_1/Relu", "layer1.0.relu"),  # the second call of layer1.0.relu
        ("/layer1/layer1.0/conv_1/Conv", "layer1.0.conv_1"),  # a real module named conv_1: no plain "conv" scope
        ("/Flatten", ""),
        ("node_Conv_292", None),
        ("Identity_3", None),
    ],
)
def test_scope_names(name: str, path: str | None) -> None:
    known = scope_prefixes(["/layer1/layer1.0/relu/Relu", "/layer1/layer1.0/conv_1/Conv"])
    assert origin_from_scope_name(name, known) == path


@pytest.mark.parametrize(
    ("ort_name", "expected"),
    [
        ("node_Conv_292", ["node_Conv_292"]),
        ("relu_nchwc", ["relu_nchwc", "relu"]),
        (
            "node_MatMul_73/MatMulScaleFusion//MatmulTransposeFusion/",
            ["node_MatMul_73/MatMulScaleFusion//MatmulTransposeFusion/", "node_MatMul_73"],
        ),
        ("/enc/layers.0/linear1/MatMul/MatMulAddFusion", ["/enc/layers.0/linear1/MatMul/MatMulAddFusion", "/enc/layers.0/linear1/MatMul"]),
        ("/stem/stem.2/Relu_output_0_nchwc", ["/stem/stem.2/Relu_output_0_nchwc", "/stem/stem.2/Relu_output_0", "/stem/stem.2/Relu"]),
        ("Squeeze_token_21", ["Squeeze_token_21", "Squeeze"]),
        ("/a/Reshape_5_new_reshape", ["/a/Reshape_5_new_reshape", "/a/Reshape_5"]),
    ],
)
def test_name_candidates(ort_name: str, expected: list[str]) -> None:
    assert name_candidates(ort_name) == expected


def test_common_module_and_neighbours() -> None:
    assert common_module("layer1.0.conv1", "layer1.1") == "layer1"
    assert common_module("layer1.0", "fc") == ""
    assert common_module("", "fc") == ""
    a = TorchOrigin("encoder.layers.0.self_attn", None, "metadata")
    b = TorchOrigin("encoder.layers.0.linear1", None, "fused")
    filled = fill_from_neighbours([None, a, None, None, b, None])
    assert filled[0] is None and filled[5] is None  # a mapped neighbour on one side only
    assert filled[1] is a and filled[4] is b
    assert filled[2] == filled[3] == TorchOrigin("encoder.layers.0", None, "neighbours")


# -- mapping real optimised graphs ---------------------------------------------------------


def mapped(model: str, level: str) -> dict[str, TorchOrigin | None]:
    events, _ = profile(model, level)
    table = node_op_table(events)
    mapper = TorchModuleMapper(read_onnx_graph(DATA / f"{model}.onnx"))
    origins = fill_from_neighbours([mapper.resolve(name, op) for name, op in table])
    return {name: o for (name, _), o in zip(table, origins)}


def test_dynamo_export_unoptimised_maps_every_node_by_metadata() -> None:
    proto = onnx.load(str(DATA / "resnet_tiny_dynamo.onnx"), load_external_data=False)
    origins = mapped("resnet_tiny_dynamo", "off")
    assert set(origins) == {n.name for n in proto.graph.node}  # every node ran, under its own name
    initializers = {i.name for i in proto.graph.initializer}
    for n in proto.graph.node:
        scopes = eval(next(p.value for p in n.metadata_props if p.key == "pkg.torch.onnx.name_scopes"))  # noqa: S307 - a list literal written by torch
        weight = next((v for v in n.input[1:] if v in initializers and v.endswith(".weight")), None)
        origin = origins[n.name]
        assert origin is not None and origin.file is not None and origin.file.endswith("models.py")
        if weight is not None and weight.removesuffix(".weight") != scopes[-2]:
            # A Conv with its BatchNorm folded in: the BN's scope, the Conv's weight; the weight decides.
            assert (origin.module_path, origin.how) == (weight.removesuffix(".weight"), "parameter"), n.name
        else:
            assert (origin.module_path, origin.how) == (scopes[-2], "metadata"), n.name
    assert origins["node_Conv_292"] is not None and origins["node_Conv_292"].module_path == "stem.0"


def test_dynamo_export_optimised_maps_fused_nodes() -> None:
    origins = mapped("resnet_tiny_dynamo", "all")
    graph = read_onnx_graph(DATA / "resnet_tiny_dynamo.onnx")
    renamed = [name for name in origins if name not in graph.nodes]
    assert renamed, "ORT_ENABLE_ALL renames nodes (NCHWc layout)"
    assert all(o is not None for o in origins.values())
    # The first Conv+BN+ReLU runs as one NCHWc Conv named after the ReLU's output ("relu"):
    # its module is the Conv's, whose weight it holds (BN was folded into it by the exporter).
    stem = origins["relu_nchwc"]
    assert stem is not None and stem.how == "fused" and stem.module_path == "stem.0" and stem.onnx_node == "node_Conv_292"
    assert {o.module_path for o in origins.values() if o is not None} >= {"layer1.0.conv1", "layer4.1.conv2", "fc", "pool"}


def test_legacy_export_maps_scoped_and_fused_names() -> None:
    origins = mapped("resnet_tiny_legacy", "all")
    assert origins["/layer1/layer1.0/relu/Relu_output_0_nchwc"] == TorchOrigin(
        "layer1.0.conv1", None, "fused", "/layer1/layer1.0/conv1/Conv"
    )
    assert origins["/layer1/layer1.0/conv2/Conv_output_0_nchwc"] is not None
    assert origins["/layer1/layer1.0/conv2/Conv_output_0_nchwc"].module_path == "layer1.0.conv2"  # type: ignore[union-attr]
    assert origins["/layer1/layer1.0/relu_1/Relu"] == TorchOrigin("layer1.0.relu", None, "scope_name", "/layer1/layer1.0/relu_1/Relu")
    assert origins["/fc/Gemm"] is not None and origins["/fc/Gemm"].module_path == "fc"  # type: ignore[union-attr]


def test_transformer_fusions() -> None:
    origins = mapped("encoder_tiny_dynamo", "all")
    fused = origins["node_MatMul_85/MatMulAddFusion"]
    assert fused is not None and fused.module_path == "encoder.layers.0.linear1" and fused.how == "fused"
    skip_ln = origins["SkipLayerNormalization"]  # Add + LayerNorm made by ORT: between self_attn and linear1
    assert skip_ln == TorchOrigin("encoder.layers.0", None, "neighbours")


def test_foreign_model_gets_no_torch_paths() -> None:
    graph = read_onnx_graph(DATA / "resnet_tiny_legacy.onnx")
    foreign = OnnxGraph(graph.graph_name, "tf2onnx", "1.16", graph.nodes, graph.producer_of)
    assert TorchModuleMapper(foreign).resolve("/layer1/layer1.0/conv1/Conv", "Conv") is None


# -- profile → spans ---------------------------------------------------------------


def test_node_and_kernel_spans_under_live_model_spans() -> None:
    events, start = profile("resnet_tiny_dynamo", "off")
    live = live_runs_around(events, start)
    out = convert("resnet_tiny_dynamo", "off", live_runs=live)
    node_events = [e for e in events if e["cat"] == "Node" and e["name"].endswith("_kernel_time")]
    layers = [s for s in out.spans if s.level == Level.LAYER and not s.attrs.get("ml.ort.module")]
    ops = [s for s in out.spans if s.level == Level.OP]
    assert len(layers) == len(ops) == len(node_events) == out.stats.node_spans == out.stats.op_spans
    assert out.stats.model_runs == out.stats.runs_matched == len(live) == 2
    assert out.stats.shift_ns == 0 and out.stats.alignment_slack_ns == 50_000
    assert not [s for s in out.spans if s.level == Level.MODEL]  # the live spans are the model spans
    by_id = {s.id: s for s in out.spans}
    live_ids = {r.span_id: r for r in live}
    for e, layer, op in zip(node_events, layers, ops):
        assert layer.name == e["name"].removesuffix("_kernel_time")
        assert layer.start_ns == start + e["ts"] * 1000 and layer.end_ns == layer.start_ns + e["dur"] * 1000
        up = layer.parent_id
        while up not in live_ids:  # the torch modules the node came from, then the model span
            module = by_id[up]
            assert module.attrs["ml.ort.module"] and module.start_ns <= layer.start_ns and layer.end_ns <= module.end_ns
            assert layer.attrs["ml.torch.module_path"].startswith(module.name)
            up = module.parent_id
        run = live_ids[up]
        assert run.start_ns <= layer.start_ns and layer.end_ns <= run.end_ns
        assert op.parent_id == layer.id and by_id[op.parent_id] is layer
        assert op.name == op.attrs["ml.op.name"] == e["args"]["op_name"]
        assert layer.attrs["ml.layer.type"] == e["args"]["op_name"]
        assert layer.attrs["ml.ort.provider"] == e["args"]["provider"] == "CPUExecutionProvider"
        assert layer.attrs["ml.framework"] == op.attrs["ml.framework"] == "onnxruntime"
        assert layer.attrs["ml.input.shapes"] == [next(iter(d.values())) for d in e["args"]["input_type_shape"]]
        assert layer.attrs["ml.ort.parameter_bytes"] == int(e["args"]["parameter_size"])
        assert layer.attrs["ml.torch.mapping"] in ("metadata", "parameter")
        parent = by_id.get(layer.parent_id)
        if layer.attrs["ml.torch.module_path"]:
            assert parent is not None and parent.name == layer.attrs["ml.torch.module_path"]
    tids = {e["tid"] for e in node_events}
    assert {out_track.tid for out_track in out.tracks if out_track.kind == TrackKind.THREAD} == tids
    assert sum(out.stats.torch_mapped.values()) == len(layers) and out.stats.torch_unmapped == 0
    assert out.stats.module_spans == len([s for s in out.spans if s.attrs.get("ml.ort.module")]) > 0


def test_kernels_that_return_their_input_move_no_bytes() -> None:
    """ORT's Reshape, Squeeze and Unsqueeze kernels return their input's buffer: the profile
    still gives their input and output sizes (a 4 MB reshape in 6 µs read as 1.3 TB/s, which
    raised the report's bandwidth roof and its ridge 40-fold). Other nodes keep the sizes."""
    events, start = profile("encoder_tiny_dynamo", "all")
    out = convert("encoder_tiny_dynamo", "all", live_runs=live_runs_around(events, start))
    sizes = {
        e["name"].removesuffix("_kernel_time"): sum(
            max(int(e["args"].get(k, 0)), 0) for k in ("parameter_size", "activation_size", "output_size")
        )
        for e in events
        if e["cat"] == "Node" and e["name"].endswith("_kernel_time")
    }
    nodes = [s for s in out.spans if s.level == Level.LAYER and not s.attrs.get("ml.ort.module")]
    alias = [s for s in nodes if s.attrs["ml.layer.type"] in ("Reshape", "Squeeze", "Unsqueeze")]
    assert len(alias) == 40 and all(sizes[s.name] > 0 for s in alias)
    assert all(s.attrs["ml.bytes"] == 0 for s in alias)
    others = [s for s in nodes if s not in alias]
    assert others and all(s.attrs["ml.bytes"] == sizes[s.name] > 0 for s in others)
    ops = {s.parent_id: s for s in out.spans if s.level == Level.OP}
    assert all(ops[s.id].attrs["ml.bytes"] == s.attrs["ml.bytes"] for s in nodes)


def test_session_events_and_unmatched_runs() -> None:
    events, start = profile("resnet_tiny_dynamo", "all")
    out = convert("resnet_tiny_dynamo", "all", model_name="ResNet", model_attrs={"ml.ort.session": 1})
    models = [s for s in out.spans if s.level == Level.MODEL]
    runs = [e for e in events if e["name"] == "model_run"]
    assert len(models) == len(runs) == 2
    assert all(m.name == "ResNet" and m.attrs["ml.ort.live_span"] is False and m.attrs["ml.ort.session"] == 1 for m in models)
    model_ids = {m.id for m in models}
    by_id = {s.id: s for s in out.spans}
    roots = [s for s in out.spans if s.level == Level.LAYER and by_id.get(s.parent_id, s).level != Level.LAYER]
    assert roots and all(s.parent_id in model_ids for s in roots)  # outermost modules and unmapped nodes
    user = sorted(s.attrs["ml.ort.event"] for s in out.spans if s.level == Level.USER)
    assert user == ["model_loading_uri", "session_initialization"]
    assert out.stats.skipped == {"SequentialExecutor::Execute": 2}


def test_levels_switch_spans_off() -> None:
    out = convert("resnet_tiny_dynamo", "off", levels=frozenset({Level.MODEL, Level.LAYER}))
    assert out.stats.op_spans == 0 and out.stats.node_spans > 0
    assert {s.level for s in out.spans} == {Level.MODEL, Level.LAYER, Level.USER}


def test_threadpool_statistics() -> None:
    events, _ = profile("resnet_tiny_dynamo", "off")
    e = next(e for e in events if "thread_scheduling_stats" in e.get("args", {}))
    stats = e["args"]["thread_scheduling_stats"]
    attrs = threadpool_attrs(stats)
    assert attrs["ml.ort.threadpool.name"] == stats["main_thread"]["thread_pool_name"]
    assert attrs["ml.ort.threadpool.run_ns"] == stats["main_thread"]["Run"] * 1000
    assert attrs["ml.ort.threadpool.sub_threads"] == len(stats["sub_threads"])
    assert attrs["ml.ort.threadpool.sub_thread_runs"] == sum(t["num_run"] for t in stats["sub_threads"].values())
    out = convert("resnet_tiny_dynamo", "off")
    total = sum(
        e["args"]["thread_scheduling_stats"]["main_thread"]["Run"] * 1000 for e in events if "thread_scheduling_stats" in e.get("args", {})
    )
    assert out.stats.threadpool["run_ns"] == total
    assert threadpool_attrs(None) == {}


def test_type_shapes() -> None:
    assert type_shapes([{"float": [1, 3, 32, 32]}, {"int64": [2]}]) == ([[1, 3, 32, 32], [2]], ["float32", "int64"])
    assert type_shapes("junk") == ([], [])


def test_event_cap_is_detected() -> None:
    """ORT keeps the first N events it records (in end-time order) and drops the rest."""
    events, start = profile("resnet_tiny_dynamo", "off")
    by_end = sorted(events, key=lambda e: e["ts"] + e["dur"])
    runs = [e for e in events if e["name"] == "model_run"]
    cap = by_end.index(runs[0]) + 1 + 5  # the first run and five nodes of the second
    kept = sorted(by_end[:cap], key=lambda e: e["ts"])
    args = {
        "start_ns": start,
        "to_session_ns": lambda ns: ns,
        "tracks": TrackRegistry(pid=PID),
        "new_id": itertools.count(1).__next__,
        "levels": frozenset(HIERARCHY),
        "max_events": cap,
    }
    live = live_runs_around(events, start)
    out = convert_events(kept, {**args, "live_runs": live})
    assert out.stats.truncated and out.stats.cpu_events == cap
    assert out.stats.model_runs == 1  # the second run's model_run ended after the cap
    assert out.stats.runs_without_nodes == 1  # the second live run
    del args["max_events"]
    full = convert_events(events, {**args, "tracks": TrackRegistry(pid=PID), "live_runs": live})
    assert not full.stats.truncated and full.stats.runs_without_nodes == 0


def test_clock_alignment_shift() -> None:
    assert align_shift([]) == (0, None)
    assert align_shift([((0, 100), (10, 90))]) == (0, 10)
    # ORT's run sticks out 5 ns past the live span: shift it back by 5 (the smallest shift that fits).
    assert align_shift([((0, 100), (10, 105)), ((200, 300), (210, 290))]) == (-5, -5)
    assert align_shift([((0, 100), (-3, 50))]) == (3, -3)
    events, start = profile("resnet_tiny_dynamo", "off")
    skewed = [LiveRun(r.span_id, r.start_ns + 60_000, r.end_ns + 60_000, r.tid) for r in live_runs_around(events, start)]
    out = convert("resnet_tiny_dynamo", "off", live_runs=skewed)
    assert out.stats.shift_ns == 10_000 and out.stats.alignment_slack_ns == -10_000
    runs = {r.span_id: r for r in skewed}
    by_id = {s.id: s for s in out.spans}
    for s in out.spans:
        if s.level == Level.LAYER:
            up = s.parent_id
            while up not in runs:  # through the module spans
                up = by_id[up].parent_id
            assert runs[up].start_ns <= s.start_ns and s.end_ns <= runs[up].end_ns


def test_gpu_kernel_events_from_cuda_ep() -> None:
    """The CUDA EP's ``Kernel`` events, in the layout onnxruntime/core/providers/cuda/cupti_manager.cc writes."""
    node = {
        "cat": "Node", "pid": 7, "tid": 7, "dur": 100, "ts": 1000, "ph": "X", "name": "conv_kernel_time",
        "args": {"op_name": "Conv", "provider": "CUDAExecutionProvider"},
    }  # fmt: skip
    kernel = {
        "cat": "Kernel", "pid": -1, "tid": -1, "dur": 40, "ts": 1050, "ph": "X", "name": "implicit_convolve_sgemm",
        "args": {"stream": "13", "grid_x": "32", "grid_y": "1", "grid_z": "1", "block_x": "128", "block_y": "1",
                 "block_z": "1", "op_name": "Conv", "parent_name": "conv_kernel_time"},
    }  # fmt: skip
    memcpy = {
        "cat": "Kernel", "pid": -1, "tid": -1, "dur": 5, "ts": 1095, "ph": "X", "name": "Memcpy HtoD",
        "args": {"stream": "13", "grid_x": "-1", "grid_y": "-1", "grid_z": "-1", "block_x": "-1", "block_y": "-1", "block_z": "-1"},
    }  # fmt: skip
    run = {"cat": "Session", "pid": 7, "tid": 7, "dur": 200, "ts": 950, "ph": "X", "name": "model_run", "args": {}}
    tracks = TrackRegistry(pid=7)
    out = convert_events(
        [run, node, kernel, memcpy],
        {"start_ns": 0, "to_session_ns": lambda ns: ns, "tracks": tracks, "new_id": itertools.count(1).__next__,
         "levels": frozenset(HIERARCHY), "gpu_device": 1},
    )  # fmt: skip
    gpu = [s for s in out.spans if s.level == Level.KERNEL]
    op = next(s for s in out.spans if s.level == Level.OP)
    assert [s.name for s in gpu] == ["implicit_convolve_sgemm", "Memcpy HtoD"]
    assert all(s.parent_id == op.id for s in gpu)
    k = gpu[0]
    assert (k.start_ns, k.end_ns) == (1_050_000, 1_090_000)
    assert k.attrs["gpu.grid"] == [32, 1, 1] and k.attrs["gpu.block"] == [128, 1, 1] and k.attrs["gpu.stream"] == 13
    assert gpu[1].attrs["gpu.activity"] == "gpu_memcpy"
    track = tracks.tracks[k.track_id]
    assert track.kind == TrackKind.GPU_STREAM and (track.device, track.stream) == (1, 13)
    off = convert_events(
        [run, node, kernel], {"start_ns": 0, "to_session_ns": lambda ns: ns, "tracks": TrackRegistry(pid=7),
                              "new_id": itertools.count(1).__next__, "levels": frozenset({Level.MODEL, Level.LAYER, Level.OP})},
    )  # fmt: skip
    assert off.stats.gpu_spans == 0 and off.stats.skipped == {"gpu kernel (kernel level off)": 1}


def test_load_profile_rejects_torn_files(tmp_path: Path) -> None:
    good = DATA / "resnet_tiny_dynamo.off.profile.json"
    raw = json.loads(good.read_text())
    events = load_ort_profile(good)
    assert [(e["name"], e["ts"], e["dur"], e["tid"]) for e in events] == [(e["name"], e["ts"], e["dur"], e["tid"]) for e in raw]
    assert all(set(e["args"]) <= set(r["args"]) and "mem_in_use_delta" not in e["args"] for e, r in zip(events, raw))
    assert events[5]["args"]["input_type_shape"] == raw[5]["args"]["input_type_shape"]
    oneline = tmp_path / "oneline.json"  # the same events in another JSON layout
    oneline.write_text(json.dumps(raw))
    assert load_ort_profile(oneline) == events
    torn = tmp_path / "torn.json"
    torn.write_bytes(good.read_bytes()[:5000])
    with pytest.raises(ValueError, match="truncated"):
        load_ort_profile(torn)
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not an ONNX Runtime profile"):
        load_ort_profile(foreign)


def test_line_up_by_module_path() -> None:
    def span(level: Level, fw: str, start: int, end: int, **attrs: Any) -> Span:
        return Span(0, None, level, "", start, end, 1, {"ml.framework": fw, **attrs})

    spans = [
        span(Level.MODEL, "pytorch", 0, 100),
        span(Level.LAYER, "pytorch", 0, 40, **{"ml.layer.path": "layer1"}),
        span(Level.LAYER, "pytorch", 0, 30, **{"ml.layer.path": "layer1.0.conv1"}),
        span(Level.MODEL, "pytorch", 0, 100),
        span(Level.LAYER, "pytorch", 0, 20, **{"ml.layer.path": "layer1"}),
        span(Level.MODEL, "onnxruntime", 0, 50),
        span(Level.LAYER, "onnxruntime", 0, 10, **{"ml.torch.module_path": "layer1.0.conv1"}),
        span(Level.LAYER, "onnxruntime", 0, 6, **{"ml.torch.module_path": "fc"}),
        span(Level.LAYER, "onnxruntime", 0, 4),  # no module: not counted
    ]
    rows = {r.module_path: r for r in line_up_by_module_path(spans)}
    assert set(rows) == {"", "layer1", "layer1.0", "layer1.0.conv1", "fc"}
    assert (rows["layer1"].torch_ns, rows["layer1"].ort_ns, rows["layer1"].ort_nodes) == (30, 10, 1)  # per model call
    assert (rows[""].torch_ns, rows[""].ort_ns, rows[""].ort_nodes) == (100, 16, 2)
    assert rows["layer1.0"].torch_ns == 0 and rows["layer1.0"].ort_ns == 10
    assert {r.module_path for r in line_up_by_module_path(spans, depth=1)} == {"", "layer1", "fc"}


def test_model_is_never_named_after_an_fx_helper() -> None:
    """A dynamic-shape export's first class can be torch.export's private hook: not a model name."""
    helper = "['torch.fx.experimental._empty_nn_module_stack_from_metadata_hook', 'torch.nn.modules.linear.Linear']"
    meta = {"pkg.torch.onnx.class_hierarchy": helper, "pkg.torch.onnx.name_scopes": "['', 'fc', 'linear']"}
    graph = OnnxGraph("main_graph", "pytorch", "2.13", {"n": OnnxNode("n", "Gemm", ("x", "fc.weight"), ("y",), meta)})
    assert graph.torch_root_class() is None
    named = {"pkg.torch.onnx.class_hierarchy": "['models.Net', 'torch.nn.modules.linear.Linear']"}
    graph.nodes["m"] = OnnxNode("m", "Gemm", ("x", "fc.weight"), ("y",), named)
    assert graph.torch_root_class() == "Net"


def test_quantized_copy_of_a_torch_export_keeps_the_weight_module() -> None:
    graph = OnnxGraph("main_graph", "onnx.quantize", "0.1.0")
    node = OnnxNode("node_Conv_292_quant", "ConvInteger", ("x_quantized", "stem.0.weight_quantized", "x_zero_point"), ("y_q",), {})
    graph.nodes[node.name] = node
    graph.producer_of["y_q"] = node.name
    mapper = TorchModuleMapper(graph)
    assert graph.from_pytorch
    assert mapper.resolve("node_Conv_292_quant", "ConvInteger") == TorchOrigin("stem.0", None, "parameter", "node_Conv_292_quant")
    # ORT's scale multiply after it is named after it
    found = mapper.resolve("node_Conv_292_quant_output_scale_mul", "Mul")
    assert found is not None and found.module_path == "stem.0"
    foreign = OnnxGraph("tf2onnx", "tf2onnx", "1.16", dict(graph.nodes), dict(graph.producer_of))
    assert TorchModuleMapper(foreign).resolve("node_Conv_292_quant", "ConvInteger") is None
