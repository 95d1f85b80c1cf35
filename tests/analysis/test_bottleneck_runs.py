"""analyze() on hand-made runs with known numbers, and on imported real traces."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from mltrace.analysis.bottleneck import Bound, analyze, timeline
from mltrace.analysis.pauses import Pauses
from mltrace.analysis.peaks import Peaks, PeakSet, gpu_peaks
from mltrace.importers.kineto import import_kineto
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run, load_run
from support.reference_breakdown import breakdown

KINETO = Path(__file__).resolve().parents[1] / "data" / "kineto"
CPU = PeakSet(Peaks("cpu", "test CPU", 100e9, 10e9, "assumed"))
M, L, OP, LIB, K, U = Level.MODEL, Level.LAYER, Level.OP, Level.LIBRARY, Level.KERNEL, Level.USER


def linear_attrs(m: int, k: int, n: int) -> dict[str, Any]:
    return {
        "ml.layer.type": "Linear",
        "ml.layer.params": k * n + n,
        "ml.input.shapes": [[m, k]],
        "ml.input.dtypes": ["float32"],
        "ml.output.shapes": [[m, n]],
        "ml.output.dtypes": ["float32"],
        "code.file.path": "/src/model.py",
        "code.line.number": 12,
    }


def cpu_run(spans: list[Span]) -> Run:
    return Run(
        path=Path("hand-made"),
        meta={"name": "hand-made", "complete": True},
        tracks={1: Track(1, TrackKind.THREAD, "MainThread", 10, 10)},
        spans=spans,
    )


def small_cpu_run() -> Run:
    return cpu_run(
        [
            Span(5, 4, LIB, "MKL SGEMM", 130, 460, 1, {"ml.library.name": "MKL"}),
            Span(4, 3, OP, "aten::addmm", 120, 470, 1, {"ml.flops": 1000}),
            Span(3, 2, OP, "aten::linear", 110, 480, 1, {}),
            Span(2, 1, L, "a", 100, 500, 1, linear_attrs(4, 8, 16)),
            Span(7, 6, OP, "aten::relu", 610, 690, 1, {}),
            Span(6, 1, L, "b", 600, 700, 1, {"ml.layer.type": "ReLU", "ml.input.shapes": [[4, 16]], "ml.output.shapes": [[4, 16]]}),
            Span(9, 8, OP, "aten::copy_", 760, 790, 1, {}),
            Span(8, 1, U, "post", 750, 800, 1, {}),
            Span(1, None, M, "Net", 0, 1000, 1, {"ml.layer.type": "Net"}),
            Span(12, 11, OP, "aten::linear", 2110, 2390, 1, {}),
            Span(11, 10, L, "a", 2100, 2400, 1, linear_attrs(4, 8, 16)),
            Span(10, None, M, "Net", 2000, 2500, 1, {"ml.layer.type": "Net"}),
        ]
    )


def test_breakdown_is_the_same_as_analysis_breakdown() -> None:
    run = small_cpu_run()
    assert analyze(run, CPU).breakdown == breakdown(run)
    assert analyze(run).breakdown == breakdown(run)


def test_layer_rows_times_contents_and_overhead() -> None:
    a = analyze(small_cpu_run(), CPU)
    rows = {r.stat.name: r for r in a.layers}
    la = rows["a"]
    assert (la.stat.calls, la.stat.total_ns, la.stat.self_ns) == (2, 700, 700)
    assert la.stat.ops == {"aten::linear": [2, 650]}
    assert (la.op_ns, la.op_count) == (650, 2)
    assert la.framework_ns == 50
    assert [(x.name, x.calls, x.total_ns) for x in la.libraries] == [("MKL SGEMM", 1, 330)]
    assert la.stat.location == "/src/model.py:12"
    # FLOPs: op FLOPs win over the formula for calls that have them (1000 + formula 2·4·8·16 for the other call)
    assert la.flops == 1000 + 2 * 4 * 8 * 16
    net = rows["Net"]
    assert net.stat.level is M and net.stat.total_ns == 1500
    assert net.stat.self_ns == (1000 - 400 - 100 - 50) + (500 - 300)
    assert net.has_child_layers and not la.has_child_layers
    assert a.findings.framework_ns == 50 + (100 - 80) + 650


def test_op_library_and_level_tables() -> None:
    a = analyze(small_cpu_run(), CPU)
    ops = {r.name: r for r in a.ops}
    assert (ops["aten::linear"].calls, ops["aten::linear"].total_ns, ops["aten::linear"].self_ns) == (2, 650, 20 + 280)
    assert (ops["aten::addmm"].self_ns, ops["aten::addmm"].flops) == (350 - 330, 1000)
    assert [r.name for r in a.ops][:2] == ["aten::linear", "aten::relu"]  # by self time
    assert [(r.name, r.detail) for r in a.libraries] == [("MKL SGEMM", "MKL")]
    levels = {lt.level: (lt.spans, lt.time_ns) for lt in a.breakdown.levels}
    assert levels[OP] == (5, 370 + 80 + 30 + 280)
    assert a.levels == [M, L, OP, LIB, U]


def test_an_op_row_counts_the_flops_of_its_own_calls_even_inside_a_counted_op() -> None:
    """aten::linear and the aten::addmm it calls both carry the product's FLOPs: each row is
    judged by its own total time with them, while the layer counts them once."""
    spans = [
        Span(1, None, M, "Net", 0, 1000, 1, {"ml.layer.type": "Net"}),
        Span(2, 1, L, "a", 100, 900, 1, linear_attrs(4, 8, 16)),
        Span(3, 2, OP, "aten::linear", 110, 890, 1, {"ml.flops": 1024}),
        Span(4, 3, OP, "aten::addmm", 120, 880, 1, {"ml.flops": 1024}),
    ]
    a = analyze(cpu_run(spans), CPU)
    ops = {r.name: r for r in a.ops}
    assert (ops["aten::linear"].flops, ops["aten::addmm"].flops) == (1024, 1024)
    verdict = ops["aten::addmm"].verdict
    assert verdict is not None and verdict.achieved_flops == pytest.approx(1024 / 760e-9)
    layer = next(r for r in a.layers if r.stat.name == "a")
    assert layer.flops == 1024


def test_ops_outside_every_model_and_user_span_stay_out_of_the_name_tables() -> None:
    """Weight init and the program's own tensor code before the model runs: counted once, in
    a line of their own, never in the op, library or data-movement figures of the inference."""
    run = small_cpu_run()
    setup = [
        Span(20, None, OP, "aten::normal_", 3000, 9000, 1, {}),
        Span(21, None, OP, "aten::copy_", 9100, 9900, 1, {}),
        Span(22, 21, OP, "aten::addmm", 9200, 9800, 1, {"ml.flops": 5000}),
        Span(23, 22, LIB, "MKL SGEMM", 9300, 9700, 1, {"ml.library.name": "MKL"}),
    ]
    with_setup = cpu_run([*run.spans, *setup])
    a, base = analyze(with_setup, CPU), analyze(run, CPU)
    assert [(r.name, r.calls, r.total_ns, r.self_ns, r.flops) for r in a.ops] == [
        (r.name, r.calls, r.total_ns, r.self_ns, r.flops) for r in base.ops
    ]
    assert [(r.name, r.calls, r.total_ns) for r in a.libraries] == [("MKL SGEMM", 1, 330)]
    assert (a.findings.data_movement_ns, a.findings.data_movement_base_ns) == (30, 370 + 80 + 30 + 280)
    assert a.unscoped_ops == (3, 6000 + 800)
    assert a.unscoped_text().startswith("3 ops outside every model call and user span (0.01 ms")
    assert base.unscoped_ops == (0, 0) and base.unscoped_text() == ""
    # The level table and the outside-model count still see every op; the level time in scope does not.
    assert {lt.level: (lt.spans, lt.time_ns) for lt in a.breakdown.levels}[OP] == (5 + 3, 370 + 80 + 30 + 280 + 6000 + 800)
    assert a.level_ns_in_scope[OP] == 370 + 80 + 30 + 280 and a.level_ns_in_scope[LIB] == 330
    assert a.level_ns_in_scope[M] == 1000 + 500 and base.level_ns_in_scope == {lt.level: lt.time_ns for lt in base.breakdown.levels}
    assert a.breakdown.ops_outside_models == 3
    # A run with no model, layer or user span at all (an imported profiler trace): everything counts.
    alone = analyze(cpu_run(setup), CPU)
    assert {r.name for r in alone.ops} == {"aten::normal_", "aten::copy_", "aten::addmm"} and alone.unscoped_ops == (0, 0)
    assert [r.name for r in alone.libraries] == ["MKL SGEMM"] and alone.findings.data_movement_ns == 800


def test_findings_idle_and_data_movement() -> None:
    f = analyze(small_cpu_run(), CPU).findings
    idle = f.idle[0]
    assert (idle.where, idle.window_ns, idle.busy_ns, idle.idle_ns) == ("between model calls", 2500, 1500, 1000)
    assert [(g.start_ns, g.end_ns, g.before, g.after) for g in idle.gaps] == [(1000, 2000, "Net", "Net")]
    assert f.data_movement_ns == 30 and f.data_movement_base_ns == 370 + 80 + 30 + 280
    assert [x.name for x in f.data_movement_top] == ["aten::copy_"]
    assert f.basis == "leaf layers (total time)" and sum(f.bound_ns.values()) == 700 + 100


def test_the_headline_says_how_much_of_the_model_its_leaf_layers_hold() -> None:
    """The headline's verdict shares are over the leaf layers: where those hold little of the
    model's time (a graph attention layer's own ops around a small LeakyReLU child), the basis
    says how little, so the shares are not read as the model's."""
    run = cpu_run(
        [
            Span(4, 2, OP, "aten::softmax", 300, 950, 1, {"ml.input.shapes": [[64, 64]], "ml.input.dtypes": ["float"]}),
            Span(3, 2, L, "attn.act", 100, 200, 1, {"ml.layer.type": "ReLU", "ml.input.shapes": [[4, 16]], "ml.output.shapes": [[4, 16]]}),
            Span(2, 1, L, "attn", 50, 980, 1, {"ml.layer.type": "Attention"}),
            Span(1, None, M, "Net", 0, 1000, 1, {"ml.layer.type": "Net"}),
        ]
    )
    f = analyze(run, CPU).findings
    assert f.basis == "leaf layers (total time; 10% of model time)" and sum(f.bound_ns.values()) == 100
    assert analyze(small_cpu_run(), CPU).findings.basis == "leaf layers (total time)"  # 800 of 1500 ns


