"""Roofs by dtype and threads, GPU layers' achieved FLOP/s from their kernels, and no share above 100 %."""

from __future__ import annotations

from mltrace.analysis.peaks import Peaks, cpu_for_run, half_factor, run_threads

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
