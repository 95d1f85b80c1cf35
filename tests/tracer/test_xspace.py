"""TensorFlow profiler XSpace conversion, on real profiles.

The fixtures in tests/data/tensorflow/ are ``xplane.pb`` files TensorFlow 2.21
wrote for Keras 3 models (a nested functional model and
``keras.applications.MobileNetV2``), with the times of each call as the live
wrappers see them (``<name>.calls.json``; make_fixtures.py regenerates them).
Expected values come from the raw protobuf, read here with TensorFlow's own
message classes.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from mltrace.formats.xspace import (
    BOOKKEEPING_OPS,
    SYNTHETIC_TID_BASE,
    HostProfile,
    KerasModelInfo,
    LiveModelSpan,
    XEventRow,
    host_profile,
    layer_of_node,
    parse_op_event,
    read_xspace,
    std_thread_hash,
    xplane_pb2,
    xspace_to_events,
)
from mltrace.run.levels import HIERARCHY, Level
from mltrace.tracer.tracks import TrackRegistry

DATA = Path(__file__).resolve().parents[1] / "data" / "tensorflow"


def fixture(name: str) -> tuple[Any, HostProfile, dict[str, Any]]:
    space = read_xspace(DATA / f"{name}.xplane.pb")
    return space, host_profile(space), json.loads((DATA / f"{name}.calls.json").read_text())


def live_spans(calls: dict[str, Any], methods: tuple[str, ...] = ("predict", "__call__")) -> list[LiveModelSpan]:
    return [
        LiveModelSpan(i + 1, c["start_ns"], c["end_ns"], calls["thread"]["tid"], calls["model"], c["method"] == "__call__")
        for i, c in enumerate(calls["calls"])
        if c["method"] in methods
    ]


Converted = tuple[Any, dict[str, Any], list[LiveModelSpan]]


def convert(name: str, methods: tuple[str, ...] = ("predict", "__call__"), **kwargs: Any) -> Converted:
    _, profile, calls = fixture(name)
    live = live_spans(calls, methods)
    args: dict[str, Any] = {
        "to_session_ns": lambda ns: ns,
        "tracks": TrackRegistry(pid=1),
        "new_id": itertools.count(1000).__next__,
        "levels": frozenset(HIERARCHY),
        "live_models": live,
        "models": {calls["model"]: KerasModelInfo(calls["model"], calls["layers"])},
        "python_threads": {calls["thread"]["hash"]: (calls["thread"]["tid"], calls["thread"]["name"])},
    }
    args.update(kwargs)
    return xspace_to_events(profile, **args), calls, live


def raw_op_events(space: Any) -> list[tuple[int, str, int, int]]:
    """(line id, name, start, end) of every ``node:Type`` event, epoch ns, straight from the protobuf."""
    start = next(
        st.uint64_value
        for p in space.planes
        if p.name == "Task Environment"
        for st in p.stats
        if p.stat_metadata[st.metadata_id].name == "profile_start_time"
    )
    host = next(p for p in space.planes if p.name == "/host:CPU")
    out = []
    for line in host.lines:
        for e in line.events:
            name = host.event_metadata[e.metadata_id].name
            node, sep, op = name.rpartition(":")
            if sep and node and "::" not in name and " " not in name and op.replace("_", "").isalnum():
                t0 = start + line.timestamp_ns + e.offset_ps // 1000
                out.append((line.id, name, t0, t0 + e.duration_ps // 1000))
    return out


def test_thread_line_ids_are_libstdcxx_thread_hashes() -> None:
    # Measured: a CPython thread's get_ident() and the id TensorFlow gave its profile line.
    assert std_thread_hash(140110152489856) == -4242992516054074338
    assert std_thread_hash(140109051578048) == 6051161366881013018
    _, profile, calls = fixture("keras_nested")
    assert profile.lines[calls["thread"]["hash"]] == "python"


def test_proto_classes_load_without_tensorflow() -> None:
    code = (
        "import sys\n"
        "from mltrace.formats.xspace import read_xspace, host_profile\n"
        f"p = host_profile(read_xspace({str(DATA / 'keras_nested.xplane.pb')!r}))\n"
        "print(len(p.events) > 0, 'tensorflow' in sys.modules, 'keras' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False"]


def test_host_profile_times_and_lines() -> None:
    space, profile, calls = fixture("keras_nested")
    assert profile.clock == "relative" and profile.start_ns > 0 and profile.stop_ns > profile.start_ns
    host = next(p for p in space.planes if p.name == "/host:CPU")
    assert len(profile.events) == sum(len(line.events) for line in host.lines)
    assert set(profile.lines) == {line.id for line in host.lines}
    assert all(profile.start_ns <= r.start_ns <= r.end_ns <= profile.stop_ns for r in profile.events)
    raw = sorted((lid, name, s, e) for lid, name, s, e in raw_op_events(space))
    mine = sorted((r.line_id, r.name, r.start_ns, r.end_ns) for r in profile.events if parse_op_event(r.name))
    assert mine == raw
    eager = [r for r in profile.events if r.name == "EagerExecute"]
    assert eager and all("eager_op" in r.stats and "is_func" in r.stats for r in eager)
    assert {r.stats["eager_op"] for r in eager} >= {"Conv2D", "MatMul"}


@pytest.mark.parametrize(
    ("event", "parsed"),
    [
        ("net_1/head_1/fc1_1/Relu:_MklNativeFusedMatMul", ("net_1/head_1/fc1_1/Relu", "_MklNativeFusedMatMul")),
        ("GatherV2:GatherV2", ("GatherV2", "GatherV2")),
        ("ThreadpoolListener::Record", None),
        ("EagerLocalExecute: Conv2D", None),
        ("EagerExecute", None),
    ],
)
def test_parse_op_event(event: str, parsed: tuple[str, str] | None) -> None:
    assert parse_op_event(event) == parsed


def test_layer_paths_from_name_scopes() -> None:
    net = KerasModelInfo("net", {"conv": "Conv2D", "conv_1": "Conv2D", "head": "Sequential", "head/fc1": "Dense"})
    models = {"net": net}
    # Scopes uniquified on the model are uniquified on every layer: conv_1 is the layer "conv".
    assert layer_of_node("net_1/conv_1/BiasAdd", models) == (net, "conv")
    assert layer_of_node("net_1/conv_1_1/BiasAdd", models) == (net, "conv_1")
    assert layer_of_node("net_1/head_1/fc1_1/MatMul", models) == (net, "head/fc1")
    assert layer_of_node("net_1/head_1/Identity", models) == (net, "head")
    # Not uniquified: names are taken as they are.
    assert layer_of_node("net/conv_1/BiasAdd", models) == (net, "conv_1")
    assert layer_of_node("net_1/Identity", models) == (net, "")
    assert layer_of_node("StatefulPartitionedCall/net_1/conv_1/BiasAdd", models) == (net, "conv")  # evaluate()
    assert layer_of_node("other_1/conv/BiasAdd", models) is None
    assert layer_of_node("Identity", models) is None


def test_graph_and_eager_calls_of_a_nested_model() -> None:
    out, calls, live = convert("keras_nested")
    space, _, _ = fixture("keras_nested")
    by_id = {s.id: s for s in out.spans}
    live_by_id = {m.span_id: m for m in live}
    predict = next(m for m in live if not m.eager)
    eager_call = next(m for m in live if m.eager)
    function_models = [s for s in out.spans if s.level == Level.MODEL]
    assert len(function_models) == out.stats.function_models == 1  # the user's tf.function, not wrapped live
    fn = function_models[0]
    fn_call = next(c for c in calls["calls"] if c["method"] == "tf.function")
    assert fn.name == "net" and fn.attrs["ml.tf.function"].startswith("__inference_user_function")
    assert fn_call["start_ns"] <= fn.start_ns and fn.end_ns <= fn_call["end_ns"]

    def model_of(span: Any) -> int:
        while span.parent_id in by_id:
            span = by_id[span.parent_id]
        return span.parent_id if span.parent_id is not None else span.id

    layers = [s for s in out.spans if s.level == Level.LAYER]
    assert {s.name for s in layers} == {"conv", "gap", "head", "head/fc1", "head/fc2"}
    assert {s.attrs["ml.layer.type"] for s in layers} == {"Conv2D", "GlobalAveragePooling2D", "Sequential", "Dense"}
    for s in layers:
        parent = by_id.get(s.parent_id)
        if "/" in s.name:
            assert parent is not None and parent.name == s.name.rsplit("/", 1)[0]
            assert parent.start_ns <= s.start_ns and s.end_ns <= parent.end_ns
        else:
            assert parent is None or parent.level == Level.MODEL
        root = model_of(s)
        owner = live_by_id.get(root) or by_id[root]
        assert owner.start_ns <= s.start_ns and s.end_ns <= owner.end_ns
    assert {model_of(s) for s in layers} == {predict.span_id, fn.id}  # eager layers come from the live wrapper
    # Graph ops: every one inside a model span, converted, and inside its parent.
    graph_ops = [s for s in out.spans if s.level == Level.OP and "ml.tf.node" in s.attrs]
    inside = [
        r
        for r in raw_op_events(space)
        if any(c["start_ns"] <= r[2] and r[3] <= c["end_ns"] for c in calls["calls"] if c["method"] in ("predict", "tf.function"))
    ]
    assert len(graph_ops) == len(inside) == out.stats.graph_ops_in_models
    for op in graph_ops:
        parent = by_id.get(op.parent_id) or live_by_id[op.parent_id]
        assert parent.start_ns <= op.start_ns and op.end_ns <= parent.end_ns
        if op.name.startswith("_MklNativeFused"):  # the compute ops lie in their layers
            assert isinstance(parent, type(op)) and parent.level == Level.LAYER
            assert op.attrs["ml.tf.node"].split("/")[-2].rsplit("_", 1)[0] == parent.name.rsplit("/", 1)[-1]
    in_models = [op for op in graph_ops if op.parent_id in live_by_id or by_id[op.parent_id].level == Level.MODEL]
    assert out.stats.ops_outside_layers == len(in_models)
    # Eager ops: on the calling thread's own track, left for nest_by_containment.
    eager_ops = [s for s in out.spans if s.level == Level.OP and s.attrs.get("ml.tf.mode") == "eager"]
    assert {s.name for s in eager_ops} >= {"Conv2D", "MatMul", "BiasAdd"}
    tracks = {t.id: t for t in out.tracks}
    assert all(tracks[s.track_id].tid == calls["thread"]["tid"] and s.parent_id is None for s in eager_ops)
    assert sum(1 for s in eager_ops if eager_call.start_ns <= s.start_ns and s.end_ns <= eager_call.end_ns) >= 6
    pool = {t.tid for t in out.tracks if t.tid != calls["thread"]["tid"]}
    assert pool and all(tid >= SYNTHETIC_TID_BASE for tid in pool)


def test_keras_applications_layers_keep_their_names() -> None:
    out, calls, _ = convert("mobilenetv2")
    layers = [s for s in out.spans if s.level == Level.LAYER]
    names = {s.name for s in layers}
    assert names <= set(calls["layers"])
    assert {"Conv1", "bn_Conv1", "block_1_expand", "block_16_project_BN", "predictions"} <= names
    assert len(names) >= 100
    by_id = {s.id: s for s in out.spans}
    convs = [s for s in out.spans if s.name in ("_MklNativeConv2D", "_MklNativeDepthwiseConv2dNative")]
    assert len(convs) == 52
    for op in convs:
        layer = by_id[op.parent_id]
        assert layer.level == Level.LAYER and layer.attrs["ml.layer.type"] in ("Conv2D", "DepthwiseConv2D")
    assert out.stats.unknown_scopes  # tf.data's ops during predict: no model scope
    assert out.stats.lines_matched == 1


def test_levels_switch_spans_off() -> None:
    out, _, _ = convert("keras_nested", levels=frozenset({Level.MODEL, Level.LAYER}))
    assert out.stats.op_spans == 0 and out.stats.layer_spans > 0
    out, _, _ = convert("keras_nested", levels=frozenset({Level.MODEL}))
    assert {s.level for s in out.spans} <= {Level.MODEL}


def test_nothing_outside_model_spans() -> None:
    out, _, _ = convert("keras_nested", methods=())
    # Without live spans only the tf.function call becomes a model; everything else is left out.
    assert {s.level for s in out.spans if s.parent_id is None and s.level != Level.OP} == {Level.MODEL}
    assert out.stats.skipped["eager op outside model spans"] > 0
    assert out.stats.skipped["graph op outside model spans"] > 0


def test_rejects_foreign_data(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        read_xspace(b"\xff\xff\xff\xff")
    empty = xplane_pb2().XSpace()
    with pytest.raises(ValueError, match="host"):
        read_xspace(empty.SerializeToString())


def _layer(sid: int, parent: int, path: str, start: int, end: int) -> Any:
    from mltrace.run.events import Span

    return Span(sid, parent, Level.LAYER, path, start, end, 7, {"ml.layer.path": path})


def test_fragments_of_one_layer_call_merge_into_one_span() -> None:
    """A BatchNormalization's Rsqrt before the conv and its Mul after: two fragments, one call."""
    from mltrace.formats.xspace import merge_layer_fragments

    layers = [
        _layer(10, 1, "bn", 0, 20),  # Rsqrt of the variance: 15 ns of work
        _layer(11, 1, "conv", 30, 90),
        _layer(12, 1, "bn", 100, 160),  # the normalisation itself: 50 ns
        _layer(13, 1, "head", 170, 260),
        _layer(14, 13, "head/fc", 170, 200),  # a fragment of head/fc inside the kept head
        _layer(15, 1, "head", 270, 280),
        _layer(16, 15, "head/fc", 270, 280),
        _layer(17, 13, "head/fc", 210, 260),
    ]
    work = {10: 15, 11: 55, 12: 50, 13: 80, 14: 25, 15: 9, 16: 9, 17: 40}
    merged = merge_layer_fragments(layers, 1, work)
    assert [(s.id, s.name, s.parent_id) for s in merged.kept] == [(11, "conv", 1), (12, "bn", 1), (13, "head", 1), (17, "head/fc", 13)]
    # What the dropped fragments held goes to their nearest kept ancestor, which contains it in time.
    assert merged.resolve(10) == 1 and merged.resolve(14) == 13 and merged.resolve(16) == 1 and merged.resolve(12) == 12