def test_two_models_with_a_layer_at_the_same_path_get_a_row_each() -> None:
    """A layer span is named by its path inside its model: a GAN's generator and discriminator
    both have ``main.0``, a ConvTranspose2d and a Conv2d. Their calls were one row (typed as
    either, with both models' ops and calls); each is now named after its model too, in the
    rows, their per-call times and their hot lines, and a path only one model has stays."""
    from mltrace.analysis.report_data import build_report

    def layer(kind: str, lines: list[list[Any]]) -> dict[str, Any]:
        return {"ml.layer.type": kind, "ml.source.hot_lines": lines}

    spans = [
        Span(3, 2, OP, "aten::conv_transpose2d", 110, 390, 1, {}),
        Span(2, 1, L, "main.0", 100, 400, 1, layer("ConvTranspose2d", [["gen.py:5 forward", 300]])),
        Span(1, None, M, "Generator", 0, 500, 1, {"ml.layer.type": "Generator"}),
        Span(6, 5, OP, "aten::conv2d", 1110, 1190, 1, {}),
        Span(5, 4, L, "main.0", 1100, 1200, 1, layer("Conv2d", [["disc.py:9 forward", 100]])),
        Span(7, 4, L, "head", 1200, 1250, 1, layer("Linear", [])),
        Span(4, None, M, "Discriminator", 1000, 1300, 1, {"ml.layer.type": "Discriminator"}),
    ]
    run = cpu_run(spans)
    a = analyze(run, CPU)
    rows = {r.stat.name: r for r in a.layers if r.stat.level is L}
    assert {n: (r.stat.type, r.stat.calls, r.median_ns) for n, r in rows.items()} == {
        "Generator.main.0": ("ConvTranspose2d", 1, 300),
        "Discriminator.main.0": ("Conv2d", 1, 100),
        "head": ("Linear", 1, 50),
    }
    assert list(rows["Generator.main.0"].stat.ops) == ["aten::conv_transpose2d"]
    layers = {e["name"]: e for e in build_report(run, a)["layers"]}
    assert layers["Generator.main.0"]["hot_lines"] == [{"line": "gen.py:5", "function": "forward", "ns": 300}]
    assert [s.name for s in run.spans if s.level is L] == ["main.0", "main.0", "head"]  # the run itself is left as it was


