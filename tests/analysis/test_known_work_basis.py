"""Verdicts where the op level ended before the run did: each row is judged over the calls
whose work is known in full (their time, FLOPs and bytes), never over the FLOPs of the calls
with ops against the time of all its calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mltrace.analysis.bottleneck import Analysis, Bound, LayerRow, analyze
from mltrace.analysis.peaks import Peaks, PeakSet, gpu_peaks
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run

CPU = PeakSet(Peaks("cpu", "test CPU", 100e9, 10e9, "assumed"))
M, L, OP, K = Level.MODEL, Level.LAYER, Level.OP, Level.KERNEL
CALLS = 10
CALL_NS = 20_000
OWN_FLOPS = 100_000  # the custom layer's ops' FLOPs per call: 10% of the CPU roofline over its 10 µs


def linear_attrs(m: int, k: int, n: int) -> dict[str, Any]:
    return {
        "ml.layer.type": "Linear",
        "ml.layer.params": k * n + n,
        "ml.input.shapes": [[m, k]],
        "ml.input.dtypes": ["float32"],
        "ml.output.shapes": [[m, n]],
        "ml.output.dtypes": ["float32"],
    }


def custom_attrs(rows: int = 4) -> dict[str, Any]:
    """A layer type with no formula: its work is its ops'."""
    return {
        "ml.layer.type": "DenseAttention",
        "ml.input.shapes": [[rows, 8]],
        "ml.input.dtypes": ["float32"],
        "ml.output.shapes": [[rows, 8]],
    }


def cpu_calls(with_ops: int, other_shapes: bool = True) -> list[Span]:
    """``CALLS`` model calls, each: a custom layer ``att`` (10 µs) running its own matmul, a
    container ``block`` with no ops of its own around a Linear ``fc``, and a container ``mixed``
    with an add of its own around a Linear ``fc2``. The first ``with_ops`` calls have ops; with
    ``other_shapes``, ``att``'s later calls have inputs of other shapes than those."""
    linear_flops = {"ml.flops": 2 * 4 * 8 * 16}
    spans: list[Span] = []
    for c in range(CALLS):
        t, i = c * 100_000, 100 * c + 1
        rows = 5 if other_shapes and c >= with_ops else 4
        spans += [
            Span(i, None, M, "Net", t, t + CALL_NS, 1, {"ml.layer.type": "Net"}),
            Span(i + 1, i, L, "att", t + 1000, t + 11_000, 1, custom_attrs(rows)),
            Span(i + 2, i, L, "block", t + 12_000, t + 15_000, 1, {"ml.layer.type": "Block"}),
            Span(i + 3, i + 2, L, "block.fc", t + 12_500, t + 14_500, 1, linear_attrs(4, 8, 16)),
            Span(i + 4, i, L, "mixed", t + 16_000, t + 19_000, 1, {"ml.layer.type": "Mixed"}),
            Span(i + 5, i + 4, L, "mixed.fc2", t + 16_500, t + 17_500, 1, linear_attrs(4, 8, 16)),
        ]
        if c < with_ops:
            spans += [
                Span(i + 50, i + 1, OP, "aten::mm", t + 1500, t + 10_500, 1, {"ml.flops": OWN_FLOPS}),
                Span(i + 51, i + 4, OP, "aten::add", t + 18_000, t + 18_500, 1, {"ml.flops": 64}),
                Span(i + 52, i + 3, OP, "aten::linear", t + 13_000, t + 14_000, 1, linear_flops),
                Span(i + 53, i + 5, OP, "aten::linear", t + 16_600, t + 17_400, 1, linear_flops),
            ]
    return spans


def cpu_run(with_ops: int, other_shapes: bool = True) -> Run:
    run = Run(
        path=Path("hand-made"),
        meta={"name": "hand-made", "complete": True},
        tracks={1: Track(1, TrackKind.THREAD, "MainThread", 10, 10)},
        spans=cpu_calls(with_ops, other_shapes),
    )
    if with_ops < CALLS:  # the op level ended after the last call with ops
        run.meta["op_window"] = {
            "ended_ns": (with_ops - 1) * 100_000 + CALL_NS + 1,
            "reason": "--op-inferences",
            "ended_after_model_calls": with_ops,
        }
    return run


def rows(a: Analysis) -> dict[str, LayerRow]:
    return {r.stat.name: r for r in a.layers}


