"""Roofs by dtype and threads, GPU layers' achieved FLOP/s from their kernels, and no share above 100 %."""

from __future__ import annotations

from pathlib import Path

from mltrace.analysis.peaks import Peaks, cpu_for_run, cpu_frequency_hz, half_factor, isa_flops_per_core, run_threads

CPU = Peaks("cpu", "test CPU", 100e9, 10e9, "measured")


def test_cpu_half_peak_from_flags() -> None:
    assert half_factor({"avx512f", "amx_bf16", "avx512_bf16"}) == 16.0
    assert half_factor({"avx512_bf16"}) == 2.0
    assert half_factor({"avx2"}) == 1.0
    amx = cpu_for_run(CPU, {}, 8, {"amx_bf16"})
    assert amx.flops_for("bfloat16") == 16 * amx.flops_for("float32")
    assert cpu_for_run(CPU, {}, 8, set()).flops_for("bfloat16") == 100e9


def test_cpu_peak_scaled_to_the_threads_used() -> None:
    assert run_threads({"threads": {"torch": 2}}) == 2
    assert run_threads({"environment": {"OMP_NUM_THREADS": "1"}}) == 1
    assert run_threads({}) is None
    one = cpu_for_run(CPU, {"environment": {"OMP_NUM_THREADS": "1"}}, 4, {"amx_bf16"})
    assert one.flops_per_s == 25e9 and one.flops_for("bfloat16") == 400e9 and one.bytes_per_s == 10e9
    assert "1 of 4 threads" in one.note


def test_the_cpu_flop_roof_is_at_least_the_isas_bound() -> None:
    hz = cpu_frequency_hz("Intel(R) Xeon(R) Processor @ 2.50GHz", this_host=False)
    assert hz == 2.5e9 and cpu_frequency_hz("some CPU", this_host=False) is None
    assert isa_flops_per_core({"avx512f", "fma", "avx"}, hz) == 160e9
    assert isa_flops_per_core({"fma", "avx2", "avx"}, hz) == 80e9
    assert isa_flops_per_core(set(), hz) is None and isa_flops_per_core({"avx512f"}, None) is None
    # measured 100 GFLOP/s on 4 cores (25 a core) is beaten by the ISA's 160 a core; 2 threads used
    two = cpu_for_run(CPU, {"threads": {"torch": 2}}, 4, {"avx512f"}, hz)
    assert two.flops_per_s == 320e9 and "ISA's bound" in two.note and two.bytes_per_s == 10e9
    # a measured roof above the ISA's (an unknown wider unit) stays
    assert cpu_for_run(Peaks("cpu", "x", 1e12, 1e10, "measured"), {}, 2, {"sse2"}, hz).flops_per_s == 1e12


def test_a_host_without_cpufreq_takes_its_clock_from_cpuinfo(tmp_path: Path) -> None:
    """A virtual machine has no cpufreq and a model name without a clock ("AMD EPYC"): its
    cpuinfo's highest ``cpu MHz`` gives the ISA's bound."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\ncpu MHz\t\t: 2596.096\n\nprocessor\t: 1\ncpu MHz\t\t: 2600.000\n")
    missing = str(tmp_path / "no-cpufreq")
    assert cpu_frequency_hz("AMD EPYC", cpufreq=missing, cpuinfo=str(cpuinfo)) == 2.6e9
    assert cpu_frequency_hz("Xeon @ 2.50GHz", cpufreq=missing, cpuinfo=str(cpuinfo)) == 2.5e9  # the name first
    assert cpu_frequency_hz("AMD EPYC", this_host=False) is None  # another host's cpuinfo is not this one's
    assert cpu_frequency_hz("AMD EPYC", cpufreq=missing, cpuinfo=missing) is None
    (tmp_path / "max").write_text("3700000\n")
    assert cpu_frequency_hz("AMD EPYC", cpufreq=str(tmp_path / "max"), cpuinfo=str(cpuinfo)) == 3.7e9


def test_a_raised_bandwidth_roof_bounds_efficiency_but_not_the_ridge() -> None:
    """A measured memory roof raised to what cache-resident work reached keeps the measured
    bandwidth as the ridge's: a GEMV at 0.64 FLOP/B stays memory-bound whatever one op of the
    run reached (a raised ridge of 0.5 called it compute-bound in one run and not the next),
    while its efficiency is against the raised roof (never above 100 %)."""
    from mltrace.analysis.bottleneck import Bound, classify
    from mltrace.analysis.peaks import raised

    measured = Peaks("cpu", "test CPU", 100e9, 25e9, "measured")
    roof = raised(measured, 0.0, 0.0, 200e9, "this run's layers and ops")
    assert (roof.bytes_per_s, roof.bound_bytes_per_s, roof.memory_bytes_per_s) == (200e9, 25e9, 25e9)
    assert roof.ridge == 0.5 and roof.ridge_for("float32") == 4.0 and "roofs raised" in roof.note
    assert raised(roof, 0.0, 0.0, 300e9, "again").bound_bytes_per_s == 25e9  # raised twice: still the measured one
    assert raised(measured, 0.0, 0.0, 10e9, "x") is measured and measured.bound_bytes_per_s == 25e9
    gemv = {"flops": 64e6, "moved_bytes": 100e6}  # 0.64 FLOP/B, at 150 GB/s: above the measured roof
    v = classify(
        time_ns=100e6 / 150e9 * 1e9, **gemv, peak_flops=roof.flops_per_s, peak_bytes=roof.bytes_per_s, ridge_bytes=roof.bound_bytes_per_s
    )
    assert v.bound is Bound.MEMORY and v.efficiency is not None and 0.7 < v.efficiency <= 1.0
    assert "ridge 4.0" in v.reason
    was = classify(time_ns=100e6 / 150e9 * 1e9, **gemv, peak_flops=roof.flops_per_s, peak_bytes=roof.bytes_per_s)
    assert was.bound is Bound.COMPUTE  # the raised roof's ridge (0.5), as before


def test_a_raised_roof_is_printed_with_the_memory_bandwidth_beside_it() -> None:
    from mltrace.analysis.peaks import bandwidth_text, raised

    measured = Peaks("cpu", "test CPU", 100e9, 25e9, "measured")
    assert bandwidth_text(measured) == "25 GB/s"
    assert bandwidth_text(raised(measured, 0.0, 0.0, 200e9, "x")) == "200 GB/s, memory 25 GB/s"
