"""Machine peaks: measured once, cached per host in MLTRACE_CACHE_DIR; the GPU table."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mltrace.analysis import peaks as peaks_mod
from mltrace.analysis.peaks import (
    Peaks,
    cache_dir,
    cpu_flags,
    cpu_frequency_hz,
    cpu_peaks,
    gpu_names,
    gpu_peaks,
    half_factor,
    isa_flops_per_core,
    peaks_for_run,
    read_cached,
    run_host_key,
    this_host_key,
    write_cache,
)
from mltrace.run.metadata import cpu_model, host_metadata
from mltrace.settings import CACHE_DIR


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_DIR.name, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_measure_once_then_cached(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_dir() == cache
    first = cpu_peaks()
    assert first.source == "measured" and first.device == "cpu"
    # A real machine: somewhere between a phone core and a large server.
    assert 1e8 < first.flops_per_s < 1e14
    assert 1e8 < first.bytes_per_s < 1e13
    files = list(cache.glob("peaks-*.json"))
    assert [f.name for f in files] == [f"peaks-{this_host_key()}.json"]
    data = json.loads(files[0].read_text())
    assert data["peaks"]["flops_per_s"] == first.flops_per_s

    def no_measuring() -> Peaks:
        raise AssertionError("measured again although cached")

    monkeypatch.setattr(peaks_mod, "measure_cpu_peaks", no_measuring)
    second = cpu_peaks()
    assert second.source == "cache"
    assert (second.flops_per_s, second.bytes_per_s) == (first.flops_per_s, first.bytes_per_s)


def test_remeasure_replaces_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_cache(this_host_key(), Peaks("cpu", "old", 1.0, 1.0, "measured"))
    assert cpu_peaks().flops_per_s == 1.0
    monkeypatch.setattr(peaks_mod, "measure_cpu_peaks", lambda: Peaks("cpu", "new", 5e10, 5e9, "measured"))
    assert cpu_peaks(remeasure=True).name == "new"
    assert read_cached(this_host_key()) == Peaks("cpu", "new", 5e10, 5e9, "cache")


@pytest.mark.parametrize("content", ["{not json", '{"method_version": 0, "peaks": {}}', '{"method_version": 1}', "[]"])
def test_corrupt_or_stale_cache_is_remeasured(cache: Path, monkeypatch: pytest.MonkeyPatch, content: str) -> None:
    cache.mkdir(parents=True)
    (cache / f"peaks-{this_host_key()}.json").write_text(content)
    monkeypatch.setattr(peaks_mod, "measure_cpu_peaks", lambda: Peaks("cpu", "fresh", 5e10, 5e9, "measured"))
    assert cpu_peaks().name == "fresh"
    assert read_cached(this_host_key()) is not None


def test_unwritable_cache_still_gives_peaks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(CACHE_DIR.name, str(blocker / "cache"))
    monkeypatch.setattr(peaks_mod, "measure_cpu_peaks", lambda: Peaks("cpu", "x", 5e10, 5e9, "measured"))
    assert cpu_peaks().source == "measured"


@pytest.mark.parametrize(
    ("name", "display", "gbps"),
    [
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB", 2039),
        ("NVIDIA A100-PG509-200", "NVIDIA A100 40GB", 1555),
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM", 3350),
        ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe", 2000),
        ("NVIDIA H200", "NVIDIA H200", 4800),
        ("Tesla T4", "NVIDIA T4", 320),
        ("NVIDIA L4", "NVIDIA L4", 300),
        ("NVIDIA L40S", "NVIDIA L40S", 864),
    ],
)
def test_gpu_table(name: str, display: str, gbps: float) -> None:
    p = gpu_peaks(name)
    assert p is not None and p.name == display and p.source == "table"
    assert p.bytes_per_s == gbps * 1e9
    assert p.flops_for("bfloat16") > p.flops_for("float32") == p.flops_per_s


def test_unknown_gpu() -> None:
    assert gpu_peaks("Matrox G200") is None


def test_gpu_names_from_run_metadata() -> None:
    meta = {"devices": [{"id": 0, "name": "NVIDIA A100-PG509-200"}, {"id": 1, "name": "NVIDIA A100-PG509-200"}]}
    assert gpu_names(meta) == ["NVIDIA A100-PG509-200"]
    assert gpu_names({"gpus": [{"name": "NVIDIA H100"}]}) == ["NVIDIA H100"]
    assert gpu_names({"host": {"gpus": ["Tesla T4"]}}) == ["Tesla T4"]
    assert gpu_names({"host": "x", "devices": "y"}) == []


def test_peaks_for_runs_from_here_elsewhere_and_gpus(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_cache(this_host_key(), Peaks("cpu", "here", 5e10, 5e9, "measured"))
    here = {"host": host_metadata()}
    assert run_host_key(here) == this_host_key()
    # This host's cached peaks, the FLOP roof at least the ISA's bound of this CPU's flags and clock.
    cores = here["host"]["cpu_count"] or os.cpu_count()
    isa = isa_flops_per_core(cpu_flags(), cpu_frequency_hz(cpu_model()))
    ps = peaks_for_run(here, has_gpu_kernels=False)
    assert ps.cpu.name == "here" and ps.cpu.bytes_per_s == 5e9 and ps.gpu is None
    # The bf16/fp16 roof's clause is there where this CPU's flags have one (avx512_bf16, amx).
    roof_notes = "; ".join(x for x in ps.cpu.note.split("; ") if x and not x.startswith("bf16/fp16 peak "))
    assert (ps.cpu.note != roof_notes) == (half_factor(cpu_flags()) > 1.0)
    if isa is not None and isa > 5e10 / cores:
        assert ps.cpu.flops_per_s == pytest.approx(isa * cores)
        measured = 5e10 / cores / 1e9
        assert roof_notes == f"FLOP/s roof: the ISA's bound, {isa / 1e9:.0f} GFLOP/s a core (the measured matmul reached {measured:.0f})"
    else:
        assert ps.cpu.flops_per_s == pytest.approx(5e10) and roof_notes == ""
    # ... and where the flags say nothing of the ISA, the cached roof as it is, with no note.
    with monkeypatch.context() as m:
        m.setattr(peaks_mod, "cpu_flags", set)
        ps = peaks_for_run(here, has_gpu_kernels=False)
    assert ps.cpu.name == "here" and ps.cpu.note == "" and ps.cpu.flops_per_s == pytest.approx(5e10)
    # A run from another host whose peaks were never cached here: this machine's, with a note.
    other = {"host": {"hostname": "elsewhere", "cpu": "Other CPU", "cpu_count": 128}}
    ps = peaks_for_run(other, has_gpu_kernels=False)
    assert ps.cpu.name == "here" and "not on the host that recorded the run" in ps.cpu.note
    # ... and once that host's peaks are cached (it reported there), those.
    key = run_host_key(other)
    assert key is not None
    write_cache(key, Peaks("cpu", "there", 9e11, 2e11, "measured"))
    assert peaks_for_run(other, has_gpu_kernels=False).cpu.name == "there"
    imported = {"devices": [{"name": "NVIDIA H100 80GB HBM3"}]}
    ps = peaks_for_run(imported, has_gpu_kernels=True)
    assert ps.gpu is not None and ps.gpu.name == "NVIDIA H100 SXM"
    assert peaks_for_run(imported, has_gpu_kernels=False).gpu is None