def test_predict_batches_are_steps() -> None:
    """keras_nested's predict() ran one batch: each layer once, numbered step 0."""
    out, _, live = convert("keras_nested")
    predict = next(m for m in live if not m.eager)
    mine = [s for s in out.spans if s.level == Level.LAYER and s.parent_id == predict.span_id]
    assert mine and all(s.attrs["ml.tf.step"] == 0 for s in mine)
    names = [s.name for s in out.spans if s.level == Level.LAYER]
    per_model = Counter(names)
    assert set(per_model.values()) == {2}  # once in predict, once in the user's tf.function


def test_graph_function_names() -> None:
    from mltrace.formats.xspace import function_entry, models_from_scopes, whole_function_op

    assert function_entry("__inference_signature_wrapper_serving_default_401") == ("saved_model", "serving_default")
    assert function_entry("__inference_restored_function_body_1302") == ("saved_model", "restored_function")
    assert function_entry("__inference_<lambda>_102") == ("tf.function", "<lambda>")
    assert whole_function_op("__inference_<lambda>_67:__inference_<lambda>_67") == "__inference_<lambda>_67"
    assert whole_function_op("net_1/conv_1/Relu:_MklNativeFusedConv2D") is None
    guessed = models_from_scopes(["StatefulPartitionedCall/tiny_1/stem_conv_1/Relu", "StatefulPartitionedCall/tiny_1/fc_1/MatMul", "range"])
    assert list(guessed) == ["tiny"] and dict(guessed["tiny"].layers) == {"stem_conv": "", "fc": ""} and guessed["tiny"].from_scopes


