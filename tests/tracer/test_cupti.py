"""CuptiSource: records → spans and flows, error messages, and every GPU-less path.

This machine has no GPU and no CUDA driver. What runs for real here: the
conversion from a table of records shaped like cupti-python's, the error
mapping (against cupti-python's own enums when it is installed), the
availability checks, cupti-python's own "driver not found" failure, and a CLI
run at ``--level kernel``. CUPTI errors that need a driver to happen
(insufficient privileges, a second subscriber) are raised by a stand-in
module that uses cupti-python's real ``cuptiError`` where it is installed.
"""

from __future__ import annotations

import ctypes
import gzip
import importlib.util
import itertools
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import mltrace_cmd, run_cli
from mltrace.config import ProfileOptions
from mltrace.run.events import Span, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import load_run
from mltrace.settings import CUPTI_DUMP, KERNEL_PATH
from mltrace.tracer.session import Session
from mltrace.tracer.sources import cupti as cs
from mltrace.tracer.sources.cupti import (
    ClockPair,
    CuptiClock,
    CuptiSource,
    cuda_driver_reason,
    cupti_error_message,
    cupti_records_to_events,
    describe_cupti_exception,
    sample_clock_pair,
)
from mltrace.tracer.sources.nvml import NvmlSampler
from mltrace.tracer.tracks import TrackRegistry

HAVE_CUPTI = importlib.util.find_spec("cupti") is not None
FILL = "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEENS_6detail5ArrayIPcLi1EEEEEviT0_T1_"
FILL_DEMANGLED = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1> >"
    "(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)"
)
OFFSET = 1_000_000  # session ns − CUPTI ns in the table below


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's own MLTRACE_KERNEL_PATH / MLTRACE_CUPTI_DUMP must not change these tests."""
    monkeypatch.delenv(KERNEL_PATH.name, raising=False)
    monkeypatch.delenv(CUPTI_DUMP.name, raising=False)


def _kernel(corr: int, start: int, end: int, stream: int = 7, name: str = FILL, **extra: Any) -> dict[str, Any]:
    rec = {
        "kind": "CONCURRENT_KERNEL",
        "start": start,
        "end": end,
        "correlation_id": corr,
        "device_id": 0,
        "context_id": 1,
        "stream_id": stream,
        "name": name,
        "grid_x": 10,
        "grid_y": 1,
        "grid_z": 1,
        "block_x": 128,
        "block_y": 1,
        "block_z": 1,
        "registers_per_thread": 16,
        "static_shared_memory": 0,
        "dynamic_shared_memory": 1024,
        "graph_id": 0,
    }
    rec.update(extra)
    return rec


def _api(kind: str, name: str, corr: int, start: int, end: int, tid: int = 11) -> dict[str, Any]:
    return {"kind": kind, "start": start, "end": end, "correlation_id": corr, "cbid": 13, "thread_id": tid, "process_id": 1, "name": name}


#: A table shaped like cupti-python records (RECORD_FIELDS), CUPTI clock (ns).
RECORDS: list[Any] = [
    _api("RUNTIME", "cudaLaunchKernel_v7000", 1, 100, 150),
    _api("DRIVER", "cuLaunchKernel", 1, 110, 140),  # same id as the runtime call: the runtime call launches
    _kernel(1, 200, 260),
    _api("RUNTIME", "cudaMemcpyAsync_v3020", 2, 300, 320),
    {
        "kind": 1,  # MEMCPY, as an int
        "start": 330,
        "end": 400,
        "correlation_id": 2,
        "device_id": 0,
        "context_id": 1,
        "stream_id": 7,
        "copy_kind": 1,
        "src_kind": 2,
        "dst_kind": 3,
        "bytes": 4096,
    },
    _api("RUNTIME", "cudaMemsetAsync_v3020", 3, 410, 420),
    SimpleNamespace(  # an object, as cupti-python hands them over
        kind=2, start=430, end=440, correlation_id=3, device_id=0, context_id=1, stream_id=7, bytes=512, value=0, memory_kind=3
    ),
    _api("RUNTIME", "cudaGraphLaunch_v10000", 4, 450, 470, tid=12),
    _kernel(4, 500, 510, stream=9, name="triton_poi_fused_add_0", graph_id=5),
    _kernel(4, 510, 520, stream=9, name="triton_poi_fused_add_1", graph_id=5),
    _kernel(4, 520, 530, stream=9, name="triton_poi_fused_add_2", graph_id=5),
    _kernel(99, 600, 610),  # no API call with this id
    _kernel(5, 0, 0),  # no timestamps
    {"kind": "SYNCHRONIZATION", "start": 700, "end": 800, "correlation_id": 6, "context_id": 1, "stream_id": 7, "type": 3},
    {"kind": "SYNCHRONIZATION", "start": 700, "end": 800, "correlation_id": 7, "context_id": 1, "stream_id": 0xFFFFFFFF, "type": 4},
    {"kind": "OVERHEAD", "start": 1, "end": 2},
]


def _convert(records: list[Any]) -> tuple[cs.CuptiEvents, TrackRegistry]:
    tracks = TrackRegistry(pid=4242)
    ids = itertools.count(1)
    return cupti_records_to_events(records, tracks, lambda: next(ids), lambda ns: ns + OFFSET, {12: "graph-thread"}), tracks