def test_a_custom_layer_is_judged_over_its_calls_with_ops() -> None:
    """The custom layer's FLOPs exist only in the 1 call with ops: judged over that call's 10 µs,
    it reads as the full run does (10% of the roofline, compute-bound), not as 1% of it over all
    10 calls' time (overhead-bound)."""
    full, early = rows(analyze(cpu_run(CALLS), CPU)), rows(analyze(cpu_run(1), CPU))
    att, att_full = early["att"], full["att"]
    v, v_full = att.verdict, att_full.verdict
    assert v_full is not None and v_full.bound is Bound.COMPUTE and v_full.efficiency == pytest.approx(0.1)
    assert att.flops == OWN_FLOPS and att.stat.total_ns == CALLS * 10_000
    assert v is not None and v.bound is Bound.COMPUTE and v.efficiency == pytest.approx(v_full.efficiency)
    assert att.achieved_flops == pytest.approx(OWN_FLOPS / 10e-6) == att_full.achieved_flops
    assert att.peak_share == pytest.approx(att_full.peak_share)
    assert v.basis == "ops (1 of 10 calls)" and "over the 1 of 10 calls whose work is known in full" in v.reason
    assert att_full.known is None
    assert att.known is not None and (att.known.calls, att.known.time_ns, att.known.flops) == (1, 10_000, OWN_FLOPS)


