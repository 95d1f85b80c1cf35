"""The HTML report: one self-contained file, checked as text and rendered in headless Chromium.

The screenshot is kept as a test artifact (``<pytest tmp>/html-artifacts*/report.png``,
and under ``$MLTRACE_ARTIFACTS_DIR`` when set).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

import mltrace
from conftest import run_cli
from mltrace.analysis.bottleneck import Bound, analyze, timeline
from mltrace.analysis.peaks import Peaks, PeakSet, gpu_peaks
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.viewers.html import BOUND_COLORS, LEVEL_COLORS, render_html
from support.perfetto_tp import CHROMIUM_FLAGS, chromium_path
from viewers.pngdecode import read_png

PEAKS = PeakSet(Peaks("cpu", "test CPU", 100e9, 10e9, "assumed"))


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 30 * 30, 10)).eval()
    out = tmp_path_factory.mktemp("html") / "run"
    with torch.inference_mode(), mltrace.profile(output=out, summary=False):
        for _ in range(3):
            model(torch.randn(2, 3, 32, 32))
    return mltrace.load_run(out)


def page(run: Run, peaks: PeakSet = PEAKS) -> str:
    return render_html(run, analyze(run, peaks), timeline(run))


def test_self_contained(real_run: Run) -> None:
    text = page(real_run)
    assert text.startswith("<!doctype html>") and text.rstrip().endswith("</html>")
    lowered = text.lower()
    # Nothing is loaded from anywhere: no scripts, stylesheets, images, fonts, frames or imports.
    for needle in ("<script", "<link", "<img", "<iframe", "<object", "<embed", "@import", "url(", " src="):
        assert needle not in lowered, needle
    hrefs = re.findall(r'href="([^"]*)"', text)
    assert hrefs, "the Perfetto links"
    for href in hrefs:
        assert href.startswith(("https://ui.perfetto.dev/#!/?url=http://127.0.0.1:9001/", "http://127.0.0.1:9001/", "file:///")), href
    assert f'href="{(real_run.path / "trace.pftrace").resolve().as_uri()}"' in text


def test_charts_and_sections(real_run: Run) -> None:
    text = page(real_run)
    assert text.count("<svg") == 5  # levels, top layers, layer types, roofline, timeline
    assert 'aria-label="roofline"' in text and 'aria-label="timeline"' in text
    for heading in (
        "Findings",
        "Time per level",
        "Top layers by total time",
        "Layer types by self time",
        "Roofline",
        "Timeline overview",
        "Top layers by self time",
        "By layer type (self time)",
    ):
        assert f"<h2>{heading}</h2>" in text, heading
    a = analyze(real_run, PEAKS)
    for row in a.layers[:5]:
        assert f">{row.stat.name}<" in text
    if any(s.level is Level.OP for s in real_run.spans):
        assert "<h2>By op (self time)</h2>" in text
    assert "polyline" in text  # the roof


def test_names_are_escaped() -> None:
    nasty = '<script>alert("x")</script>'
    run = Run(
        Path("x"),
        {"name": nasty},
        {1: Track(1, TrackKind.THREAD, nasty, 1, 1)},
        [
            Span(2, 1, Level.LAYER, nasty, 10, 90, 1, {"ml.layer.type": nasty, "code.file.path": nasty, "code.line.number": 1}),
            Span(1, None, Level.MODEL, "Net", 0, 100, 1, {}),
        ],
    )
    text = page(run)
    assert "<script" not in text
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in text


def test_the_headline_says_mixed_where_no_verdict_holds_half() -> None:
    from viewers.test_terminal import mostly_unknown_run

    text = page(mostly_unknown_run())
    assert "Mostly" not in text
    assert re.search(r"Mixed, <span[^>]*>compute-bound</span> the largest known — share of leaf layers", text)


def test_gpu_run_has_a_gpu_roof_and_kernel_table() -> None:
    tracks = {1: Track(1, TrackKind.THREAD, "main", 1, 1), 2: Track(2, TrackKind.GPU_STREAM, "s", 1, 0, 0, 7)}
    spans = [
        Span(1, None, Level.MODEL, "Net", 0, 10_000_000, 1, {}),
        Span(2, 1, Level.OP, "aten::mm", 0, 9_000_000, 1, {"ml.flops": 2 * 4096**3, "ml.input.shapes": [[4096, 4096], [4096, 4096]]}),
        Span(3, 2, Level.KERNEL, "cudaLaunchKernel", 10, 20, 1, {"cuda.api.name": "cudaLaunchKernel"}),
        Span(
            4,
            3,
            Level.KERNEL,
            "ampere_sgemm_128x64_tn",
            100,
            9_000_100,
            2,
            {"gpu.kernel.name": "ampere_sgemm_128x64_tn", "ml.library.name": "cuBLAS"},
        ),
    ]
    run = Run(Path("gpu"), {"name": "gpu"}, tracks, spans)
    text = page(run, PeakSet(PEAKS.cpu, gpu_peaks("NVIDIA H100 80GB HBM3")))
    assert "GPU: 67 TFLOP/s, 3.35 TB/s" in text
    assert "<h2>By GPU kernel</h2>" in text and "ampere_sgemm_128x64_tn" in text and "cuBLAS" in text
    assert "<h2>By CUDA API call (CPU side)</h2>" in text and "Idle GPU 0" in text


def test_report_html_command(real_run: Run, tmp_path: Path) -> None:
    out = tmp_path / "sub" / "report.html"
    res = run_cli("report", str(real_run.path), "--html", str(out), env={"MLTRACE_CACHE_DIR": str(tmp_path / "cache")})
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout.decode() == f"HTML report: {out}\n"
    text = out.read_text(encoding="utf-8")
    assert "<h2>Roofline</h2>" in text and "(measured)" in text  # peaks measured into the temp cache
    assert list((tmp_path / "cache").glob("peaks-*.json"))
    res = run_cli("report", str(real_run.path), "--html", str(tmp_path), env={"MLTRACE_CACHE_DIR": str(tmp_path / "cache")})
    assert res.returncode == 2 and b"is a directory" in res.stderr


def near(pixels: object, color: str, tolerance: int = 6) -> int:
    """How many pixels are within ``tolerance`` of ``#rrggbb`` on every channel."""
    import numpy as np

    rgb = np.array([int(color[i : i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
    px = np.asarray(pixels)[..., :3].astype(np.int16)
    return int((np.abs(px - rgb) <= tolerance).all(axis=-1).sum())


def test_renders_in_headless_chromium(real_run: Run, tmp_path_factory: pytest.TempPathFactory) -> None:
    browser = chromium_path()
    if browser is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium missing on CI (scripts/install-chromium.sh)")
        pytest.skip("chromium is not installed (scripts/install-chromium.sh)")
    a = analyze(real_run, PEAKS)
    artifacts = tmp_path_factory.mktemp("html-artifacts")
    html_file = artifacts / "report.html"
    html_file.write_text(render_html(real_run, a, timeline(real_run), top=8), encoding="utf-8")
    shot = artifacts / "report.png"
    profile = tempfile.mkdtemp(prefix="mltrace-chromium-")
    proc = subprocess.Popen(
        [
            browser,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
            "--window-size=1280,2400",
            f"--screenshot={shot}",
            html_file.as_uri(),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        proc.wait(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(profile, ignore_errors=True)
    assert shot.is_file(), "chromium wrote no screenshot"
    if os.environ.get("MLTRACE_ARTIFACTS_DIR"):
        dest = Path(os.environ["MLTRACE_ARTIFACTS_DIR"])
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, dest / "html-report.png")
    pixels = read_png(shot)
    assert pixels.shape[:2] == (2400, 1280)
    # The level chart's bars, in their level colours.
    for level in (Level.MODEL, Level.LAYER):
        assert near(pixels, LEVEL_COLORS[level]) > 2000, level
    # Bars and roofline points in the colours of the verdicts the analysis gave.
    shown = {r.verdict.bound for r in a.layers[:8] if r.verdict is not None}
    assert shown
    for bound in shown:
        assert near(pixels, BOUND_COLORS[bound]) > 500, bound
    assert near(pixels, "#fbfbfb", 0) > 50_000  # the roofline plot area
    # Timeline lanes: the op lane (when ops were recorded) is drawn in its colour.
    if any(lane.level is Level.OP for lane in timeline(real_run).lanes):
        assert near(pixels, LEVEL_COLORS[Level.OP], 40) > 2000
    assert Bound.UNKNOWN not in shown or len(shown) > 1  # the run is judged, not left unknown


def test_source_context_and_hot_lines(tmp_path: Path) -> None:
    """The call site's code with lines of context, read at report time; a file that is gone
    leaves just its location."""
    src = tmp_path / "infer.py"
    src.write_text("".join(f"line_{n} = {n}\n" for n in range(1, 10)))
    spans = [
        Span(1, None, Level.MODEL, "Net", 0, 1_000, 1, {"ml.layer.type": "Net"}),
        Span(2, 1, Level.LAYER, "fc", 0, 900, 1, {"ml.layer.type": "Linear", "code.file.path": str(src), "code.line.number": 5}),
        Span(
            3,
            1,
            Level.LAYER,
            "act",
            900,
            1_000,
            1,
            {
                "ml.layer.type": "ReLU",
                "code.file.path": str(tmp_path / "gone.py"),
                "code.line.number": 3,
                "ml.source.hot_lines": [[f"{src}:7 f", 10]],
            },
        ),
    ]
    run = Run(Path("hand"), {"name": "hand", "complete": True}, {1: Track(1, TrackKind.THREAD, "MainThread", 1, 1)}, spans)
    text = page(run)
    assert f"<code>{src}:5</code> <code>line_5 = 5</code>" in text
    assert '<span class="ctx">    2  line_2 = 2</span>' in text and '<span class="hl">    5  line_5 = 5</span>' in text
    assert f"<code>{tmp_path}/gone.py:3</code>" in text
    hot = text.split("Hottest model-code lines per layer", 1)[1]
    assert "<b>act</b>" in hot and "line_7 = 7" in hot and "100.0% of samples" in hot