def test_mltrace_pauses_between_model_calls_are_neither_busy_nor_idle() -> None:
    """torch.profiler's cycle switches (run.json ``torch_profiler.pauses``) inside the window
    and outside the model calls are left out of the idle time and end no gap; parts inside a
    model call, or outside the window (the last switch, after the program), count nothing."""
    run = small_cpu_run()
    run.meta["torch_profiler"] = {"pauses": [[10, 1000, 1300], [10, 1800, 2100], [10, 2500, 2900]]}
    idle = analyze(run, CPU).findings.idle[0]
    assert (idle.window_ns, idle.busy_ns, idle.tracer_ns, idle.idle_ns) == (2500, 1500, 500, 500)
    assert [(g.start_ns, g.end_ns, g.before, g.after) for g in idle.gaps] == [(1300, 1800, "mltrace's pause", "mltrace's pause")]
    assert "mltrace's own pauses (the op level's cycle switches, waits and early end) 500 ns more, left out" in idle.tracer_text()
    assert analyze(small_cpu_run(), CPU).findings.idle[0].tracer_text() == ""


def test_the_op_levels_early_end_is_mltraces_pause_too() -> None:
    """The op level's early end holds the thread that ended it while the profilers stop
    (run.json ``op_window``: ``ended_ns``, ``pause_s``, ``thread``; a framework's entry may repeat
    the whole level's): left out of the idle time as a cycle switch is. An entry written before
    the thread was recorded counts for every thread."""
    run = small_cpu_run()
    end = {"ended_ns": 1100, "pause_s": 400e-9, "thread": 10}
    run.meta["op_window"] = {**end, "frameworks": {"pytorch": dict(end)}}
    idle = analyze(run, CPU).findings.idle[0]
    assert (idle.window_ns, idle.busy_ns, idle.tracer_ns, idle.idle_ns) == (2500, 1500, 400, 600)
    assert Pauses.of_run(run.meta, thread=11).intervals == []
    del run.meta["op_window"]["thread"], run.meta["op_window"]["frameworks"]
    assert Pauses.of_run(run.meta, thread=11).intervals == [(1100, 1500)]


