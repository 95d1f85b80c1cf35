"""The cold-start rule from tables, and on the H100 fixture (cold calls 10-100x the steady ones)."""

from __future__ import annotations

import io
import re
import statistics
from pathlib import Path

import pytest

import mltrace
from analysis.schema_check import errors
from mltrace.analysis.bottleneck import Bound, analyze, timeline
from mltrace.analysis.coldstart import MAX_BATCH_KINDS, call_kinds, category_of, cold_by_kind, cold_indices, find_cold_start, kind_parts
from mltrace.analysis.peaks import Peaks, PeakSet, gpu_peaks
from mltrace.analysis.report_data import build_report
from mltrace.analysis.report_schema import REPORT_SCHEMA
from mltrace.analysis.units import fmt_ns
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.viewers.html import render_html
from mltrace.viewers.markdown import render_markdown
from mltrace.viewers.terminal import render_report
from support.runs import unpack_run

try:  # imported with the module: its import hooks are in place before a test's check of them
    import transformers
except ImportError:
    transformers = None

MS = 1_000_000


@pytest.mark.parametrize(
    ("durations", "one_time", "cold"),
    [
        ([50 * MS, 5 * MS, 5 * MS, 5 * MS], [None] * 4, [0]),  # a slow first call
        ([50 * MS, 30 * MS, 5 * MS, 5 * MS, 5 * MS], [None] * 5, [0, 1]),  # warm-up over two calls
        ([6 * MS, 5 * MS, 5 * MS, 5 * MS], [None] * 4, []),  # 1.2x: jitter, not cold
        ([5 * MS, 5 * MS, 50 * MS, 5 * MS, 5 * MS], [None] * 5, []),  # a late slow call, nothing seen inside
        ([5 * MS, 5 * MS, 50 * MS, 5 * MS, 5 * MS], [False, False, False, False, False], []),  # nothing one-time in it
        ([5 * MS, 5 * MS, 50 * MS, 5 * MS, 5 * MS], [False, False, True, False, False], [2]),  # a recompile
        ([5 * MS, 5 * MS, 5.2 * MS, 5 * MS], [True, False, True, False], []),  # one-time work, not an outlier
        ([50 * MS], [True], []),  # one call: nothing to compare with
        ([50 * MS, 5 * MS], [None, None], [0]),
    ],
)
def test_cold_rule(durations: list[int], one_time: list[bool | None], cold: list[int]) -> None:
    assert cold_indices([int(d) for d in durations], one_time) == cold


def test_a_prefill_is_another_kind_of_call_not_a_cold_one() -> None:
    kinds = ["prefill", *["decode"] * 6] * 2
    durations = [40 * MS, *[5 * MS] * 6] * 2
    assert cold_indices(durations, [None] * 14) == [0]  # one sequence: the first prefill looks cold
    assert cold_by_kind(durations, [None] * 14, kinds) == []
    slow_start = [400 * MS, *durations[1:]]  # a first call slow even for a prefill is still cold
    assert cold_by_kind(slow_start, [None] * 14, kinds) == [0]


def test_the_only_prefill_is_cold_when_it_compiled() -> None:
    """One generate() of a model whose forward torch.compile compiled: three plain calls (the
    first compiles), the prefill (compiles for its new shape), decode steps (the first two
    recompile for dynamic shapes)."""
    kinds = ["", "", "", "prefill", *["decode"] * 8]
    durations = [900 * MS, 2 * MS, 2 * MS, 1100 * MS, 700 * MS, 800 * MS, *[2 * MS] * 6]
    compiled = [True, False, False, True, True, True, *[False] * 6]
    assert cold_by_kind(durations, compiled, kinds) == [0, 4, 5]  # the prefill: no reference
    assert cold_by_kind(durations, compiled, kinds, compiled=compiled) == [0, 3, 4, 5]
    warm = [*compiled[:3], False, *compiled[4:]]  # a prefill that compiled nothing is steady
    assert cold_by_kind(durations, warm, kinds, compiled=warm) == [0, 4, 5]
    assert cold_by_kind([900 * MS], [True], ["prefill"], compiled=[True]) == []  # a model called once