def test_records_become_spans_on_stream_and_thread_tracks() -> None:
    result, tracks = _convert(RECORDS)
    by_name = {s.name: s for s in result.spans if s.attrs.get("gpu.correlation_id") != 99}
    kernel = by_name[FILL_DEMANGLED]
    stream7 = tracks.gpu_stream(0, 7)
    assert kernel.level is Level.KERNEL and kernel.track_id == stream7.id
    assert (kernel.start_ns, kernel.end_ns) == (200 + OFFSET, 260 + OFFSET)
    assert kernel.attrs == {
        "gpu.device": 0,
        "gpu.stream": 7,
        "gpu.activity": "kernel",
        "gpu.kernel.name": FILL_DEMANGLED,
        "gpu.grid": [10, 1, 1],
        "gpu.block": [128, 1, 1],
        "gpu.registers_per_thread": 16,
        "gpu.shared_memory_bytes": 1024,
        "gpu.context": 1,
        "gpu.correlation_id": 1,
    }
    memcpy = by_name["Memcpy HtoD (Pinned -> Device)"]
    assert memcpy.track_id == stream7.id
    assert memcpy.attrs["gpu.activity"] == "gpu_memcpy" and memcpy.attrs["gpu.memcpy.kind"] == "HtoD"
    assert memcpy.attrs["gpu.bytes"] == 4096
    memset = by_name["Memset (Device)"]
    assert memset.attrs["gpu.activity"] == "gpu_memset" and memset.attrs["gpu.bytes"] == 512
    launch = by_name["cudaLaunchKernel"]
    thread11 = tracks.thread(11)
    assert launch.track_id == thread11.id and thread11.kind == TrackKind.THREAD and thread11.pid == 4242
    assert launch.attrs == {"cuda.api.name": "cudaLaunchKernel", "cuda.api.kind": "runtime", "cuda.api.cbid": 13, "gpu.correlation_id": 1}
    assert by_name["cuLaunchKernel"].attrs["cuda.api.kind"] == "driver"
    assert by_name["cuLaunchKernel"].track_id == thread11.id
    assert tracks.thread(12).name == "graph-thread"
    assert all(s.parent_id is None for s in result.spans)  # parents come from the correlator passes
    assert {t.id for t in result.tracks} == {stream7.id, tracks.gpu_stream(0, 9).id, thread11.id, tracks.thread(12).id}


def test_one_launch_flow_per_activity_and_graph_launch_reaches_all_its_kernels() -> None:
    result, _ = _convert(RECORDS)
    by_id = {s.id: s for s in result.spans}
    flows = [(by_id[f.from_span].name, by_id[f.to_span].name) for f in result.flows]
    assert all(f.kind == "launch" for f in result.flows)
    assert sorted(flows) == sorted(
        [
            ("cudaLaunchKernel", FILL_DEMANGLED),  # the runtime call, not the driver call under it
            ("cudaMemcpyAsync", "Memcpy HtoD (Pinned -> Device)"),
            ("cudaMemsetAsync", "Memset (Device)"),
            ("cudaGraphLaunch", "triton_poi_fused_add_0"),
            ("cudaGraphLaunch", "triton_poi_fused_add_1"),
            ("cudaGraphLaunch", "triton_poi_fused_add_2"),
        ]
    )
    graph_kernels = [s for s in result.spans if s.name.startswith("triton_")]
    assert {s.attrs["gpu.graph.id"] for s in graph_kernels} == {5}
    st = result.stats
    assert st.gpu_activities == 7 and st.gpu_activities_launched == 6
    assert st.unmatched_correlation_ids == 1 and st.unmatched_examples == [99]
    assert st.skipped == {
        "SYNCHRONIZATION (context-wide)": 1,
        "kind OVERHEAD": 1,
        "no timestamps": 1,
    }
    assert st.records_by_kind["CONCURRENT_KERNEL"] == 6 and st.records_by_kind["MEMCPY"] == 1


def test_synchronization_becomes_an_instant_on_its_stream() -> None:
    result, tracks = _convert(RECORDS)
    assert len(result.instants) == 1
    sync = result.instants[0]
    assert sync.name == "Stream Sync" and sync.track_id == tracks.gpu_stream(0, 7).id
    assert sync.ts_ns == 700 + OFFSET
    assert sync.attrs == {"cuda.sync.kind": "Stream Sync", "cuda.sync.duration_ns": 100, "gpu.correlation_id": 6}


def test_api_call_without_a_resolved_name_is_named_by_cbid() -> None:
    named = _api("DRIVER", "", 1, 10, 20)  # cbid 13: cuCtxDetach in every CUDA
    unnamed = {**_api("RUNTIME", "", 2, 30, 40), "cbid": 531}  # a placeholder (cuda531) in CUDA 13's enum
    result, _ = _convert([named, unnamed])
    assert [s.name for s in result.spans] == ["cuCtxDetach", "runtime API cbid 531"]
    assert [s.attrs["cuda.api.cbid"] for s in result.spans] == [13, 531]


def test_collector_names_what_get_callback_name_cannot() -> None:
    collector = cs._Collector(_StandInCupti(), 1 << 20)  # type: ignore[arg-type]
    assert collector.api_name("RUNTIME", 211) == "cudaLaunchKernel_v7000"  # CUPTI's own name first
    assert collector.api_name("RUNTIME", 468) == "cudaGetDriverEntryPointByVersion"  # the stand-in raises: the table's
    assert collector.api_name("RUNTIME", 531) is None  # no name anywhere: to_events falls back to the cbid


class _Record:
    """A record shaped like cupti-python's: its fields are properties of a slotted class, as on
    the extension's classes; ``missing`` names a field this version lacks."""

    __slots__ = ("_values", "_missing")

    def __init__(self, missing: str = "", **values: Any) -> None:
        self._values, self._missing = values, missing

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == self._missing:
            raise AttributeError(name)
        return self._values.get(name, 0)


