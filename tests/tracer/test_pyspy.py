"""Python source samples (py-spy) attributed to the layer that was running."""

from __future__ import annotations

from pathlib import Path

import mltrace
from conftest import run_cli
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.tracer.passes.samples import attribute_samples
from mltrace.tracer.sources.pyspy import MARKER, marker_offset_ns

SCRIPT = """
import time, torch
from torch import nn

def hot_python_loop(seconds):
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n

class Slow(nn.Module):
    def forward(self, x):
        hot_python_loop(0.4)
        return x * 2

model = nn.Sequential(nn.Linear(4, 4), Slow())
model(torch.randn(1, 4))
print("done")
"""


def test_marker_offset_from_first_marker_sample() -> None:
    events = [
        {"ph": "B", "name": "thread (1): MainThread", "ts": 10.0},
        {"ph": "B", "name": "start", "ts": 10.0},
        {"ph": "B", "name": MARKER, "ts": 20.5},
        {"ph": "E", "name": MARKER, "ts": 80.0},
    ]
    assert marker_offset_ns(events, 1_000_000) == 1_000_000 - 20_500
    assert marker_offset_ns(events[:2], 5) is None


def test_hot_lines_land_on_the_layer_that_ran_them(tmp_path: Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text(SCRIPT)
    res = run_cli("python", "-q", "--py-spy", "-o", str(tmp_path / "run"), str(script))
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout == b"done\n"
    run = mltrace.load_run(tmp_path / "run")
    assert run.meta["sources"]["py-spy"]["aligned"] is True
    samples = [s for s in run.spans if s.level == Level.SOURCE]
    assert samples and all(s.attrs["mltrace.source"] == "py-spy" for s in samples)
    assert not any(s.name == MARKER for s in samples)  # mltrace's own marker is dropped
    slow = next(s for s in run.spans if s.name == "1")
    hot = slow.attrs["ml.source.hot_lines"]
    assert "hot_python_loop" in hot[0][0] and str(script) in hot[0][0]
    # Most of the 0.4 s loop was sampled inside the layer (100 Hz, generous margin).
    assert hot[0][1] > 0.1e9


def test_hot_lines_are_the_innermost_model_code_frames() -> None:
    """A sample inside torch's conv code counts for the user's line that called the layer;
    the layer gets the samples taken while its op ran, and the op keeps them too."""
    torch_dir = "/venv/lib/python3.11/site-packages/torch/nn/modules"
    user = "/home/u/proj/infer.py"

    def frame(sid: int, parent: int | None, name: str, path: str, line: int, start: int, end: int) -> Span:
        attrs = {"code.file.path": path, "code.line.number": line, "mltrace.source": "py-spy"}
        return Span(sid, parent, Level.SOURCE, name, start, end, 2, attrs)

    spans = [
        Span(1, None, Level.LAYER, "stem.0", 0, 1_000, 1, {"ml.layer.type": "Conv2d"}),
        Span(2, 1, Level.OP, "aten::conv2d", 100, 900, 1, {}),
        frame(10, None, "<module>", user, 30, 0, 1_000),
        frame(11, 10, "Net.forward", user, 25, 0, 1_000),
        frame(12, 11, "Module._call_impl", f"{torch_dir}/module.py", 1773, 0, 1_000),
        frame(13, 12, "Conv2d.forward", f"{torch_dir}/conv.py", 552, 0, 600),  # leaf, mid 300: in the op
        frame(14, 12, "Conv2d._conv_forward", f"{torch_dir}/conv.py", 549, 600, 1_000),  # leaf, mid 800: in the op
        frame(20, None, "<frozen runpy>", "<frozen runpy>", 1, 990, 1_000),  # no model code: counts for nothing
    ]
    tracks = {1: Track(1, TrackKind.THREAD, "MainThread", 1, 1), 2: Track(2, TrackKind.ASYNC, "MainThread (python)", 1, 1, parent_track=1)}
    run = attribute_samples(Run(Path("synthetic"), {}, tracks, spans))
    by_name = {s.name: s for s in run.spans}
    expected = [[f"{user}:25 Net.forward", 1_000]]
    assert by_name["stem.0"].attrs["ml.source.hot_lines"] == expected
    assert by_name["aten::conv2d"].attrs["ml.source.hot_lines"] == expected