def test_an_op_level_that_ended_before_every_counted_call_measures_no_framework_overhead() -> None:
    """The op level ended (memory budget) before the first model call: no call has ops, so the
    report claims no framework overhead (it read "0 ns (- of model time)") and says why."""
    run = cpu_run(
        [
            Span(1, None, OP, "aten::randn", 0, 100, 1, {}),
            Span(2, None, M, "Net", 1000, 2000, 1, {"ml.layer.type": "Net"}),
            Span(3, 2, L, "a", 1100, 1900, 1, linear_attrs(4, 8, 16)),
            Span(4, None, M, "Net", 3000, 4000, 1, {"ml.layer.type": "Net"}),
            Span(5, 4, L, "a", 3100, 3900, 1, linear_attrs(4, 8, 16)),
        ]
    )
    run.meta["op_window"] = {"ended_ns": 500, "reason": "memory budget", "ended_after_model_calls": 0}
    f = analyze(run, CPU).findings
    assert f.framework_ns is None
    assert "ops were recorded in 0 of 2 model calls; framework overhead and ops per call are not measured" in f.notes[0]


def test_idle_time_after_the_op_levels_early_end_is_said_to_have_no_ops_recorded() -> None:
    """Three model calls, an op of the program's between the first two (1,200..1,600), the op
    level ended at 2,600 (no pause recorded): of the idle 1,000..2,000 and 2,500..5,000, 400 ns
    ran ops and 2,400 ns lie after the end, where the program's ops (a backward pass) were
    not recorded: the finding says so rather than leave that time unexplained."""
    run = cpu_run(
        [
            Span(1, None, M, "Net", 0, 1000, 1, {"ml.layer.type": "Net"}),
            Span(2, 1, L, "a", 100, 900, 1, linear_attrs(4, 8, 16)),
            Span(3, 2, OP, "aten::linear", 110, 890, 1, {}),
            Span(4, None, OP, "aten::mul", 1200, 1600, 1, {}),
            Span(5, None, M, "Net", 2000, 2500, 1, {"ml.layer.type": "Net"}),
            Span(6, 5, L, "a", 2100, 2400, 1, linear_attrs(4, 8, 16)),
            Span(7, None, M, "Net", 5000, 5500, 1, {"ml.layer.type": "Net"}),
            Span(8, 7, L, "a", 5100, 5400, 1, linear_attrs(4, 8, 16)),
        ]
    )
    run.meta["op_window"] = {"ended_ns": 2600, "reason": "memory budget", "ended_after_model_calls": 2}
    idle = analyze(run, CPU).findings.idle[0]
    assert (idle.idle_ns, idle.ops_ns, idle.unrecorded_ns) == (3500, 400, 2400)
    assert "2.4 µs of it (69%) after the op level ended, where the program's ops were not recorded" in idle.headline()
    del run.meta["op_window"]
    assert analyze(run, CPU).findings.idle[0].unrecorded_ns == 0


