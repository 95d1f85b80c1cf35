"""The ONNX Runtime source, live: real models exported from PyTorch, run in ORT.

A small ResNet from examples/models.py is exported once per module with
``torch.onnx.export`` (the dynamo exporter, torch's default, and the
TorchScript one), then run by ``onnxruntime.InferenceSession`` inside an
in-process session with graph optimisations off and on. One test goes through
the command line as a user would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch

import mltrace
from mltrace.config import ProfileOptions
from mltrace.formats.ort_profile import line_up_by_module_path
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.tracer.session import Session
from mltrace.tracer.sources.onnxruntime import OrtSource
from mltrace.tracer.sources.torch_modules import TorchModuleSource
from support.installed import installed_infer
from support.reference_breakdown import breakdown

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
from models import ResNet  # noqa: E402

IMAGE = np.random.default_rng(0).standard_normal((1, 3, 32, 32), dtype=np.float32)
OPT = {"off": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A small ResNet and its ONNX exports (dynamo and TorchScript exporters)."""
    torch.manual_seed(0)
    model = ResNet(widths=(4, 8, 16, 32), num_classes=10).eval()
    out = tmp_path_factory.mktemp("onnx")
    x = torch.from_numpy(IMAGE)
    torch.onnx.export(model, (x,), str(out / "dynamo.onnx"), dynamo=True, external_data=False)
    torch.onnx.export(model, (x,), str(out / "legacy.onnx"), dynamo=False, input_names=["x"])
    return {"model": model, "dynamo": out / "dynamo.onnx", "legacy": out / "legacy.onnx"}


@pytest.fixture(autouse=True)
def ort_unpatched() -> Iterator[None]:
    """Fails a test that leaves ONNX Runtime patched."""
    from onnxruntime.capi import onnxruntime_inference_collection as oic

    before = (oic.InferenceSession.__init__, oic.Session.run, oic.Session.run_with_iobinding, oic.Session.end_profiling)
    yield
    after = (oic.InferenceSession.__init__, oic.Session.run, oic.Session.run_with_iobinding, oic.Session.end_profiling)
    assert after == before, "ONNX Runtime was left patched"


def traced(tmp_path: Path, body: Any, sources: list[Any] | None = None, level: Level | None = None) -> Run:
    session = Session(ProfileOptions(output=tmp_path / "run", summary=False, level=level), sources=sources or [OrtSource()]).start()
    try:
        body()
    finally:
        path = session.stop()
    return mltrace.load_run(path)


def check_hierarchy(run: Run) -> None:
    """Nodes under the torch modules they came from (or the model span), modules under their
    parent module or the model span, kernels under nodes, every child inside its parent."""
    by_id = run.span_by_id()
    for s in run.spans:
        if s.level == Level.LAYER and s.attrs.get("ml.framework") == "onnxruntime":
            assert s.parent_id is not None, s
            parent = by_id[s.parent_id]
            assert parent.level == Level.MODEL or parent.attrs.get("ml.ort.module"), s
            if parent.level == Level.LAYER:
                assert s.name.startswith(parent.name + ".") or s.attrs.get("ml.torch.module_path") == parent.name, s
        if s.level == Level.OP and s.attrs.get("ml.framework") == "onnxruntime":
            assert by_id[s.parent_id].level == Level.LAYER, s  # every op lies in a layer (graph node)
    facts = run.meta["correlation"]["check_containment"]
    assert facts["outside_parent"] == 0 and facts["missing_parent"] == 0, facts


