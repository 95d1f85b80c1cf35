"""The span table (spans.bin): round trip, staleness, corruption, and analysis equal to the JSON path."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest

from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.breakdown import cross_stack_chains
from mltrace.analysis.peaks import Peaks, PeakSet
from mltrace.importers.kineto import import_kineto
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.metadata import base_metadata
from mltrace.run.store import EVENTS_FILE, TABLE_FILE, EventWriter, Run, load_run, write_meta, write_table

KINETO = Path(__file__).resolve().parents[1] / "data" / "kineto"
CPU = PeakSet(Peaks("cpu", "test CPU", 100e9, 10e9, "assumed"))


def _spans() -> list[Span]:
    shared = {"ml.layer.type": "Conv2d", "ml.input.shapes": [[1, 3, 8, 8]], "code.line.number": 3}
    return [
        Span(1, None, Level.MODEL, "Net", 0, 1000, 1, {"ml.layer.type": "Net"}),
        Span(2, 1, Level.LAYER, "conv", 10, 400, 1, shared),
        Span(3, 1, Level.LAYER, "conv", 410, 800, 1, dict(shared)),  # equal, not the same object
        Span(4, 2, Level.OP, "aten::conv2d", 20, 390, 1, {"ml.flops": 1234, "kineto.external_id": 7}),
        Span(5, 4, Level.OP, "aten::weird", 30, 40, 1, {"ml.flops": "n/a"}),  # not a number
        Span(6, 4, Level.LIBRARY, "oneDNN convolution", 50, 380, 1, {"ml.library.name": "oneDNN"}),
        Span(7, 3, Level.OP, "aten::conv2d", 420, 790, 1, {"ml.flops": 1234.5, "kineto.external_id": 8}),
        Span(8, 999, Level.USER, "orphan", 900, 950, 1, {}),  # parent not in the run
        Span(9, None, Level.USER, "open", 960, -1, 1, {"nested": {"a": [1, 2.5, None, True]}}),
    ]


def _write_run(run_dir: Path, spans: list[Span], *, table: bool = True, complete: bool = True) -> Run:
    run_dir.mkdir(parents=True)
    meta = base_metadata(["python", "x.py"], "t")
    meta["complete"] = complete
    write_meta(run_dir, meta)
    track = Track(1, TrackKind.THREAD, "MainThread", 10, 10)
    writer = EventWriter(run_dir / EVENTS_FILE)
    writer.write(tracks=[track], spans=spans)
    writer.close()
    run = Run(run_dir, meta, tracks={1: track}, spans=spans)
    if table:
        write_table(run_dir, run)
    return run


def test_round_trip_dedupes_attribute_sets(tmp_path: Path) -> None:
    spans = _spans()
    _write_run(tmp_path / "r", spans)
    run = load_run(tmp_path / "r")
    t = run.table
    assert len(t) == len(spans)
    # The two conv calls share one stored attribute set; every other map is distinct.
    assert t.attr_set_count == len(spans) - 1
    assert t.attr[1] == t.attr[2]
    assert t.names[int(t.name[3])] == "aten::conv2d"
    assert list(t.has_flops) == [False, False, False, True, True, False, True, False, False]
    assert t.flops[3] == 1234 and t.flops[6] == 1234.5
    assert list(t.parent_row()) == [-1, 0, 0, 1, 3, 3, 2, -1, -1]
    assert run.spans == spans
    assert run.tracks[1].name == "MainThread"


def _figures(analysis: Any) -> dict[str, Any]:
    """An analysis's fields as a dict, less ``counted`` (the run the tables count: a Run of its
    own run directory, which differs between the two runs compared)."""
    figures = dataclasses.asdict(analysis)
    figures.pop("counted", None)
    return figures


def test_table_backed_run_reads_like_the_json_one(tmp_path: Path) -> None:
    spans = _spans()
    _write_run(tmp_path / "with", spans)
    _write_run(tmp_path / "without", spans, table=False)
    from_table = load_run(tmp_path / "with")
    from_json = load_run(tmp_path / "without")
    assert not (tmp_path / "without" / TABLE_FILE).exists()
    a, b = analyze(from_table, CPU), analyze(from_json, CPU)
    assert _figures(a) == _figures(b)
    assert a.ops[0].name == "aten::conv2d" and a.ops[0].flops == pytest.approx(2468.5)
    # Materialised spans equal the JSON ones; spans with the same attributes share one dict,
    # the table's own, so a span's attributes change by replacing its dict.
    assert from_table.spans == from_json.spans
    same = [s for s in from_table.spans if s.attrs == from_table.spans[2].attrs]
    assert len(same) >= 2 and all(s.attrs is same[0].attrs for s in same)
    same[0].attrs = {**same[0].attrs, "x": 1}
    row = next(i for i, s in enumerate(from_table.spans) if s is same[1])
    assert all("x" not in s.attrs for s in same[1:]) and from_table.table.attrs(row) is same[1].attrs


def test_stale_table_is_ignored(tmp_path: Path) -> None:
    spans = _spans()
    _write_run(tmp_path / "r", spans)
    extra = Span(10, None, Level.USER, "late", 2000, 2100, 1, {})
    writer = EventWriter(tmp_path / "r" / EVENTS_FILE)
    writer.write(spans=[extra])
    writer.close()
    run = load_run(tmp_path / "r")
    assert len(run.table) == len(spans) + 1
    assert run.spans[-1] == extra


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_damaged_table_falls_back_to_events(tmp_path: Path, damage: str) -> None:
    spans = _spans()
    _write_run(tmp_path / "r", spans)
    path = tmp_path / "r" / TABLE_FILE
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"not a table" * 10, "empty": b""}[damage])
    run = load_run(tmp_path / "r")
    assert run.spans == spans


def test_cache_table_writes_only_for_complete_runs(tmp_path: Path) -> None:
    spans = _spans()
    _write_run(tmp_path / "done", spans, table=False)
    _write_run(tmp_path / "killed", spans, table=False, complete=False)
    load_run(tmp_path / "done")
    assert not (tmp_path / "done" / TABLE_FILE).exists()  # loading alone writes nothing
    load_run(tmp_path / "done", cache_table=True)
    load_run(tmp_path / "killed", cache_table=True)
    assert (tmp_path / "done" / TABLE_FILE).exists()
    assert not (tmp_path / "killed" / TABLE_FILE).exists()
    assert load_run(tmp_path / "done").spans == spans


def test_report_command_writes_the_table(tmp_path: Path, capsys: Any) -> None:
    from mltrace.cli import main

    _write_run(tmp_path / "r", _spans(), table=False)
    assert main(["report", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / TABLE_FILE).exists()

    def without_peaks_source(text: str) -> list[str]:  # "measured" the first time, "cache" after
        return [line for line in text.splitlines() if not line.startswith("Roofline peaks")]

    first = without_peaks_source(capsys.readouterr().out)
    assert main(["report", str(tmp_path / "r")]) == 0
    assert without_peaks_source(capsys.readouterr().out) == first


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Run]:
    base = tmp_path_factory.mktemp("gpu")
    import_kineto(KINETO / "a100_alexnet_train.json.gz", base / "with")
    assert (base / "with" / TABLE_FILE).exists()  # written when the run is finalized
    shutil.copytree(base / "with", base / "without")
    (base / "without" / TABLE_FILE).unlink()
    return load_run(base / "with"), load_run(base / "without")


def test_gpu_run_analysis_is_the_same_from_the_table(gpu_runs: tuple[Run, Run]) -> None:
    from_table, from_json = gpu_runs
    a, b = analyze(from_table, CPU), analyze(from_json, CPU)
    assert a.kernels and a.runtime and any(r.device_ns for r in a.ops)
    assert _figures(a) == _figures(b)
    layers = [x for x in a.breakdown.layers if x.level is Level.LAYER][:10]
    assert cross_stack_chains(from_table, layers) == cross_stack_chains(from_json, layers)


def test_writing_a_table_holds_about_what_its_attribute_sets_take(tmp_path: Path) -> None:
    """orjson's results hold a buffer of 4 KB or more whatever their length: the writer keeps
    only trimmed copies (an op-level run, every attribute map its own, held 4 KB a span)."""
    import tracemalloc

    from mltrace.run.jsoncodec import dumps, trimmed

    attrs = [{"ml.seq": i, "ml.input.shapes": [[1, i]]} for i in range(3000)]
    spans = [Span(i + 1, None, Level.OP, "aten::add", i * 10, i * 10 + 5, 1, a) for i, a in enumerate(attrs)]
    _write_run(tmp_path / "r", spans, table=False)
    run = load_run(tmp_path / "r")
    run.spans  # noqa: B018 - loaded before measuring
    tracemalloc.start()
    try:
        kept = trimmed(dumps({"k": 1}))
        held_by_one = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        write_table(tmp_path / "r", run)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert kept == b'{"k":1}' and held_by_one < 200
    assert peak < 1000 * len(spans), f"{peak / len(spans):.0f} bytes a span"
    assert load_run(tmp_path / "r").table.attrs(2999) == {"ml.seq": 2999, "ml.input.shapes": [[1, 2999]]}


def _columns(table: Any) -> dict[str, list[Any]]:
    return {c: getattr(table, c).tolist() for c in ("id", "parent_id", "level", "start", "end", "track", "has_flops")}


def test_a_table_spilled_a_part_at_a_time_is_the_table_written_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``TableWriter(spill=...)``, its parts added one by one and kept in files until the end,
    writes the table ``write_table`` writes for the same spans: the same rows and attributes,
    a CRC-32 that checks; its spill files are gone afterwards. With at most two attribute sets
    remembered, a set seen again is stored again, and every row still reads its own."""
    from mltrace.run import table as table_module
    from mltrace.run.table import TableWriter, read_table

    spans = _spans()
    whole = _write_run(tmp_path / "whole", spans)
    run_dir = tmp_path / "parts"
    shutil.copytree(tmp_path / "whole", run_dir)
    (run_dir / TABLE_FILE).unlink()
    monkeypatch.setattr(table_module, "_INDEX_MAX", 2)
    writer = TableWriter(spill=run_dir / TABLE_FILE)
    for part in (spans[:2], spans[2:3], [], spans[3:]):
        writer.add(part)
    spilled = sorted(f"{TABLE_FILE}.{key}.streamed.tmp" for key in table_module._SPILLED)
    assert sorted(p.name for p in run_dir.glob("*.streamed.tmp")) == spilled
    written = writer.write(run_dir / TABLE_FILE, b"{}", run_dir / EVENTS_FILE)
    assert list(run_dir.glob("*.tmp")) == []
    read = read_table(run_dir / TABLE_FILE, run_dir / EVENTS_FILE)  # the checksum verified
    assert read is not None
    expected = read_table(whole.path / TABLE_FILE, whole.path / EVENTS_FILE)
    assert expected is not None
    for table in (written, read[0]):
        assert _columns(table) == _columns(expected[0])
        assert [table.names[i] for i in table.name.tolist()] == [s.name for s in spans]
        assert [table.attrs(r) for r in range(len(spans))] == [s.attrs for s in spans]
    again = [Span(i, None, Level.OP, "op", i, i + 1, 1, {"k": k}) for i, k in enumerate("xyzx", 1)]
    spill = TableWriter(spill=tmp_path / "again.bin")
    spill.add(again)  # x, y; the index is full at z and starts over; x is stored again
    stored = spill.write(tmp_path / "again.bin", b"{}", run_dir / EVENTS_FILE)
    assert stored.attr_set_count == 4 and [stored.attrs(r) for r in range(4)] == [s.attrs for s in again]