def test_span_order_does_not_matter() -> None:
    run = small_cpu_run()
    expected = analyze(run, CPU)
    for seed in range(5):
        shuffled = list(run.spans)
        random.Random(seed).shuffle(shuffled)
        got = analyze(cpu_run(shuffled), CPU)
        assert got.breakdown.levels == expected.breakdown.levels
        assert sorted((r.stat.name, r.stat.total_ns, r.stat.self_ns, r.flops, r.framework_ns) for r in got.layers) == sorted(
            (r.stat.name, r.stat.total_ns, r.stat.self_ns, r.flops, r.framework_ns) for r in expected.layers
        )
        assert {r.name: (r.total_ns, r.self_ns) for r in got.ops} == {r.name: (r.total_ns, r.self_ns) for r in expected.ops}


def test_cyclic_parents_do_not_hang() -> None:
    run = cpu_run([Span(1, 2, L, "a", 0, 10, 1, {}), Span(2, 1, L, "b", 0, 10, 1, {}), Span(3, 1, OP, "aten::x", 1, 2, 1, {})])
    a = analyze(run, CPU)
    assert {r.stat.name for r in a.layers} == {"a", "b"} and [r.name for r in a.ops] == ["aten::x"]
    b = breakdown(run)  # the reference implementation (the end-of-run summary uses it) too
    assert b.span_count == 3 and {x.name for x in b.layers} == {"a", "b"}


def test_empty_run_and_model_only_run() -> None:
    empty = analyze(cpu_run([]), CPU)
    assert empty.layers == [] and empty.breakdown.span_count == 0 and empty.findings.dominant is Bound.UNKNOWN
    model_only = analyze(cpu_run([Span(1, None, M, "Net", 0, 1000, 1, {"ml.layer.type": "Net", "ml.input.shapes": [[2, 3]]})]), CPU)
    assert [r.stat.name for r in model_only.layers] == ["Net"]
    assert model_only.layers[0].verdict is not None