def test_fragments_on_two_threads_at_once_are_one_call() -> None:
    """An attention layer's ``query`` runs on one thread while its ``key`` runs on another: one call of it."""
    from mltrace.formats.xspace import merge_layer_fragments
    from mltrace.run.events import Span

    def frag(sid: int, parent: int, path: str, start: int, end: int, track: int) -> Span:
        return Span(sid, parent, Level.LAYER, path, start, end, track, {"ml.layer.path": path})

    layers = [
        frag(10, 1, "att", 100, 300, 7),
        frag(11, 10, "att/key", 100, 200, 7),
        frag(12, 1, "att", 105, 400, 8),  # the same call, on thread 8 meanwhile
        frag(13, 12, "att/query", 105, 190, 8),
        frag(14, 12, "att/out", 345, 400, 8),
        frag(15, 1, "att", 500, 520, 8),  # after the call: not joined, moved up
    ]
    work = {10: 100, 11: 100, 12: 140, 13: 85, 14: 55, 15: 20}
    merged = merge_layer_fragments(layers, 1, work)
    assert [(s.id, s.name, s.parent_id, s.start_ns, s.end_ns) for s in merged.kept] == [
        (12, "att", 1, 100, 400),  # grown to cover the fragment it joined
        (11, "att/key", 12, 100, 200),
        (13, "att/query", 12, 105, 190),
        (14, "att/out", 12, 345, 400),
    ]
    assert merged.resolve(10) == 12 and merged.resolve(15) == 1


