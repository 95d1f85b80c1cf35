"""The TensorFlow / Keras source, live, with a real keras.applications model.

TensorFlow's import takes seconds, so the module imports it once and builds
one ``keras.applications.MobileNetV2(weights=None)`` for every test. Each test
runs its calls inside an in-process session; one goes through the command
line as a user would.
"""

from __future__ import annotations

import gc
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import mltrace  # noqa: E402
from mltrace.config import ProfileOptions  # noqa: E402
from mltrace.run.levels import Level  # noqa: E402
from mltrace.run.store import Run  # noqa: E402
from mltrace.tracer.session import Session  # noqa: E402
from mltrace.tracer.sources.tensorflow import TensorFlowSource  # noqa: E402
from support.installed import installed_infer  # noqa: E402
from support.tf_session import traced  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
IMAGES = np.random.default_rng(0).standard_normal((2, 32, 32, 3)).astype(np.float32)


@pytest.fixture(scope="module")
def mobilenet() -> Any:
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(weights=None, alpha=0.35, input_shape=(32, 32, 3), classes=10)
    model.compile(loss="sparse_categorical_crossentropy")
    model.predict(IMAGES, verbose=0)  # build and trace once, outside the tests
    return model


@pytest.fixture(autouse=True)
def keras_unpatched() -> Iterator[None]:
    """Fails a test that leaves Keras or the TensorFlow profiler API patched, or the profiler running."""
    from keras.src.layers.layer import Layer
    from tensorflow.python.profiler import profiler_v2

    before = (Layer.__call__, keras.Model.predict, keras.Model.evaluate, profiler_v2.start, tf.profiler.experimental.stop)
    yield
    after = (Layer.__call__, keras.Model.predict, keras.Model.evaluate, profiler_v2.start, tf.profiler.experimental.stop)
    assert after == before, "Keras or the profiler API was left patched"
    probe = tempfile.mkdtemp(prefix="tf-profiler-probe-")
    try:
        tf.profiler.experimental.start(probe)  # raises if mltrace left its profiler running
        tf.profiler.experimental.stop()
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def check(run: Run) -> None:
    """Every TensorFlow op lies in a layer or directly in a model; children lie in their parents."""
    by_id = run.span_by_id()
    for s in run.spans:
        if s.level == Level.OP and s.attrs.get("ml.framework") == "tensorflow":
            up = s
            while up.level == Level.OP:  # an op may run inside another (tf.data's Range inside MakeIterator)
                assert up.parent_id is not None, s
                up = by_id[up.parent_id]
            assert up.level in (Level.LAYER, Level.MODEL), (s, up)
        if s.level == Level.LAYER:
            assert by_id[s.parent_id].level in (Level.LAYER, Level.MODEL), s
    facts = run.meta["correlation"]["check_containment"]
    assert facts["outside_parent"] == 0 and facts["missing_parent"] == 0, facts


def test_eager_call(tmp_path: Path, mobilenet: Any) -> None:
    outputs: list[Any] = []
    run = traced(tmp_path, lambda: outputs.append(np.asarray(mobilenet(IMAGES, training=False))))
    np.testing.assert_allclose(outputs[0], np.asarray(mobilenet(IMAGES, training=False)), rtol=1e-5)
    (model,) = [s for s in run.spans if s.level == Level.MODEL]
    assert model.name == mobilenet.name and model.attrs["ml.keras.method"] == "__call__"
    assert model.attrs["ml.input.shapes"] == [[2, 32, 32, 3]] and model.attrs["ml.call.file.path"] == __file__
    layers = [s for s in run.spans if s.level == Level.LAYER]
    names = [s.name for s in layers]
    assert names == [layer.name for layer in mobilenet.layers[1:]]  # every layer once, in call order, by its Keras name
    assert all(s.attrs["ml.tf.mode"] == "eager" and s.parent_id == model.id for s in layers)
    conv = next(s for s in layers if s.name == "Conv1")
    assert conv.attrs["ml.layer.type"] == "Conv2D"
    # A functional model's layers run inside Keras: their call site is this test's line that
    # called the model; where Conv2D's call() is defined is kept apart.
    assert {(s.attrs["code.file.path"], s.attrs["code.line.number"]) for s in layers} == {
        (model.attrs["code.file.path"], model.attrs["code.line.number"])
    }
    assert model.attrs["code.file.path"] == __file__
    assert "keras" in conv.attrs["ml.defined.file.path"] and conv.attrs["ml.defined.function.name"] == "Conv2D.call"
    assert conv.attrs["ml.output.shapes"][0][1:] == list(mobilenet.get_layer("Conv1").output.shape[1:])
    by_id = run.span_by_id()
    ops = [s for s in run.spans if s.level == Level.OP]
    convs = [s for s in ops if s.name == "Conv2D"]
    assert len(convs) == sum(1 for layer in mobilenet.layers if type(layer).__name__ == "Conv2D")
    assert all(by_id[s.parent_id].attrs.get("ml.layer.type") == "Conv2D" for s in convs)
    check(run)