def test_a_generates_prefill_that_compiled_is_cold_in_a_run() -> None:
    from mltrace.run.events import Span, Track, TrackKind

    spans, next_id, at = [], 1, 0
    calls = [("", 900, True), ("", 2, False), ("prefill", 1100, True), *[("decode", 2, False)] * 6]
    for phase, ms, compiles in calls:
        attrs = {"ml.layer.type": "Net", **({"ml.generate.phase": phase} if phase else {})}
        spans.append(Span(next_id, None, Level.MODEL, "Net", at, at + ms * MS, 1, attrs))
        inner = "_compile.compile_inner (dynamo_timed)" if compiles else "aten::mm"
        spans.append(Span(next_id + 1, next_id, Level.OP, inner, at + MS // 2, at + ms * MS - MS // 2, 1, {}))
        next_id, at = next_id + 2, at + (ms + 1) * MS
    run = Run(
        path=Path("hand-made"),
        meta={"name": "hand-made", "complete": True},
        tracks={1: Track(1, TrackKind.THREAD, "MainThread", 10, 10)},
        spans=spans,
    )
    (model,) = find_cold_start(run).models
    assert model.cold == [0, 2] and list(model.one_time) == ["compile"]


def _lstm_run(ops_in: int) -> Run:
    """A model's first call, cold (90 ms: aten::copy_ 60 ms, aten::mm 20 ms), then six steady
    calls of 10 ms (aten::copy_ 6 ms, aten::mm 2 ms each), the first ``ops_in`` of them with
    their ops recorded (the op level ended after them)."""
    from mltrace.run.events import Span, Track, TrackKind

    spans, next_id, at = [], 1, 0
    for i, ms in enumerate([90, 10, 10, 10, 10, 10, 10]):
        spans.append(Span(next_id, None, Level.MODEL, "Sequence", at, at + ms * MS, 1, {"ml.layer.type": "Sequence"}))
        if i <= ops_in:
            copy_ms, mm_ms = (60, 20) if i == 0 else (6, 2)
            spans.append(Span(next_id + 1, next_id, Level.OP, "aten::copy_", at, at + copy_ms * MS, 1, {}))
            spans.append(Span(next_id + 2, next_id, Level.OP, "aten::mm", at + copy_ms * MS, at + (copy_ms + mm_ms) * MS, 1, {}))
        next_id, at = next_id + 3, at + (ms + 1) * MS
    tracks = {1: Track(1, TrackKind.THREAD, "MainThread", 10, 10)}
    return Run(path=Path("hand-made"), meta={"name": "hand-made", "complete": True}, tracks=tracks, spans=spans)


def test_the_cold_calls_extra_time_is_measured_against_steady_calls_with_ops() -> None:
    """Where the op level ended early, the steady calls after its end have no ops: the cold
    call's ops are compared with those of the steady calls that have some (60 - 6 ms of
    aten::copy_), and with none of them, nothing is listed (it read "aten::copy_ +60 ms")."""
    cs = find_cold_start(_lstm_run(ops_in=2))
    assert cs.models[0].cold == [0]
    assert {x.name: x.ns for x in cs.spent} == {"aten::copy_": 54 * MS, "aten::mm": 18 * MS}
    cs = find_cold_start(_lstm_run(ops_in=0))
    assert cs.models[0].cold == [0] and cs.spent == []


def _keras_run(calls: list[tuple[str, float]]) -> Run:
    """A hand-made run of one Keras model's calls: (``ml.keras.method``, ms) each, in order."""
    from mltrace.run.events import Span, Track, TrackKind

    spans, at = [], 0
    for i, (method, ms) in enumerate(calls):
        attrs = {"ml.framework": "tensorflow", "ml.layer.type": "Functional", "ml.keras.method": method}
        spans.append(Span(i + 1, None, Level.MODEL, "mobilenetv2_1.00_224", at, at + int(ms * MS), 1, attrs))
        at += int((ms + 1) * MS)
    return Run(
        path=Path("hand-made"),
        meta={"name": "hand-made", "complete": True},
        tracks={1: Track(1, TrackKind.THREAD, "MainThread", 10, 10)},
        spans=spans,
    )


#: A traced MobileNetV2 (batch 4, 2 CPU cores): predict() batches, eager calls, then a
#: tf.function around the model; each way's first call is its warm-up.
KERAS_CALLS = [
    *[("predict", ms) for ms in (1348, 125, 190, 176)],
    *[("__call__", ms) for ms in (577, 130, 234, 128, 136, 148, 132, 123, 140, 159, 140, 320)],
    *[("tf.function", ms) for ms in (213, 24, 24, 25, 24, 24, 24, 24, 24, 25, 24, 24)],
]


def test_a_keras_models_graph_and_eager_calls_are_kinds_of_call() -> None:
    """As one sequence, the 24 ms graph calls and the 130 ms eager calls make a spread so wide
    that only the 1.3 s first predict() stands out: the first eager call (577 ms) and the first
    tf.function call (213 ms) would count as steady. Each way of calling is judged apart."""
    durations = [int(ms * MS) for _, ms in KERAS_CALLS]
    assert cold_indices(durations, [None] * len(durations)) == [0]
    (model,) = find_cold_start(_keras_run(KERAS_CALLS)).models
    assert model.cold == [0, 4, 16]
    assert [(kind, len(d), statistics.median(d) / MS) for kind, d in model.steady_by_kind()] == [
        ("predict", 3, 176),
        ("__call__", 11, 140),
        ("tf.function", 11, 24),
    ]


def test_the_cold_finding_gives_a_steady_median_per_kind_of_call() -> None:
    run = _keras_run(KERAS_CALLS)
    (cold,) = (f for f in build_report(run, analyze(run, PEAKS, include_cold=False))["findings"] if f["kind"] == "cold_start")
    assert "mobilenetv2_1.00_224 3 of 28" in cold["text"]
    assert "steady median predict 176.00 ms, eager 140.00 ms, tf.function 24.00 ms" in cold["text"]
    one_kind = _keras_run([("__call__", ms) for _, ms in KERAS_CALLS[4:16]])
    (cold,) = (f for f in build_report(one_kind, analyze(one_kind, PEAKS))["findings"] if f["kind"] == "cold_start")
    assert "1 of 12 (577.00 ms; steady median 140.00 ms)" in cold["text"]


def _torch_run(calls: list[tuple[bool, bool, list[int], float]], name: str = "Net") -> Run:
    """A hand-made run of one torch model's calls: (``module.training``, grad mode, first input's
    shape, ms) each, in order."""
    from mltrace.run.events import Span, Track, TrackKind

    spans, at = [], 0
    for i, (training, grad, shape, ms) in enumerate(calls):
        attrs = {
            "ml.framework": "pytorch",
            "ml.layer.type": name,
            "ml.model.training": training,
            "ml.grad.enabled": grad,
            "ml.input.shapes": [shape],
        }
        spans.append(Span(i + 1, None, Level.MODEL, name, at, at + int(ms * MS), 1, attrs))
        at += int((ms + 1) * MS)
    return Run(
        path=Path("hand-made"),
        meta={"name": "hand-made", "complete": True},
        tracks={1: Track(1, TrackKind.THREAD, "MainThread", 10, 10)},
        spans=spans,
    )


def _mnist_calls(first_eval_ms: float = 100) -> list[tuple[bool, bool, list[int], float]]:
    """An mnist-like program's model calls: three epochs of 20 training steps at batch 64
    (about 25 ms) then 4 evaluation calls under ``torch.no_grad()`` at batch 250 (about 100 ms);
    the first evaluation call takes ``first_eval_ms``."""
    calls: list[tuple[bool, bool, list[int], float]] = []
    for epoch in range(3):
        calls += [(True, True, [64, 1, 28, 28], 25 + (i % 3)) for i in range(20)]
        calls += [(False, False, [250, 1, 28, 28], (first_eval_ms if epoch == 0 and i == 0 else 100 + (i % 3))) for i in range(4)]
    return calls


def test_train_and_eval_calls_at_their_batch_sizes_are_kinds_of_call() -> None:
    """An mnist-like loop: 60 training calls at batch 64 and 12 evaluation calls at batch 250. As
    one sequence their steady median is the training step's and their p90 the evaluation's, and the
    first evaluation call (nearly twice the others: a new batch size's first call) is a late slow
    call with nothing recorded in it, so steady. Each (mode, batch size) is a kind of call: the
    first evaluation call is its kind's warm-up, and each kind has its own median and p90."""
    (model,) = find_cold_start(_torch_run(_mnist_calls(first_eval_ms=190))).models
    assert set(model.kinds) == {"train, batch 64", "eval, batch 250"}
    assert model.cold == [20]
    kinds = [(k.kind, k.calls, k.cold, k.steady_median_ns, k.steady_p90_ns) for k in model.by_kind()]
    assert kinds == [("train, batch 64", 60, 0, 26 * MS, 27 * MS), ("eval, batch 250", 12, 1, 101 * MS, 102 * MS)]
    durations = [int(ms * MS) for *_, ms in _mnist_calls(first_eval_ms=190)]
    assert cold_indices(durations, [None] * len(durations)) == []  # as one sequence: steady


def test_a_kind_of_call_is_only_what_differs_between_the_calls() -> None:
    """The parts the same in every call are left out; a sequence length (a dimension after the
    leading one) is never a kind; batch sizes that vary call to call (more than
    ``MAX_BATCH_KINDS``) are none either; calls without shapes are their own kind."""

    def attrs(training: bool, grad: bool, shape: list[int] | None) -> dict[str, object]:
        out: dict[str, object] = {"ml.model.training": training, "ml.grad.enabled": grad}
        return out | ({"ml.input.shapes": [shape, [1]]} if shape is not None else {})

    assert call_kinds([attrs(False, False, [1, 3, 224, 224])] * 3) == ["", "", ""]
    assert call_kinds([attrs(False, False, [4, n]) for n in (7, 19, 33)]) == ["", "", ""]  # sequence lengths
    assert call_kinds([attrs(False, False, [4, 7]), attrs(False, False, [8, 7])]) == ["batch 4", "batch 8"]
    assert call_kinds([attrs(True, True, [4, 7]), attrs(False, True, [4, 7]), attrs(True, False, [4, 7])]) == [
        "train",
        "eval with grad",
        "train without grad",
    ]
    varying = [attrs(False, False, [n, 16]) for n in range(1, MAX_BATCH_KINDS + 2)]  # sequence-first, or a dynamic batcher
    assert set(call_kinds(varying)) == {""}
    assert call_kinds([attrs(False, False, [2, 3]), attrs(False, False, None)]) == ["batch 2", ""]
    generate = [{"ml.generate.phase": "prefill", "ml.input.shapes": [[2, 9]]}, {"ml.generate.phase": "decode", "ml.input.shapes": [[2, 1]]}]
    assert call_kinds(generate) == ["prefill", "decode"]
    assert [kind_parts(k) for k in ("eval with grad, batch 250", "predict, batch 32", "")] == [
        ("", "eval with grad", 250),
        ("predict", "", 32),
        ("", "", None),
    ]


def test_the_report_gives_each_kind_of_call_its_steady_figures() -> None:
    """The JSON report's model entry lists its kinds of call; a finding and the Markdown Models
    table give each kind's calls, steady median and p90, not one median over all of them."""
    run = _torch_run(_mnist_calls())
    data = build_report(run, analyze(run, PEAKS))
    assert errors(data, REPORT_SCHEMA) == []
    (net,) = data["models"]
    assert [(k["kind"], k["mode"], k["batch"], k["calls"], k["steady_median_ns"], k["steady_p90_ns"]) for k in net["kinds"]] == [
        ("train at batch 64", "train", 64, 60, 26 * MS, 27 * MS),
        ("eval at batch 250", "eval", 250, 12, 100.5 * MS, 102 * MS),
    ]
    (kinds,) = (f["text"] for f in data["findings"] if f["kind"] == "call_kinds")
    assert "Net — train at batch 64, 60 calls: 26.00 ms (p90 27.00 ms); eval at batch 250, 12 calls: 100.50 ms (p90 102.00 ms)" in kinds
    md = render_markdown(data)
    assert "| Net | 72 | 0 | per kind | per kind |" in md
    assert "| ↳ eval at batch 250 | 12 | 0 | 100.50 ms | 102.00 ms |  |" in md
    a = analyze(run, PEAKS)
    out = io.StringIO()
    render_report(run, a, file=out, width=400)
    assert "Net — train at batch 64, 60 calls: 26.00 ms (p90 27.00 ms); eval at batch 250" in out.getvalue()
    page = render_html(run, a, timeline(run))
    assert "<code>Net</code> — train at batch 64, 60 calls: 26.00 ms (p90 27.00 ms)" in page
    one_kind = _torch_run([c for c in _mnist_calls() if c[0]])
    data = build_report(one_kind, analyze(one_kind, PEAKS))
    assert data["models"][0]["kinds"] == [] and not [f for f in data["findings"] if f["kind"] == "call_kinds"]


def test_prefills_of_a_generate_loop_are_not_cold(tmp_path: Path) -> None:
    """A real GPT-2 generate loop traced twice, its prefill calls then made 20x its decode
    steps in the table (as a long prompt makes them), so that the outcome does not hang on
    this machine's timing: one sequence of calls would call the first prefill cold."""
    from mltrace.run.events import Span

    if transformers is None:
        pytest.skip("transformers is not installed")
    import torch

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=500, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    prompt = torch.randint(0, 500, (1, 16))
    with torch.no_grad(), mltrace.profile(output=tmp_path / "run", summary=False, level="layer"):
        for _ in range(2):
            model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    run = mltrace.load_run(tmp_path / "run")
    calls = sorted((s for s in run.spans if s.level is Level.MODEL), key=lambda s: s.start_ns)
    assert [s.attrs["ml.generate.phase"] for s in calls] == (["prefill"] + ["decode"] * 7) * 2
    step = max(s.duration_ns for s in calls)
    prefills = {s.id for s in calls if s.attrs["ml.generate.phase"] == "prefill"}
    # every decode step exactly `step` (a loaded machine made the first one slow enough to be
    # called cold), every prefill exactly 20 steps
    decodes = {s.id for s in calls} - prefills
    long = [
        Span(s.id, s.parent_id, s.level, s.name, s.start_ns, s.start_ns + (20 if s.id in prefills else 1) * step, s.track_id, s.attrs)
        if s.id in prefills or s.id in decodes
        else s
        for s in run.spans
    ]
    (model_calls,) = find_cold_start(run.replace(spans=long)).models
    phases = ["prefill" if d == 20 * step else "decode" for d in model_calls.durations]
    assert phases == (["prefill"] + ["decode"] * 7) * 2
    assert cold_indices(model_calls.durations, [None] * 16) == [0]  # as one sequence: "cold"
    assert model_calls.cold == []


def test_the_median_of_steady_calls_is_robust_to_a_slow_one() -> None:
    steady = [5 * MS + i * 10_000 for i in range(9)]
    assert cold_indices([80 * MS, *steady[:4], 9 * MS, *steady[4:]], [None] * 11) == [0]


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("Scheduler.codegen", "compile"),
        ("cudnnFindConvolutionForwardAlgorithmEx", "autotune"),
        ("cuModuleLoadData", "kernel loading (JIT)"),
        ("cudaMalloc", "lazy init"),
        ("GPU memcpy HtoD", "weight transfer"),
        ("cudaLaunchKernel", ""),
        ("aten::addmm", ""),
    ],
)
def test_one_time_names(name: str, category: str) -> None:
    assert category_of(name) == category


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return unpack_run("h100_resnet50_bert", tmp_path_factory.mktemp("h100") / "run")