def gpu_run(kernels: int, kernel_ns: int, cpu_ns: int, n: int = 64) -> Run:
    """Model → layer (n×n×n Linear) → aten::mm → cudaLaunchKernel ×k on the CPU; k kernels on GPU 0 stream 7."""
    tracks = {1: Track(1, TrackKind.THREAD, "MainThread", 10, 10), 2: Track(2, TrackKind.GPU_STREAM, "stream 7", 10, 0, 0, 7)}
    spans = [
        Span(1, None, M, "Net", 0, cpu_ns, 1, {}),
        Span(2, 1, L, "fc", 0, cpu_ns, 1, linear_attrs(n, n, n)),
        Span(3, 2, OP, "aten::mm", 10, cpu_ns - 10, 1, {"ml.flops": 2 * n**3}),
    ]
    step = (cpu_ns - 40) // kernels
    for i in range(kernels):
        launch = 100 + i
        t = 20 + i * step
        spans.append(Span(launch, 3, K, "cudaLaunchKernel", t, t + 5, 1, {"cuda.api.name": "cudaLaunchKernel"}))
        spans.append(
            Span(
                1000 + i,
                launch,
                K,
                "gemm_kernel",
                t + 50,
                t + 50 + kernel_ns,
                2,
                {"gpu.kernel.name": "gemm_kernel", "ml.library.name": "cuBLAS"},
            )
        )
    return Run(path=Path("gpu"), meta={"name": "gpu", "devices": [{"name": "NVIDIA A100-SXM4-80GB"}]}, tracks=tracks, spans=spans)


def test_gpu_launch_bound_layer_and_op() -> None:
    run = gpu_run(kernels=10, kernel_ns=100, cpu_ns=100_000)
    a100 = gpu_peaks("NVIDIA A100-SXM4-80GB")
    a = analyze(run, PeakSet(CPU.cpu, a100))
    fc = next(r for r in a.layers if r.stat.name == "fc")
    assert (fc.kernel_count, fc.kernel_ns) == (10, 1000)
    assert [(k.name, k.calls) for k in fc.kernels] == [("gemm_kernel", 10)]
    assert fc.verdict is not None and fc.verdict.bound is Bound.OVERHEAD and "launch-bound" in fc.verdict.reason
    mm = next(r for r in a.ops if r.name == "aten::mm")
    assert (mm.kernels, mm.device_ns) == (10, 1000)
    assert mm.verdict is not None and "launch-bound" in mm.verdict.reason
    assert [(k.name, k.detail, k.calls, k.total_ns) for k in a.kernels] == [("gemm_kernel", "cuBLAS", 10, 1000)]
    assert [(r.name, r.calls) for r in a.runtime] == [("cudaLaunchKernel", 10)]
    gpu_idle = next(i for i in a.findings.idle if i.where == "GPU 0")
    assert gpu_idle.busy_ns == 1000 and gpu_idle.idle_ns > 0
    assert a.findings.device_ns == 1000 and a.findings.cpu_ns == 100_000


def test_gpu_busy_layer_is_judged_on_the_gpu_roofs() -> None:
    # 2·4096³ FLOP (137 GFLOP, 680 FLOP/B) in 10 ms of kernels on an A100 (19.5 TFLOP/s fp32): 70% of the compute roof
    run = gpu_run(kernels=1, kernel_ns=10_000_000, cpu_ns=5_000_000, n=4096)
    a = analyze(run, PeakSet(CPU.cpu, gpu_peaks("NVIDIA A100-SXM4-80GB")))
    fc = next(r for r in a.layers if r.stat.name == "fc")
    assert fc.verdict is not None and fc.verdict.bound is Bound.COMPUTE, fc.verdict.reason
    assert a.roofline and all(p.device == "gpu" for p in a.roofline if p.kind == "layer")