@pytest.mark.parametrize("opt", ["off", "all"])
def test_model_node_and_kernel_spans(tmp_path: Path, exported: dict[str, Any], opt: str) -> None:
    options = ort.SessionOptions()
    options.graph_optimization_level = OPT[opt]
    results: list[Any] = []

    def body() -> None:
        sess = ort.InferenceSession(str(exported["dynamo"]), options, providers=["CPUExecutionProvider"])
        for _ in range(2):
            results.append(sess.run(None, {"x": IMAGE})[0])
        results.append(sess.end_profiling())

    run = traced(tmp_path, body)
    plain = ort.InferenceSession(str(exported["dynamo"]), options, providers=["CPUExecutionProvider"]).run(None, {"x": IMAGE})[0]
    np.testing.assert_array_equal(results[0], plain)  # tracing does not change what the model computes
    assert results[2] == ""  # as in a plain run without profiling
    assert (options.enable_profiling, options.profile_file_prefix) == (False, "onnxruntime_profile_")  # caller's options untouched
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert [m.name for m in models] == ["ResNet", "ResNet"]
    assert [m.attrs["ml.model.invocation"] for m in models] == [1, 2]
    m = models[0]
    assert m.attrs["ml.framework"] == "onnxruntime" and m.attrs["ml.ort.provider"] == "CPUExecutionProvider"
    assert m.attrs["ml.input.shapes"] == [[1, 3, 32, 32]] and m.attrs["ml.input.dtypes"] == ["float32"]
    assert m.attrs["ml.call.file.path"] == __file__
    nodes = [s for s in run.spans if s.level == Level.LAYER and not s.attrs.get("ml.ort.module")]
    kernels = [s for s in run.spans if s.level == Level.OP]
    assert nodes and len(nodes) == len(kernels)
    by_id = run.span_by_id()

    def model_of(span: Any) -> int:
        while span.level != Level.MODEL:
            span = by_id[span.parent_id]
        return int(span.id)

    assert {model_of(s) for s in nodes} == {m.id for m in models}  # both runs profiled
    check_hierarchy(run)
    # Every node knows its torch module; unoptimised, straight from the exporter's metadata.
    assert all("ml.torch.module_path" in s.attrs for s in nodes)
    hows = {s.attrs["ml.torch.mapping"] for s in nodes}
    assert hows == {"metadata", "parameter"} if opt == "off" else "fused" in hows
    modules = {n for n, _ in exported["model"].named_modules()}
    assert {s.attrs["ml.torch.module_path"] for s in nodes} <= modules
    info = run.meta["sources_info"]["onnxruntime"]["sessions"][0]
    assert info["runs_matched"] == 2 and info["node_spans"] == len(nodes) and not info["truncated"]
    user = sorted(s.name for s in run.spans if s.level == Level.USER)
    assert user == ["onnxruntime model_loading_uri", "onnxruntime session_initialization"]


def test_lines_up_with_the_pytorch_run(tmp_path: Path, exported: dict[str, Any]) -> None:
    """The torch model and its ORT export in one run: ORT nodes name the torch layers that exist."""
    model = exported["model"]

    def body() -> None:
        with torch.inference_mode():
            model(torch.from_numpy(IMAGE))
        sess = ort.InferenceSession(str(exported["legacy"]), providers=["CPUExecutionProvider"])
        sess.run(None, {"x": IMAGE})

    run = traced(tmp_path, body, sources=[TorchModuleSource(), OrtSource()])
    torch_layers = {s.name for s in run.spans if s.level == Level.LAYER and s.attrs.get("ml.framework") == "pytorch"}
    ort_nodes = [
        s for s in run.spans if s.level == Level.LAYER and s.attrs.get("ml.framework") == "onnxruntime" and not s.attrs.get("ml.ort.module")
    ]
    paths = {s.attrs["ml.torch.module_path"] for s in ort_nodes}
    assert "layer1.0.conv1" in paths and "layer1.0.conv1" in torch_layers
    assert paths - {""} <= torch_layers
    models = sorted((s.name, s.attrs["ml.framework"]) for s in run.spans if s.level == Level.MODEL)
    assert models == [("ResNet", "pytorch"), ("legacy", "onnxruntime")]  # the TorchScript export has no class metadata
    check_hierarchy(run)
    rows = {r.module_path: r for r in line_up_by_module_path(run.spans, depth=2)}
    for path in ("layer1", "layer1.0", "layer4.1", "fc"):
        assert rows[path].torch_ns > 0 and rows[path].ort_ns > 0, rows[path]
    assert rows[""].ort_nodes == len(ort_nodes)


def test_model_level_only_does_not_profile(tmp_path: Path, exported: dict[str, Any]) -> None:
    def body() -> None:
        sess = ort.InferenceSession(str(exported["dynamo"]), providers=["CPUExecutionProvider"])
        sess.run(None, {"x": IMAGE})
        assert sess.get_session_options().enable_profiling is False

    run = traced(tmp_path, body, level=Level.MODEL)
    assert [s.level for s in run.spans] == [Level.MODEL]


