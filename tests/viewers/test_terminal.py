"""Terminal rendering of the report and of a diff (what the user reads)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

import mltrace
from conftest import run_cli
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.codepaths import location
from mltrace.analysis.diff import diff_runs
from mltrace.analysis.peaks import Peaks, PeakSet, gpu_peaks
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.viewers.terminal import fmt_si, render_diff, render_report

PEAKS = PeakSet(Peaks("cpu", "test CPU", 100e9, 10e9, "assumed"))
M, L, OP, LIB, K = Level.MODEL, Level.LAYER, Level.OP, Level.LIBRARY, Level.KERNEL


def hand_run() -> Run:
    fc = {
        "ml.layer.type": "Linear",
        "ml.layer.params": 4096 * 4096,
        "ml.input.shapes": [[4096, 4096]],
        "ml.output.shapes": [[4096, 4096]],
        "ml.input.dtypes": ["float32"],
        "code.file.path": "/src/net.py",
        "code.line.number": 7,
    }
    spans = [
        Span(1, None, M, "Net", 0, 3_000_000_000, 1, {"ml.layer.type": "Net"}),
        Span(2, 1, L, "fc", 0, 2_000_000_000, 1, fc),  # 137 GFLOP in 2 s at 100 GFLOP/s peak: compute-bound
        Span(3, 2, OP, "aten::linear", 10, 1_999_000_000, 1, {"ml.flops": 2 * 4096**3}),
        Span(4, 3, LIB, "MKL SGEMM", 20, 1_998_000_000, 1, {"ml.library.name": "MKL"}),
        Span(
            5,
            1,
            L,
            "act",
            2_000_000_000,
            2_100_000_000,
            1,
            {"ml.layer.type": "ReLU", "ml.input.shapes": [[1024]], "ml.output.shapes": [[1024]]},
        ),
        Span(6, 5, OP, "aten::relu", 2_000_000_100, 2_000_001_000, 1, {}),
        Span(7, 1, OP, "aten::copy_", 2_200_000_000, 2_300_000_000, 1, {"ml.input.shapes": [[4096, 4096], [4096, 4096]]}),
    ]
    return Run(Path("hand"), {"name": "hand", "complete": True}, {1: Track(1, TrackKind.THREAD, "MainThread", 1, 1)}, spans)


def rendered(run: Run, peaks: PeakSet | None = PEAKS, top: int = 15) -> str:
    out = io.StringIO()
    render_report(run, analyze(run, peaks), top=top, file=out)
    return out.getvalue()


def test_report_sections_and_verdicts() -> None:
    text = rendered(hand_run())
    for heading in (
        "mltrace report — hand",
        "Roofline peaks — CPU test CPU: 100 GFLOP/s, 10 GB/s (ridge 10.0 FLOP/B; assumed)",
        "Findings",
        "Time per level",
        "Top layers by total time",
        "Top layers by self time",
        "Why: the roofline numbers",
        "By layer type (self time)",
        "By op (self time)",
        "By library call",
    ):
        assert heading in text, heading
    fc = next(line for line in text.splitlines() if line.startswith("│ fc ") and "compute" in line)
    assert "/src/net.py:7" in fc and "aten::linear" in fc
    assert "Mostly compute-bound" in text
    assert "Data movement: 100.00 ms" in text and "aten::copy_" in text
    assert "Framework overhead (layer time not covered by ops)" in text
    assert "run did not finish normally" not in text
    assert "By GPU kernel" not in text  # no kernels, no empty table


def test_report_without_peaks_or_layers() -> None:
    run = hand_run()
    text = rendered(run, peaks=None)
    assert "Roofline peaks" not in text and "Findings" in text
    ops_only = Run(Path("ops"), {"name": "ops"}, run.tracks, [Span(1, None, OP, "aten::mm", 0, 1000, 1, {"ml.flops": 10})])
    text = rendered(ops_only)
    assert "Top layers" not in text and "By op (self time)" in text and "aten::mm" in text


def mostly_unknown_run() -> Run:
    """hand_run and a second model whose one layer (5 s) has no shapes and no ops: its verdict
    is unknown, 70 % of the leaf layers' time, compute-bound 28 %."""
    run = hand_run()
    run.spans.append(Span(8, None, M, "Other", 4_000_000_000, 9_000_000_000, 1, {"ml.layer.type": "Other"}))
    run.spans.append(Span(9, 8, L, "mystery", 4_000_000_000, 9_000_000_000, 1, {"ml.layer.type": "Mystery"}))
    return run


