"""The report's memory numbers (``analysis.memory``) from small tables of spans and counters."""

from __future__ import annotations

from pathlib import Path

from mltrace.analysis.memory import MemoryChange, MemoryReport, MemoryRow, memory_diff, memory_report
from mltrace.run.events import CounterSample, Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run


def mem_attrs(alloc: int, freed: int, peak: int, device: str = "cpu") -> dict[str, object]:
    return {
        "ml.memory.device": device,
        "ml.memory.alloc_bytes": alloc,
        "ml.memory.freed_bytes": freed,
        "ml.memory.peak_bytes": peak,
        "ml.memory.peak_total_bytes": peak,
    }


def a_run(tmp_path: Path) -> Run:
    thread = Track(1, TrackKind.THREAD, "main", 1, 1)
    counter = Track(2, TrackKind.COUNTER, "cpu.memory.allocated", 1, unit="bytes")
    spans = [
        Span(1, None, Level.MODEL, "Net", 0, 1000, 1, mem_attrs(900, 900, 700)),
        Span(2, 1, Level.LAYER, "block", 100, 500, 1, mem_attrs(600, 500, 600)),
        Span(3, 2, Level.OP, "aten::mm", 150, 300, 1, mem_attrs(400, 0, 400)),
        Span(4, 1, Level.LAYER, "head", 600, 900, 1, mem_attrs(300, 400, 100)),
        Span(5, 4, Level.OP, "aten::mm", 650, 700, 1, mem_attrs(100, 0, 100)),
        Span(6, None, Level.MODEL, "Net", 2000, 3000, 1, mem_attrs(800, 800, 650)),
        Span(7, 6, Level.LAYER, "block", 2100, 2500, 1, mem_attrs(500, 500, 650)),
        Span(8, 6, Level.LAYER, "quiet", 2600, 2700, 1),  # no memory event ran inside it
    ]
    counters = [CounterSample(2, ts, v) for ts, v in ((150, 100.0), (250, 700.0), (650, 300.0), (2200, 650.0))]
    correlation = {"attribute_memory": {"memory_events": 4}}
    return Run(tmp_path, {"correlation": correlation}, tracks={1: thread, 2: counter}, spans=spans, counters=counters)


def test_rows_sum_allocations_and_take_the_largest_peak(tmp_path: Path) -> None:
    mem = memory_report(a_run(tmp_path))
    assert mem is not None
    assert mem.layer("block") == MemoryRow("block", Level.LAYER, 2, 1100, 1000, 650, "cpu")
    assert mem.layer("Net") == MemoryRow("Net", Level.MODEL, 2, 1700, 1700, 700, "cpu")
    assert mem.layer("quiet") is None
    assert mem.op("aten::mm") == MemoryRow("aten::mm", Level.OP, 2, 500, 0, 400, "cpu")
    assert [r.name for r in mem.layers] == ["Net", "block", "head"]  # by peak


def test_the_run_peak_names_the_innermost_layer_then(tmp_path: Path) -> None:
    mem = memory_report(a_run(tmp_path))
    assert mem is not None
    (peak,) = mem.peaks
    assert (peak.track, peak.bytes, peak.ts_ns, peak.layer, peak.samples) == ("cpu.memory.allocated", 700, 250, "block", 4)


def test_counted_calls_give_the_rows_and_the_whole_run_the_peak(tmp_path: Path) -> None:
    run = a_run(tmp_path)
    steady = Run(tmp_path, run.meta, tracks=run.tracks, spans=run.spans[5:], counters=run.counters)
    mem = memory_report(run, steady)
    assert mem is not None
    assert mem.layer("block") == MemoryRow("block", Level.LAYER, 1, 500, 500, 650, "cpu")
    assert mem.peaks[0].bytes == 700 and mem.peaks[0].layer == "block"


def test_no_memory_recorded_gives_none(tmp_path: Path) -> None:
    run = Run(tmp_path, {}, tracks={1: Track(1, TrackKind.THREAD, "main", 1, 1)}, spans=[Span(1, None, Level.MODEL, "Net", 0, 10, 1)])
    assert memory_report(run) is None


def test_memory_diff_puts_device_peaks_first_then_layers_by_change() -> None:
    a = MemoryReport(layers=[MemoryRow("x", Level.LAYER, 1, 10, 10, 100, "cpu"), MemoryRow("y", Level.LAYER, 1, 1, 1, 50, "cpu")])
    b = MemoryReport(layers=[MemoryRow("x", Level.LAYER, 1, 10, 10, 120, "cpu"), MemoryRow("z", Level.LAYER, 1, 1, 1, 500, "cpu")])
    assert memory_diff(a, b) == [MemoryChange("z", None, 500), MemoryChange("y", 50, None), MemoryChange("x", 100, 120)]
    assert memory_diff(None, None) == []