def test_a_spilling_table_writer_discarded_leaves_no_file(tmp_path: Path) -> None:
    from mltrace.run.table import TableWriter

    writer = TableWriter(spill=tmp_path / TABLE_FILE)
    writer.add(_spans())
    assert list(tmp_path.glob("*.streamed.tmp"))
    writer.discard()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("size", [0, 1, 7, 8, 255, 4096, 100_003])
def test_crc32_combine_is_the_crc_of_the_concatenation(size: int) -> None:
    """A spilled array's checksum is combined into the table's without reading it again."""
    import zlib

    from mltrace.run.table import crc32_combine

    head, tail = bytes(range(256)) * 3 + b"head", bytes((i * 7919) % 251 for i in range(size))
    assert crc32_combine(zlib.crc32(head), zlib.crc32(tail), len(tail)) == zlib.crc32(head + tail)
    assert crc32_combine(0, zlib.crc32(tail), len(tail)) == zlib.crc32(tail)


@pytest.mark.parametrize(
    ("ids", "parents"),
    [
        ([5, 1, 3, 2], [1, -1, 1, 9]),  # dense ids: looked up by id
        ([7, 7, 2], [7, 2, -1]),  # an id on two rows: the first
        ([10**12, 3, 5], [3, 10**12, 4]),  # a large id: sorted
        ([-4, 2, 6], [2, -4, 6]),  # a negative id: sorted
        ([], []),
    ],
)
def test_parent_rows_by_lookup_or_by_sorting_agree(ids: list[int], parents: list[int]) -> None:
    """Each span's parent row, found through an array indexed by id where the ids allow it and
    by sorting otherwise: the same rows, the first of an id's rows, -1 for a missing parent."""
    import numpy as np

    from mltrace.run.table import parent_rows

    got = parent_rows(np.array(ids, dtype=np.int64), np.array(parents, dtype=np.int64)).tolist()
    expected = [next((row for row, i in enumerate(ids) if i == p), -1) if p >= 0 else -1 for p in parents]
    assert got == expected
