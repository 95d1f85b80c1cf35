"""The program's garbage collections as the session records them (``sources/gc_pauses.py``),
and the report charging them to the layer they ran in (``analysis/gcpauses.py``)."""

from __future__ import annotations

import gc
import itertools
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import mltrace
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.peaks import Peaks, PeakSet
from mltrace.run.events import TrackKind
from mltrace.run.levels import Level
from mltrace.tracer.recorder import Recorder
from mltrace.tracer.sources import default_sources
from mltrace.tracer.sources.gc_pauses import GC_TRACK, GcPauseSource
from mltrace.tracer.tracks import TrackRegistry


class View:
    """What the source reads of a session."""

    def __init__(self) -> None:
        self.meta: dict[str, object] = {}
        self.tracks = TrackRegistry()
        self.recorder = Recorder(self.tracks, itertools.count(1))


class Collecting(nn.Module):
    """A layer that runs a full collection in its second call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            gc.collect()
        return x * 2


def test_a_collection_inside_a_layer_is_recorded_and_charged_to_it(tmp_path: Path) -> None:
    net = nn.Sequential(nn.Linear(4, 4), Collecting(), nn.ReLU())
    before = list(gc.callbacks)
    with mltrace.profile(output=tmp_path / "run", summary=False, level="layer"):
        for _ in range(3):
            net(torch.randn(2, 4))
    assert gc.callbacks == before  # the session's callback is gone, the program's own are as they were
    run = mltrace.load_run(tmp_path / "run")
    info = run.meta["gc"]
    assert info["collections"][2][0] >= 1 and info["collections"][2][1] > 0
    full = [p for p in info["pauses"] if p[3] == 2]
    main = threading.main_thread().native_id
    layers = [s for s in run.spans if s.name == "1" and s.level == Level.LAYER]
    assert any(p[0] == main and s.start_ns <= p[1] <= p[2] <= s.end_ns for p in full for s in layers)
    track = next(t for t in run.tracks.values() if t.name == GC_TRACK)
    assert track.kind == TrackKind.COUNTER and any(c.track_id == track.id and c.value == 3 for c in run.counters)
    analysis = analyze(run, PeakSet(Peaks("cpu", "test CPU", 100e9, 10e9, "assumed")), include_cold=True)
    row = next(r for r in analysis.layers if r.stat.name == "1")
    assert row.gc is not None and row.gc.full >= 1 and 0 < row.gc.ns <= row.stat.self_ns
    assert row.verdict is not None and "garbage collection" in row.verdict.reason
    assert next(r for r in analysis.layers if r.stat.name == "0").gc is None


def test_every_run_records_collections() -> None:
    assert any(isinstance(s, GcPauseSource) for s in default_sources())


def test_a_forked_child_records_no_collection() -> None:
    source, view = GcPauseSource(), View()
    source.start(view)  # type: ignore[arg-type]
    try:
        assert source._on_collection in gc.callbacks
        source.release_in_forked_child()
        assert source._on_collection not in gc.callbacks
        gc.collect()
        assert source.counts == [0, 0, 0]
    finally:
        source.stop()
    assert view.meta == {}


@pytest.mark.parametrize("generation", [0, 1, 2])
def test_collections_are_counted_by_generation(generation: int) -> None:
    source, view = GcPauseSource(), View()
    source.start(view)  # type: ignore[arg-type]
    try:
        gc.collect(generation)
    finally:
        source.stop()
    info = view.meta["gc"]
    assert isinstance(info, dict)
    assert info["collections"][generation][0] >= 1
    kept = [p for p in info["pauses"] if p[3] == generation]
    assert kept or generation == 0  # an older generation's collection is always kept; a short young one need not be
