"""Verdicts on real runs of workloads whose character is known.

Each workload is traced in-process with ``mltrace.profile``, loaded back, and
judged against this machine's measured peaks (the FLOP roof at least the ISA's bound). The workloads are chosen with a
wide margin (more than 10× on the deciding number) so that a busy machine
cannot flip a verdict:

- a 2048×2048 by 2048×2048 matrix product: ~340 FLOP/byte, far right of any
  CPU's ridge, at a good fraction of the peak → compute-bound;
- an add over 64 Mi floats: ≤ 0.13 FLOP/byte, far left of the ridge, at the
  speed of memory → memory-bound;
- 2000 additions on a 16-element tensor: the roofline allows well under a
  microsecond for what takes milliseconds → overhead-bound;
- a layer whose forward runs its own matmuls and softmax over a 2048×2048 score
  matrix (as a graph-attention layer does), with a child layer on its small output:
  ≈ 0.3 FLOP/byte, at 15–26 % of the roofline by the bytes its ops move (one torch
  thread, on a busy 2-core machine) → memory-bound; judged by its inputs
  and outputs alone, the same layer sat at 0.3 % of the roofline (overhead-bound).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import mltrace
from mltrace.analysis.bottleneck import Analysis, Bound, analyze
from mltrace.analysis.peaks import PeakSet, cpu_flags, cpu_for_run, cpu_frequency_hz, measure_cpu_peaks
from mltrace.run.metadata import cpu_model

torch = pytest.importorskip("torch")
nn = torch.nn


@pytest.fixture(scope="module")
def peaks() -> PeakSet:
    """This machine's peaks, measured now (no cache involved), its FLOP roof at least the ISA's bound."""
    hz = cpu_frequency_hz(cpu_model())
    return PeakSet(cpu_for_run(measure_cpu_peaks(), {}, os.cpu_count(), cpu_flags(), hz))


class AddInPlace(nn.Module):  # type: ignore[misc]
    """x + y over large tensors, into a preallocated output (no page faults in the timed call)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("y", torch.ones(n))
        self.register_buffer("out", torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.add(x, self.y, out=self.out)


class TinyOps(nn.Module):  # type: ignore[misc]
    """2000 additions on a 16-element tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2000):
            x = x + 1
        return x


def traced(model: nn.Module, x: torch.Tensor, out: Path, peaks: PeakSet) -> Analysis:
    with torch.inference_mode():
        model(x)  # warm-up: allocator, thread pool, primitive caches
        with mltrace.profile(output=out, summary=False):
            model(x)
    return analyze(mltrace.load_run(out), peaks)


def verdict_of(a: Analysis, layer: str) -> Bound:
    row = next(r for r in a.layers if r.stat.name == layer)
    assert row.verdict is not None
    return row.verdict.bound


def test_large_matmul_is_compute_bound(tmp_path: Path, peaks: PeakSet) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048, bias=False))
    a = traced(model, torch.randn(2048, 2048), tmp_path / "run", peaks)
    row = next(r for r in a.layers if r.stat.name == "0")
    assert row.stat.type == "Linear" and row.flops >= 2 * 2048**3
    assert verdict_of(a, "0") is Bound.COMPUTE, row.verdict
    types = {t.type: t for t in a.types}
    assert types["Linear"].verdict is not None and types["Linear"].verdict.bound is Bound.COMPUTE


def test_elementwise_add_over_a_large_tensor_is_memory_bound(tmp_path: Path, peaks: PeakSet) -> None:
    n = 64 * 1024 * 1024
    model = nn.Sequential(AddInPlace(n))
    a = traced(model, torch.ones(n), tmp_path / "run", peaks)
    row = next(r for r in a.layers if r.stat.name == "0")
    assert row.bytes >= 2 * n * 4  # input and output at least
    assert verdict_of(a, "0") is Bound.MEMORY, row.verdict


def test_loop_of_tiny_ops_is_overhead_bound(tmp_path: Path, peaks: PeakSet) -> None:
    model = nn.Sequential(TinyOps())
    a = traced(model, torch.ones(16), tmp_path / "run", peaks)
    assert verdict_of(a, "0") is Bound.OVERHEAD, next(r for r in a.layers if r.stat.name == "0").verdict
    assert a.findings.dominant is Bound.OVERHEAD


def test_user_spans_with_explicit_work(tmp_path: Path, peaks: PeakSet) -> None:
    np = pytest.importorskip("numpy")
    n = 1024
    a_mat = np.ones((n, n), dtype=np.float32)
    src = np.ones(32 * 1024 * 1024, dtype=np.float32)
    dst = np.empty_like(src)
    np.matmul(a_mat, a_mat)
    np.copyto(dst, src)
    # One element: 8 bytes an add, ≈ 0.1 % of the roofline even at a low measured bandwidth (16
    # elements put it at ≈ 2 %, on the overhead threshold, and the verdict flipped under load).
    small = np.ones(1, dtype=np.float32)
    # The copy declares a quarter of the bytes it moves, so it sits at about a quarter of the
    # roofline: a bandwidth measured low on a busy machine (up to 4× low) cannot put it past the
    # roofline (unknown), and a copy slowed 10× stays above the overhead threshold.
    with mltrace.profile(output=tmp_path / "run", summary=False):
        with mltrace.span("gemm", level="layer", **{"ml.flops": 2 * n**3, "ml.bytes": 3 * n * n * 4}):
            np.matmul(a_mat, a_mat)
        with mltrace.span("copy", level="layer", **{"ml.flops": 0, "ml.bytes": src.nbytes // 2}):
            np.copyto(dst, src)
        with mltrace.span("tiny", level="layer", **{"ml.flops": 2000, "ml.bytes": 2000 * 2 * small.nbytes}):
            for _ in range(2000):
                small = small + 1
    a = analyze(mltrace.load_run(tmp_path / "run"), peaks)
    assert verdict_of(a, "gemm") is Bound.COMPUTE
    assert verdict_of(a, "copy") is Bound.MEMORY
    assert verdict_of(a, "tiny") is Bound.OVERHEAD
    assert {r.stat.name: r.work_source for r in a.layers} == {"gemm": "explicit", "copy": "explicit", "tiny": "explicit"}


class DenseAttention(nn.Module):  # type: ignore[misc]
    """Attention over every pair of n nodes, run in its own forward (matmuls, softmax), then a
    child layer (Tanh) on its small output: the work is in ops directly in the layer."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.wq = nn.Parameter(torch.randn(d, d))
        self.wk = nn.Parameter(torch.randn(d, d))
        self.wv = nn.Parameter(torch.randn(d, d))
        self.register_buffer("bias", torch.randn(n, n))
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.addmm(self.bias, x @ self.wq, (x @ self.wk).t())  # n×n
        return self.act(torch.softmax(scores, dim=-1) @ (x @ self.wv))  # n×d


def test_a_layer_running_its_own_ops_is_judged_by_what_they_move(tmp_path: Path, peaks: PeakSet) -> None:
    n, d = 2048, 2
    model = nn.Sequential(DenseAttention(n, d)).eval()
    x = torch.randn(n, d)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no thread pool waiting on a busy machine: the ops run at one core's speed
    try:
        with torch.inference_mode():
            model(x)  # warm-up
            with mltrace.profile(output=tmp_path / "run", summary=False):
                for _ in range(3):
                    model(x)
    finally:
        torch.set_num_threads(threads)
    a = analyze(mltrace.load_run(tmp_path / "run"), peaks)
    layer = next(r for r in a.layers if r.stat.name == "0")
    child = next(r for r in a.layers if r.stat.name == "0.act")
    ops = {o.name: o for o in a.ops}
    # The layer's own ops: the projections and the attention product (aten::matmul, the
    # aten::mm inside each not counted again), the scores (aten::addmm), the softmax; each
    # name's calls are all directly in the layer.
    own = sum(ops[name].bytes for name in ("aten::matmul", "aten::addmm", "aten::softmax"))
    assert own >= 3 * 5 * n * n * 4  # per call: scores written, softmax read and written, product read
    assert layer.has_child_layers and layer.bytes == pytest.approx(child.bytes + own)
    assert layer.flops >= 3 * 2 * (2 * n * n * d)  # the scores and the product, from the ops' FLOPs
    assert layer.verdict is not None and layer.verdict.bound is Bound.MEMORY, layer.verdict
