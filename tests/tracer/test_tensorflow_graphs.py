"""Keras models run as TensorFlow graphs: ``predict()``/``evaluate()`` batches, ``tf.function`` and SavedModels.

A small functional model (``stem_conv`` … ``classifier``) is built in code; each
test runs it in an in-process session with the TensorFlow source and reads the
run back, and the JSON report (``mltrace report RUN --format json``) as a user
would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from mltrace.run.levels import Level  # noqa: E402
from mltrace.run.store import Run  # noqa: E402
from support.reference_breakdown import breakdown  # noqa: E402
from support.tf_session import traced  # noqa: E402

LAYERS = ("stem_conv", "stem_bn", "block_conv", "pool", "fc", "classifier")
DATA = np.random.default_rng(0).standard_normal((24, 16, 16, 3)).astype(np.float32)


def build(name: str) -> Any:
    """A functional model whose layers are named ``stem_conv`` … ``classifier``."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((16, 16, 3), name="image")
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="stem_conv")(inp)
    x = keras.layers.BatchNormalization(name="stem_bn")(x)
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="block_conv")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    x = keras.layers.Dense(16, activation="relu", name="fc")(x)
    out = keras.layers.Dense(4, name="classifier")(x)
    return keras.Model(inp, out, name=name)


def json_report(tmp_path: Path, *flags: str) -> dict[str, Any]:
    args = [sys.executable, "-m", "mltrace", "report", str(tmp_path / "run"), "--format", "json", *flags]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def layer_calls(run: Run) -> Counter[str]:
    return Counter(s.name for s in run.spans if s.level == Level.LAYER)


def test_predict_one_layer_span_per_layer_per_batch(tmp_path: Path) -> None:
    """predict() on 6 batches: each layer has exactly 6 calls, one per batch, in the run and the JSON report."""
    model = build("tiny")
    run = traced(tmp_path, lambda: model.predict(DATA, batch_size=4, verbose=0))
    (call,) = [s for s in run.spans if s.level == Level.MODEL]
    assert call.attrs["ml.keras.method"] == "predict"
    computing = {name for name in LAYERS}  # every layer runs ops (BatchNormalization in inference too)
    assert layer_calls(run) == dict.fromkeys(computing, 6)
    by_id = run.span_by_id()
    for s in run.spans:
        if s.level == Level.LAYER:
            assert s.parent_id == call.id and s.attrs["ml.tf.step"] in range(6)
    assert sorted(Counter(s.attrs["ml.tf.step"] for s in run.spans if s.level == Level.LAYER).values()) == [len(LAYERS)] * 6
    convs = [s for s in run.spans if s.level == Level.OP and "Conv2D" in s.name]
    assert len(convs) == 12 and all(by_id[s.parent_id].name in ("stem_conv", "block_conv") for s in convs)
    assert run.meta["correlation"]["check_containment"]["outside_parent"] == 0
    report = json_report(tmp_path)
    assert {row["name"]: row["calls"] for row in report["layers"]} == dict.fromkeys(LAYERS, 6)


def test_evaluate_one_layer_span_per_layer_per_batch(tmp_path: Path) -> None:
    model = build("tiny_eval")
    model.compile(loss="mse")
    targets = np.zeros((12, 4), np.float32)
    run = traced(tmp_path, lambda: model.evaluate(DATA[:12], targets, batch_size=4, verbose=0))
    assert layer_calls(run) == dict.fromkeys(LAYERS, 3)
    assert run.meta["correlation"]["check_containment"]["outside_parent"] == 0


def models_by_method(run: Run) -> Counter[tuple[str, str]]:
    return Counter((s.name, s.attrs["ml.keras.method"]) for s in run.spans if s.level == Level.MODEL)


