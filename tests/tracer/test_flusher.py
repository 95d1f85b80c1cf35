"""The session's flusher keeps each flush's times (run.json ``flushes``), which the report sets
against the program's model calls (``analysis/flushes.py``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import mltrace
from mltrace.tracer import recorder
from mltrace.tracer.recorder import Flusher


def test_a_run_keeps_each_flush_with_the_flushers_cpu_time(tmp_path: Path) -> None:
    with mltrace.profile(level="layer", output=tmp_path / "run", summary=False, flush_interval_s=0.02):
        time.sleep(0.3)
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    flushes = meta["flushes"]
    assert flushes["count"] >= 3 and len(flushes["kept"]) == flushes["count"] and flushes["interval_s"] == 0.02
    start = meta["clock"]["anchor_monotonic_ns"]  # the session clock is CLOCK_MONOTONIC; the stop flushes once more
    assert all(start <= begin < end and cpu >= 0 for begin, end, cpu in flushes["kept"])
    assert sum(begin < start + meta["duration_ns"] for begin, _, _ in flushes["kept"]) >= flushes["count"] - 1
    assert [b for b, _, _ in flushes["kept"]] == sorted(b for b, _, _ in flushes["kept"])
    assert flushes["wall_ns"] == sum(e - b for b, e, _ in flushes["kept"]) and flushes["cpu_ns"] == sum(c for *_, c in flushes["kept"])


def test_flushes_past_those_kept_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorder, "FLUSHES_KEPT", 2)
    done: list[int] = []
    flusher = Flusher(lambda: done.append(1), 0.001)
    flusher.start()
    deadline = time.monotonic() + 10
    while len(done) < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    flusher.stop()
    summary = flusher.summary()
    assert summary["count"] == len(done) >= 5 and len(summary["kept"]) == 2
