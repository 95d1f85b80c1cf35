"""The ops torch.compile runs while it compiles (TorchDynamo tracing on fake tensors,
AOTAutograd, Inductor; ``run/ranges.py``) are compile time, not the model's work: the report
counts them apart and leaves them out of the op tables, FLOPs, ops per call and data
movement; the trace keeps them."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

import mltrace
from analysis.schema_check import errors
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.peaks import Peaks, PeakSet
from mltrace.analysis.report_data import build_report
from mltrace.analysis.report_schema import REPORT_SCHEMA
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.ranges import is_compile_range, torch_range_kind, wraps_compile_range
from mltrace.run.store import Run
from mltrace.viewers.markdown import render_markdown
from mltrace.viewers.terminal import render_report

CPU = PeakSet(Peaks("cpu", "test CPU", 100e9, 10e9, "assumed"))
M, OP = Level.MODEL, Level.OP
INNER = "_compile.compile_inner (dynamo_timed)"


def test_compile_range_names() -> None:
    assert is_compile_range(INNER) and is_compile_range("CachingAutotuner.benchmark_all_configs (dynamo_timed)")
    assert not is_compile_range("guard_collective (dynamo_timed)")  # runs with every call
    for runtime in ("Torch-Compiled Region: 0/0", "TorchDynamo Cache Lookup", "aten::addmm", "dynamo"):
        assert not is_compile_range(runtime)
    assert wraps_compile_range("entire_frame_compile", INNER) and wraps_compile_range("dynamo", INNER)
    assert wraps_compile_range("build_guards", "build_guards (dynamo_timed)")
    assert not wraps_compile_range("Torch-Compiled Region: 0/0", INNER)


def _op(sid: int, parent: int, name: str, start: int, end: int, flops: float | None = None) -> Span:
    attrs: dict[str, object] = {"ml.op.name": name}
    if flops is not None:
        attrs["ml.flops"] = flops
    return Span(sid, parent, OP, name, start, end, 1, attrs)


def _run() -> Run:
    """A compiled model called once: its call (0–10,000) compiles (1,000–8,000: torch's wrappers
    around the compile range, with a fake-tensor addmm and copy inside), then runs the compiled
    code (8,500–9,500: the real addmm and copy). A compile outside every model call
    (20,000–21,000) holds one op."""
    return Run(
        path=Path("hand-made"),
        meta={"name": "hand-made", "complete": True},
        tracks={1: Track(1, TrackKind.THREAD, "MainThread", 10, 10)},
        spans=[
            Span(1, None, M, "OptimizedModule", 0, 10_000, 1, {"ml.layer.type": "OptimizedModule"}),
            _op(2, 1, "dynamo", 1_000, 8_000),
            _op(3, 2, "entire_frame_compile", 1_100, 7_900),
            _op(4, 3, INNER, 1_200, 7_800),
            _op(5, 4, "PythonDispatchMode", 2_000, 5_000),
            _op(6, 5, "aten::addmm", 2_100, 4_900, flops=1e6),
            _op(7, 4, "aten::copy_", 5_100, 5_300),
            _op(8, 1, "Torch-Compiled Region: 0/0", 8_500, 9_500),
            _op(9, 8, "aten::addmm", 8_600, 9_000, flops=1e6),
            _op(10, 8, "aten::copy_", 9_100, 9_200),
            _op(11, None, INNER, 20_000, 21_000),
            _op(12, 11, "aten::empty", 20_100, 20_200),
        ],
    )


def test_compile_time_ops_are_counted_apart() -> None:
    run = _run()
    a = analyze(run, CPU)
    assert {r.name for r in a.ops} == {"Torch-Compiled Region: 0/0", "aten::addmm", "aten::copy_"}
    ops = {r.name: r for r in a.ops}
    assert (ops["aten::addmm"].calls, ops["aten::addmm"].flops, ops["aten::addmm"].total_ns) == (1, 1e6, 400)
    assert ops["aten::copy_"].calls == 1
    assert a.compile_ops == (6, 7_000)  # dynamo, its wrapper, the range and the three spans inside; the outermost's time
    assert a.compile_text() == (
        "6 ops ran while torch.compile compiled (0.01 ms: TorchDynamo tracing, AOTAutograd, Inductor), "
        "left out of the op, library and kernel tables, FLOPs and data movement"
    )
    (model,) = a.layers
    assert model.flops == 1e6 and model.op_count == 1  # the compiled code's work alone
    assert set(model.stat.ops) == {"Torch-Compiled Region: 0/0"}
    assert model.framework_ns == 10_000 - 7_000 - 1_000  # compiling is not framework overhead
    assert a.findings.data_movement_ns == 100 and a.findings.data_movement_base_ns == 1_000
    assert a.unscoped_ops == (2, 1_000) and a.unscoped_ops_compile == 2
    assert "; 2 of them torch.compile compiling" in a.unscoped_text()
    assert len(run.spans) == 12  # the trace keeps them
    report = build_report(run, a)
    assert report["run"]["compile_ops"] == {"count": 6, "ns": 7_000, "text": a.compile_text()}
    assert errors(report, REPORT_SCHEMA) == []
    assert f"_{a.compile_text()}_" in render_markdown(report)
    out = io.StringIO()
    render_report(run, a, file=out, width=400)
    assert a.compile_text() in " ".join(out.getvalue().split())  # the terminal may wrap the line


def test_a_run_without_compiling_has_no_compile_note() -> None:
    run = _run()
    run = Run(path=run.path, meta=run.meta, tracks=run.tracks, spans=[s for s in run.spans if s.id in (1, 8, 9, 10)])
    a = analyze(run, CPU)
    assert a.compile_ops == (0, 0) and a.compile_text() == ""


def test_a_compiled_model_called_once_has_the_eager_models_ops(tmp_path: Path) -> None:
    """A model called once has no steady state, so its call, compile and all, is in the tables:
    its ops must be the eager model's, one call each, with the eager FLOPs."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch._dynamo")
    from torch import nn

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    compiled = torch.compile(eager, backend="eager")
    x = torch.randn(16, 64)
    with mltrace.profile(output=tmp_path / "run", summary=False, level="op"), torch.no_grad():
        compiled(x)
    run = mltrace.load_run(tmp_path / "run")
    assert any(is_compile_range(s.name) for s in run.spans), "torch no longer marks its compile time: this test checks nothing"
    a = analyze(run, CPU, include_cold=False)
    (model,) = a.cold.models
    assert model.name == "Sequential (compiled)" and model.cold == []  # called once: steady
    ops = {r.name: r for r in a.ops}
    assert not [name for name in ops if is_compile_range(name) or name in ("dynamo", "PythonDispatchMode")]
    addmm = 2 * (16 * 64 * 64 + 16 * 64 * 8)
    assert (ops["aten::addmm"].calls, ops["aten::addmm"].flops) == (2, addmm)  # not the traced fake-tensor calls too
    assert (ops["aten::relu"].calls, ops["aten::relu"].flops) == (1, 16 * 64)  # an activation: 1 FLOP an element
    count, ns = a.compile_ops
    assert count > 10 and ns > 0
    (row,) = [r for r in a.layers if r.stat.name == "Sequential (compiled)"]
    assert row.flops == addmm + 16 * 64 and ns < row.stat.total_ns
    # torch.compile's region and cache lookup (recorded as ops) are torch's ranges: not ops,
    # and seen through, so the model's own ops are its top ops.
    assert not [name for name in ops if torch_range_kind(name)]
    assert a.torch_ranges["torch.compile"][0] >= 2
    assert {"aten::linear", "aten::relu"} <= set(row.stat.ops)
    torch._dynamo.reset()