def test_sessions_made_before_and_destroyed_during_tracing(tmp_path: Path, exported: dict[str, Any]) -> None:
    early = ort.InferenceSession(str(exported["legacy"]), providers=["CPUExecutionProvider"])

    def body() -> None:
        early.run(None, {"x": IMAGE})
        short_lived = ort.InferenceSession(str(exported["dynamo"]), providers=["CPUExecutionProvider"])
        short_lived.run(None, {"x": IMAGE})
        del short_lived  # ORT writes its profile from the destructor

    run = traced(tmp_path, body)
    by_model: dict[str, list[Level]] = {}
    by_id = run.span_by_id()
    for s in run.spans:
        root = s
        while root.parent_id is not None:
            root = by_id[root.parent_id]
        by_model.setdefault(root.name, []).append(s.level)
    assert by_model["legacy"] == [Level.MODEL]  # made before tracing: not profiled
    assert {Level.MODEL, Level.LAYER, Level.OP} <= set(by_model["ResNet"])


def test_profiling_enabled_by_the_program(tmp_path: Path, exported: dict[str, Any]) -> None:
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "mine")
    paths: list[str] = []

    def body() -> None:
        sess = ort.InferenceSession(str(exported["dynamo"]), options, providers=["CPUExecutionProvider"])
        sess.run(None, {"x": IMAGE})
        paths.append(sess.end_profiling())

    run = traced(tmp_path, body)
    assert paths[0].startswith(str(tmp_path / "mine")) and os.path.exists(paths[0])  # the program's file, left in place
    assert any(s.level == Level.LAYER for s in run.spans)
    check_hierarchy(run)


def _per_run(run: Run) -> list[tuple[int, int]]:
    """(node spans, kernel spans) under each model span, in time order."""
    by_id = run.span_by_id()
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    counts = {m.id: [0, 0] for m in models}
    for s in run.spans:
        if s.level in (Level.LAYER, Level.OP):
            root = s
            while root.parent_id is not None:
                root = by_id[root.parent_id]
            assert root.id in counts, s  # every node and kernel lies in a model span
            counts[root.id][0 if s.level == Level.LAYER else 1] += 1
    return [(counts[m.id][0], counts[m.id][1]) for m in models]


def test_profiling_ends_after_op_inferences(tmp_path: Path, exported: dict[str, Any]) -> None:
    """--op-inferences 2: every live session ends its profiling when the second run returns, and a
    session made afterwards is not profiled; model spans go on. The program's results are unchanged."""
    opts = ProfileOptions.build(output=tmp_path / "run", summary=False, op_inferences=2)
    session = Session(opts, sources=[OrtSource()]).start()
    outputs = []
    try:
        sess = ort.InferenceSession(str(exported["dynamo"]), providers=["CPUExecutionProvider"])
        for _ in range(3):
            outputs.append(sess.run(None, {"x": IMAGE})[0])
        later = ort.InferenceSession(str(exported["dynamo"]), providers=["CPUExecutionProvider"])
        outputs.append(later.run(None, {"x": IMAGE})[0])
        assert later.get_session_options().enable_profiling is False
        assert sess.end_profiling() == ""  # as in a plain run
    finally:
        session.stop()
    assert all(np.array_equal(o, outputs[0]) for o in outputs)
    run = mltrace.load_run(tmp_path / "run")
    assert run.meta["op_window"]["ended_after_model_calls"] == 2 and run.meta["op_window"]["sources"] == ["onnxruntime"]
    per_run = _per_run(run)
    assert len(per_run) == 4 and all(n > 0 and k > 0 for n, k in per_run[:2]) and per_run[2:] == [(0, 0), (0, 0)]
    assert any("ONNX Runtime's layer spans come from the profiler" in x for x in run.meta["limitations"])
    check_hierarchy(run)