def _tx_profile() -> tuple[HostProfile, dict[str, str]]:
    """One call of a Transformer block whose ops ran on two executor threads (times as TensorFlow 2.21
    interleaved them in a Keras MultiHeadAttention block: ``key`` and ``value`` on one, ``query``, the
    attention and its output projection on the other)."""
    a, b = 11, 22
    ops = [
        (a, "tx_1/block_1/mha_1/key_1/einsum/Einsum:_MklBatchMatMulV2", 100, 200),
        (b, "tx_1/block_1/mha_1/query_1/einsum/Einsum:_MklBatchMatMulV2", 105, 190),
        (b, "tx_1/block_1/mha_1/query_1/Add/ReadVariableOp:ReadVariableOp", 191, 192),
        (b, "tx_1/block_1/mha_1/einsum/Einsum:_MklEinsum", 195, 260),
        (a, "tx_1/block_1/mha_1/value_1/einsum/Einsum:_MklBatchMatMulV2", 210, 300),
        (b, "tx_1/block_1/mha_1/Softmax:_MklSoftmax", 262, 280),
        (b, "tx_1/block_1/mha_1/einsum_1/Einsum:_MklEinsum", 305, 340),
        (b, "tx_1/block_1/mha_1/attention_output_1/einsum/Einsum:_MklBatchMatMulV2", 345, 400),
        (b, "tx_1/block_1/add:AddV2", 402, 410),
        (a, "tx_1/block_1/ln_1/moments/mean:Mean", 412, 450),
        (b, "tx_1/block_1/ln_1/mul:Mul", 430, 440),
        (a, "tx_1/dense_1/MatMul:_MklMatMul", 460, 500),
    ]
    profile = HostProfile(lines={a: "tf_Compute", b: "tf_Compute"})
    profile.events = [XEventRow(line, name, s, e, {}) for line, name, s, e in ops]
    layers = {
        "block": "TransformerBlock",
        "block/mha": "MultiHeadAttention",
        **{f"block/mha/{p}": "EinsumDense" for p in ("query", "key", "value", "attention_output")},
        "block/ln": "LayerNormalization",
        "dense": "Dense",
    }
    return profile, layers