def test_collector_copies_each_records_fields_and_names_api_calls() -> None:
    """``buffer_completed`` (on CUPTI's thread) copies each converted kind's fields into a dict:
    enum members as ints, a field the record lacks as None, an API call named; kinds it does
    not convert are counted, not copied."""
    import enum

    class CopyKind(enum.IntEnum):  # cupti-python's enums are int enums
        HTOD = 1

    class Bytes:  # a number that is not an int (a ctypes or numpy value): int() of it
        def __int__(self) -> int:
            return 64

    collector = cs._Collector(_StandInCupti(), 1 << 20)  # type: ignore[arg-type]
    collector.active = True
    kernel = _Record(kind="CONCURRENT_KERNEL", start=10, end=20, correlation_id=7, name="k", grid_x=4, graph_id=3)
    old_kernel = _Record(missing="graph_id", kind="CONCURRENT_KERNEL", start=30, end=40, correlation_id=8, name="k")
    memcpy = _Record(kind="MEMCPY", start=1, end=2, correlation_id=9, copy_kind=CopyKind.HTOD, bytes=Bytes())
    api = _Record(kind="RUNTIME", start=0, end=5, correlation_id=7, cbid=211)
    other = _Record(kind="EXTERNAL_CORRELATION")
    collector.buffer_completed([kernel, old_kernel, memcpy, api, other])
    got = collector.take()
    assert [r["kind"] for r in got] == ["CONCURRENT_KERNEL", "CONCURRENT_KERNEL", "MEMCPY", "RUNTIME"]
    assert all(list(r) == ["kind", *cs.RECORD_FIELDS[r["kind"]]] + (["name"] if r["kind"] == "RUNTIME" else []) for r in got)
    assert (got[0]["grid_x"], got[0]["graph_id"], got[1]["graph_id"], got[1]["start"]) == (4, 3, None, 30)
    assert got[2]["copy_kind"] == 1 and type(got[2]["bytes"]) is int and got[2]["bytes"] == 64
    assert got[3]["name"] == "cudaLaunchKernel_v7000"
    assert collector.not_copied == Counter({"EXTERNAL_CORRELATION": 1}) and collector.errors == 0


# -- generated cbid names (scripts/gen_cuda_cbid_names.py → cuda_cbids.py) -------------------------


def _generator() -> Any:
    path = Path(__file__).resolve().parents[2] / "scripts" / "gen_cuda_cbid_names.py"
    spec = importlib.util.spec_from_file_location("gen_cuda_cbid_names", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not HAVE_CUPTI, reason="cupti-python not installed")
def test_cbid_module_is_what_the_generator_writes_now() -> None:
    """Regenerates the installed cupti-python's major version (the other majors' tables come
    from wheels not at hand here, so they are taken from the module) and compares the text."""
    from mltrace.formats import cuda_cbids

    gen = _generator()
    installed = gen.read_enums()
    versions, tables = gen.build_tables([installed])
    (major,) = versions
    if cuda_cbids.SOURCES.get(major) != versions[major]:
        for api, checked in (("runtime", cuda_cbids.RUNTIME), ("driver", cuda_cbids.DRIVER)):
            shared = set(checked[major]) & set(tables[api][major])
            assert {i: checked[major][i] for i in shared} == {i: tables[api][major][i] for i in shared}
        pytest.skip(f"installed {versions[major]}, module from {cuda_cbids.SOURCES.get(major)}: shared ids agree")
    all_versions = {**cuda_cbids.SOURCES, **versions}
    all_tables = {
        "runtime": {**cuda_cbids.RUNTIME, major: tables["runtime"][major]},
        "driver": {**cuda_cbids.DRIVER, major: tables["driver"][major]},
    }
    expected = gen.render(dict(sorted(all_versions.items())), {api: dict(sorted(t.items())) for api, t in all_tables.items()})
    assert Path(cuda_cbids.__file__).read_text() == expected


def test_cbid_tables_cover_cuda_12_and_13() -> None:
    from mltrace.formats.cuda_cbids import DRIVER, RUNTIME, SOURCES, api_name

    assert set(SOURCES) == set(RUNTIME) == set(DRIVER) == {12, 13}
    assert api_name("runtime", 468, 13) == api_name("runtime", 468) == "cudaGetDriverEntryPointByVersion"
    assert api_name("runtime", 211, 12) == api_name("runtime", 211, 13) == "cudaLaunchKernel"
    assert api_name("driver", 307, 13) == "cuLaunchKernel"
    # the one naming difference the two majors keep: CUDA 12 calls the function by its _v2 name
    assert (api_name("runtime", 440, 12), api_name("runtime", 440, 13)) == ("cudaGetDeviceProperties_v2", "cudaGetDeviceProperties")
    assert api_name("runtime", 470, 12) == "cudaLibraryLoadData"  # a placeholder in 12.8's enum, named by 13's
    assert api_name("runtime", 487, 12) is None and api_name("runtime", 487, 13) == "cudaMemPrefetchBatchAsync"
    assert api_name("runtime", 468, 11) == api_name("runtime", 468)  # no table for 11: the newest
    for tables in (RUNTIME, DRIVER):
        for table in tables.values():
            # names, not placeholders or CUPTI's version suffix
            assert not [n for n in table.values() if re.fullmatch(r"(cuda|reserved)\d+", n) or re.search(r"_v\d{4,}$", n)]
    # the ids of CUDA 12 mean the same in 13 (names agree but for the _v2 spellings)
    for tables in (RUNTIME, DRIVER):
        differ = {i for i, name in tables[12].items() if i in tables[13] and tables[13][i] != name}
        assert all(tables[12][i].replace("_v2", "").replace("_v3", "") == tables[13][i] for i in differ), differ