def test_profiling_ends_while_other_threads_run_the_same_session(tmp_path: Path, exported: dict[str, Any]) -> None:
    """The run whose return ends the op level ends profiling on its own thread while three others
    are inside ``run`` on the same session: ORT takes it, every result is right, and a call counts
    as having kernels only if it ended before the end."""
    opts = ProfileOptions.build(output=tmp_path / "run", summary=False, op_inferences=12)
    session = Session(opts, sources=[OrtSource()]).start()
    results: list[np.ndarray] = []
    failures: list[BaseException] = []
    try:
        sess = ort.InferenceSession(str(exported["dynamo"]), providers=["CPUExecutionProvider"])
        expected = sess.run(None, {"x": IMAGE})[0]
        start = threading.Barrier(4)

        def worker() -> None:
            try:
                start.wait()  # all four run together from the first call
                for _ in range(25):
                    results.append(sess.run(None, {"x": IMAGE})[0])
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                failures.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        session.stop()
    assert not failures and len(results) == 100
    assert all(np.array_equal(r, expected) for r in results)
    run = mltrace.load_run(tmp_path / "run")
    window = run.meta["op_window"]
    assert window["ended_after_model_calls"] >= 12 and window["sources"] == ["onnxruntime"]
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert len(models) == 101
    per_call = _per_run(run)[0][1]  # the first run, before the threads
    kernels = [s for s in run.spans if s.level == Level.OP]
    assert per_call > 0 and len(kernels) < 50 * per_call  # profiling ended: runs after it have none
    # The analysis counts the calls that ended before the end as the calls with kernels.
    with_ops = sum(1 for m in models if m.end_ns <= window["ended_ns"])
    assert breakdown(run).calls_for(Level.OP) == with_ops >= 12
    check_hierarchy(run)
    # So the nodes and kernels are those of exactly these calls, each whole, on its own thread:
    # a call in flight at the end (nodes but no model_run) or ended after it has none.
    counts = _per_run(run)
    in_time = [c for c, m in zip(counts, sorted(models, key=lambda s: s.start_ns)) if c != (0, 0) or m.end_ns <= window["ended_ns"]]
    assert in_time == [counts[0]] * with_ops
    by_id = run.span_by_id()
    for s in run.spans:
        if s.level in (Level.LAYER, Level.OP):
            root = s
            while root.parent_id is not None:
                root = by_id[root.parent_id]
            assert root.level == Level.MODEL and root.track_id == s.track_id and root.end_ns <= window["ended_ns"], s