def test_the_headline_says_mixed_where_no_verdict_holds_half() -> None:
    """The terminal's headline says what the JSON and Markdown reports say: "Mostly" only where
    the dominant verdict holds more than half the time (unknown 70 % is not mostly compute)."""
    text = rendered(mostly_unknown_run())
    (line,) = [line for line in text.splitlines() if "share of leaf layers" in line]
    assert "Mixed, compute-bound the largest known — share of leaf layers (total time): unknown 70%, compute 28%" in line


def test_gpu_sections() -> None:
    tracks = {1: Track(1, TrackKind.THREAD, "main", 1, 1), 2: Track(2, TrackKind.GPU_STREAM, "s", 1, 0, 0, 7)}
    spans = [
        Span(1, None, OP, "aten::mm", 0, 100_000, 1, {}),
        Span(2, 1, K, "cudaLaunchKernel", 10, 20, 1, {"cuda.api.name": "cudaLaunchKernel"}),
        Span(3, 2, K, "gemm", 100, 1_100, 2, {"gpu.kernel.name": "gemm", "ml.library.name": "cuBLAS"}),
    ]
    text = rendered(Run(Path("g"), {"name": "g"}, tracks, spans), PeakSet(PEAKS.cpu, gpu_peaks("NVIDIA H100")))
    assert "By GPU kernel" in text and "cuBLAS" in text and "By CUDA API call (CPU side)" in text
    assert "Idle GPU 0: 0 ns (0.0% of 1.0 µs)" in text  # one kernel: nothing idle between kernels
    assert "CPU time 100.0 µs vs GPU busy 1.0 µs: ratio 100.00" in text
    mm = next(line for line in text.splitlines() if line.startswith("│ aten::mm"))
    assert "overhead" in mm  # CPU 100 µs for 1 µs of GPU work: launch-bound


def test_diff_rendering() -> None:
    a = hand_run()
    b_spans = [s for s in hand_run().spans if s.name != "act"]
    b_spans[1] = Span(2, 1, L, "fc", 0, 4_000_000_000, 1, b_spans[1].attrs)
    d = diff_runs(a, Run(Path("b"), {"name": "b"}, a.tracks, b_spans))
    out = io.StringIO()
    render_diff(d, file=out)
    text = out.getvalue()
    assert "mltrace diff — A: hand (hand)  B: b (b)" in text
    assert "Layers: " in text and "1 removed" in text and "1 slower" in text
    fc = next(line for line in text.splitlines() if line.startswith("│ fc "))
    assert "slower" in fc and "2.00×" in fc


@pytest.mark.parametrize(("value", "text"), [(0, "0 FLOP"), (1234, "1.23 kFLOP"), (2.5e9, "2.5 GFLOP"), (7, "7 FLOP")])
def test_fmt_si(value: float, text: str) -> None:
    assert fmt_si(value, "FLOP") == text


def test_report_command_on_a_real_run(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()).eval()
    with torch.inference_mode(), mltrace.profile(output=tmp_path / "run", level="layer", summary=False):
        model(torch.randn(4, 32))
    res = run_cli("report", str(tmp_path / "run"), "--top", "3", env={"MLTRACE_CACHE_DIR": str(tmp_path / "cache")})
    out = res.stdout.decode()
    assert res.returncode == 0, res.stderr.decode()
    assert "Findings" in out and "Top layers by self time" in out and "(measured)" in out
    assert "no op spans" in out  # level layer: the report says what it could not measure