PEAKS = PeakSet(Peaks("cpu", "test CPU", 1e11, 1e10, "assumed"), gpu_peaks("NVIDIA H100 80GB HBM3"))


def test_fixture_first_calls_are_cold_with_what_they_spent_time_on(run: Run) -> None:
    cs = find_cold_start(run)
    by_name = {m.name: m for m in cs.models}
    assert by_name["ResNet"].cold == [0] and by_name["BertModel"].cold == [0]
    for m in by_name.values():
        assert m.cold_ns > 10 * (m.steady_median_ns or 0)
    assert "lazy init" in by_name["ResNet"].one_time  # cudaMalloc, stream and host allocations
    spent = {x.name: x for x in cs.spent}
    assert spent["aten::_cudnn_attention_forward"].category == "cuDNN/cuBLAS set-up"
    assert spent["aten::cudnn_convolution"].ns > 100 * MS


def test_fixture_report_is_steady_by_default(run: Run) -> None:
    steady = build_report(run, analyze(run, PEAKS, include_cold=False))
    every = build_report(run, analyze(run, PEAKS, include_cold=True))
    conv1 = {x["name"]: x for x in steady["layers"]}["conv1"]
    conv1_all = {x["name"]: x for x in every["layers"]}["conv1"]
    assert conv1["calls"] == 3 and conv1_all["calls"] == 4
    assert conv1_all["total_ns"] > 50 * MS  # the cold call's cuDNN set-up
    assert conv1["total_ns"] < 2 * MS and conv1["p90_ns"] < MS
    resnet = {m["name"]: m for m in steady["models"]}["ResNet"]
    assert (resnet["calls"], resnet["cold_calls"]) == (4, 1) and resnet["steady_median_ns"] < 20 * MS
    assert steady["run"]["model_calls"] == 6 and every["run"]["model_calls"] == 8
    idle = next(f for f in steady["findings"] if f["kind"] == "idle" and f["where"] == "between model calls")
    assert idle["idle_ns"] < 10 * MS  # a cold call left out is not idle time