def test_recorded_api_names_are_the_tables_names() -> None:
    """Every API record of the H100 fixtures was named live by CUPTI 13.0's get_callback_name:
    the CUDA 13 table gives the same name for each cbid, and records stripped of their names
    replay without one unnamed API call."""
    from mltrace.formats.cuda_cbids import api_name

    for fixture in ("h100_cupy_records.json.gz", "h100_torch_records.json.gz"):
        doc = _recorded(fixture)
        api = [r for r in doc["records"] if r["kind"] in ("RUNTIME", "DRIVER")]
        assert api
        live = {(r["kind"], r["cbid"], cs.api_display_name(r["name"])) for r in api}
        assert live == {(k, i, api_name(k.lower(), i, 13)) for k, i, _ in live}
        stripped = {**doc, "records": [{**r, "name": None} if r in api else r for r in doc["records"]]}
        result, _ = _convert_recorded(stripped)
        calls = [s for s in result.spans if "cuda.api.kind" in s.attrs]
        assert len(calls) == len(api)
        assert not [s for s in calls if "cbid" in s.name]
        assert {(s.attrs["cuda.api.kind"], s.attrs["cuda.api.cbid"], s.name) for s in calls} == {(k.lower(), i, n) for k, i, n in live}


@pytest.mark.skipif(not HAVE_CUPTI, reason="cupti-python not installed")
def test_enum_tables_match_cupti_python() -> None:
    from cupti import cupti

    for value, name in cs.ACTIVITY_KINDS.items():
        assert int(getattr(cupti.ActivityKind, name)) == value
    assert {int(m): m.name for m in cupti.ActivityMemcpyKind if m.name != "FORCE_INT"} == {k: v.upper() for k, v in cs.MEMCPY_KINDS.items()}
    assert {int(m) for m in cupti.ActivityMemoryKind if m.name != "FORCE_INT"} == set(cs.MEMORY_KINDS)
    assert {int(m) for m in cupti.ActivitySynchronizationType if m.name != "FORCE_INT"} == set(cs.SYNC_TYPES)
    assert int(cupti.ActivityThreadIdType.SYSTEM) == cs._THREAD_ID_SYSTEM
    for code, (name, _) in cs.CUPTI_ERRORS.items():
        assert "CUPTI_" + cupti.Result(code).name == name
    for kind in cs.ENABLED_KINDS:
        assert hasattr(cupti.ActivityKind, kind)


# -- errors and availability -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (35, "CUPTI_ERROR_INSUFFICIENT_PRIVILEGES: "),
        (39, "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED: CUPTI already in use by another subscriber"),
        (15, "CUPTI_ERROR_NOT_INITIALIZED: "),
        (14, "CUPTI_ERROR_NOT_COMPATIBLE: "),
        (43, "CUPTI_ERROR_MIG_DEVICE_NOT_SUPPORTED: "),
        (12345, "CUPTI error 12345"),
    ],
)
def test_cupti_error_messages(status: int, expected: str) -> None:
    msg = cupti_error_message(status)
    assert msg.startswith(expected) and "\n" not in msg


def test_insufficient_privileges_names_the_fix() -> None:
    assert "NVreg_RestrictProfilingToAdminUsers=0" in cupti_error_message(35)
    assert "kernels come from Kineto instead" in cupti_error_message(39)


@pytest.mark.skipif(not HAVE_CUPTI, reason="cupti-python not installed")
def test_describe_real_cupti_exceptions() -> None:
    from cupti import cupti

    assert describe_cupti_exception(cupti.cuptiError(35)) == cupti_error_message(35)
    try:
        cupti.get_timestamp()
    except Exception as exc:  # no driver here: cupti-python's own error
        assert describe_cupti_exception(exc).startswith(cs.NO_DRIVER)
    else:
        pytest.skip("a CUDA driver is present")


class _FakeLibcuda:
    def __init__(self, init: int = 0, count: int = 1) -> None:
        self.init, self.count = init, count

    def cuInit(self, flags: int) -> int:
        return self.init

    def cuDeviceGetCount(self, ref: Any) -> int:
        ref._obj.value = self.count
        return 0


def _no_lib(name: str) -> Any:
    raise OSError(f"{name}: cannot open shared object file")


@pytest.mark.parametrize(
    ("load", "expected"),
    [
        (_no_lib, cs.NO_DRIVER),
        (lambda name: _FakeLibcuda(init=100), "no CUDA device (cuInit: CUDA_ERROR_NO_DEVICE)"),
        (lambda name: _FakeLibcuda(init=35), "CUDA driver too old"),
        (lambda name: _FakeLibcuda(init=7777), "cuInit failed (CUresult 7777)"),
        (lambda name: _FakeLibcuda(count=0), cs.NO_DEVICE),
        (lambda name: _FakeLibcuda(count=2), None),
    ],
)
def test_cuda_driver_reason(load: Any, expected: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cs.sys, "platform", "linux")
    reason = cuda_driver_reason(load)
    assert reason == expected if expected is None else (reason is not None and reason.startswith(expected))


def test_available_here_names_what_is_missing() -> None:
    reason = CuptiSource().available()
    if not HAVE_CUPTI:
        assert reason == cs.NOT_INSTALLED
        return
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert reason == cs.NO_DRIVER
    else:
        pytest.skip("a CUDA driver is installed here")


def test_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cs.importlib.util, "find_spec", lambda name: None)
    assert CuptiSource().available() == cs.NOT_INSTALLED


# -- clock -------------------------------------------------------------------------------------


def test_sample_clock_pair_keeps_the_tightest_bracket() -> None:
    session = iter([100, 180, 200, 210, 300, 390])  # brackets of 80, 10, 90 ns
    cupti = iter([5000, 6000, 7000])
    pair = sample_clock_pair(lambda: next(cupti), lambda: next(session), samples=3)
    assert pair == ClockPair(cupti_ns=6000, session_ns=205, uncertainty_ns=5)
    assert pair.offset_ns == 205 - 6000


M = cs.MIN_RATE_SPAN