def test_a_layer_call_on_two_threads_holds_its_ops_from_both() -> None:
    """Each op's layer is the one its name scopes name, whichever thread ran it; every span lies in its parent."""
    profile, layers = _tx_profile()
    out = xspace_to_events(
        profile,
        to_session_ns=lambda ns: ns,
        tracks=TrackRegistry(pid=1),
        new_id=itertools.count(1000).__next__,
        levels=frozenset(HIERARCHY),
        live_models=[LiveModelSpan(1, 0, 600, 99, "tx", False)],
        models={"tx": KerasModelInfo("tx", layers)},
    )
    by_id = {s.id: s for s in out.spans}

    def parent_path(s: Any) -> str:  # "" for the model
        return "" if s.parent_id == 1 else by_id[s.parent_id].name

    spans = [s for s in out.spans if s.level == Level.LAYER]
    assert sorted(s.name for s in spans) == sorted(layers)  # one span per layer
    assert all(parent_path(s) == s.name.rpartition("/")[0] for s in spans)
    for s in out.spans:
        parent = by_id.get(s.parent_id) if s.parent_id is not None else None
        if parent is not None:
            assert parent.start_ns <= s.start_ns and s.end_ns <= parent.end_ns, (s, parent)
    model = KerasModelInfo("tx", layers)
    for op in (s for s in out.spans if s.level == Level.OP and s.name not in BOOKKEEPING_OPS):
        found = layer_of_node(op.attrs["ml.tf.node"], {"tx": model})
        assert found is not None and parent_path(op) == found[1], op.attrs["ml.tf.node"]
    assert out.stats.ops_outside_layers == 1  # the variable read after its layer's run: the model's
    # It names the layer that read the variable, so the report counts it as that layer's read.
    (read,) = [s for s in out.spans if s.level == Level.OP and s.parent_id == 1]
    assert read.name == "ReadVariableOp" and read.attrs["ml.tf.layer"] == "block/mha/query"
    assert out.stats.variable_reads_outside_layers == 1
    assert out.stats.layer_ops_outside_layers == 1


