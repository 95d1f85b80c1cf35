"""The DataFrame API on a real run and on an imported GPU trace."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import mltrace
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.frames import load_frames
from mltrace.analysis.peaks import Peaks, PeakSet
from mltrace.importers.kineto import import_kineto
from mltrace.run.events import TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run

pd = pytest.importorskip("pandas")
KINETO = Path(__file__).resolve().parents[1] / "data" / "kineto"


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Sequential(nn.Linear(8 * 14 * 14, 10), nn.Softmax(-1))).eval()
    out = tmp_path_factory.mktemp("frames") / "run"
    with torch.inference_mode(), mltrace.profile(output=out, summary=False):
        for _ in range(2):
            model(torch.randn(2, 3, 16, 16))
    return mltrace.load_run(out)


def nearest_layer(run: Run, span_id: int) -> str | None:
    by_id = run.span_by_id()
    cur = by_id.get(span_id)
    while cur is not None:
        if cur.level in (Level.MODEL, Level.LAYER):
            return cur.name
        cur = by_id.get(cur.parent_id) if cur.parent_id is not None else None
    return None


def test_spans_and_layers(real_run: Run) -> None:
    f = load_frames(real_run)
    assert len(f.spans) == len(real_run.spans)
    assert Counter(f.spans.level) == Counter(s.level.label for s in real_run.spans)
    assert set(f.spans.columns) >= {"id", "parent_id", "level", "name", "start_ns", "end_ns", "dur_ns", "self_ns", "layer", "op", "attrs"}
    assert (f.spans.dur_ns == f.spans.end_ns - f.spans.start_ns).all()
    layers = [s for s in real_run.spans if s.level in (Level.MODEL, Level.LAYER)]
    assert len(f.layers) == len(layers)
    a = analyze(real_run)
    by_path = f.layers.groupby("path").self_ns.sum().to_dict()
    assert by_path == {r.stat.name: r.stat.self_ns for r in a.layers}
    conv = f.layers[f.layers.path == "0"].iloc[0]
    assert conv.type == "Conv2d" and conv.input_shapes == [[2, 3, 16, 16]] and conv.parent_layer == "Sequential"
    assert conv.file == __file__ and conv.line > 0  # the call site, in this test's model
    assert str(conv.defined_file).endswith("torch/nn/modules/conv.py") and conv.defined_line > 0


def test_ops_know_their_layer(real_run: Run) -> None:
    f = load_frames(real_run)
    ops = [s for s in real_run.spans if s.level is Level.OP]
    if not ops:
        pytest.skip("op level not recorded on this machine (torch.profiler source unavailable)")
    assert len(f.ops) == len(ops)
    expected = {s.id: nearest_layer(real_run, s.id) for s in ops}
    got = {i: (None if pd.isna(layer) else layer) for i, layer in zip(f.ops.id, f.ops.layer)}
    assert got == expected
    assert f.ops.top_level.any()
    conv_ops = f.ops[f.ops.layer_type == "Conv2d"]
    assert len(conv_ops) > 0


def test_layer_stats_with_verdicts(real_run: Run) -> None:
    f = load_frames(real_run, peaks=PeakSet(Peaks("cpu", "test", 100e9, 10e9, "assumed")))
    stats = f.layer_stats.set_index("name")
    assert stats.loc["0", "type"] == "Conv2d" and stats.loc["0", "calls"] == 2
    assert set(f.layer_stats.verdict) <= {"compute", "memory", "overhead", "unknown"}
    assert f.layer_stats.verdict.notna().all()


def test_kernels_of_an_imported_gpu_trace(tmp_path: Path) -> None:
    run = mltrace.load_run(import_kineto(KINETO / "a100_triton_kernel.json.gz", tmp_path / "triton"))
    f = load_frames(tmp_path / "triton")  # a path works too
    gpu = [s for s in run.spans if s.level is Level.KERNEL and run.tracks[s.track_id].kind == TrackKind.GPU_STREAM]
    assert len(f.kernels) == len(gpu) > 0
    assert set(f.kernels.device) == {run.tracks[s.track_id].device for s in gpu}
    launched = {fl.to_span for fl in run.flows if fl.kind == "launch"}
    with_op = f.kernels[f.kernels.id.isin(launched)]
    assert with_op.op.notna().all()


def test_analysis_modules_import_no_pandas() -> None:
    code = (
        "import sys, mltrace.analysis.frames, mltrace.analysis.bottleneck, mltrace.analysis.diff, "
        "mltrace.viewers.html, mltrace.viewers.terminal, mltrace.viewers.perfetto_ui; "
        "bad = [m for m in ('pandas', 'torch', 'numpy', 'matplotlib') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