@pytest.mark.parametrize(
    ("ts", "expected"),
    [
        (M, M + 50),  # at start: start offset
        (M + M // 2, M + M // 2 + 60),  # half way: offsets interpolated
        (2 * M, 2 * M + 70),  # at stop
        (M // 2, M // 2 + 40),  # before start: the same line, extended
        (2 * M + M // 2, 2 * M + M // 2 + 80),  # after stop
    ],
)
def test_cupti_clock_is_a_line_through_both_pairs(ts: int, expected: int) -> None:
    clock = CuptiClock(ClockPair(M, M + 50, 3), ClockPair(2 * M, 2 * M + 70, 4))
    assert clock.to_session(ts) == expected
    assert clock.uncertainty_ns == 4 and clock.drift_ns == 20


def test_cupti_clock_in_tsc_ticks() -> None:
    """Once torch.profiler runs, CUPTI stamps records in Kineto's TSC ticks (read on an
    H100 machine: 257.4e6 ticks over 122.6e6 ns of time.monotonic_ns)."""
    start, stop = ClockPair(104_288_635_296, 48_820_338_357, 40), ClockPair(104_546_050_586, 48_942_916_936, 40)
    clock = CuptiClock(start, stop)
    assert clock.rate == pytest.approx(122_578_579 / 257_415_290)
    kernel_start = 104_544_639_860  # a kernel record's start, between the two pairs
    assert start.session_ns < clock.to_session(kernel_start) < stop.session_ns
    assert clock.to_session(stop.cupti_ns) == stop.session_ns
    assert clock.as_dict()["session_ns_per_cupti_unit"] == pytest.approx(0.4762, abs=1e-4)


def test_cupti_clock_without_stop_uses_the_start_offset() -> None:
    clock = CuptiClock(ClockPair(1000, 1050, 3))
    assert clock.to_session(5000) == 5050 and clock.drift_ns is None and clock.rate == 1.0
    near = CuptiClock(ClockPair(1000, 1050, 3), ClockPair(2000, 2100, 3))  # too close together for a rate
    assert near.rate == 1.0 and near.to_session(5000) == 5050


# -- start(): path choice and CUPTI errors -------------------------------------------------------


def _bare_session(started: list[Any], levels: frozenset[Level] = frozenset({Level.KERNEL})) -> Any:
    return SimpleNamespace(meta={}, levels=levels, started=started, errors=[], limitations=[], note_limitation=lambda t: None)


def _never_load() -> Any:
    raise AssertionError("cupti must not be imported on the Kineto path")


def test_kineto_path_when_torch_profiler_records_kernels() -> None:
    torch_profiler = SimpleNamespace(name="torch.profiler", levels=(Level.OP, Level.KERNEL), profiling=False)
    session = _bare_session([torch_profiler])
    source = CuptiSource(load=_never_load)
    source.start(session)
    assert source.path == "kineto" and session.meta["kernel_path"] == "kineto"
    assert session.meta["sources"]["cupti"]["path"].startswith("kineto")
    assert source.stop() == []


@pytest.mark.skipif(not HAVE_CUPTI, reason="cupti-python not installed")
def test_cupti_path_when_torch_profiler_records_no_kernels() -> None:
    cpu_only = SimpleNamespace(name="torch.profiler", levels=(Level.OP,), profiling=False)  # torch without CUDA
    session = _bare_session([cpu_only])
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        pytest.skip("a CUDA driver is installed here")
    with pytest.raises(RuntimeError) as info:  # the real cupti-python, without a driver
        CuptiSource().start(session)
    assert str(info.value).startswith(cs.NO_DRIVER)
    assert session.meta["kernel_path"] == "none"


def _cupti_error_class() -> type[Exception]:
    if HAVE_CUPTI:
        from cupti import cupti

        return cupti.cuptiError  # type: ignore[no-any-return]

    class CuptiError(Exception):
        def __init__(self, status: int) -> None:
            super().__init__(f"CUPTI error {status}")
            self.status = status

    return CuptiError


class _StandInCupti:
    """Stands in for ``cupti.cupti`` where there is no driver: fixed clock, fails or delivers records."""

    ActivityKind = SimpleNamespace(**{name: value for value, name in cs.ACTIVITY_KINDS.items()})
    CallbackDomain = SimpleNamespace(RUNTIME_API=1, DRIVER_API=2)

    def __init__(self, fail: dict[str, int] | None = None, records: list[Any] | None = None) -> None:
        self.fail = fail or {}
        self.records = records or []
        self.enabled: list[int] = []
        self.thread_id_type: int | None = None
        self._completed: Any = None
        self.flushes = 0
        self.cuptiError = _cupti_error_class()

    def get_timestamp(self) -> int:
        return time.monotonic_ns() - OFFSET

    def set_thread_id_type(self, kind: int) -> None:
        self.thread_id_type = kind

    def activity_register_callbacks(self, requested: Any, completed: Any) -> None:
        assert requested() == (8 << 20, 0)
        self._completed = completed

    def activity_enable(self, kind: int) -> None:
        name = cs.ACTIVITY_KINDS[kind]
        if name in self.fail:
            raise self.cuptiError(self.fail[name])
        self.enabled.append(kind)

    def activity_disable(self, kind: int) -> None:
        self.enabled.remove(kind)

    def activity_flush_all(self, flag: int) -> None:
        assert flag == 1
        self.flushes += 1
        if self._completed is None:  # nothing registered yet: nothing to complete
            return
        delivered, self.records = self.records, []  # each record once, as CUPTI does
        self._completed(delivered)

    def get_callback_name(self, domain: int, cbid: int) -> str:
        return {(1, 211): "cudaLaunchKernel_v7000"}[(domain, cbid)]


def test_insufficient_privileges_is_one_line_and_the_run_goes_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stand_in = _StandInCupti(fail={"CONCURRENT_KERNEL": 35})

    class Here(CuptiSource):
        def available(self) -> str | None:
            return None  # as on a GPU machine

    session = Session(
        ProfileOptions(output=tmp_path / "run", summary=False), sources=[Here(load=lambda: stand_in), NvmlSampler(0.02)]
    ).start()
    time.sleep(0.05)
    run_dir = session.stop()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "cupti" in ln]
    assert lines == [f"mltrace: warning: source cupti failed to start: {cupti_error_message(35)}"]
    meta = json.loads((run_dir / "run.json").read_text())
    kernel = meta["levels"]["kernel"]
    assert kernel["recorded"] is False and "CUPTI_ERROR_INSUFFICIENT_PRIVILEGES" in kernel["reason"]
    assert meta["kernel_path"] == "none"
    assert meta["sources"]["cupti"]["path"] == f"none: {cupti_error_message(35)}"
    assert meta["complete"] is True and meta["counters_summary"]["cpu.utilization"]["samples"] >= 1
    assert stand_in.enabled == []


def test_forced_cupti_python_path_keeps_kineto_off_cupti(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KERNEL_PATH.name, "cupti-python")
    torch_profiler = SimpleNamespace(  # waiting for the program's `import torch`
        name="torch.profiler",
        levels=(Level.OP, Level.KERNEL),
        record_kernels=True,
        profiling=False,
        recording_ops=False,
        around_profiler_start=lambda before, after: None,
    )
    session = _bare_session([torch_profiler])
    stand_in = _StandInCupti()
    source = CuptiSource(load=lambda: stand_in)
    source.start(session)
    try:
        assert source.path == "cupti-python" and session.meta["kernel_path"] == "cupti-python"
        assert torch_profiler.record_kernels is False  # torch.profiler will record ops only
        assert cs.ACTIVITY_KINDS[stand_in.enabled[0]] == "CONCURRENT_KERNEL"
    finally:
        source._unsubscribe(stand_in)  # type: ignore[arg-type]


def test_cupti_python_asked_too_late_leaves_cupti_to_kineto() -> None:
    """torch.profiler already records CUDA activity: subscribing too crashed the process at
    exit on an H100 machine ("free(): invalid size"), so kernels come from Kineto."""
    recording = SimpleNamespace(name="torch.profiler", levels=(Level.OP, Level.KERNEL), record_kernels=True, profiling=True)
    session = _bare_session([recording])
    source = CuptiSource(prefer="cupti-python", load=_never_load)
    source.start(session)
    assert source.path == "kineto" and session.meta["kernel_path"] == "kineto"
    assert "already recording kernels" in session.meta["sources"]["cupti"]["path"]


def test_torch_profiler_leaves_cuda_out_from_the_start_when_cupti_python_is_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    from mltrace.tracer.sources.torch_ops import TorchOpSource

    monkeypatch.setenv(KERNEL_PATH.name, "cupti-python")
    source = TorchOpSource()  # torch is imported here: the profiler starts with the session
    session = Session(ProfileOptions(output=tmp_path / "run", summary=False), sources=[source]).start()
    try:
        assert source.profiling and source.record_kernels is False
    finally:
        session.stop()
    monkeypatch.delenv(KERNEL_PATH.name)
    source = TorchOpSource()
    session = Session(ProfileOptions(output=tmp_path / "run2", summary=False), sources=[source]).start()
    try:
        assert source.record_kernels is True  # the default: Kineto records kernels where there is a GPU
    finally:
        session.stop()


def test_forced_kineto_path_never_subscribes() -> None:
    session = _bare_session([])
    source = CuptiSource(prefer="kineto", load=_never_load)
    source.start(session)
    assert session.meta["kernel_path"] == "kineto" and source.stop() == []


def test_unknown_path_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KERNEL_PATH.name, "nsight")
    with pytest.raises(RuntimeError, match="MLTRACE_KERNEL_PATH='nsight': choose auto, kineto or cupti-python"):
        CuptiSource(load=_never_load).start(_bare_session([]))


def test_second_subscriber_says_kernels_come_from_elsewhere() -> None:
    stand_in = _StandInCupti(fail={"CONCURRENT_KERNEL": 39})
    session = _bare_session([])
    with pytest.raises(RuntimeError, match="CUPTI already in use by another subscriber"):
        CuptiSource(load=lambda: stand_in).start(session)


def test_unsupported_optional_kind_is_skipped_with_a_limitation() -> None:
    stand_in = _StandInCupti(fail={"SYNCHRONIZATION": 27})
    notes: list[str] = []
    session = _bare_session([])
    session.note_limitation = notes.append
    source = CuptiSource(load=lambda: stand_in)
    source.start(session)
    try:
        assert source.path == "cupti-python"
        assert [cs.ACTIVITY_KINDS[k] for k in stand_in.enabled] == ["CONCURRENT_KERNEL", "MEMCPY", "MEMSET", "RUNTIME", "DRIVER"]
        assert notes == [f"kernel level: CUPTI activity SYNCHRONIZATION: {cupti_error_message(27)}"]
    finally:
        source._unsubscribe(stand_in)  # type: ignore[arg-type]


def test_records_delivered_by_cupti_reach_the_run(tmp_path: Path) -> None:
    """The live path end to end, with records delivered through the buffer callback at flush."""
    tid = threading_native_id()
    base = time.monotonic_ns() - OFFSET  # CUPTI clock now
    records = [
        SimpleNamespace(
            kind=5, start=base + 1000, end=base + 5000, correlation_id=1, cbid=211, thread_id=tid, process_id=1, return_value=0
        ),
        SimpleNamespace(kind=10, name=FILL, start=base + 6000, end=base + 9000, correlation_id=1, device_id=0, context_id=1, stream_id=7),
        SimpleNamespace(kind=39, correlation_id=1, external_id=77),  # Kineto's external correlation: counted, not copied
    ]
    stand_in = _StandInCupti(records=records)
    dump = tmp_path / "records.json"

    class Here(CuptiSource):
        def available(self) -> str | None:
            return None

    source = Here(load=lambda: stand_in, dump_records=dump)
    session = Session(ProfileOptions(output=tmp_path / "run", summary=False), sources=[source]).start()
    time.sleep(0.01)
    run_dir = session.stop()
    assert stand_in.thread_id_type == 1 and stand_in.enabled == []
    run = load_run(run_dir)
    by_id = run.span_by_id()
    kernel = next(s for s in run.spans if s.attrs.get("gpu.activity") == "kernel")
    launch = by_id[kernel.parent_id]  # attach_gpu_to_launch used the flow
    assert kernel.name == FILL_DEMANGLED and launch.name == "cudaLaunchKernel"
    assert run.tracks[launch.track_id].tid == tid
    assert kernel.start_ns - launch.start_ns == 5000  # offsets measured on the stand-in's clock
    assert run.meta["kernel_path"] == "cupti-python"
    assert run.meta["levels"]["kernel"]["recorded"] is True
    clock = run.meta["cupti"]["clock"]
    assert clock["uncertainty_ns"] >= 0 and clock["offset_start_ns"] is not None and clock["offset_stop_ns"] is not None
    assert run.meta["cupti"]["gpu_activities_launched"] == 1
    assert run.meta["sources"]["cupti"]["records_of_other_kinds"] == {"KIND_39": 1}
    dumped = json.loads(dump.read_text())
    assert [r["kind"] for r in dumped["records"]] == ["RUNTIME", "CONCURRENT_KERNEL"]
    assert dumped["records"][0]["name"] == "cudaLaunchKernel_v7000"


class _OpsSource:
    """Stands in for the torch.profiler source while it waits for the program's ``import torch``."""

    name = "torch.profiler"
    levels = (Level.OP,)
    profiling = False
    recording_ops = False

    def __init__(self) -> None:
        self.hooks: list[tuple[Any, Any]] = []

    def around_profiler_start(self, before: Any, after: Any) -> None:
        self.hooks.append((before, after))


def test_cupti_is_handed_over_empty_around_torch_profilers_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only torch.profiler takes CUPTI's buffer callbacks and clock when it starts
    (seen on an H100 machine: Kineto got our buffer, "bufferCompleted called with unknown
    buffer", and CUPTI's clock turned into TSC ticks). So the source flushes and disables
    before it, subscribes again after, and converts each stretch with its own clock."""
    monkeypatch.setenv(KERNEL_PATH.name, "cupti-python")
    ops = _OpsSource()
    session = _bare_session([ops])
    session.tracks = TrackRegistry(pid=4242)
    ids = itertools.count(1)
    session.new_id = lambda: next(ids)
    stand_in = _StandInCupti()
    source = CuptiSource(load=lambda: stand_in)
    source.start(session)
    assert len(ops.hooks) == 1 and source.path == "cupti-python"
    before, after = ops.hooks[0]

    t1 = time.monotonic_ns()
    stand_in.records = [SimpleNamespace(**{**_kernel(1, t1 - OFFSET, t1 - OFFSET + 2_000), "kind": 10})]  # first stretch: CUPTI counts ns
    time.sleep(0.002)
    before()
    assert stand_in.enabled == [] and stand_in.records == []  # nothing left with CUPTI

    origin = time.monotonic_ns()
    stand_in.get_timestamp = lambda: 2 * (time.monotonic_ns() - origin)  # type: ignore[method-assign]
    after()
    assert cs.ACTIVITY_KINDS[stand_in.enabled[0]] == "CONCURRENT_KERNEL"
    time.sleep(0.002)
    t2 = time.monotonic_ns()
    ticks = 2 * (t2 - origin)  # second stretch: 2 ticks a ns
    stand_in.records = [SimpleNamespace(**{**_kernel(2, ticks, ticks + 4_000), "kind": 10})]
    time.sleep(0.002)
    events = source.stop()

    kernels = sorted((e for e in events if isinstance(e, cs.Span)), key=lambda k: k.start_ns)
    assert [k.attrs["gpu.correlation_id"] for k in kernels] == [1, 2]
    for kernel, t, length in zip(kernels, (t1, t2), (2_000, 2_000)):
        assert abs(kernel.start_ns - t) < 50_000  # each stretch on the session clock (pair uncertainty)
        assert abs(kernel.end_ns - kernel.start_ns - length) <= 2
    meta = session.meta["cupti"]
    assert len(meta["clock_segments"]) == 2
    assert meta["clock_segments"][0]["session_ns_per_cupti_unit"] == pytest.approx(1.0, abs=0.01)
    assert meta["clock_segments"][1]["session_ns_per_cupti_unit"] == pytest.approx(0.5, abs=0.01)
    assert stand_in.enabled == []


def threading_native_id() -> int:
    import threading

    return threading.get_native_id()


# -- the CLI, as a user runs it ----------------------------------------------------------------

_LAUNCHER = """
import runpy, sys
import mltrace.tracer.sources as sources
from mltrace.tracer.sources.cupti import CuptiSource
from mltrace.tracer.sources.nvml import NvmlSampler
original = sources.default_sources
sources.default_sources = lambda options=None: [*original(options), CuptiSource(), NvmlSampler()]
sys.argv = ["mltrace", *sys.argv[1:]]
runpy.run_module("mltrace", run_name="__main__", alter_sys=True)
"""


def _wired() -> bool:
    from mltrace.tracer.sources import default_sources

    return any(s.name == "cupti" for s in default_sources())


def test_cli_kernel_level_without_gpu_completes_and_says_why(tmp_path: Path) -> None:
    reason = CuptiSource().available()
    if reason is None:
        pytest.skip("kernels can be recorded here")
    script = tmp_path / "work.py"
    script.write_text("print(sum(range(1000)))\n")
    args = ("python", "--level", "kernel", "-o", str(tmp_path / "run"), str(script))
    if _wired():
        proc = run_cli(*args, cwd=tmp_path)
    else:  # until default_sources() lists CuptiSource: the same command with it added
        import subprocess

        assert mltrace_cmd()[:2] == [sys.executable, "-m"]
        proc = subprocess.run([sys.executable, "-c", _LAUNCHER, *args], cwd=tmp_path, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout == b"499500\n"
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    kernel = meta["levels"]["kernel"]
    assert kernel["requested"] is True and kernel["recorded"] is False
    assert f"cupti: {reason}" in kernel["reason"]
    assert meta["complete"] is True and meta["exit_status"] == 0


# -- records recorded on a GPU -----------------------------------------------------------------

CUPTI_DATA = Path(__file__).resolve().parents[1] / "data" / "cupti"


def _recorded(name: str) -> dict[str, Any]:
    with gzip.open(CUPTI_DATA / name, "rt", encoding="utf-8") as f:
        return json.load(f)  # type: ignore[no-any-return]


def _stretches(doc: dict[str, Any]) -> list[tuple[float, list[dict[str, Any]]]]:
    """(session ns per CUPTI unit, raw records) of each recorded stretch."""
    out, i = [], 0
    for seg in doc["segments"]:
        n = seg["records"]
        out.append((seg["clock"]["session_ns_per_cupti_unit"], doc["records"][i : i + n]))
        i += n
    assert i == len(doc["records"])
    return out


def _convert_recorded(doc: dict[str, Any], rate: float | None = None) -> tuple[cs.CuptiEvents, dict[int, Span]]:
    """Converts each stretch with its recorded rate (or ``rate``); only the rate matters for
    what these tests compare (intervals of one stretch against each other)."""
    records = []
    for recorded_rate, recs in _stretches(doc):
        unit = 10**12
        clock = CuptiClock(ClockPair(0, 0, 0), ClockPair(unit, round(unit * (rate or recorded_rate)), 0))
        records += cs._on_session_clock(recs, clock)
    tracks = TrackRegistry(pid=1)
    ids = itertools.count(1)
    result = cupti_records_to_events(records, tracks, lambda: next(ids), lambda ns: ns)
    return result, {s.id: s for s in result.spans}


def _launches(result: cs.CuptiEvents, by_id: dict[int, Span]) -> list[tuple[Span, Span]]:
    """(launch call, GPU activity) for every launch flow."""
    return [(by_id[f.from_span], by_id[f.to_span]) for f in result.flows if f.kind == "launch"]


def test_recorded_cupy_run_every_activity_is_launched() -> None:
    """cupti-python 13.0.1 records of a CuPy program on an H100 (scripts/gpu_check.sh): elementwise,
    cuBLAS and CUB kernels, memcpys, a memset and a two-kernel CUDA graph."""
    doc = _recorded("h100_cupy_records.json.gz")
    raw_kinds = Counter(r["kind"] for r in doc["records"])
    result, by_id = _convert_recorded(doc)
    activities = Counter(s.attrs["gpu.activity"] for s in result.spans if "gpu.activity" in s.attrs)
    assert activities == {"kernel": raw_kinds["CONCURRENT_KERNEL"], "gpu_memcpy": raw_kinds["MEMCPY"], "gpu_memset": raw_kinds["MEMSET"]}
    assert result.stats.gpu_activities_launched == result.stats.gpu_activities == sum(activities.values())
    pairs = _launches(result, by_id)
    assert len(pairs) == sum(activities.values())
    assert all(launch.start_ns <= act.start_ns for launch, act in pairs)  # nothing runs before it is launched
    graph = [(launch, act) for launch, act in pairs if act.attrs.get("gpu.graph.id")]
    assert len(graph) == 2 and {launch.name for launch, _ in graph} == {"cudaGraphLaunch"}
    names = {s.name for s in result.spans if s.attrs.get("gpu.activity") == "kernel"}
    assert {"cupy_multiply__float32_float_float32", "cupy_add__float32_float32_float32", "cupy_sin__float32_float32"} <= names


def test_recorded_torch_run_is_on_kinetos_tsc_clock() -> None:
    """cupti-python records of a torch CNN and encoder on an H100 beside a CPU-only
    torch.profiler: the stretch before torch's import is empty, the one after is in
    Kineto's TSC ticks. With the recorded rate the kernels' total time matches Kineto's
    own trace of the same models, recorded in the same gpu_check.sh run; taken as ns
    (rate 1) it would be 2.1 times too long."""
    doc = _recorded("h100_torch_records.json.gz")
    stretches = _stretches(doc)
    assert [len(recs) for _, recs in stretches][0] == 0 and len(stretches) == 2
    assert stretches[1][0] == pytest.approx(1 / 2.1, rel=0.01)
    result, by_id = _convert_recorded(doc)
    pairs = _launches(result, by_id)
    kernels = [act for _, act in pairs if act.attrs["gpu.activity"] == "kernel"]
    assert len(kernels) == sum(r["kind"] == "CONCURRENT_KERNEL" for r in doc["records"]) > 0
    assert result.stats.gpu_activities_launched == result.stats.gpu_activities
    assert all(launch.start_ns <= act.start_ns for launch, act in pairs)
    assert result.stats.skipped.get("kind KIND_39") == sum(r["kind"] == "KIND_39" for r in doc["records"]) > 0  # Kineto's external ids
    with gzip.open(Path(__file__).resolve().parents[1] / "data" / "kineto" / "h100_cuda_models.json.gz", "rt") as f:
        kineto = json.load(f)
    kineto_ns = 1000 * sum(e["dur"] for e in kineto["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel")

    def kernel_ns(events: cs.CuptiEvents) -> int:
        return sum(s.end_ns - s.start_ns for s in events.spans if s.attrs.get("gpu.activity") == "kernel")

    assert kernel_ns(result) == pytest.approx(kineto_ns, rel=0.05)
    wrong, _ = _convert_recorded(doc, rate=1.0)
    assert kernel_ns(wrong) > 2 * kineto_ns