def test_rows_with_work_known_in_every_call_keep_all_their_calls() -> None:
    """Linear layers (a formula) and a container with no ops of its own around one are known in
    every call; so is a container with an op of its own whose inputs are those of its call with
    ops (its add's FLOPs are that call's); the model above the custom layer, whose later calls
    had other shapes, is not."""
    early = rows(analyze(cpu_run(1), CPU))
    for name in ("block.fc", "mixed.fc2", "block", "mixed"):
        v = early[name].verdict
        assert early[name].known is None and v is not None and "of 10 calls" not in v.basis, name
    assert early["block"].flops == CALLS * 2 * 4 * 8 * 16
    assert early["mixed"].flops == CALLS * (2 * 4 * 8 * 16 + 64)
    known = early["Net"].known
    assert known is not None and (known.calls, known.time_ns) == (1, early["Net"].stat.total_ns // CALLS)
    assert known.flops == OWN_FLOPS + 2 * (2 * 4 * 8 * 16) + 64


def test_calls_after_the_end_on_the_same_inputs_do_the_work_of_those_with_ops() -> None:
    """Every later call's inputs are those of the call with ops: each does its work, so every
    row reads as in the run whose op level did not end, over all its calls."""
    full, early = rows(analyze(cpu_run(CALLS), CPU)), rows(analyze(cpu_run(1, other_shapes=False), CPU))
    assert set(early) == set(full)
    for name, row in early.items():
        got, want = row.verdict, full[name].verdict
        assert row.known is None and got is not None and want is not None, name
        assert (row.flops, row.bytes) == (pytest.approx(full[name].flops), pytest.approx(full[name].bytes)), name
        assert (got.bound, got.basis) == (want.bound, want.basis) and got.efficiency == pytest.approx(want.efficiency), name


def test_layer_types_are_judged_over_the_same_calls() -> None:
    full = {t.type: t for t in analyze(cpu_run(CALLS), CPU).types}
    early = {t.type: t for t in analyze(cpu_run(1), CPU).types}
    got, want = early["DenseAttention"].verdict, full["DenseAttention"].verdict
    assert got is not None and want is not None
    assert got.efficiency == pytest.approx(want.efficiency) and got.bound is want.bound is Bound.COMPUTE
    assert got.basis == "ops (1 of 10 calls)"
    assert early["Linear"].known is None


def test_no_call_with_known_work_gives_no_verdict() -> None:
    """The op level ended before the first call: the custom layer's work is unknown in every
    call, and the model above it is judged on nothing (it read "overhead-bound" from its
    children's partial FLOPs over its whole time)."""
    early = rows(analyze(cpu_run(0), CPU))
    for name in ("Net", "att"):
        v = early[name].verdict
        assert v is not None and v.bound is Bound.UNKNOWN and early[name].achieved_flops is None, name
        assert v.basis.endswith("(0 of 10 calls)") and "the op level ended before any of its 10 calls did" in v.reason


def test_a_run_whose_op_level_did_not_end_is_judged_over_every_call() -> None:
    a = analyze(cpu_run(CALLS), CPU)
    assert all(r.known is None for r in a.layers) and all(t.known is None for t in a.types)
    assert all(r.verdict is not None and "calls)" not in r.verdict.basis for r in a.layers)


def gpu_run(with_ops: int, kernel_ns: int = 8_000) -> Run:
    """``CALLS`` calls of Net → fc (a Linear) → aten::mm → one kernel (8 µs of a 10 µs call);
    the first ``with_ops`` calls have ops, and so kernels."""
    n = 64
    tracks = {1: Track(1, TrackKind.THREAD, "MainThread", 10, 10), 2: Track(2, TrackKind.GPU_STREAM, "stream 7", 10, 0, 0, 7)}
    spans: list[Span] = []
    for c in range(CALLS):
        t, i = c * 100_000, 100 * c + 1
        spans += [Span(i, None, M, "Net", t, t + 10_000, 1, {}), Span(i + 1, i, L, "fc", t, t + 10_000, 1, linear_attrs(n, n, n))]
        if c < with_ops:
            spans += [
                Span(i + 2, i + 1, OP, "aten::mm", t + 10, t + 9_990, 1, {"ml.flops": 2 * n**3}),
                Span(i + 3, i + 2, K, "cudaLaunchKernel", t + 20, t + 25, 1, {"cuda.api.name": "cudaLaunchKernel"}),
                Span(i + 4, i + 3, K, "gemm_kernel", t + 500, t + 500 + kernel_ns, 2, {"gpu.kernel.name": "gemm_kernel"}),
            ]
    run = Run(path=Path("gpu"), meta={"name": "gpu", "devices": [{"name": "NVIDIA A100-SXM4-80GB"}]}, tracks=tracks, spans=spans)
    if with_ops < CALLS:
        run.meta["op_window"] = {
            "ended_ns": (with_ops - 1) * 100_000 + 10_001,
            "reason": "--op-inferences",
            "ended_after_model_calls": with_ops,
        }
    return run


def test_a_gpu_layer_is_judged_over_the_calls_whose_kernels_were_recorded() -> None:
    """Kernels exist only in calls with ops: the CPU time of all 10 calls against the kernels of
    1 read as launch-bound (12.5× the GPU time); over that 1 call it reads as the full run does."""
    peaks = PeakSet(CPU.cpu, gpu_peaks("NVIDIA A100-SXM4-80GB"))
    full, early = rows(analyze(gpu_run(CALLS), peaks)), rows(analyze(gpu_run(1), peaks))
    for name in ("fc", "Net"):
        got, want = early[name].verdict, full[name].verdict
        assert got is not None and want is not None, name
        assert "launch-bound" not in got.reason and (got.bound, got.efficiency) == (want.bound, pytest.approx(want.efficiency)), name
        assert early[name].achieved_flops == pytest.approx(full[name].achieved_flops), name
        assert got.basis.endswith("(1 of 10 calls)"), name


def test_a_traced_custom_layer_after_the_op_level_ended(tmp_path: Path) -> None:
    """A real run (``op_inferences=1``, 4 calls: three on 256 nodes, the first with ops, then
    one on 128): the calls after the op level's end on inputs of the same shapes do the work of
    the one with ops, so the custom layer and the model above it are judged over those 3 of 4
    calls; the call on other shapes has no known work. The Linear (a formula) over all 4."""
    torch = pytest.importorskip("torch")
    import mltrace

    class DenseAttention(torch.nn.Module):  # type: ignore[misc,name-defined]
        """Attention over the input's nodes, run in its own forward: no formula, its work is its ops'."""

        def __init__(self, d: int) -> None:
            super().__init__()
            self.wq, self.wk, self.wv = (torch.nn.Parameter(torch.randn(d, d)) for _ in range(3))

        def forward(self, x: Any) -> Any:
            return torch.softmax((x @ self.wq) @ (x @ self.wk).t(), dim=-1) @ (x @ self.wv)

    model = torch.nn.Sequential(DenseAttention(16), torch.nn.Linear(16, 16)).eval()
    x, smaller = torch.randn(256, 16), torch.randn(128, 16)
    with torch.inference_mode():
        model(x)
        with mltrace.profile(output=tmp_path / "run", summary=False, op_inferences=1):
            for inputs in (x, x, x, smaller):
                model(inputs)
    run = mltrace.load_run(tmp_path / "run")
    assert run.meta["op_window"]["ended_after_model_calls"] == 1
    got = rows(analyze(run, CPU))
    for name in ("0", "Sequential"):
        row, v = got[name], got[name].verdict
        assert row.op_calls == 1 and row.known is not None and row.known.calls == 3 and row.known.time_ns < row.stat.total_ns, name
        assert v is not None and v.basis == "ops (3 of 4 calls)", name
        assert row.achieved_flops == pytest.approx(row.known.flops / (row.known.time_ns * 1e-9)), name
    # Each of the 3 calls on 256 nodes counts its two 256x16x256 products at least; the call on
    # 128 nodes counts nothing.
    attention = got["0"]
    assert attention.known is not None and attention.flops == pytest.approx(attention.known.flops)
    assert attention.known.flops >= 3 * 2 * (2 * 256 * 16 * 256)
    assert got["1"].known is None and got["1"].verdict is not None and got["1"].verdict.basis == "ops"