def test_batch_norm_arithmetic_run_with_the_reads_names_its_layer() -> None:
    """MobileNetV2's BatchNormalizations (Keras 3: ``batchnorm/add``, ``Rsqrt``, ``mul``, ``mul_2``,
    ``sub`` on the layer's weights, then ``mul_1`` and ``add_1`` on its input): the executor runs the
    weights' arithmetic at the start of the step with the variable reads, long before the layer's
    main run, so it is a fragment the merge drops and its ops stay in the model span. Each names its
    BatchNormalization in ``ml.tf.layer``, as the reads do; what is left in no layer is tf.data's."""
    out, calls, live = convert("mobilenetv2")
    models = {m.span_id for m in live}
    by_id = {s.id: s for s in out.spans}
    graph_ops = [s for s in out.spans if s.level == Level.OP and "ml.tf.node" in s.attrs]
    in_model = [s for s in graph_ops if s.parent_id in models]
    bn_ops = [s for s in graph_ops if "/batchnorm/" in s.attrs["ml.tf.node"]]
    apart = [s for s in bn_ops if s.parent_id in models]
    assert {s.name for s in apart} == {"AddV2", "Rsqrt", "Mul", "Sub"} and len(apart) >= 200
    model = {calls["model"]: KerasModelInfo(calls["model"], calls["layers"])}
    for op in bn_ops:
        found = layer_of_node(op.attrs["ml.tf.node"], model)
        assert found is not None and calls["layers"][found[1]] == "BatchNormalization"
        if op.parent_id in models:  # outside its layer's span: names it
            assert op.attrs["ml.tf.layer"] == found[1], op.attrs
        else:  # inside it: in the layer's span, which names no other
            assert by_id[op.parent_id].name == found[1] and "ml.tf.layer" not in op.attrs
    named = [s for s in in_model if s.attrs.get("ml.tf.layer")]
    reads = [s for s in named if s.name == "ReadVariableOp"]
    assert (out.stats.layer_ops_outside_layers, out.stats.variable_reads_outside_layers) == (len(named), len(reads))
    assert out.stats.ops_outside_layers == len(in_model)
    unnamed = [s for s in in_model if not s.attrs.get("ml.tf.layer")]
    assert unnamed and all(layer_of_node(s.attrs["ml.tf.node"], model) is None for s in unnamed)  # predict's tf.data ops
    assert len(unnamed) == 10