def test_gpu_not_in_table_gives_unknown_not_a_guess() -> None:
    run = gpu_run(kernels=1, kernel_ns=20_000, cpu_ns=5_000)
    a = analyze(run, CPU)
    fc = next(r for r in a.layers if r.stat.name == "fc")
    assert fc.verdict is not None and fc.verdict.bound is Bound.UNKNOWN
    assert any("not in the table" in n for n in a.findings.notes)


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("imported") / "alexnet"
    import_kineto(KINETO / "a100_alexnet_train.json.gz", out)
    return load_run(out)


def test_imported_gpu_trace(imported: Run) -> None:
    peaks = PeakSet(CPU.cpu, gpu_peaks(imported.meta["devices"][0]["name"]))
    assert peaks.gpu is not None and peaks.gpu.name == "NVIDIA A100 40GB"
    a = analyze(imported, peaks)
    assert a.breakdown == breakdown(imported)
    gpu_spans = [s for s in imported.spans if imported.tracks[s.track_id].kind == TrackKind.GPU_STREAM and s.level is K]
    assert sum(k.calls for k in a.kernels) == len(gpu_spans)
    assert sum(k.total_ns for k in a.kernels) == sum(s.duration_ns for s in gpu_spans)
    # every kernel reached through its launch belongs to each op above it (aten::linear and the
    # aten::addmm in it both launched it): no op has more GPU time than the launched kernels
    launched = {f.to_span for f in imported.flows if f.kind == "launch"}
    launched_ns = sum(s.duration_ns for s in gpu_spans if s.id in launched)
    assert max(r.device_ns for r in a.ops) <= launched_ns <= sum(r.device_ns for r in a.ops)
    assert any(i.where.startswith("GPU") for i in a.findings.idle)
    assert a.findings.basis == "ops (self time)" and a.findings.bound_ns
    assert all(r.verdict is not None for r in a.ops)


def test_imported_cpu_trace_with_modules(tmp_path: Path) -> None:
    run = load_run(import_kineto(KINETO / "cpu_modules_torch.json.gz", tmp_path / "cpu"))
    a = analyze(run, CPU)
    assert a.breakdown == breakdown(run)
    assert any(r.stat.level is L for r in a.layers)
    assert all(r.verdict is not None for r in a.layers)


def test_timeline_lanes_cover_the_busy_time() -> None:
    tl = timeline(small_cpu_run(), bins=25)  # 100 ns per bin over 0..2500
    assert (tl.start_ns, tl.end_ns, tl.bins) == (0, 2500, 25)
    lanes = {(lane.track, lane.level): lane for lane in tl.lanes}
    model = lanes[("MainThread (10)", M)]
    assert model.busy[:10] == [1.0] * 10 and model.busy[10:20] == [0.0] * 10 and model.busy[20:] == [1.0] * 5
    assert sum(lanes[("MainThread (10)", OP)].busy) * tl.bin_ns == pytest.approx(370 + 80 + 30 + 280)
    assert [lv.level for lv in tl.lanes] == [M, L, OP, LIB, U]
    assert [m[2] for m in tl.models] == ["Net", "Net"]


def test_a_layers_source_is_its_most_frequent_call_site() -> None:
    """Three calls from line 12 and a last one from line 40: the report's and the end-of-run
    summary's source is line 12, the line of most calls (it was the last call's)."""
    from mltrace.analysis.summary import summarize

    spans = []
    for i, line in enumerate([12, 12, 12, 40]):
        base, attrs = 1000 * i, {**linear_attrs(4, 8, 16), "code.line.number": line}
        spans += [Span(10 + 2 * i, None, M, "Net", base, base + 500, 1, {"ml.layer.type": "Net", "code.line.number": line})]
        spans += [Span(11 + 2 * i, 10 + 2 * i, L, "a", base + 100, base + 400, 1, attrs)]
    run = cpu_run(spans)
    rows = {r.stat.name: r.stat for r in analyze(run, CPU).layers}
    assert (rows["a"].line, rows["Net"].line) == (12, 12)
    (top,) = summarize(run)["top_layers_by_self_time"]
    assert top["location"] == "/src/model.py:12"