def test_predict_layers_from_the_profiler(tmp_path: Path, mobilenet: Any) -> None:
    run = traced(tmp_path, lambda: mobilenet.predict(IMAGES, verbose=0))
    (model,) = [s for s in run.spans if s.level == Level.MODEL]
    assert model.attrs["ml.keras.method"] == "predict"
    layers = [s for s in run.spans if s.level == Level.LAYER]
    assert layers and all(s.attrs["ml.tf.mode"] == "graph" for s in layers)
    assert {s.name for s in layers} <= {layer.name for layer in mobilenet.layers}
    assert {"Conv1", "block_16_project", "predictions"} <= {s.name for s in layers}
    by_id = run.span_by_id()
    convs = [s for s in run.spans if s.level == Level.OP and "Conv" in s.name]
    assert len(convs) == sum(1 for layer in mobilenet.layers if "Conv" in type(layer).__name__)
    assert all(by_id[s.parent_id].level == Level.LAYER for s in convs)
    outside = [s for s in run.spans if s.level == Level.OP and s.parent_id == model.id]
    info = run.meta["sources_info"]["tensorflow"]["profiles"][0]
    assert info["ops_outside_layers"] >= len([s for s in outside if "ml.tf.node" in s.attrs]) > 0
    check(run)


def test_evaluate_and_a_users_tf_function(tmp_path: Path, mobilenet: Any) -> None:
    labels = np.array([1, 2])

    @tf.function
    def serve(x: Any) -> Any:
        return mobilenet(x, training=False)

    def body() -> None:
        mobilenet.evaluate(IMAGES, labels, verbose=0)
        serve(IMAGES)

    run = traced(tmp_path, body)
    models = {s.attrs["ml.keras.method"]: s for s in run.spans if s.level == Level.MODEL}
    assert set(models) == {"evaluate", "tf.function"}
    assert models["tf.function"].name == mobilenet.name
    by_id = run.span_by_id()
    for method, model in models.items():
        mine = [s for s in run.spans if s.level == Level.LAYER and by_id[s.parent_id] is model]
        assert any(s.name == "Conv1" for s in mine), method
    check(run)


def test_eager_layer_calls_leave_no_tracked_object_until_the_flush(tmp_path: Path, mobilenet: Any) -> None:
    """Between two flushes an eager layer call leaves nothing that the cyclic garbage collector
    tracks (it used to leave a Span, its attribute dict and its shape lists: promoted to the
    oldest generation by the thousand, they brought the program's full collections sooner and
    made them longer). The calls are all in the run, with their shapes."""
    options = ProfileOptions(output=tmp_path / "run", summary=False, level=Level.LAYER, flush_interval_s=60)
    session = Session(options, sources=[TensorFlowSource()]).start()
    alive = []
    try:
        for i in range(4):  # one line: every call shares its layers' templates
            if i == 2:
                gc.collect()
                alive.append(len(gc.get_objects()))
            mobilenet(IMAGES, training=False)
        gc.collect()
        alive.append(len(gc.get_objects()))
    finally:
        path = session.stop()
    run = mltrace.load_run(path)
    layers = [s for s in run.spans if s.level == Level.LAYER]
    per_call = len(mobilenet.layers) - 1
    assert len(layers) == 4 * per_call
    assert all(s.attrs["ml.input.shapes"] and s.attrs["ml.output.shapes"] for s in layers)
    assert alive[1] - alive[0] < per_call  # two calls, 2 × per_call layer calls: not one tracked object each


