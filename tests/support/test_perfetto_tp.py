"""Tests for the Perfetto WASM trace-processor harness (tests/support/perfetto_tp.py).

The trace built here has what mltrace's exporter writes: process and thread tracks, a
GPU-stream track, interned names and categories, nested slices, debug annotations, a
launch -> kernel flow across tracks, and a counter track. The real trace processor
must read it back exactly.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from .perfetto_tp import (
    CHROMIUM_ENV,
    ENGINE_DIR_ENV,
    PerfettoTPError,
    _Protos,
    chromium_path,
    decode_cells,
    query_trace,
    require_trace_processor,
)

SEQ = 1
PID, TID = 4242, 4243
PROCESS_TRACK, THREAD_TRACK, STREAM_TRACK, COUNTER_TRACK = 1, 2, 3, 4
FLOW_ID = 77

NAMES = {1: "resnet18", 2: "layer1.0.conv1", 3: "aten::conv2d", 4: "aten::relu", 5: "implicit_gemm_kernel"}
CATEGORIES = {1: "model", 2: "layer", 3: "op", 4: "kernel"}
ANNOTATION_NAMES = {1: "ml.layer.type"}

# (ts ns, track, type, name iid, category iid) in timestamp order; END events need no name.
B, E = pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_SLICE_END
EVENTS = [
    (1000, THREAD_TRACK, B, 1, 1),
    (2000, THREAD_TRACK, B, 2, 2),
    (3000, THREAD_TRACK, B, 3, 3),
    (4000, THREAD_TRACK, E, 0, 0),
    (4500, STREAM_TRACK, B, 5, 4),
    (5000, THREAD_TRACK, B, 4, 3),
    (6000, THREAD_TRACK, E, 0, 0),
    (6500, STREAM_TRACK, E, 0, 0),
    (7000, THREAD_TRACK, E, 0, 0),
    (9000, THREAD_TRACK, E, 0, 0),
]
COUNTERS = [(1000, 0), (4500, 87.5), (6500, 12)]  # (ts ns, GPU utilisation %)


def build_trace() -> bytes:
    """Returns a small native TrackEvent trace (see the module docstring)."""
    trace = pb.Trace()

    def packet(ts: int | None = None) -> Any:
        p = trace.packet.add()
        p.trusted_packet_sequence_id = SEQ
        if ts is not None:
            p.timestamp = ts
        return p

    first = packet()
    first.sequence_flags = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    first.track_descriptor.uuid = PROCESS_TRACK
    first.track_descriptor.process.pid = PID
    first.track_descriptor.process.process_name = "python infer.py"
    for iid, name in NAMES.items():
        first.interned_data.event_names.add(iid=iid, name=name)
    for iid, name in CATEGORIES.items():
        first.interned_data.event_categories.add(iid=iid, name=name)
    for iid, name in ANNOTATION_NAMES.items():
        first.interned_data.debug_annotation_names.add(iid=iid, name=name)

    thread = packet().track_descriptor
    thread.uuid, thread.parent_uuid = THREAD_TRACK, PROCESS_TRACK
    thread.thread.pid, thread.thread.tid, thread.thread.thread_name = PID, TID, "MainThread"
    stream = packet().track_descriptor
    stream.uuid, stream.parent_uuid, stream.name = STREAM_TRACK, PROCESS_TRACK, "GPU 0 stream 7"
    counter = packet().track_descriptor
    counter.uuid, counter.parent_uuid, counter.name = COUNTER_TRACK, PROCESS_TRACK, "gpu.utilization"
    counter.counter.unit_name = "%"

    counters = list(COUNTERS)
    for ts, track, kind, name_iid, category_iid in EVENTS:
        while counters and counters[0][0] <= ts:
            c_ts, value = counters.pop(0)
            c = packet(c_ts)
            c.sequence_flags = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
            c.track_event.type = pb.TrackEvent.TYPE_COUNTER
            c.track_event.track_uuid = COUNTER_TRACK
            if isinstance(value, float):
                c.track_event.double_counter_value = value
            else:
                c.track_event.counter_value = value
        p = packet(ts)
        p.sequence_flags = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
        ev = p.track_event
        ev.type, ev.track_uuid = kind, track
        if name_iid:
            ev.name_iid = name_iid
            ev.category_iids.append(category_iid)
        if NAMES.get(name_iid) == "layer1.0.conv1":
            ev.debug_annotations.add(name_iid=1, string_value="Conv2d")
            ev.debug_annotations.add(name="flops", int_value=118013952)
        if NAMES.get(name_iid) == "aten::conv2d":
            ev.flow_ids.append(FLOW_ID)
        if NAMES.get(name_iid) == "implicit_gemm_kernel":
            ev.terminating_flow_ids.append(FLOW_ID)
    assert not counters, "every counter sample is before the last event"
    data: bytes = trace.SerializeToString()
    return data


QUERIES = {
    "stats_errors": """
        select name, idx, severity, source, value from stats
        where severity in ('error', 'data_loss') and value > 0""",
    # Some parse problems are counted at 'info' severity (track_event_tokenizer_errors).
    "stats_info_problems": """
        select name, value from stats
        where severity = 'info' and value > 0
          and (name glob '*error*' or name glob '*skipped*' or name glob '*invalid*'
               or name glob '*dropped*' or name glob '*mismatch*')""",
    "per_category": "select category, count(*) as n from slice group by category order by category",
    "nesting": """
        select s.name, s.category, s.ts, s.dur, s.depth, p.name as parent
        from slice s left join slice p on s.parent_id = p.id order by s.ts""",
    "thread_slices": """
        select s.name, t.tid, t.name as thread, p.pid, p.name as process
        from slice s join thread_track tt on s.track_id = tt.id
        join thread t using (utid) join process p using (upid)
        where s.depth = 0""",
    "kernel_track": """
        select s.name, tr.name as track from slice s join track tr on s.track_id = tr.id
        where s.category = 'kernel'""",
    "flows": """
        select so.name as source, si.name as target
        from flow f join slice so on f.slice_out = so.id join slice si on f.slice_in = si.id""",
    "counters": """
        select t.name as track, c.ts, c.value
        from counter c join counter_track t on c.track_id = t.id order by c.ts""",
    "annotations": """
        select key, display_value from args
        where arg_set_id = (select arg_set_id from slice where name = 'layer1.0.conv1')
          and key glob 'debug.*'
        order by key""",
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, object]]]:
    """Runs every query in QUERIES on build_trace() once, in the real trace processor."""
    require_trace_processor()
    path = tmp_path_factory.mktemp("perfetto") / "trace.pftrace"
    path.write_bytes(build_trace())
    return query_trace(path, QUERIES)


def test_stats_have_no_errors(results: dict[str, list[dict[str, object]]]) -> None:
    assert results["stats_errors"] == []
    assert results["stats_info_problems"] == []


def test_slice_count_per_category(results: dict[str, list[dict[str, object]]]) -> None:
    assert results["per_category"] == [
        {"category": "kernel", "n": 1},
        {"category": "layer", "n": 1},
        {"category": "model", "n": 1},
        {"category": "op", "n": 2},
    ]


def test_nesting_depth_and_parents(results: dict[str, list[dict[str, object]]]) -> None:
    assert results["nesting"] == [
        {"name": "resnet18", "category": "model", "ts": 1000, "dur": 8000, "depth": 0, "parent": None},
        {"name": "layer1.0.conv1", "category": "layer", "ts": 2000, "dur": 5000, "depth": 1, "parent": "resnet18"},
        {"name": "aten::conv2d", "category": "op", "ts": 3000, "dur": 1000, "depth": 2, "parent": "layer1.0.conv1"},
        {"name": "implicit_gemm_kernel", "category": "kernel", "ts": 4500, "dur": 2000, "depth": 0, "parent": None},
        {"name": "aten::relu", "category": "op", "ts": 5000, "dur": 1000, "depth": 2, "parent": "layer1.0.conv1"},
    ]


def test_tracks(results: dict[str, list[dict[str, object]]]) -> None:
    assert results["thread_slices"] == [
        {"name": "resnet18", "tid": TID, "thread": "MainThread", "pid": PID, "process": "python infer.py"},
    ]
    assert results["kernel_track"] == [{"name": "implicit_gemm_kernel", "track": "GPU 0 stream 7"}]


def test_flow_links_launch_to_kernel(results: dict[str, list[dict[str, object]]]) -> None:
    assert results["flows"] == [{"source": "aten::conv2d", "target": "implicit_gemm_kernel"}]


def test_counter_values(results: dict[str, list[dict[str, object]]]) -> None:
    assert results["counters"] == [
        {"track": "gpu.utilization", "ts": 1000, "value": 0.0},
        {"track": "gpu.utilization", "ts": 4500, "value": 87.5},
        {"track": "gpu.utilization", "ts": 6500, "value": 12.0},
    ]


def test_debug_annotations(results: dict[str, list[dict[str, object]]]) -> None:
    # The trace processor (v52) turns the dots of an annotation name into underscores:
    # "ml.layer.type" is stored under the key "debug.ml_layer_type".
    assert results["annotations"] == [
        {"key": "debug.flops", "display_value": "118013952"},
        {"key": "debug.ml_layer_type", "display_value": "Conv2d"},
    ]


def test_unreadable_file_raises_with_the_parse_error(tmp_path: Path) -> None:
    require_trace_processor()
    path = tmp_path / "garbage.pftrace"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(PerfettoTPError) as info:
        query_trace(path, {"stats_errors": QUERIES["stats_errors"]})
    assert info.value.load_errors[0] == "parse: Unknown trace type provided (ERR:fmt)"
    assert "Unknown trace type" in str(info.value)


def test_malformed_track_event_is_counted_in_stats(tmp_path: Path) -> None:
    require_trace_processor()
    # One more packet whose track_event (field 11) holds 2 bytes that are not a message.
    path = tmp_path / "bad_event.pftrace"
    path.write_bytes(build_trace() + b"\x0a\x04\x5a\x02\xff\xff")
    rows = query_trace(path, {"problems": QUERIES["stats_info_problems"]})["problems"]
    assert rows == [{"name": "track_event_tokenizer_errors", "value": 1}]


def test_sql_error_names_the_query_and_keeps_other_results(tmp_path: Path) -> None:
    require_trace_processor()
    path = tmp_path / "trace.pftrace"
    path.write_bytes(build_trace())
    with pytest.raises(PerfettoTPError) as info:
        query_trace(path, {"ok": "select count(*) as n from slice", "bad": "select x from no_such_table"})
    assert list(info.value.query_errors) == ["bad"]
    assert "no such table: no_such_table" in info.value.query_errors["bad"]
    assert info.value.results == {"ok": [{"n": 5}]}


def test_browser_failure_reports_its_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "fake-chromium"
    fake.write_text("#!/bin/sh\necho 'fake chromium: cannot start' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    engine = tmp_path / "engine"
    engine.mkdir()
    for name in ("engine_bundle.js", "trace_processor.wasm"):
        (engine / name).write_bytes(b"")
    monkeypatch.setenv(CHROMIUM_ENV, str(fake))
    monkeypatch.setenv(ENGINE_DIR_ENV, str(engine))
    path = tmp_path / "trace.pftrace"
    path.write_bytes(build_trace())
    with pytest.raises(PerfettoTPError, match="exited with status 3") as info:
        query_trace(path, {"n": "select 1 as n"}, timeout_s=30)
    assert "fake chromium: cannot start" in str(info.value)


@pytest.mark.parametrize(("ci", "outcome"), [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_missing_chromium_skips_except_on_ci(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ci: str, outcome: type[BaseException]
) -> None:
    monkeypatch.setenv(CHROMIUM_ENV, str(tmp_path / "no-such-chromium"))
    monkeypatch.setenv("CI", ci)
    assert chromium_path() is None
    with pytest.raises(outcome, match="chromium is not installed"):
        require_trace_processor()


def test_decode_cells_reads_every_cell_type() -> None:
    batch = _Protos.get().Rpc().query_result.batch.add()
    batch.cells.extend([2, 4, 1, 3, 5, 2])  # varint string null | float64 blob varint
    batch.varint_cells.extend([7, -1])
    batch.float64_cells.append(2.5)
    batch.blob_cells.append(b"\x00\x01")
    batch.string_cells = "caf\u00e9\0"
    rows = decode_cells(["a", "b", "c"], batch)
    assert rows == [{"a": 7, "b": "caf\u00e9", "c": None}, {"a": 2.5, "b": b"\x00\x01", "c": -1}]


def test_decode_cells_rejects_partial_rows() -> None:
    batch = _Protos.get().Rpc().query_result.batch.add()
    batch.cells.extend([1, 1, 1])
    with pytest.raises(PerfettoTPError, match="3 cells do not fill rows of 2 columns"):
        decode_cells(["a", "b"], batch)


def test_chromium_path_honours_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "my-chrome"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv(CHROMIUM_ENV, str(fake))
    assert chromium_path() == str(fake)