def test_a_layer_known_only_by_its_inputs_and_outputs_gets_no_verdict() -> None:
    """A module of a type without a formula, with no ops and no child layers (basis io: a
    torch.compile'd model at the layer level, a custom block): its FLOPs are unknown, so no
    memory-bound verdict from its bytes alone (it was judged memory-bound)."""
    attrs = {"ml.layer.type": "OptimizedModule", "ml.input.shapes": [[8, 128]], "ml.input.dtypes": ["float32"]}
    attrs |= {"ml.output.shapes": [[8, 128]], "ml.output.dtypes": ["float32"]}
    run = cpu_run([Span(1, None, M, "OptimizedModule", 0, 1_000_000, 1, attrs)])
    (row,) = analyze(run, CPU).layers
    assert row.work_source == "io" and row.bytes > 0
    assert row.verdict is not None and row.verdict.bound is Bound.UNKNOWN
    assert row.verdict.reason == "no FLOP estimate (unknown layer type, no op FLOPs)"


def test_ops_outside_the_models_in_child_processes_are_said_to_be_there() -> None:
    """Ops outside every model call: one on the program's thread, two on a DataLoader worker's
    (a followed child process): the line says how many ran in child processes."""
    tracks = {1: Track(1, TrackKind.THREAD, "MainThread", 10, 10), 2: Track(2, TrackKind.THREAD, "MainThread", 20, 20)}
    spans = [
        Span(1, None, M, "Net", 0, 1000, 1, {"ml.layer.type": "Net"}),
        Span(2, None, OP, "aten::randn", 1100, 1200, 1, {}),
        Span(3, None, OP, "aten::stack", 1100, 1300, 2, {}),
        Span(4, None, OP, "aten::stack", 1400, 1500, 2, {}),
    ]
    run = Run(path=Path("hand-made"), meta={"name": "hand-made", "complete": True, "pid": 10}, tracks=tracks, spans=spans)
    a = analyze(run, CPU)
    assert a.unscoped_ops == (3, 400) and a.unscoped_ops_elsewhere == 2
    assert "; 2 of them in the program's child processes (pid 20))" in a.unscoped_text()
    assert "child processes" not in analyze(small_cpu_run(), CPU).unscoped_text()


def test_ops_outside_the_models_in_child_processes_name_those_processes() -> None:
    """torchrun's two ranks build their models outside every model call: the line names the
    ranks (run.json ``processes``' roles), not DataLoader workers, and not the launcher."""
    tracks = {tid: Track(tid, TrackKind.THREAD, "MainThread", pid, pid) for tid, pid in ((1, 10), (2, 21), (3, 22))}
    spans = [Span(1, None, OP, "aten::empty", 0, 100, 1, {})]
    for i, track in enumerate((2, 3, 2, 3)):
        spans.append(Span(10 + i, None, OP, "aten::uniform_", 200 + 10 * i, 205 + 10 * i, track, {}))
    spans += [
        Span(20, None, M, "DistributedDataParallel", 1000, 2000, 2, {}),
        Span(21, None, M, "DistributedDataParallel", 1000, 2000, 3, {}),
    ]
    processes = [{"pid": 10, "role": "main"}, {"pid": 22, "role": "rank 1"}, {"pid": 21, "role": "rank 0"}]
    run = Run(
        path=Path("hand-made"), meta={"name": "hand-made", "complete": True, "pid": 10, "processes": processes}, tracks=tracks, spans=spans
    )
    a = analyze(run, CPU)
    assert a.unscoped_ops_elsewhere == 4 and a.unscoped_ops_roles == ["rank 1", "rank 0"]
    assert "; 4 of them in the program's child processes (rank 1, rank 0))" in a.unscoped_text()