def test_building_a_model_records_nothing(tmp_path: Path) -> None:
    def body() -> None:
        inp = keras.Input((4,))
        keras.Model(inp, keras.layers.Dense(2)(inp))  # symbolic calls only

    run = traced(tmp_path, body)
    assert run.spans == []


def test_model_level_only(tmp_path: Path, mobilenet: Any) -> None:
    def body() -> None:
        mobilenet(IMAGES, training=False)
        mobilenet.predict(IMAGES, verbose=0)

    run = traced(tmp_path, body, level=Level.MODEL)
    assert [(s.level, s.attrs["ml.keras.method"]) for s in run.spans] == [(Level.MODEL, "__call__"), (Level.MODEL, "predict")]
    assert "profiles" not in run.meta["sources_info"]["tensorflow"] or not run.meta["sources_info"]["tensorflow"]["profiles"]


def test_a_call_an_installed_library_makes_names_the_programs_line(tmp_path: Path, mobilenet: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model call made by an installed library (an inference helper) names the program's
    line that called the helper (docs/CONVENTIONS.md, "Call sites")."""
    infer = installed_infer(tmp_path, monkeypatch, "def infer(model, x):\n    return model(x, training=False)\n")
    lines: list[int] = []

    def body() -> None:
        lines.append(sys._getframe().f_lineno + 1)
        infer(mobilenet, IMAGES)

    run = traced(tmp_path, body, level=Level.MODEL)
    (model,) = [s for s in run.spans if s.level == Level.MODEL]
    assert (model.attrs["code.file.path"], model.attrs["code.line.number"]) == (__file__, lines[0])
    assert (model.attrs["ml.call.file.path"], model.attrs["ml.call.line.number"]) == (__file__, lines[0])


def test_the_programs_own_profiler_still_works(tmp_path: Path, mobilenet: Any) -> None:
    mine = tmp_path / "mine"

    def body() -> None:
        mobilenet(IMAGES, training=False)
        with tf.profiler.experimental.Profile(str(mine)):
            mobilenet(IMAGES, training=False)
        mobilenet.predict(IMAGES, verbose=0)

    run = traced(tmp_path, body)
    assert list(mine.glob("plugins/profile/*/*.xplane.pb"))  # the program got its profile
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert len(models) == 3
    by_id = run.span_by_id()
    ops_per_model = [sum(1 for s in run.spans if s.level == Level.OP and _root(by_id, s) is m) for m in models]
    assert ops_per_model[0] > 0 and ops_per_model[1] == 0 and ops_per_model[2] > 0  # mltrace paused meanwhile
    assert any("paused" in text for text in run.meta["limitations"])
    check(run)


def _spans_per_model(run: Run) -> list[tuple[str, int, int]]:
    """(Keras method, layer spans, op spans) of each model call, in time order."""
    by_id = run.span_by_id()
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    counts = {m.id: [0, 0] for m in models}
    for s in run.spans:
        if s.level in (Level.LAYER, Level.OP) and s.attrs.get("ml.framework") == "tensorflow":
            counts[_root(by_id, s).id][0 if s.level == Level.LAYER else 1] += 1
    return [(m.attrs["ml.keras.method"], *counts[m.id]) for m in models]


def test_the_op_level_ends_after_op_inferences(tmp_path: Path, mobilenet: Any) -> None:
    """--op-inferences 2: the profiler stops when the second model call returns; eager layer spans
    go on, and so do model spans (a predict afterwards has no graph layers: they came from the profiler)."""
    opts = ProfileOptions.build(output=tmp_path / "run", summary=False, op_inferences=2)
    session = Session(opts, sources=[TensorFlowSource()]).start()
    try:
        for _ in range(3):
            mobilenet(IMAGES, training=False)
        mobilenet.predict(IMAGES, verbose=0)
    finally:
        session.stop()
    run = mltrace.load_run(tmp_path / "run")
    window = run.meta["op_window"]
    assert window["ended_after_model_calls"] == 2 and window["sources"] == ["tensorflow"]
    per_model = _spans_per_model(run)
    layers = len(mobilenet.layers) - 1
    assert [(m, n) for m, n, _ in per_model] == [("__call__", layers)] * 3 + [("predict", 0)]
    ops = [o for _, _, o in per_model]
    assert ops[0] > 0 and ops[1] > 0 and ops[2:] == [0, 0]
    assert any("TensorFlow's graph-mode layer spans" in x for x in run.meta["limitations"])
    check(run)


def test_the_span_limit_ends_the_op_level_then_the_layer_level(tmp_path: Path, mobilenet: Any) -> None:
    """--max-spans N counts the spans as they are recorded (no flush here): one call's eager layer
    spans pass 1.5 N, so its return ends the op level, then the layer level; later calls are
    model spans only (short of 2 N, where the trace would be full)."""
    layers = len(mobilenet.layers) - 1
    limit = (layers + 1) * 2 // 3  # one call records its layers and its model span: at least 1.5 N
    opts = ProfileOptions.build(output=tmp_path / "run", summary=False, max_spans=limit, flush_interval_s=60)
    session = Session(opts, sources=[TensorFlowSource()]).start()
    try:
        assert session.layer_window is not None
        mobilenet(IMAGES, training=False)  # its return ends the op level, then the layer level
        assert session.layer_window.ended_ns is not None
        mobilenet(IMAGES, training=False)
        mobilenet(IMAGES, training=False)
        mobilenet.predict(IMAGES, verbose=0)
        assert not session.full
    finally:
        session.stop()
    run = mltrace.load_run(tmp_path / "run")
    layer_window, op_window = run.meta["layer_window"], run.meta["op_window"]
    assert layer_window["ended_after_model_calls"] == 1 and layer_window["sources"] == ["tensorflow"]
    assert op_window["ended_after_model_calls"] == 1 and op_window["ended_ns"] < layer_window["ended_ns"]
    assert op_window["reason"].endswith(f"spans recorded, --max-spans {limit}")
    assert "frameworks" not in op_window or list(op_window["frameworks"]) == ["tensorflow"]
    per_model = _spans_per_model(run)
    assert [(n, o > 0) for _, n, o in per_model] == [(layers, True), (0, False), (0, False), (0, False)]
    check(run)


def _root(by_id: dict[int, Any], s: Any) -> Any:
    while s.parent_id is not None:
        s = by_id[s.parent_id]
    return s


_REGISTERED = """
import sys
import mltrace.tracer.sources as sources
from mltrace.tracer.sources.tensorflow import TensorFlowSource
if not any(isinstance(s, TensorFlowSource) for s in sources.default_sources()):
    _default = sources.default_sources
    sources.default_sources = lambda options=None: [*_default(options), TensorFlowSource()]
from mltrace.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_cli_runs_the_keras_example(tmp_path: Path) -> None:
    """``mltrace python examples/keras_infer.py`` (with TensorFlowSource among the default sources)."""
    args = [str(REPO / "examples" / "keras_infer.py"), "--iters", "2", "--image-size", "64"]
    plain = subprocess.run([sys.executable, *args], capture_output=True, timeout=300, cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr.decode()
    traced_run = subprocess.run(
        [sys.executable, "-c", _REGISTERED, "python", "-o", str(tmp_path / "run"), *args], capture_output=True, timeout=300, cwd=tmp_path
    )
    assert traced_run.returncode == 0, traced_run.stderr.decode()
    lines = [line.split(",")[0] for line in traced_run.stdout.decode().splitlines()]
    assert lines == [line.split(",")[0] for line in plain.stdout.decode().splitlines()]  # same classes, no verbose lines leaked
    run = mltrace.load_run(tmp_path / "run")
    assert run.complete and run.meta["exit_status"] == 0
    methods = sorted(s.attrs["ml.keras.method"] for s in run.spans if s.level == Level.MODEL)
    assert methods == ["__call__", "__call__", "predict", "predict"]
    check(run)
    if "cpu.library" in run.meta["levels"]["library"]["sources"]:
        by_id = run.span_by_id()
        calls = [s for s in run.spans if s.level == Level.LIBRARY and s.attrs.get("ml.library.name") == "oneDNN"]
        assert calls and all(by_id[s.parent_id].attrs.get("ml.framework") == "tensorflow" for s in calls if s.parent_id is not None)
