"""The verdict rules (bottleneck.classify), from tables of plain numbers.

Peaks in every row: 100 GFLOP/s and 10 GB/s, so the ridge is 10 FLOP/byte and
1 GFLOP takes at least 10 ms, 1 GB at least 100 ms.
"""

from __future__ import annotations

from typing import Any

import pytest

from mltrace.analysis.bottleneck import Bound, Thresholds, classify

P, W = 100e9, 10e9
MS = 1_000_000

ROWS: list[tuple[str, dict[str, Any], Bound, str]] = [
    ("no time", {"time_ns": 0, "flops": 1e9, "moved_bytes": 1e6}, Bound.UNKNOWN, "no time"),
    # 1 GFLOP over 1 MB in 20 ms: intensity 1000 ≥ 10, efficiency 50%
    ("compute", {"time_ns": 20 * MS, "flops": 1e9, "moved_bytes": 1e6}, Bound.COMPUTE, "ridge 10.0"),
    # 10 MFLOP over 1 GB in 200 ms: intensity 0.01, efficiency 50%
    ("memory", {"time_ns": 200 * MS, "flops": 1e7, "moved_bytes": 1e9}, Bound.MEMORY, "< ridge"),
    # bytes only (no FLOPs known): intensity 0
    ("bytes only", {"time_ns": 200 * MS, "flops": 0, "moved_bytes": 1e9}, Bound.MEMORY, "< ridge"),
    # FLOPs only: intensity infinite
    ("flops only", {"time_ns": 20 * MS, "flops": 1e9, "moved_bytes": 0}, Bound.COMPUTE, "∞"),
    # the same compute work at 1% of the roofline: overhead
    ("far below roofs", {"time_ns": 1000 * MS, "flops": 1e9, "moved_bytes": 1e6}, Bound.OVERHEAD, "of the roofline"),
    # just above the 2% line: still judged by intensity
    ("just above 2%", {"time_ns": 450 * MS, "flops": 1e9, "moved_bytes": 1e6}, Bound.COMPUTE, "ridge"),
    # many tiny ops (2000 per call, 3 µs each) at 5% of the roofline: overhead (tiny-op rule, < 10%)
    (
        "many tiny ops",
        {"time_ns": 200 * MS, "flops": 1e9, "moved_bytes": 1e6, "ops": 2000, "op_ns": 6 * MS, "calls": 1},
        Bound.OVERHEAD,
        "many tiny ops: 2000 ops per call",
    ),
    # the same ops but efficient (50%): the tiny-op rule needs e < 10%
    (
        "many ops, efficient",
        {"time_ns": 20 * MS, "flops": 1e9, "moved_bytes": 1e6, "ops": 2000, "op_ns": 6 * MS},
        Bound.COMPUTE,
        "ridge",
    ),
    # few ops per call: no tiny-op verdict even when short
    ("few short ops", {"time_ns": 20 * MS, "flops": 1e9, "moved_bytes": 1e6, "ops": 4, "op_ns": 8_000}, Bound.COMPUTE, "ridge"),
    # no work estimate at all
    ("unknown work", {"time_ns": 5 * MS, "flops": 0, "moved_bytes": 0, "work_known": False}, Bound.UNKNOWN, "no FLOP estimate"),
    (
        "unknown work, tiny ops",
        {"time_ns": 5 * MS, "flops": 0, "moved_bytes": 0, "work_known": False, "ops": 400, "op_ns": 4 * MS, "calls": 2},
        Bound.OVERHEAD,
        "200 ops per call",
    ),
    ("known zero work", {"time_ns": 5_000, "flops": 0, "moved_bytes": 0}, Bound.OVERHEAD, "computes nothing"),
    # GPU: CPU 10 ms for 1 ms of kernels → launch-bound, whatever the work
    (
        "launch-bound",
        {"time_ns": 10 * MS, "flops": 1e9, "moved_bytes": 1e6, "kernels": 500, "device_ns": 1 * MS},
        Bound.OVERHEAD,
        "launch-bound: CPU time is 10.0× the GPU time (500 kernels, mean 2.0 µs)",
    ),
    # GPU busy longer than the CPU: judged on the device time (1 GFLOP in 20 ms of kernels)
    (
        "gpu compute",
        {"time_ns": 5 * MS, "flops": 1e9, "moved_bytes": 1e6, "kernels": 3, "device_ns": 20 * MS},
        Bound.COMPUTE,
        "ridge",
    ),
    # faster than the roofline allows (1 GFLOP needs 10 ms): the estimate is wrong, no verdict
    (
        "above the roofline",
        {"time_ns": 5 * MS, "flops": 1e9, "moved_bytes": 1e6},
        Bound.UNKNOWN,
        "the work estimate needs 10000.0 µs at the roofline, more than its 5000.0 µs",
    ),
    (
        "above the roofline on the gpu",
        {"time_ns": 3 * MS, "flops": 1e9, "moved_bytes": 1e6, "kernels": 10, "device_ns": 2 * MS},
        Bound.UNKNOWN,
        "the work estimate needs 10000.0 µs at the roofline, more than its 2000.0 µs",
    ),
]


@pytest.mark.parametrize(("case", "numbers", "bound", "reason"), ROWS, ids=[r[0] for r in ROWS])
def test_rules(case: str, numbers: dict[str, Any], bound: Bound, reason: str) -> None:
    v = classify(peak_flops=P, peak_bytes=W, **numbers)
    assert v.bound is bound, v.reason
    assert reason in v.reason


def test_a_point_above_the_roofline_carries_no_numbers() -> None:
    v = classify(time_ns=5 * MS, flops=1e9, moved_bytes=1e6, peak_flops=P, peak_bytes=W, basis="formula")
    assert (v.intensity, v.efficiency, v.achieved_flops, v.basis) == (None, None, None, "formula")
    # exactly at the roofline is still judged
    at = classify(time_ns=10 * MS, flops=1e9, moved_bytes=1e6, peak_flops=P, peak_bytes=W)
    assert at.bound is Bound.COMPUTE and at.efficiency == pytest.approx(1.0)


def test_verdict_carries_its_numbers() -> None:
    v = classify(time_ns=20 * MS, flops=1e9, moved_bytes=1e6, peak_flops=P, peak_bytes=W, basis="formula")
    assert v.intensity == pytest.approx(1000)
    assert v.efficiency == pytest.approx(0.5)
    assert v.achieved_flops == pytest.approx(50e9)
    assert v.basis == "formula"


def test_thresholds_are_parameters() -> None:
    numbers: dict[str, Any] = {"time_ns": 1000 * MS, "flops": 1e9, "moved_bytes": 1e6, "peak_flops": P, "peak_bytes": W}
    assert classify(**numbers).bound is Bound.OVERHEAD  # 1% < 2%
    assert classify(**numbers, th=Thresholds(min_efficiency=0.005)).bound is Bound.COMPUTE
    # 1 GFLOP in 20 ms of kernels (50% of the roofline), CPU 1.5× the GPU time: under the 2× line
    launch: dict[str, Any] = {**numbers, "time_ns": 30 * MS, "kernels": 10, "device_ns": 20 * MS}
    assert classify(**launch).bound is Bound.COMPUTE
    assert "launch-bound" in classify(**launch, th=Thresholds(launch_ratio=1.2)).reason