def test_spans_of_cold_calls_leave_the_tables(run: Run) -> None:
    a = analyze(run, PEAKS, include_cold=False)
    ops = {r.name: r for r in a.ops}
    every = {r.name: r for r in analyze(run, PEAKS).ops}
    assert ops["aten::cudnn_convolution"].calls * 4 == every["aten::cudnn_convolution"].calls * 3
    assert all(r.stat.calls in (3, 6, 9, 12, 36) or r.stat.level is not Level.LAYER for r in a.layers)


def test_gpu_layers_get_achieved_flops_from_their_kernels_never_above_the_peak(run: Run) -> None:
    a = analyze(run, PEAKS, include_cold=False)
    gpu = [r for r in a.layers if r.kernel_count and r.achieved_flops]
    assert len(gpu) > 50
    assert all(r.peak_share is None or 0 < r.peak_share <= 1 for r in a.layers)
    assert all(o.peak_share is None or 0 <= o.peak_share <= 1 for o in a.ops)
    linear = next(r for r in a.layers if r.stat.name == "encoder.layer.0.attention.self.query")
    assert linear.dtype == "float16" and linear.achieved_flops is not None
    assert linear.peak_share == linear.achieved_flops / 989e12  # the fp16 tensor-core peak of the table


def test_a_point_above_a_roof_gets_no_efficiency_and_no_share(run: Run) -> None:
    slow = PeakSet(Peaks("cpu", "too low", 1e3, 1e3, "measured"), Peaks("gpu", "too low", 1e3, 1e3, "table"))
    a = analyze(run, slow)
    assert a.peaks is not None and a.peaks.cpu.flops_per_s == 1e3 and a.peaks.gpu == slow.gpu  # FLOP roofs never raised
    over = [r for r in a.layers if r.kernel_count and r.flops > 0 and r.verdict is not None]
    assert len(over) > 50
    assert all(r.verdict.efficiency is None and r.peak_share is None for r in over if r.verdict is not None)
    assert {r.verdict.bound for r in over if r.verdict is not None} <= {Bound.UNKNOWN, Bound.OVERHEAD}