def test_tf_function_and_saved_model_of_a_model_never_called_eagerly(tmp_path: Path) -> None:
    """5 calls through tf.function and 3 through a reloaded SavedModel's signature: 8 model calls, each with its layers."""
    model = build("tiny_graph")
    serve = tf.function(lambda x: model(x, training=False))
    batch = tf.constant(DATA[:2])
    outputs: list[Any] = []

    def body() -> None:
        for _ in range(5):
            outputs.append(serve(batch))
        tf.saved_model.save(model, str(tmp_path / "saved"))
        signature = tf.saved_model.load(str(tmp_path / "saved")).signatures["serving_default"]
        for _ in range(3):
            outputs.append(next(iter(signature(batch).values())))

    run = traced(tmp_path, body)
    np.testing.assert_allclose(np.asarray(outputs[-1]), np.asarray(outputs[0]), rtol=1e-5)
    assert models_by_method(run) == {("tiny_graph", "tf.function"): 5, ("tiny_graph:serving_default", "saved_model"): 3}
    assert layer_calls(run) == dict.fromkeys(LAYERS, 8)
    by_id = run.span_by_id()
    for s in run.spans:
        if s.level == Level.LAYER:
            assert by_id[s.parent_id].level == Level.MODEL and s.attrs["ml.layer.type"] == type(model.get_layer(s.name)).__name__
    sig = next(s for s in run.spans if s.level == Level.MODEL and s.attrs["ml.keras.method"] == "saved_model")
    assert sig.attrs["ml.tf.signature"] == "serving_default" and sig.attrs["ml.model.name"] == "tiny_graph"
    # Each call's site is the line of body() that made it; the model's call() is Keras's Functional.call.
    sites = {
        (s.attrs["ml.keras.method"], s.attrs["code.file.path"], s.attrs["code.line.number"]) for s in run.spans if s.level == Level.MODEL
    }
    assert len(sites) == 2 and {f for _, f, _ in sites} == {__file__}
    assert all(s.attrs["code.function.name"].endswith("body") for s in run.spans if s.level == Level.MODEL)
    assert sig.attrs["ml.defined.function.name"] == f"{type(model).__name__}.call" and "keras" in sig.attrs["ml.defined.file.path"]
    assert run.meta["correlation"]["check_containment"]["outside_parent"] == 0
    report = json_report(tmp_path, "--include-cold")
    assert sum(m["calls"] for m in report["models"]) == 8
    # The two entry points are two models, so the layers they share get a row each, named by model.
    per_model = {"tiny_graph": 5, "tiny_graph:serving_default": 3}
    assert {row["name"]: row["calls"] for row in report["layers"]} == {f"{m}.{layer}": n for m, n in per_model.items() for layer in LAYERS}
    # FLOPs by hand for a batch of 2 (16x16 images, 3x3 kernels): 2 x output elements x inner dimension.
    per_call = {
        "stem_conv": 2 * (2 * 16 * 16 * 8) * 27,
        "block_conv": 2 * (2 * 16 * 16 * 8) * 72,
        "fc": 2 * 2 * 16 * 8,
        "classifier": 2 * 2 * 4 * 16,
    }
    assert {row["name"]: row["flops"] for row in report["layers"]} == {
        f"{m}.{layer}": n * per_call.get(layer, 0.0) for m, n in per_model.items() for layer in LAYERS
    }
    # By default the cold calls (warm-up: tracing, oneDNN set-up) are left out of the layer rows.
    report = json_report(tmp_path)
    assert sorted((m["name"], m["calls"]) for m in report["models"]) == [("tiny_graph", 5), ("tiny_graph:serving_default", 3)]
    steady = {m["name"]: m["calls"] - m["cold_calls"] for m in report["models"]}
    assert {row["name"]: row["calls"] for row in report["layers"]} == {
        f"{m}.{layer}": n for m, n in steady.items() for layer in LAYERS if n
    }


def test_a_saved_model_this_process_never_built(tmp_path: Path) -> None:
    """Saved before the session: the model and its top-level layers are read from the graph's name scopes."""
    model = build("tiny_saved")
    tf.saved_model.save(model, str(tmp_path / "saved"))
    loaded = tf.saved_model.load(str(tmp_path / "saved"))
    batch = tf.constant(DATA[:2])
    run = traced(tmp_path, lambda: [loaded.signatures["serving_default"](batch) for _ in range(2)])
    assert models_by_method(run) == {("tiny_saved:serving_default", "saved_model"): 2}
    assert layer_calls(run) == dict.fromkeys(LAYERS, 2)
    assert all(s.attrs["ml.tf.model_from_scopes"] for s in run.spans if s.level == Level.MODEL)


def test_graph_calls_at_the_model_level_are_a_limitation(tmp_path: Path) -> None:
    """--level model: the profiler does not run, so tf.function calls are not recorded, and the run says so."""
    model = build("tiny_model_level")
    serve = tf.function(lambda x: model(x, training=False))
    run = traced(tmp_path, lambda: serve(tf.constant(DATA[:2])), level=Level.MODEL)
    assert [s for s in run.spans if s.level == Level.MODEL] == []
    assert any("tiny_model_level runs inside a tf.function" in line and "not recorded" in line for line in run.meta["limitations"])