def test_run_summary_from_run_json_equals_the_one_computed_from_the_events(tmp_path: Path) -> None:
    """The end-of-run summary reads run.json's stored summary instead of loading the run
    again; where it is missing (a run that was not finalized) it computes the same text."""
    import json
    import shutil

    from mltrace.viewers.terminal import print_run_summary

    torch = pytest.importorskip("torch")
    nn = torch.nn
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with mltrace.profile(output=tmp_path / "run", summary=False, level="layer"):
        for _ in range(3):
            model(torch.ones(4, 8))
    stored, computed = io.StringIO(), io.StringIO()
    print_run_summary(tmp_path / "run", file=stored)
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    meta_path = tmp_path / "copy" / "run.json"
    meta = json.loads(meta_path.read_text())
    del meta["summary"]
    meta_path.write_text(json.dumps(meta))
    print_run_summary(tmp_path / "copy", file=computed)
    linear = next(s for s in mltrace.load_run(tmp_path / "run").spans if s.attrs.get("ml.layer.type") == "Linear")
    source = location(linear.attrs["code.file.path"], linear.attrs["code.line.number"])  # call site or definition
    summary = json.loads((tmp_path / "run" / "run.json").read_text())["summary"]
    assert summary["model_calls"] + summary["cold_calls"] == 3  # the steady calls, as the report counts
    assert f"{summary['model_calls']} model calls" in stored.getvalue() and source in stored.getvalue()
    assert stored.getvalue().replace("copy", "run") == computed.getvalue().replace("copy", "run")


def test_run_summary_ranks_layers_without_their_garbage_collections(tmp_path: Path) -> None:
    """A cheap layer inside which the program's full collections ran: the end-of-run summary
    ranks the layers as the report's "Top layers by self time" does (the collections left out)
    and shows them beside the layer's self time."""
    import gc
    import json

    from mltrace.viewers.terminal import print_run_summary

    torch = pytest.importorskip("torch")
    nn = torch.nn
    heap = [[i] for i in range(300_000)]  # tracked objects: a full collection takes a while

    class Tag(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gc.collect()
            return x

    model = nn.Sequential(nn.Linear(8, 8), Tag(), nn.Linear(8, 2))
    with mltrace.profile(output=tmp_path / "run", summary=False, level="layer"):
        for _ in range(4):
            model(torch.ones(4, 8))
    del heap
    summary = json.loads((tmp_path / "run" / "run.json").read_text())["summary"]
    top = summary["top_layers_by_self_time"]
    report = analyze(mltrace.load_run(tmp_path / "run"), include_cold=False).top_by_self(5)
    assert [x["layer"] for x in top] == [r.stat.name for r in report]
    assert [x["gc_ns"] for x in top] == [r.gc.ns if r.gc is not None else 0 for r in report]
    (tag,) = [x for x in top if x["type"] == "Tag"]
    assert tag["gc_ns"] > 0
    out = io.StringIO()
    print_run_summary(tmp_path / "run", file=out)
    (row,) = [line for line in out.getvalue().splitlines() if " Tag " in line]
    assert "(GC " in row


def test_hot_lines_and_defined_location_are_shown(tmp_path: Path) -> None:
    """Sampled model-code lines per layer (``--py-spy``), the line's code read now, and the
    ``forward`` definition beside the call site."""
    src = tmp_path / "infer.py"
    src.write_text("import torch\n\n\ndef run(model, x):\n    return model.fc(x)  # the call\n")
    run = hand_run()
    fc = next(s for s in run.spans if s.name == "fc")
    fc.attrs = {
        **fc.attrs,
        "code.file.path": str(src),
        "code.line.number": 5,
        "ml.defined.file.path": "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py",
        "ml.defined.line.number": 124,
        "ml.source.hot_lines": [[f"{src}:5 run", 1_500_000], [f"{tmp_path}/gone.py:9 helper", 500_000]],
    }
    text = rendered(run)
    row = next(line for line in text.splitlines() if line.startswith("│ fc ") and "compute" in line)
    assert f"{src}:5" in row and "return model.fc(x)  # the call" in row and "torch/nn/modules/linear.py:124" in row
    hot = text.split("Hottest model-code lines per layer (py-spy samples)", 1)[1]
    assert f"{src}:5  return model.fc(x)" in hot and "75.0% of samples" in hot
    assert f"{tmp_path}/gone.py:9" in hot and "helper" in hot  # a file gone since: the location alone
