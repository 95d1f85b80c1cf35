"""Python source samples (py-spy) attributed to the layer that was running."""

from __future__ import annotations

from pathlib import Path

import mltrace
from conftest import run_cli
from mltrace.analysis.report_data import hot_lines
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


def test_marker_offset_is_the_middle_of_what_the_marker_samples_allow() -> None:
    """The first sample inside the marker (µs 20.5) was taken within a period (10 µs here)
    after the marker began at 1 ms, the first one after it (µs 80.0) within a period after
    it ended at 1.06 ms: the offset is the middle of the range both allow."""
    events = [
        {"ph": "B", "name": "thread (1): MainThread", "ts": 10.0},
        {"ph": "B", "name": "start", "ts": 10.0},
        {"ph": "B", "name": MARKER, "ts": 20.5},
        {"ph": "E", "name": MARKER, "ts": 50.0},  # the marker's line changed: a new slice
        {"ph": "B", "name": MARKER, "ts": 50.0},
        {"ph": "E", "name": MARKER, "ts": 80.0},
    ]
    # From the first sample: 979_500 … 989_500; from the last: 980_000 … 990_000.
    assert marker_offset_ns(events, (1_000_000, 1_060_000), 10_000) == (984_750, 4_750)
    # Bounds that do not meet (py-spy late at the end): the first sample's alone.
    assert marker_offset_ns(events, (1_000_000, 1_030_000), 10_000) == (984_500, 5_000)
    assert marker_offset_ns(events[:2], (5, 10), 10_000) is None


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
        Span(2, 1, Level.OP, "aten::conv2d", 0, 900, 1, {}),
        frame(10, None, "<module>", user, 30, 0, 1_000),
        frame(11, 10, "Net.forward", user, 25, 0, 1_000),
        frame(12, 11, "Module._call_impl", f"{torch_dir}/module.py", 1773, 0, 1_000),
        frame(13, 12, "Conv2d.forward", f"{torch_dir}/conv.py", 552, 0, 600),  # one sample, at 0: in the op
        frame(14, 12, "Conv2d._conv_forward", f"{torch_dir}/conv.py", 549, 600, 1_000),  # one at 600: in the op
        frame(20, None, "<frozen runpy>", "<frozen runpy>", 1, 990, 1_000),  # no model code: counts for nothing
    ]
    tracks = {1: Track(1, TrackKind.THREAD, "MainThread", 1, 1), 2: Track(2, TrackKind.ASYNC, "MainThread (python)", 1, 1, parent_track=1)}
    run = attribute_samples(Run(Path("synthetic"), {}, tracks, spans))
    by_name = {s.name: s for s in run.spans}
    expected = [[f"{user}:25 Net.forward", 1_000]]
    assert by_name["stem.0"].attrs["ml.source.hot_lines"] == expected
    assert by_name["aten::conv2d"].attrs["ml.source.hot_lines"] == expected


BUSY_AND_SLEEPY = """
import time, torch
from torch import nn

class Busy(nn.Module):
    def forward(self, x):
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass  # the busy line
        return x

class Sleepy(nn.Module):
    def forward(self, x):
        time.sleep(0.03)  # the sleeping line
        return x

model = nn.Sequential(Busy(), Sleepy())
for _ in range(10):
    model(torch.ones(1))
print("done")
"""


def test_a_sleeping_layer_is_not_given_the_busy_line_before_it(tmp_path: Path) -> None:
    """Without idle samples py-spy kept the busy line open through the sleep after it, and
    the whole slice went to whichever layer held its middle: the sleeping layer's hottest
    line was the busy one."""
    script = tmp_path / "busy_sleepy.py"
    script.write_text(BUSY_AND_SLEEPY)
    res = run_cli("python", "-q", "--py-spy", "-o", str(tmp_path / "run"), str(script))
    assert res.returncode == 0, res.stderr.decode()
    run = mltrace.load_run(tmp_path / "run")
    hot = hot_lines(run, ["0", "1"])
    assert hot["0"][0][0] == f"{script}:8 Busy.forward"
    assert hot["1"][0][0] == f"{script}:14 Sleepy.forward"
    assert not any("Busy.forward" in line for line, _ in hot["1"])
    assert not any("Sleepy.forward" in line for line, _ in hot["0"])
    assert run.meta["sources"]["py-spy"]["idle_samples"] is True


def _layer(sid: int, name: str, cls: str, start_ms: float, end_ms: float, user: str, def_line: int) -> Span:
    attrs = {
        "ml.layer.type": cls,
        "ml.defined.file.path": user,
        "ml.defined.line.number": def_line,
        "ml.defined.function.name": f"{cls}.forward",
        "code.file.path": user,
        "code.line.number": 19,
    }
    return Span(sid, None, Level.LAYER, name, int(start_ms * 1e6), int(end_ms * 1e6), 1, attrs)


def test_one_slice_of_many_samples_is_split_and_each_sample_goes_where_its_stack_ran() -> None:
    """Calls of 1 ms (Busy 0.4 ms, then Sleepy), sampled every 10 ms: three samples in a row
    caught Busy, so py-spy wrote one slice from the first (0.1 ms) to the first that showed
    Sleepy (30.9 ms). Its middle lies in a Sleepy call; its samples, one a period apart, are
    in Busy calls, the last (20.63 ms) a little off into the Sleepy after it."""
    user = "/home/u/proj/infer.py"
    spans = []
    for k in range(40):
        spans.append(_layer(100 + 2 * k, "0", "Busy", k, k + 0.4, user, 5))
        spans.append(_layer(101 + 2 * k, "1", "Sleepy", k + 0.4, k + 1, user, 12))

    def frame(sid: int, parent: int | None, name: str, line: int, start_ms: float, end_ms: float) -> Span:
        attrs = {"code.file.path": user, "code.line.number": line, "mltrace.source": "py-spy"}
        return Span(sid, parent, Level.SOURCE, name, int(start_ms * 1e6), int(end_ms * 1e6), 2, attrs)

    spans += [
        frame(1, None, "<module>", 19, 0.1, 40.0),
        frame(2, 1, "Busy.forward", 7, 0.1, 30.9),
        frame(3, 1, "Sleepy.forward", 13, 30.9, 40.0),
    ]
    tracks = {1: Track(1, TrackKind.THREAD, "MainThread", 1, 1), 2: Track(2, TrackKind.ASYNC, "MainThread (python)", 1, 1, parent_track=1)}
    meta = {"sources": {"py-spy": {"rate_hz": 100}}}
    run = attribute_samples(Run(Path("synthetic"), meta, tracks, spans))
    got: dict[str, dict[str, int]] = {}
    for s in run.spans:
        for line, ns in s.attrs.get("ml.source.hot_lines", ()):
            got.setdefault(s.name, {}).setdefault(line, 0)
            got[s.name][line] += ns
    assert got == {"0": {f"{user}:7 Busy.forward": 30_800_000}, "1": {f"{user}:13 Sleepy.forward": 9_100_000}}