def test_xla_compiled_calls_are_model_spans_without_layers(tmp_path: Path) -> None:
    """jit_compile=True: XLA runs the whole function as one op; each call is still a model span, and the run says why it has no layers."""
    model = build("tiny_xla")
    serve = tf.function(lambda x: model(x, training=False), jit_compile=True)
    batch = tf.constant(DATA[:2])
    run = traced(tmp_path, lambda: [serve(batch) for _ in range(4)])
    calls = [s for s in run.spans if s.level == Level.MODEL]
    assert models_by_method(run) == {("tiny_xla", "tf.function"): 4}
    assert all(s.attrs["ml.tf.xla"] and s.attrs["code.file.path"] == __file__ for s in calls)
    assert layer_calls(run) == {}
    assert any("4 XLA-compiled call(s)" in line and "without layers" in line for line in run.meta["limitations"])
    assert not any("no known Keras model" in line for line in run.meta["limitations"])


def test_an_exported_models_signatures_are_named_by_their_keys(tmp_path: Path) -> None:
    """model.export(): both signatures run a `signature_wrapper___call__` function; the loaded keys name them."""
    from tensorflow.python.eager.polymorphic_function.concrete_function import ConcreteFunction

    before = (tf.saved_model.load, ConcreteFunction.__dict__["_call_flat"])
    model = build("tiny_export")
    model.export(str(tmp_path / "exported"), verbose=False)
    batch = tf.constant(DATA[:2])

    def body() -> None:
        loaded = tf.saved_model.load(str(tmp_path / "exported"))
        loaded.signatures["serve"](batch)
        loaded.signatures["serving_default"](batch)
        loaded.serve(batch)  # a restored tf.function: its signature key is not known

    run = traced(tmp_path, body)
    assert models_by_method(run) == {
        ("tiny_export:serve", "saved_model"): 1,
        ("tiny_export:serving_default", "saved_model"): 1,
        ("tiny_export:restored_function", "saved_model"): 1,
    }
    assert (tf.saved_model.load, ConcreteFunction.__dict__["_call_flat"]) == before  # put back at stop


