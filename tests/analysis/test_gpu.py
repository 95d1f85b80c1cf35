"""GPU tables: every kernel accounted once, per op (real A100 trace) and per layer (a table)."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from mltrace.analysis.gpu import attribute_gpu_activities, gpu_tables, is_gpu_activity
from mltrace.importers import import_kineto
from mltrace.run.events import Flow, Span
from mltrace.run.levels import Level
from mltrace.run.store import Run, load_run

ALEXNET = Path(__file__).resolve().parents[1] / "data" / "kineto" / "a100_alexnet_train.json.gz"


@pytest.fixture(scope="module")
def alexnet(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return load_run(import_kineto(ALEXNET, tmp_path_factory.mktemp("gpu") / "run"))


def _raw_gpu_events() -> list[dict]:
    with gzip.open(ALEXNET, "rt", encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def test_every_kernel_is_accounted_to_exactly_one_op(alexnet: Run) -> None:
    by_id = alexnet.span_by_id()
    gpu = [s for s in alexnet.spans if is_gpu_activity(s)]
    assert len(gpu) == len(_raw_gpu_events()) == 98
    attributions = attribute_gpu_activities(alexnet)
    assert set(attributions) == {s.id for s in gpu}
    for a in attributions.values():
        assert a.launch is not None and a.op is not None, a
        launch, op = by_id[a.launch], by_id[a.op]
        assert "cuda.api.name" in launch.attrs and op.level is Level.OP
        # The op ran the launch call: same thread, and its interval holds the call's.
        assert op.track_id == launch.track_id
        assert op.start_ns <= launch.start_ns and launch.end_ns <= op.end_ns
        # No op nested inside that op also holds the launch (the innermost op is chosen).
        inner = [
            s
            for s in alexnet.spans
            if s.level is Level.OP
            and s.id != op.id
            and s.parent_id == op.id
            and s.start_ns <= launch.start_ns
            and launch.end_ns <= s.end_ns
        ]
        assert inner == []


def test_op_table_sums_to_the_run_and_lists_top_kernels(alexnet: Run) -> None:
    t = gpu_tables(alexnet)
    raw = _raw_gpu_events()
    assert t.activities == len(raw)
    assert t.gpu_ns == sum(s.duration_ns for s in alexnet.spans if is_gpu_activity(s))
    assert t.unattributed_to_op == 0 and t.unlaunched == 0
    assert sum(g.gpu_ns for g in t.ops) == t.gpu_ns
    assert sum(g.activities for g in t.ops) == t.activities
    assert [g.gpu_ns for g in t.ops] == sorted((g.gpu_ns for g in t.ops), reverse=True)
    # No layers in this trace (recorded without with_modules): everything is unattributed to a layer.
    assert t.layers == [] and t.unattributed_to_layer == t.activities and t.unattributed_layer_ns == t.gpu_ns
    # Kernel table: by name, counts as in the raw trace.
    raw_counts = Counter(e["name"] for e in raw)
    assert {k.name: k.count for k in t.kernels} == dict(raw_counts)
    assert sum(k.total_ns for k in t.kernels) == t.gpu_ns
    for k in t.kernels:
        assert k.min_ns <= k.mean_ns <= k.max_ns
        if k.activity == "kernel":
            assert k.library  # set by attribute_gpu_library during the import's correlation
    conv = next(g for g in t.ops if g.name == "aten::cudnn_convolution")
    top = conv.top_kernels(3)
    assert len(top) == 3 and [ns for _, _, ns in top] == sorted((ns for _, _, ns in top), reverse=True)
    assert sum(v[1] for v in conv.kernels.values()) == conv.gpu_ns
    assert conv.launches == conv.activities  # one kernel per cudaLaunchKernel here
    lib = {k.name: k.library for k in t.kernels}
    assert all(lib[name] == "cuDNN" for name, _, _ in top)
    copy = next(g for g in t.ops if g.name == "aten::copy_")
    assert set(copy.kernels) == {"Memcpy HtoD (Pageable -> Device)"} and copy.memcpy_ns == copy.gpu_ns


def _table_run() -> Run:
    """A model with two layers on thread track 1, kernels on stream track 2.

    Net [0, 1000]
      fc [100, 500]: aten::linear [120, 480] > aten::addmm (2e6 FLOP) [150, 450] > cudaLaunchKernel [200, 220]
                       → gemm [600, 800]
      act [520, 900]: aten::relu [530, 700] > cudaGraphLaunch [540, 560] → k1 [820, 850], k2 [850, 900]
                      cudaMemcpyAsync [710, 720] (no op) → memcpy [900, 960]
    plus a kernel with no launch call [970, 980].
    """

    def span(i: int, parent: int | None, level: Level, name: str, a: int, b: int, track: int = 1, **attrs: object) -> Span:
        return Span(i, parent, level, name, a, b, track, dict(attrs))

    spans = [
        span(1, None, Level.MODEL, "Net", 0, 1000),
        span(2, 1, Level.LAYER, "fc", 100, 500),
        span(3, 2, Level.OP, "aten::linear", 120, 480),
        span(4, 3, Level.OP, "aten::addmm", 150, 450, **{"ml.flops": 2e6}),
        span(5, 4, Level.KERNEL, "cudaLaunchKernel", 200, 220, **{"cuda.api.name": "cudaLaunchKernel"}),
        span(6, 5, Level.KERNEL, "gemm", 600, 800, 2, **{"gpu.activity": "kernel", "gpu.kernel.name": "gemm", "ml.library.name": "cuBLAS"}),
        span(7, 1, Level.LAYER, "act", 520, 900),
        span(8, 7, Level.OP, "aten::relu", 530, 700),
        span(9, 8, Level.KERNEL, "cudaGraphLaunch", 540, 560, **{"cuda.api.name": "cudaGraphLaunch"}),
        span(10, 9, Level.KERNEL, "k1", 820, 850, 2, **{"gpu.activity": "kernel", "gpu.kernel.name": "k"}),
        span(11, 9, Level.KERNEL, "k2", 850, 900, 2, **{"gpu.activity": "kernel", "gpu.kernel.name": "k"}),
        span(12, 7, Level.KERNEL, "cudaMemcpyAsync", 710, 720, **{"cuda.api.name": "cudaMemcpyAsync"}),
        span(13, None, Level.KERNEL, "Memcpy DtoH", 900, 960, 2, **{"gpu.activity": "gpu_memcpy"}),  # parent only via its flow
        span(14, None, Level.KERNEL, "orphan", 970, 980, 2, **{"gpu.activity": "kernel", "gpu.kernel.name": "orphan"}),
    ]
    flows = [Flow(100, 5, 6), Flow(101, 9, 10), Flow(102, 9, 11), Flow(103, 12, 13)]
    return Run(path=Path("."), meta={}, spans=spans, flows=flows)


def test_layer_table_from_a_table() -> None:
    t = gpu_tables(_table_run())
    layers = {g.name: g for g in t.layers}
    fc, act, net = layers["fc"], layers["act"], layers["Net"]
    assert (fc.gpu_ns, fc.gpu_inclusive_ns, fc.cpu_ns, fc.launches, fc.activities) == (200, 200, 400, 1, 1)
    assert fc.flops == 2e6 and fc.flops_per_s == pytest.approx(2e6 / 200e-9)
    assert fc.kernels == {"gemm": [1, 200]}
    # One graph launch, two kernels; the memcpy has no op but its layer is known.
    assert (act.gpu_ns, act.launches, act.activities, act.memcpy_ns) == (30 + 50 + 60, 2, 3, 60)
    assert act.kernels == {"k": [2, 80], "Memcpy DtoH": [1, 60]}
    assert act.flops_per_s is None  # no FLOP known
    # The model gets nothing directly, everything inclusively (not the orphan kernel).
    assert (net.gpu_ns, net.gpu_inclusive_ns, net.flops) == (0, 340, 2e6)
    assert [g.name for g in t.layers] == ["Net", "fc", "act"]  # by inclusive GPU time
    ops = {g.name: g for g in t.ops}
    assert set(ops) == {"aten::addmm", "aten::relu"}  # the innermost op; linear launched nothing itself
    assert ops["aten::addmm"].flops_per_s == pytest.approx(1e13)
    assert (ops["aten::relu"].launches, ops["aten::relu"].activities) == (1, 2)
    assert (t.unattributed_to_op, t.unattributed_op_ns) == (2, 70)  # the memcpy and the orphan
    assert (t.unattributed_to_layer, t.unattributed_layer_ns, t.unlaunched) == (1, 10, 1)
    assert t.gpu_ns == 200 + 80 + 60 + 10
    assert [(k.name, k.count, k.total_ns) for k in t.kernels] == [("gemm", 1, 200), ("k", 2, 80), ("Memcpy DtoH", 1, 60), ("orphan", 1, 10)]
    assert t.kernels[0].library == "cuBLAS" and t.kernels[1].mean_ns == 40.0


def test_report_lists_top_kernels_per_op_for_an_imported_trace(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from mltrace.importers.kineto import import_kineto

    data = Path(__file__).resolve().parents[1] / "data" / "kineto" / "a100_alexnet_train.json.gz"
    import_kineto(data, tmp_path / "run")
    # The piped report is whole unless COLUMNS says otherwise; a C-level COLUMNS=80 set under pytest
    # (not in os.environ) would otherwise reach the child and fold the kernel names.
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    cmd = [sys.executable, "-m", "mltrace", "report", str(tmp_path / "run")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    section = res.stdout.split("GPU time by op", 1)[1]
    assert "aten::cudnn_convolution" in section and "cudnn" in section.split("aten::cudnn_convolution", 1)[1][:400]
    assert "ampere_sgemm_32x32_sliced1x4_tn ×6" in section