def test_the_layer_tables_model_row_gives_each_kind_its_own_figures() -> None:
    """A model's row in the layer tables counts all its calls (the tables' calls: steady ones,
    or every one with ``--include-cold``), so its median and p90 would mix the training steps with
    the evaluations: the terminal row says "per kind" there, and a row per kind under it (terminal,
    HTML) gives that kind's calls, total, share, median and p90, over the calls the table counts."""
    run = _torch_run(_mnist_calls(first_eval_ms=190))
    for include_cold, eval_calls in ((False, 11), (True, 12)):
        a = analyze(run, PEAKS, include_cold=include_cold)
        (row,) = [r for r in a.layers if r.stat.level is Level.MODEL]
        assert [(k.kind, k.calls) for k in row.kinds] == [("train, batch 64", 60), ("eval, batch 250", eval_calls)]
        assert sum(k.calls for k in row.kinds) == row.stat.calls and sum(k.total_ns for k in row.kinds) == row.stat.total_ns
    a = analyze(run, PEAKS, include_cold=False)  # the report's default: the cold first evaluation left out
    (row,) = [r for r in a.layers if r.stat.level is Level.MODEL]
    (steady_eval,) = [k for k in a.cold.models[0].by_kind() if k.kind == "eval, batch 250"]
    train, evals = row.kinds
    assert (evals.median_ns, evals.p90_ns) == (steady_eval.steady_median_ns, steady_eval.steady_p90_ns) == (101 * MS, 102 * MS)
    out = io.StringIO()
    render_report(run, a, file=out, width=400)
    lines = out.getvalue().splitlines()
    (net,) = [line for line in lines if line.startswith("│ Net ")]
    assert re.search(r"│ +71 │ .* │ +per kind │ +per kind │ +100\.0% │", net)
    (kind_row,) = [line for line in lines if "↳ eval at batch 250" in line]
    share = f"{100 * evals.total_ns / row.stat.total_ns:.1f}%"
    assert re.search(rf"│ +11 │ +{re.escape(fmt_ns(evals.total_ns))} │ +│ +101\.00 ms │ +102\.00 ms │ +{re.escape(share)} │", kind_row)
    page = render_html(run, a, timeline(run))
    assert '↳ eval at batch 250<div class="muted">median 101.00 ms, p90 102.00 ms</div>' in page
    assert f'↳ train at batch 64<div class="muted">median {fmt_ns(train.median_ns or 0)}' in page
    one_kind = _torch_run([c for c in _mnist_calls() if c[0]])
    a = analyze(one_kind, PEAKS)
    assert [r.kinds for r in a.layers] == [[]]
    out = io.StringIO()
    render_report(one_kind, a, file=out, width=400)
    assert "per kind" not in out.getvalue() and "↳" not in out.getvalue()