def test_eager_calls_count_the_flops_their_graph_calls_count(tmp_path: Path) -> None:
    """The profiler records no shapes for eager ops, so an eager call's FLOPs come from its layer's
    input and output shapes and settings: per call they equal the graph calls' (counted on the
    function's graph), and the hand counts. Before, eager calls had none while their time counted,
    which halved the achieved FLOP/s of a layer called both ways."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((16, 16, 4), name="image")
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv")(inp)
    x = keras.layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same", name="dw")(x)
    x = keras.layers.Reshape((256, 16), name="tokens")(x)
    x = keras.layers.Dense(12, name="fc")(x)
    out = keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, 6), name="proj")(x)
    model = keras.Model(inp, out, name="tiny_work")
    serve = tf.function(lambda x: model(x, training=False))
    batch = tf.constant(np.random.default_rng(1).standard_normal((2, 16, 16, 4)).astype(np.float32))

    run = traced(tmp_path, lambda: [(model(batch, training=False), serve(batch)) for _ in range(3)])
    # By hand for a batch of 2: 2 x output elements x inner dimension.
    per_call = {
        "conv": 2 * (2 * 16 * 16 * 8) * (9 * 4),
        "dw": 2 * (2 * 16 * 16 * 16) * 9,
        "fc": 2 * (2 * 256 * 12) * 16,
        "proj": 2 * (2 * 256 * 6) * 12,
    }
    by_id = run.span_by_id()
    ops_flops: Counter[int] = Counter()
    for s in run.spans:
        if s.level == Level.OP and "ml.flops" in s.attrs:
            ops_flops[s.parent_id] += s.attrs["ml.flops"]
    seen: Counter[tuple[str, str]] = Counter()
    for s in run.spans:
        if s.level != Level.LAYER or s.name not in per_call:
            continue
        mode = s.attrs["ml.tf.mode"]
        flops = s.attrs.get("ml.flops") if mode == "eager" else ops_flops[s.id]
        assert flops == per_call[s.name], (s.name, mode, by_id[s.parent_id].attrs.get("ml.keras.method"))
        seen[(s.name, mode)] += 1
    assert seen == {(name, mode): 3 for name in per_call for mode in ("eager", "graph")}


def test_a_tf_function_call_that_traces_holds_its_tracing(tmp_path: Path) -> None:
    """The first call of a tf.function traces the model into a graph before running it: its model
    span begins with the call (TensorFlow's event around ``Function.__call__``, ``traced-…``), so
    the tracing is in the call (``ml.tf.trace_ns``) rather than idle time before it."""
    from mltrace.tracer.clock import now_ns

    model = build("tiny_traced")
    serve = tf.function(lambda x: model(x, training=False))
    batch = tf.constant(DATA[:2])
    times: list[int] = []

    def body() -> None:
        for _ in range(3):
            times.append(now_ns())
            serve(batch)
        times.append(now_ns())

    run = traced(tmp_path, body)
    calls = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert [s.attrs["ml.keras.method"] for s in calls] == ["tf.function"] * 3
    first = calls[0]
    trace_ns = first.attrs["ml.tf.trace_ns"]
    assert trace_ns > 0 and all("ml.tf.trace_ns" not in s.attrs for s in calls[1:])
    # The span holds the whole Python call but for the wrapper's own few steps: it begins
    # before the tracing ends, where the graph's run would have begun it.
    assert times[0] <= first.start_ns < first.start_ns + trace_ns <= first.end_ns <= times[1]
    assert first.start_ns - times[0] < trace_ns
    layers = [s for s in run.spans if s.level == Level.LAYER and s.parent_id == first.id]
    assert {s.name for s in layers} == set(LAYERS)
    assert all(s.start_ns >= first.start_ns + trace_ns for s in layers)  # the graph ran after the tracing


#: The cross-attention of the attention tests: batch, query length, memory length, width, heads,
#: key and value widths (T != S and value_dim != key_dim, so each product has its own count).
_ATT = (2, 10, 12, 16, 2, 4, 3)


def _cross_attention() -> tuple[Any, Any, Any, Any]:
    """A Keras model of one MultiHeadAttention ``att`` over a query and a memory (``_ATT``), its
    ``tf.function``, and a query and memory: (model, serve, query, memory)."""
    keras.utils.set_random_seed(0)
    b, t, s, d, heads, key_dim, value_dim = _ATT
    query, memory = keras.Input((t, d), name="query"), keras.Input((s, d), name="memory")
    att = keras.layers.MultiHeadAttention(num_heads=heads, key_dim=key_dim, value_dim=value_dim, name="att")
    model = keras.Model([query, memory], att(query, memory), name="tiny_att")
    serve = tf.function(lambda q, m: model([q, m], training=False))
    rng = np.random.default_rng(2)
    q, m = (tf.constant(rng.standard_normal((b, n, d)).astype(np.float32)) for n in (t, s))
    return model, serve, q, m


def _att_projections() -> float:
    """The FLOPs of ``_cross_attention``'s four projections in one call."""
    b, t, s, d, heads, key_dim, value_dim = _ATT
    return 2.0 * b * d * heads * (t * key_dim + s * key_dim + s * value_dim) + 2.0 * b * t * heads * value_dim * d


def test_attention_products_count_in_graph_calls(tmp_path: Path) -> None:
    """A MultiHeadAttention's two attention products are Einsum ops (run as ``_MklEinsum``): they count
    from their equation and the function graph's shapes, so each graph call of the layer has the hand
    count, its four projections and the two products. Before, the products had none."""
    model, serve, q, m = _cross_attention()
    b, t, s, d, heads, key_dim, value_dim = _ATT

    run = traced(tmp_path, lambda: [serve(q, m) for _ in range(2)])
    products = {2.0 * b * heads * t * s * key_dim, 2.0 * b * heads * t * s * value_dim}  # scores, then their use
    projections = _att_projections()
    by_id = run.span_by_id()
    calls = [s for s in run.spans if s.level == Level.LAYER and s.name == "att"]
    assert len(calls) == 2
    for call in calls:
        ops = [s for s in run.spans if s.level == Level.OP and _under(s, call.id, by_id)]
        einsums = {s.attrs.get("ml.flops") for s in ops if "Einsum" in s.name}
        assert einsums == products
        assert sum(s.attrs.get("ml.flops", 0.0) for s in ops) == projections + sum(products)


def _under(span: Any, ancestor: int, by_id: dict[int, Any]) -> bool:
    parent = span.parent_id
    while parent is not None and parent != ancestor:
        parent = by_id[parent].parent_id if parent in by_id else None
    return parent == ancestor


def test_eager_attention_calls_count_their_products(tmp_path: Path) -> None:
    """The eager einsums of a MultiHeadAttention carry no shapes, so an eager call's FLOPs come from the
    layer's settings and its query's, value's and output's shapes: its four projections and the two
    attention products, as its graph calls count them. The layer's row has them once: its EinsumDense
    children's FLOPs are in its own, not added to it. Before, an eager call had the projections only."""
    model, serve, q, m = _cross_attention()
    b, t, s, d, heads, key_dim, value_dim = _ATT

    run = traced(tmp_path, lambda: [(model([q, m], training=False), serve(q, m)) for _ in range(2)])
    projections = _att_projections()
    per_call = projections + 2.0 * b * heads * t * s * (key_dim + value_dim)  # QK^T, then A.V
    by_id = run.span_by_id()
    calls = [x for x in run.spans if x.level == Level.LAYER and x.name == "att"]
    eager = [x for x in calls if x.attrs["ml.tf.mode"] == "eager"]
    assert len(calls) == 4 and len(eager) == 2
    for call in eager:
        assert call.attrs["ml.flops"] == per_call
        assert call.attrs["ml.input.shapes"] == [[b, t, d], [b, s, d]]
        children = [x for x in run.spans if x.level == Level.LAYER and x.parent_id == call.id]
        assert sum(x.attrs.get("ml.flops", 0.0) for x in children) == projections
    for call in (x for x in calls if x.attrs["ml.tf.mode"] == "graph"):
        assert sum(x.attrs.get("ml.flops", 0.0) for x in run.spans if x.level == Level.OP and _under(x, call.id, by_id)) == per_call
    (row,) = [r for r in json_report(tmp_path, "--include-cold")["layers"] if r["name"] == "att"]
    assert (row["calls"], row["flops"]) == (4, 4 * per_call)


def test_variable_reads_ahead_of_their_layers_name_them(tmp_path: Path) -> None:
    """predict() runs each step's variable reads before the layers that read them begin: such a
    read stays the model's child (it ran outside its layer's span) but names its layer, and the
    report counts it apart from the ops the model ran in no layer."""
    from mltrace.analysis.bottleneck import analyze

    model = build("tiny_reads")
    run = traced(tmp_path, lambda: model.predict(DATA, batch_size=4, verbose=0))
    (call,) = [s for s in run.spans if s.level == Level.MODEL]
    in_model = [s for s in run.spans if s.level == Level.OP and s.parent_id == call.id]
    reads = [s for s in in_model if s.name == "ReadVariableOp"]
    assert reads, Counter(s.name for s in in_model)
    layers = {s.name for s in run.spans if s.level == Level.LAYER}
    assert all(s.attrs.get("ml.tf.layer") in layers for s in reads), [s.attrs for s in reads[:3]]
    assert {s.attrs["ml.tf.layer"] for s in reads} <= set(LAYERS)
    by_id = run.span_by_id()

    def in_no_layer(s: Any) -> bool:  # the nearest model or layer span above it is the model
        up = by_id.get(s.parent_id)
        while up is not None and up.level == Level.OP:
            up = by_id.get(up.parent_id)
        return up is call

    # stem_bn's arithmetic on its weights (batchnorm/Rsqrt …) runs with the reads, before its
    # span: those ops name it too, and are counted apart from the reads.
    named = [s for s in in_model if s.attrs.get("ml.tf.layer")]
    bn_ops = [s for s in in_model if "/batchnorm/" in s.attrs.get("ml.tf.node", "")]
    assert bn_ops and all(s.attrs.get("ml.tf.layer") == "stem_bn" for s in bn_ops), [s.attrs for s in bn_ops[:3]]
    b = analyze(run).breakdown
    assert b.reads_outside_layers == len(reads)
    assert b.layer_ops_outside_layers == len(named) - len(reads)
    no_layer = [s for s in run.spans if s.level == Level.OP and in_no_layer(s)]
    assert b.ops_outside_layers == len(no_layer) - len(named)
    assert b == breakdown(run)
    info = run.meta["sources_info"]["tensorflow"]["profiles"][0]
    assert info["variable_reads_outside_layers"] == len(reads)
    assert info["layer_ops_outside_layers"] == len(named)