def test_the_span_limit_ends_profiling_without_a_warning(
    tmp_path: Path, exported: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """ONNX Runtime's node spans come from its profiler: at --max-spans it ends as the op level
    does, so no 'cannot end' warning; the run after the limit is the last with nodes."""
    opts = ProfileOptions.build(output=tmp_path / "run", summary=False, max_spans=2, flush_interval_s=60)
    session = Session(opts, sources=[OrtSource()]).start()
    try:
        sess = ort.InferenceSession(str(exported["dynamo"]), providers=["CPUExecutionProvider"])
        sess.run(None, {"x": IMAGE})
        sess.run(None, {"x": IMAGE})  # two model spans recorded (none streamed yet): its return ends profiling
        sess.run(None, {"x": IMAGE})
        sess.run(None, {"x": IMAGE})
    finally:
        session.stop()
    assert "cannot end" not in capsys.readouterr().err
    run = mltrace.load_run(tmp_path / "run")
    assert run.meta["op_window"]["reason"] == "2 spans recorded, --max-spans 2"
    assert [n > 0 for n, _ in _per_run(run)] == [True, True, False, False]


def test_a_full_trace_stops_recording_runs(tmp_path: Path, exported: dict[str, Any]) -> None:
    opts = ProfileOptions.build(output=tmp_path / "run", summary=False, level=Level.MODEL, max_spans=1, flush_interval_s=60)
    session = Session(opts, sources=[OrtSource()]).start()
    try:
        sess = ort.InferenceSession(str(exported["dynamo"]), providers=["CPUExecutionProvider"])
        sess.run(None, {"x": IMAGE})
        sess.run(None, {"x": IMAGE})
        session.flush()  # two model spans: twice the limit
        assert session.full
        sess.run(None, {"x": IMAGE})
    finally:
        session.stop()
    run = mltrace.load_run(tmp_path / "run")
    assert [s.level for s in run.spans] == [Level.MODEL, Level.MODEL] and run.meta["trace_full"]["spans"] == 2


def test_iobinding_runs_are_model_spans(tmp_path: Path, exported: dict[str, Any]) -> None:
    def body() -> None:
        sess = ort.InferenceSession(str(exported["dynamo"]), providers=["CPUExecutionProvider"])
        binding = sess.io_binding()
        binding.bind_cpu_input("x", IMAGE)
        binding.bind_output(sess.get_outputs()[0].name)
        sess.run_with_iobinding(binding)

    run = traced(tmp_path, body)
    model = next(s for s in run.spans if s.level == Level.MODEL)
    assert model.attrs["ml.ort.method"] == "run_with_iobinding"
    assert any(s.parent_id == model.id and s.level == Level.LAYER for s in run.spans)


def test_a_run_an_installed_library_makes_names_the_programs_line(
    tmp_path: Path, exported: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model call made by an installed library (an inference helper calling ``run``) names
    the program's line that called the helper (docs/CONVENTIONS.md, "Call sites")."""
    infer = installed_infer(tmp_path, monkeypatch, "def infer(sess, feed):\n    return sess.run(None, feed)\n")
    lines: list[int] = []

    def body() -> None:
        sess = ort.InferenceSession(str(exported["legacy"]), providers=["CPUExecutionProvider"])
        lines.append(sys._getframe().f_lineno + 1)
        infer(sess, {"x": IMAGE})

    run = traced(tmp_path, body, level=Level.MODEL)
    (model,) = [s for s in run.spans if s.level == Level.MODEL]
    assert (model.attrs["code.file.path"], model.attrs["code.line.number"]) == (__file__, lines[0])
    assert (model.attrs["ml.call.file.path"], model.attrs["ml.call.line.number"]) == (__file__, lines[0])


_NO_ORT_SESSION = """
import sys
from pathlib import Path
from mltrace.config import ProfileOptions
from mltrace.tracer.session import Session
from mltrace.tracer.sources.onnxruntime import OrtSource

source = OrtSource()
session = Session(ProfileOptions(output=Path(sys.argv[1]), summary=False), sources=[source]).start()
session.stop()
print(source in session.started, "mltrace.formats.ort_profile" in sys.modules)
"""


def test_a_stop_without_an_ort_session_does_not_load_the_profile_converter(tmp_path: Path) -> None:
    """A session that ran no ONNX Runtime session has no profile to convert: its stop (a forked
    child's too, at its exit) does not import the converter."""
    res = subprocess.run([sys.executable, "-c", _NO_ORT_SESSION, str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "False"]


_REGISTERED = """
import sys
import mltrace.tracer.sources as sources
from mltrace.tracer.sources.onnxruntime import OrtSource
from mltrace.formats.ort_profile import line_up_by_module_path
if not any(isinstance(s, OrtSource) for s in sources.default_sources()):
    _default = sources.default_sources
    sources.default_sources = lambda options=None: [*_default(options), OrtSource()]
from mltrace.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_cli_runs_the_ort_example(tmp_path: Path) -> None:
    """``mltrace python examples/ort_infer.py`` (with OrtSource among the default sources)."""
    script = REPO / "examples" / "ort_infer.py"
    args = [str(script), "--iters", "2", "--image-size", "64", "--exporter", "legacy", "--cache", str(tmp_path / "cache")]
    plain = subprocess.run([sys.executable, *args], capture_output=True, timeout=300, cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr.decode()
    traced_run = subprocess.run(
        [sys.executable, "-c", _REGISTERED, "python", "-o", str(tmp_path / "run"), *args],
        capture_output=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert traced_run.returncode == 0, traced_run.stderr.decode()
    assert [line.split(",")[0] for line in traced_run.stdout.decode().splitlines()] == [
        line.split(",")[0] for line in plain.stdout.decode().splitlines() if not line.startswith("exported")
    ]
    run = mltrace.load_run(tmp_path / "run")
    assert run.complete and run.meta["exit_status"] == 0
    assert run.meta["levels"]["layer"]["recorded"] and "onnxruntime" in run.meta["levels"]["layer"]["sources"]
    nodes = [s for s in run.spans if s.level == Level.LAYER and s.attrs.get("ml.framework") == "onnxruntime"]
    assert any(s.attrs.get("ml.torch.module_path") == "layer1.0.conv1" for s in nodes)
    check_hierarchy(run)
