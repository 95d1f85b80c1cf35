"""No share of a roof above 100 %: the work estimates and roofs are right, not capped.

Over the stored H100 run (datasheet roofs, never raised) and the CPU example models traced
at the op level here (the CPU's FLOP roof is the ISA's bound, never raised), every layer and
op moves and computes no faster than its roofs allow, every verdict's efficiency and every
FLOP share is at most 1, and no percentage the terminal, HTML or Markdown report shows exceeds
100.
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest
import torch

import mltrace
from mltrace.analysis.bottleneck import Analysis, analyze, timeline
from mltrace.analysis.peaks import PeakSet, peaks_for_run
from mltrace.analysis.report_data import build_report
from mltrace.run.store import Run
from mltrace.viewers.html import render_html
from mltrace.viewers.markdown import render_markdown
from mltrace.viewers.terminal import render_report
from support.runs import unpack_run

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from models import encoder, resnet_small  # noqa: E402


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return unpack_run("h100_resnet50_bert", tmp_path_factory.mktemp("h100"))


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The example CNN and encoder (smaller inputs), three calls each, one thread, op level."""
    out = tmp_path_factory.mktemp("cpu") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cnn, enc = resnet_small(), encoder(layers=1)
    images, tokens = torch.randn(1, 3, 64, 64), torch.randint(0, 30522, (1, 32))
    try:
        with torch.inference_mode(), mltrace.profile(output=out, level="op", summary=False):
            for _ in range(3):
                cnn(images)
                enc(tokens)
    finally:
        torch.set_num_threads(threads)
    return mltrace.load_run(out)


def _raw_shares(a: Analysis, peaks: PeakSet) -> list[tuple[str, float, float]]:
    """(name, FLOP/s ÷ FLOP roof, bytes/s ÷ unraised bandwidth roof) of every layer and op with
    work and time, each against the roofs of the device it ran on (GPU when it launched kernels)."""
    out = []
    for r in a.layers:
        roofs = peaks.gpu if r.kernel_count else peaks.cpu
        t = r.kernel_ns if r.kernel_count else r.stat.total_ns
        if roofs is not None and t > 0:
            flops_roof = roofs.flops_for(r.dtype) if r.dtype else roofs.top_flops_per_s
            out.append((r.stat.name, r.flops / (t * 1e-9) / flops_roof, r.bytes / (t * 1e-9) / roofs.bytes_per_s))
    for o in a.ops:
        roofs = peaks.gpu if o.kernels else peaks.cpu
        t = o.device_ns if o.kernels else o.total_ns
        if roofs is not None and t > 0:
            out.append((o.name, o.flops / (t * 1e-9) / roofs.top_flops_per_s, o.bytes / (t * 1e-9) / roofs.bytes_per_s))
    return out


def _printed_percentages(run: Run, a: Analysis) -> list[float]:
    """Every percentage of the terminal, HTML (text, not markup) and Markdown reports."""
    text = io.StringIO()
    render_report(run, a, top=200, file=text, width=400)
    html = re.sub(r"<[^>]*>", " ", render_html(run, a, timeline(run), top=200))
    markdown = render_markdown(build_report(run, a), top=200)
    return [float(x) for page in (text.getvalue(), html, markdown) for x in re.findall(r"(\d+(?:\.\d+)?)\s?%", page)]


def _check_report(run: Run, a: Analysis) -> None:
    verdicts = [r.verdict for r in a.layers] + [t.verdict for t in a.types] + [o.verdict for o in a.ops]
    assert all(v is None or v.efficiency is None or v.efficiency <= 1.0 for v in verdicts)
    assert all(r.peak_share is None or r.peak_share <= 1.0 for r in [*a.layers, *a.ops])
    doc = build_report(run, a)
    for entry in doc["layers"] + doc["ops"]:
        assert entry["peak_share"] is None or entry["peak_share"] <= 1.0, entry["name"]
    printed = _printed_percentages(run, a)
    assert printed and max(printed) <= 100.0


@pytest.mark.parametrize("include_cold", [False, True])
def test_the_gpu_run_stays_under_the_datasheet_roofs(gpu_run: Run, include_cold: bool, tmp_path: Path) -> None:
    peaks = peaks_for_run(gpu_run.meta, True, directory=tmp_path)
    assert peaks.gpu is not None and peaks.gpu.source == "table"
    a = analyze(gpu_run, peaks, include_cold=include_cold)
    on_gpu = {o.name for o in a.ops if o.kernels} | {r.stat.name for r in a.layers if r.kernel_count}
    for name, flops_share, bytes_share in _raw_shares(a, peaks):
        assert flops_share <= 1.0, name
        if name in on_gpu:
            assert bytes_share <= 1.0, name
    ops = {o.name: o for o in a.ops}
    # A nested op is judged by the kernels it launched, not by its CPU time against the CPU's roofs.
    assert ops["aten::addmm"].kernels == ops["aten::addmm"].calls and ops["aten::addmm"].peak_share is not None
    assert ops["aten::dropout"].bytes == 0  # inference dropout returns its input
    _check_report(gpu_run, a)


def test_the_cpu_examples_stay_under_the_isa_roof(cpu_run: Run, tmp_path: Path) -> None:
    peaks = peaks_for_run(cpu_run.meta, False, directory=tmp_path)
    a = analyze(cpu_run, peaks, include_cold=False)
    shares = _raw_shares(a, peaks)
    assert len(shares) > 30
    over = [(name, f) for name, f, _ in shares if f > 1.0]
    assert not over
    conv = next(r for r in a.layers if r.stat.type == "Conv2d")
    assert conv.peak_share is not None and 0 < conv.peak_share <= 1.0  # computed, not left out
    _check_report(cpu_run, a)
