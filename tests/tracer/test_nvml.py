"""NvmlSampler: CPU utilisation from /proc/stat (real), GPU counters from NVML.

This machine has no GPU and no NVIDIA driver: the CPU counter and the
"no driver" path run for real; GPU readings come from pynvml functions
replaced by fixed values (the one place a fake stands in, for the hardware).
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mltrace.config import ProfileOptions
from mltrace.run.store import Run, load_run
from mltrace.tracer.session import Session
from mltrace.tracer.sources import nvml
from mltrace.tracer.sources.nvml import CpuTimes, NvmlSampler, cpu_utilization, nvml_error_reason, parse_proc_stat
from support.pftrace import parse_pftrace


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1


def _record(tmp_path: Path, sampler: NvmlSampler, seconds: float = 0.15) -> tuple[Run, dict[str, Any]]:
    session = Session(ProfileOptions(output=tmp_path / "run", summary=False), sources=[sampler]).start()
    try:
        _busy(seconds)
    finally:
        run_dir = session.stop()
    run = load_run(run_dir)
    return run, json.loads((run_dir / "run.json").read_text())


def _samples(run: Run, name: str) -> list[float]:
    ids = [t.id for t in run.tracks.values() if t.kind == "counter" and t.name == name]
    assert len(ids) == 1, f"{name}: {ids}"
    return [c.value for c in run.counters if c.track_id == ids[0]]


# -- /proc/stat helpers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # user nice system idle iowait irq softirq steal guest guest_nice
        ("cpu  10 2 3 80 5 0 0 0 0 0\ncpu0 5 1 1 40 2 0 0 0 0 0\n", CpuTimes(busy=15, total=100)),
        ("cpu  10 0 10 70 0 4 4 2 9 9\n", CpuTimes(busy=30, total=100)),  # guest time is inside user: not added
        ("cpu 1 2 3 4\n", CpuTimes(busy=6, total=10)),  # kernels before 2.6.11: four fields
        ("intr 1 2 3\ncpu  0 0 0 10 0 0 0 0 0 0\n", CpuTimes(busy=0, total=10)),  # finds the cpu line
        ("cpu0 1 2 3 4\n", None),  # per-CPU lines only
        ("cpu  a b c d\n", None),
        ("cpu  1 2\n", None),
        ("", None),
    ],
)
def test_parse_proc_stat(text: str, expected: CpuTimes | None) -> None:
    assert parse_proc_stat(text) == expected


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        (CpuTimes(0, 0), CpuTimes(50, 100), 50.0),
        (CpuTimes(100, 1000), CpuTimes(100, 1100), 0.0),
        (CpuTimes(100, 1000), CpuTimes(200, 1100), 100.0),
        (CpuTimes(100, 1000), CpuTimes(125, 1100), 25.0),
        (CpuTimes(100, 1000), CpuTimes(100, 1000), None),  # no jiffy elapsed
        (CpuTimes(100, 1000), CpuTimes(90, 1100), None),  # counters went back
    ],
)
def test_cpu_utilization(before: CpuTimes, after: CpuTimes, expected: float | None) -> None:
    assert cpu_utilization(before, after) == expected


@pytest.mark.parametrize(
    ("code", "starts"),
    [
        (12, "NVIDIA driver not found (libnvidia-ml.so.1 could not be loaded)"),
        (9, "NVIDIA driver not loaded"),
        (4, "no permission to use NVML"),
        (999, "nvmlInit failed: boom (NVML error 999)"),
        (None, "nvmlInit failed: boom"),
    ],
)
def test_nvml_error_reason(code: int | None, starts: str) -> None:
    assert nvml_error_reason(code, "boom").startswith(starts)


# -- real sessions -----------------------------------------------------------------------------


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux /proc/stat")
def test_cpu_utilization_counter_in_a_real_session(tmp_path: Path) -> None:
    run, meta = _record(tmp_path, NvmlSampler(interval_s=0.02), seconds=0.25)
    values = _samples(run, "cpu.utilization")
    assert values, "no CPU samples"
    assert all(0.0 <= v <= 100.0 for v in values)
    track = next(t for t in run.tracks.values() if t.name == "cpu.utilization")
    assert track.unit == "%" and track.device == -1
    summary = meta["counters_summary"]["cpu.utilization"]
    assert summary["samples"] == len(values)
    assert summary["min"] == min(values) and summary["max"] == max(values)
    assert summary["mean"] == pytest.approx(sum(values) / len(values))
    assert meta["sources"]["nvml"]["cpu"] == "sampling /proc/stat"
    # The counter reaches the Perfetto trace as a counter track.
    trace = parse_pftrace(run.path / "trace.pftrace")
    uuids = [u for u, td in trace.tracks.items() if td.name == "cpu.utilization (%)" and td.HasField("counter")]
    assert len(uuids) == 1
    assert [v for _, v in trace.counters[uuids[0]]] == values


def test_no_driver_records_the_gpu_reason_and_samples_the_cpu(tmp_path: Path) -> None:
    pytest.importorskip("pynvml")
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        pass
    else:
        pytest.skip("an NVIDIA driver is installed here")
    sampler = NvmlSampler(interval_s=0.02)
    run, meta = _record(tmp_path, sampler)
    assert sampler.gpu_reason == nvml.NO_DRIVER
    assert meta["sources"]["nvml"]["gpu"] == f"unavailable: {nvml.NO_DRIVER}"
    assert meta["complete"] is True
    assert not [t for t in run.tracks.values() if t.name.startswith("gpu")]
    assert list(meta["counters_summary"]) == ["cpu.utilization"]


def test_without_nvidia_ml_py_the_cpu_is_still_sampled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml → ImportError
    run, meta = _record(tmp_path, NvmlSampler(interval_s=0.02))
    assert meta["sources"]["nvml"]["gpu"] == f"unavailable: {nvml.NOT_INSTALLED}"
    assert _samples(run, "cpu.utilization")


def test_unreadable_proc_stat_and_no_nvml_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml.importlib.util, "find_spec", lambda name: None)
    reason = NvmlSampler(proc_stat=tmp_path / "missing").available()
    assert reason is not None and nvml.NOT_INSTALLED in reason and "unreadable" in reason


# -- simulated GPUs ----------------------------------------------------------------------------


class _FakeNvml:
    """Fixed readings for two GPUs; GPU 1 does not support power readings."""

    def __init__(self, pynvml: Any) -> None:
        self.nv = pynvml
        self.shutdowns = 0

    def install(self, mp: pytest.MonkeyPatch) -> None:
        nv = self.nv
        mp.setattr(nv, "nvmlInit", lambda: None)
        mp.setattr(nv, "nvmlShutdown", self._shutdown)
        mp.setattr(nv, "nvmlDeviceGetCount", lambda: 2)
        mp.setattr(nv, "nvmlDeviceGetHandleByIndex", lambda i: f"h{i}")
        mp.setattr(nv, "nvmlDeviceGetName", lambda h: f"Fake GPU {h[1]}")
        mp.setattr(nv, "nvmlDeviceGetUtilizationRates", lambda h: SimpleNamespace(gpu=37 if h == "h0" else 90, memory=12))
        mp.setattr(nv, "nvmlDeviceGetMemoryInfo", lambda h: SimpleNamespace(used=2**30, total=2**34, free=2**34 - 2**30))
        mp.setattr(nv, "nvmlDeviceGetPowerUsage", self._power)
        mp.setattr(nv, "nvmlDeviceGetClockInfo", lambda h, kind: {nv.NVML_CLOCK_SM: 1410, nv.NVML_CLOCK_MEM: 1215}[kind])
        mp.setattr(nv, "nvmlDeviceGetTemperature", lambda h, sensor: 55)

    def _shutdown(self) -> None:
        self.shutdowns += 1

    def _power(self, h: str) -> int:
        if h == "h1":
            raise self.nv.NVMLError(self.nv.NVML_ERROR_NOT_SUPPORTED)
        return 123_456  # mW


def test_simulated_gpus_give_counter_tracks_and_a_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pynvml = pytest.importorskip("pynvml")
    fake = _FakeNvml(pynvml)
    fake.install(monkeypatch)
    run, meta = _record(tmp_path, NvmlSampler(interval_s=0.01))
    assert fake.shutdowns == 1
    info = meta["sources"]["nvml"]
    assert info["gpu"] == "sampling 2 GPU(s)"
    assert info["devices"] == [{"index": 0, "name": "Fake GPU 0"}, {"index": 1, "name": "Fake GPU 1"}]
    assert meta["host"]["gpus"] == info["devices"]  # where the report's roofline looks for GPU names
    assert info["unsupported"] == {"gpu1.power": "NVML_ERROR_NOT_SUPPORTED"}
    expected = {
        "gpu0.utilization": ("%", 37.0),
        "gpu0.memory.utilization": ("%", 12.0),
        "gpu0.memory.used": ("bytes", float(2**30)),
        "gpu0.power": ("W", 123.456),
        "gpu0.clock.sm": ("MHz", 1410.0),
        "gpu0.clock.memory": ("MHz", 1215.0),
        "gpu0.temperature": ("C", 55.0),
        "gpu1.utilization": ("%", 90.0),
    }
    tracks = {t.name: t for t in run.tracks.values() if t.kind == "counter"}
    summary = meta["counters_summary"]
    for name, (unit, value) in expected.items():
        assert tracks[name].unit == unit and tracks[name].device == int(name[3])
        values = _samples(run, name)
        assert len(values) >= 2 and set(values) == {value}  # first sample at start, last at stop
        mean = summary[name].pop("mean")
        assert mean == pytest.approx(value)  # a sum of equal floats over n
        assert summary[name] == {"unit": unit, "device": int(name[3]), "samples": len(values), "min": value, "max": value}
    assert _samples(run, "gpu1.power") == []
    assert summary["gpu1.power"]["samples"] == 0 and "mean" not in summary["gpu1.power"]
    # Samples of one device at one instant share a timestamp, inside the session.
    ts = sorted({c.ts_ns for c in run.counters if c.track_id == tracks["gpu0.power"].id})
    assert ts == sorted({c.ts_ns for c in run.counters if c.track_id == tracks["gpu0.temperature"].id})


def test_no_gpu_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pynvml = pytest.importorskip("pynvml")
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 0)
    _, meta = _record(tmp_path, NvmlSampler(interval_s=0.02))
    assert meta["sources"]["nvml"]["gpu"] == f"unavailable: {nvml.NO_GPU}"


def test_nvml_permission_error_is_one_warning_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pynvml = pytest.importorskip("pynvml")

    def denied() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    monkeypatch.setattr(pynvml, "nvmlInit", denied)
    run, meta = _record(tmp_path, NvmlSampler(interval_s=0.02))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "GPU counters" in ln]
    assert len(lines) == 1 and lines[0].startswith("mltrace: warning: no GPU counters: no permission to use NVML")
    assert meta["sources"]["nvml"]["gpu"].startswith("unavailable: no permission to use NVML")
    assert _samples(run, "cpu.utilization")


def test_no_driver_prints_no_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    _record(tmp_path, NvmlSampler(interval_s=0.02))
    assert "mltrace: warning" not in capsys.readouterr().err


def test_without_a_driver_pynvml_is_not_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the system shows no NVIDIA driver, the sampler records the reason without importing
    ``pynvml`` (thousands of objects the program's garbage collections would scan)."""
    pytest.importorskip("pynvml")
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    monkeypatch.setattr(nvml, "_DRIVER_PATHS", (str(tmp_path / "no-such-device"),))
    sampler = NvmlSampler(interval_s=0.02)
    _, meta = _record(tmp_path, sampler)
    assert sampler.gpu_reason == nvml.NO_DRIVER and meta["sources"]["nvml"]["gpu"] == f"unavailable: {nvml.NO_DRIVER}"
    assert "pynvml" not in sys.modules
