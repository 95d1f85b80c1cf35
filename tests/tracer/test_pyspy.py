"""Python source samples (py-spy) attributed to the layer that was running."""

from __future__ import annotations

from pathlib import Path

import mltrace
from conftest import run_cli
from mltrace.tracer.levels import Level
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