def test_the_json_kinds_give_each_kinds_total_time() -> None:
    """``models[].kinds[].total_ns``: each kind's calls' summed duration, every call counted as
    ``models[].total_ns`` counts them: the kinds' totals add up to the model's."""
    run = _torch_run(_mnist_calls(first_eval_ms=190))
    data = build_report(run, analyze(run, PEAKS))
    assert errors(data, REPORT_SCHEMA) == []
    (net,) = data["models"]
    # 3 epochs: 20 steps of 25, 26, 27 ms in turn (519 ms), 4 evaluations of 100, 101, 102, 100 ms
    # (403 ms; the first evaluation took 190 ms instead of 100)
    totals = [(k["kind"], k["total_ns"]) for k in net["kinds"]]
    assert totals == [("train at batch 64", 3 * 519 * MS), ("eval at batch 250", (3 * 403 + 90) * MS)]
    assert sum(k["total_ns"] for k in net["kinds"]) == net["total_ns"]


def test_a_slow_start_without_more_cpu_is_contention_not_warm_up() -> None:
    """Calls after the first go on warming up only where the calling thread's CPU time is an
    outlier too: calls slowed by other processes (waiting for a core) are steady, slow as they
    were; calls that did more work (a JIT, page faults) stay cold; unknown CPU times change
    nothing."""
    ms = 1_000_000
    durations = [100 * ms, 90 * ms, 90 * ms, 90 * ms] + [10 * ms] * 20
    none: list[bool | None] = [False] * 24
    waited = [100 * ms] + [10 * ms] * 23  # the slow calls used the CPU of a steady one
    worked = [100 * ms, 90 * ms, 90 * ms, 90 * ms] + [10 * ms] * 20
    assert cold_indices(durations, none, cpu=waited) == [0]
    assert cold_indices(durations, none, cpu=worked) == [0, 1, 2, 3]
    assert cold_indices(durations, none) == [0, 1, 2, 3]
    assert cold_indices(durations, none, cpu=[None] * 24) == [0, 1, 2, 3]
    assert cold_indices(durations, none, cpu=[100 * ms, 90 * ms, None] + [None] * 21) == [0, 1, 2, 3]  # too few known
    one_time: list[bool | None] = [False, False, True] + [False] * 21
    assert cold_indices(durations, one_time, cpu=waited) == [0, 2]  # one-time work is cold whatever its CPU
