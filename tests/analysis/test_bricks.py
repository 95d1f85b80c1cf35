"""DLBricks: extraction, constructor arguments, deduplication, construction, benchmarking."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import mltrace
from mltrace.analysis.bricks import (
    BasisChoice,
    Brick,
    LayerCall,
    ModelBricks,
    brick_of,
    construct,
    critical_path_ns,
    extract,
    infer_config,
)
from mltrace.brickbench import benchmark_bricks, build_brick, run_bricks
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.tracer.sources.torch_layer_config import layer_config


class Zoo(nn.Module):
    """One of most layer kinds, with non-default arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 7, 2, 3, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.dw = nn.Conv2d(16, 16, 3, 1, 1, groups=16)
        self.pw = nn.Conv2d(16, 32, 1)
        self.down = nn.Conv2d(32, 32, 3, 2, 1, bias=False)
        self.act = nn.ReLU6()
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, 64)
        self.ln = nn.LayerNorm(64)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.bn(self.conv(x)))
        x = self.act(self.down(self.pw(self.dw(x))))
        return self.drop(self.ln(self.fc(torch.flatten(self.gap(x), 1))))


class Seq(nn.Module):
    """Embedding, attention, a transformer layer (fast path under inference mode), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 128)
        self.attn = nn.MultiheadAttention(128, 2, batch_first=True)
        self.enc = nn.TransformerEncoderLayer(128, 2, 256, dropout=0.0, batch_first=True)
        self.head = nn.Linear(128, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = self.attn(h, h, h, need_weights=False)[0]
        return self.head(self.enc(h)[:, 0])


class Rep(nn.Module):
    """Three identical Linear+ReLU blocks and a different head: 7 leaf calls, 3 unique."""

    def __init__(self, out: int = 4, blocks: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(blocks) for m in (nn.Linear(16, 16), nn.ReLU())])
        self.head = nn.Linear(16, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Custom(nn.Module):
    """A leaf layer of the user's own: not rebuildable in isolation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _trace(tmp_path: Path, name: str, fn: Any, calls: int = 2) -> Run:
    torch.manual_seed(0)
    with torch.inference_mode(), mltrace.profile(output=tmp_path / name, summary=False, level="layer"):
        for _ in range(calls):
            fn()
    return mltrace.load_run(tmp_path / name)


@pytest.fixture(scope="module")
def zoo_runs(tmp_path_factory: pytest.TempPathFactory) -> list[Run]:
    tmp = tmp_path_factory.mktemp("zoo")
    zoo, seq = Zoo().eval(), Seq().eval()
    x, tokens = torch.randn(2, 3, 32, 32), torch.randint(0, 100, (3, 7))
    return [_trace(tmp, "zoo", lambda: zoo(x)), _trace(tmp, "seq", lambda: seq(tokens))]


def _without_recorded_configs(runs: list[Run]) -> list[Run]:

    from mltrace.run.events import Span

    def strip(s: Span) -> Span:
        attrs = {k: v for k, v in s.attrs.items() if k != "ml.layer.config"}
        return Span(s.id, s.parent_id, s.level, s.name, s.start_ns, s.end_ns, s.track_id, attrs)

    return [r.replace(spans=[strip(s) for s in r.spans]) for r in runs]


def test_recorded_configs_match_the_inferred_ones(zoo_runs: list[Run]) -> None:
    recorded = extract(zoo_runs)
    inferred = extract(_without_recorded_configs(zoo_runs))
    rec = {lc.path: lc.brick for m in recorded.models for lc in m.layers}
    inf = {lc.path: lc.brick for m in inferred.models for lc in m.layers}
    assert {p for p, b in rec.items() if b.config_source == "recorded"} >= {"conv", "dw", "embed"}

    def norm(v: object) -> object:
        if isinstance(v, (tuple, list)) and len(set(v)) == 1:
            return norm(v[0])  # (7, 7) and 7 are the same kernel
        return tuple(v) if isinstance(v, list) else v

    for path, brick in rec.items():
        if brick.config_source == "recorded" and path in ("conv", "dw", "down", "pw", "embed"):
            got, guessed = dict(brick.config), dict(inf[path].config)
            shared = set(got) & set(guessed)
            assert shared, path
            assert {k: norm(got[k]) for k in shared} == {k: norm(guessed[k]) for k in shared}, path


def test_inferred_bricks_rebuild_the_traced_layers(zoo_runs: list[Run]) -> None:
    zoo_runs = _without_recorded_configs(zoo_runs)
    bset = extract(zoo_runs)
    types = [lc.brick.type for m in bset.models for lc in m.layers]
    assert types == [
        "Conv2d", "BatchNorm2d", "MaxPool2d", "Conv2d", "Conv2d", "Conv2d", "ReLU6", "AdaptiveAvgPool2d", "Linear", "LayerNorm", "Dropout",
        "Embedding", "MultiheadAttention", "TransformerEncoderLayer", "Linear",
    ]  # fmt: skip
    calls = {lc.path: lc for m in bset.models for lc in m.layers}
    spans = {s.name: s for r in zoo_runs for s in r.spans if s.level == Level.LAYER}
    for path, call in calls.items():
        brick = call.brick
        assert brick.config_source == "inferred", path
        module, inputs, kwargs = build_brick(brick)  # also checks the parameter count
        with torch.inference_mode():
            out = module(*inputs, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        assert [list(out.shape)] == spans[path].attrs["ml.output.shapes"], path
    cfg = {lc.path: dict(lc.brick.config) for m in bset.models for lc in m.layers}
    assert cfg["conv"] == {
        "in_channels": 3,
        "out_channels": 16,
        "kernel_size": 7,
        "stride": (2, 2),
        "padding": (3, 3),
        "groups": 1,
        "bias": False,
    }
    assert cfg["dw"]["groups"] == 16 and cfg["dw"]["bias"] is True
    assert cfg["down"]["stride"] == (2, 2) and cfg["pw"]["kernel_size"] == 1
    assert cfg["enc"]["dim_feedforward"] == 256 and cfg["enc"]["batch_first"] is True
    assert cfg["attn"]["batch_first"] is True and cfg["embed"] == {"num_embeddings": 100, "embedding_dim": 128}


def test_batch_first_follows_the_model_batch() -> None:
    assert infer_config("MultiheadAttention", ((7, 3, 64),), ((7, 3, 64),), 4 * 64 * 64 + 4 * 64, model_batch=3)["batch_first"] is False
    assert infer_config("MultiheadAttention", ((3, 7, 64),), ((3, 7, 64),), 4 * 64 * 64 + 4 * 64, model_batch=3)["batch_first"] is True
    assert infer_config("Linear", ((2, 16),), ((2, 4),), 999) is None  # parameters that fit no Linear
    assert infer_config("MyLayer", ((2, 16),), ((2, 4),), 10) is None


def test_layer_config_rebuilds_live_layers() -> None:
    for module in [*Zoo().children(), *Seq().children(), nn.Conv1d(4, 8, 5, padding=2), nn.GELU(approximate="tanh")]:
        cfg = layer_config(module)
        assert cfg is not None, type(module).__name__
        rebuilt = type(module)(**cfg)
        assert repr(rebuilt) == repr(module)
        assert sum(p.numel() for p in rebuilt.parameters()) == sum(p.numel() for p in module.parameters())
    assert layer_config(Custom()) is None


def test_recorded_config_wins_over_inference() -> None:
    attrs = {
        "ml.layer.type": "Conv2d",
        "ml.input.shapes": [[1, 4, 8, 8]],
        "ml.input.dtypes": ["float32"],
        "ml.output.shapes": [[1, 4, 8, 8]],
        "ml.layer.params": 4 * 4 * 9,
        "ml.layer.config": {
            "in_channels": 4,
            "out_channels": 4,
            "kernel_size": [3, 3],
            "padding": [1, 1],
            "bias": False,
            "dilation": [1, 1],
        },
    }
    brick = brick_of(Span(1, None, Level.LAYER, "c", 0, 1, 1, attrs))
    assert brick.config_source == "recorded" and dict(brick.config)["kernel_size"] == (3, 3)
    module, _, _ = build_brick(brick)
    assert module.padding == (1, 1)


@pytest.fixture(scope="module")
def rep_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("rep")
    a, b, c = Rep().eval(), Rep(out=8, blocks=1).eval(), Custom()
    x = torch.randn(2, 16)

    def go() -> None:
        a(x)
        b(x)

    run = _trace(tmp, "rep", go, calls=3)
    run2 = _trace(tmp, "custom", lambda: nn.Sequential(nn.Linear(16, 16), c)(x), calls=2)
    return run, run2  # type: ignore[return-value]


def test_known_repeats_are_counted_and_deduplicated(rep_run: Any) -> None:
    run, _ = rep_run
    bset = extract([run], granularity=1)
    rep, rep2 = bset.models
    assert rep.model.startswith("Rep (") and len(rep.layers) == 7 and len({lc.brick for lc in rep.layers}) == 3
    assert len(rep2.layers) == 3
    assert bset.total_layers == 10 and len(bset.bricks) == 4  # Linear 16→16 and ReLU shared across models
    assert [lc.path for lc in rep.layers] == ["body.0", "body.1", "body.2", "body.3", "body.4", "body.5", "head"]
    assert rep.invocations == 2 and not rep.parallel  # the first call of three is warm-up
    seqs = extract([run], granularity=2)
    assert [len(sq) for sq in seqs.models[0].sequences] == [2, 2, 2, 1]
    assert seqs.total_sequences == 6 and len(seqs.sequences) == 3


def test_runs_of_one_script_are_named_apart(rep_run: Any, tmp_path: Path) -> None:
    """Two runs whose models share a label (the same script run twice) give two rows, each
    named with its run directory; a label no other run shares stays as it is."""
    import shutil

    run, custom = rep_run
    again = tmp_path / "rep-again"
    shutil.copytree(run.path, again)
    bset = extract([run, mltrace.load_run(again), custom])
    names = [m.model for m in bset.models]
    rep_names = [n for n in names if n.startswith("Rep (")]
    assert len(rep_names) == 4 and len(set(rep_names)) == 4
    assert {n.rsplit(" [", 1)[1] for n in rep_names} == {f"{run.path.name}]", "rep-again]"}
    assert all(" [" not in n for n in names if not n.startswith("Rep ("))


def test_construct_sum_fallback_and_sequences(rep_run: Any) -> None:
    run, _ = rep_run
    bset = extract([run], granularity=2)
    rep = bset.models[0]
    lin16, relu, lin4 = rep.layers[0].brick, rep.layers[1].brick, rep.layers[6].brick
    glue = rep.glue_ns  # the model's time between its leaf layers, a term of its own
    c = construct(rep, {lin16: 10.0, relu: 1.0, lin4: 5.0})
    assert (c.bricks_ns, c.glue_ns, c.constructed_ns, c.method, c.from_trace) == (38.0, glue, 38.0 + glue, "sum", 0)
    c = construct(rep, {lin16: 10.0, relu: 1.0})
    assert c.from_trace == 1 and c.bricks_ns == 33.0 + rep.layers[6].traced_ns
    pair, last = rep.sequences[0], rep.sequences[3]
    c = construct(rep, {lin16: 10.0, relu: 1.0, lin4: 5.0}, {pair: 12.0, last: 4.0})
    assert (c.bricks_ns, c.method) == (40.0, "sequence sum (H=2)")
    assert c.ratio == pytest.approx((40.0 + glue) / rep.measured_ns)


def _call(start: int, end: int, name: str) -> LayerCall:
    return LayerCall(name, Brick(name, (), (), 0), start, end, float(end - start))


def test_critical_path_through_parallel_branches() -> None:
    layers = [_call(0, 10, "A"), _call(10, 20, "B"), _call(10, 30, "C"), _call(30, 40, "D")]
    w = {"A": 10.0, "B": 10.0, "C": 25.0, "D": 5.0}
    assert critical_path_ns(layers, lambda lc: w[lc.path]) == 40.0  # A → C → D; B runs beside C
    assert critical_path_ns(layers[:2], lambda lc: w[lc.path]) == 20.0  # sequential: the sum
    model = ModelBricks("m", ".", 50.0, 1, layers, [], parallel=True, unattributed_ns=0)
    c = construct(model, {lc.brick: w[lc.path] for lc in layers})
    assert (c.constructed_ns, c.method) == (40.0, "critical path")


def test_overlapping_layers_on_two_tracks_are_parallel() -> None:
    attrs = {"ml.layer.type": "ReLU", "ml.input.shapes": [[1, 4]], "ml.input.dtypes": ["float32"], "ml.layer.params": 0}
    spans = [
        Span(1, None, Level.MODEL, "Net", 0, 100, 1, {}),
        Span(2, 1, Level.LAYER, "left", 10, 60, 1, dict(attrs)),
        Span(3, 1, Level.LAYER, "right", 20, 70, 2, dict(attrs)),
        Span(4, 1, Level.LAYER, "join", 80, 90, 1, dict(attrs)),
    ]
    tracks = {1: Track(1, TrackKind.THREAD, "a", 1, 1), 2: Track(2, TrackKind.THREAD, "b", 1, 2)}
    bset = extract([Run(Path("."), {"format": "mltrace-run"}, tracks, spans)], warmup=0)
    (m,) = bset.models
    assert m.parallel and [lc.path for lc in m.layers] == ["left", "right", "join"]
    assert m.unattributed_ns == m.glue_ns == 100 - 60 - 10 and len(bset.bricks) == 1
    c = construct(m, {})
    assert c.method == "critical path" and c.bricks_ns == 50 + 10 and c.constructed_ns == 50 + 10 + 30


def test_run_without_layers_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no layer spans"):
        extract([Run(tmp_path, {}, {}, [Span(1, None, Level.MODEL, "Net", 0, 5, 1, {})])])
    with pytest.raises(ValueError, match="at least 1"):
        extract([], granularity=0)


def test_run_bricks_end_to_end(rep_run: Any) -> None:
    run, custom_run = rep_run
    report = run_bricks([run, custom_run], warmup=1, n=3)
    assert report.set.total_layers == 12 and len(report.set.bricks) == 5
    ok = [t for t in report.timings if t.median_ns is not None]
    failed = [(b.type, t.error) for b, t in zip(report.set.bricks, report.timings) if t.median_ns is None]
    assert len(ok) == 4 and all(t.median_ns > 0 and t.samples >= 3 and t.mean_ns and t.mean_ns > 0 for t in ok)
    assert failed == [("Custom", "Custom is not a torch.nn layer")]
    rep, rep2, seq = report.constructions
    assert rep.from_trace == 0 and rep.constructed_ns > 0 and math.isfinite(rep.ratio)
    assert seq.from_trace == 1  # the custom layer keeps its traced latency
    timed = sum(t.median_ns for t in ok)  # type: ignore[misc]
    assert report.bricks_cost_ns == pytest.approx(4 * timed)
    assert report.end_to_end_cost_ns == pytest.approx(4 * sum(m.measured_ns for m in report.set.models))
    assert report.speedup == pytest.approx(report.end_to_end_cost_ns / report.bricks_cost_ns)
    doc = report.to_json()
    assert doc["counts"] == {"models": 3, "layers_total": 12, "layers_unique": 5, "sequences_total": 0, "sequences_unique": 0}
    assert "weight" not in str(doc).lower()  # shapes and counts only
    assert all(b["mean_ns"] is None or b["mean_ns"] > 0 for b in doc["bricks"])


def test_warm_cold_and_onnxruntime_runtimes() -> None:
    brick = Brick("Linear", ((2, 16),), ("float32",), 16 * 16 + 16, (("bias", True), ("in_features", 16), ("out_features", 16)), "inferred")
    for kwargs in ({"cache": "warm"}, {"cache": "cold"}, {"runtime": "onnxruntime"}):
        (t,) = benchmark_bricks([brick], warmup=1, n=2, **kwargs)  # type: ignore[arg-type]
        assert t.median_ns is not None and t.median_ns > 0 and t.error == "", kwargs
    with pytest.raises(ValueError, match="cache"):
        benchmark_bricks([brick], cache="lukewarm")


class Residual(nn.Module):
    """The examples' basic block: its residual add and the head's flatten run in no leaf layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, 1, 1, bias=False)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.conv(x) + x)
        return self.fc(torch.flatten(self.pool(y), 1))


@pytest.fixture(scope="module")
def residual_runs(tmp_path_factory: pytest.TempPathFactory) -> list[Run]:
    """The residual model traced with one thread and with two."""
    tmp = tmp_path_factory.mktemp("residual")
    model, x = Residual().eval(), torch.randn(1, 8, 32, 32)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs.append(_trace(tmp, f"t{threads}", lambda: model(x), calls=4))
    finally:
        torch.set_num_threads(before)
    return runs


def test_glue_is_each_calls_time_outside_its_leaf_layers(residual_runs: list[Run]) -> None:
    from mltrace.analysis.leveled import invocations

    run = residual_runs[0]
    (m,) = extract([run]).models
    (calls,) = invocations(run).values()
    outside = []
    for call in calls[1:]:
        leaves = sorted((s.start_ns, s.end_ns) for s in call.spans.values() if s.level == Level.LAYER)
        assert all(a[1] <= b[0] for a, b in zip(leaves, leaves[1:]))  # sequential leaves: their sum is their union
        outside.append(call.root.duration_ns - sum(e - s for s, e in leaves))
    assert m.glue_ns == sorted(outside)[1] and m.glue_ns > 0  # the median of three
    c = construct(m, {lc.brick: 1000.0 for lc in m.layers})
    assert c.bricks_ns == 4000.0 and c.constructed_ns == 4000.0 + m.glue_ns


def test_bricks_run_with_the_threads_the_model_ran_with(residual_runs: list[Run]) -> None:
    from mltrace.brickbench import bench_threads

    one, two = residual_runs
    assert [m.threads for m in extract(residual_runs).models] == [1, 2]
    assert bench_threads(extract([one]), None) == 1 and bench_threads(extract([two]), None) == 2
    assert bench_threads(extract([one]), 3) == 3
    with pytest.raises(ValueError, match=r"different thread counts \(1, 2\): give --threads"):
        bench_threads(extract(residual_runs), None)
    before = torch.get_num_threads()
    report = run_bricks([one], warmup=1, n=2)
    assert report.extra["threads"] == 1 and torch.get_num_threads() == before
    assert report.machine is not None and report.machine.threads == 1 and report.machine.others_cores >= 0


def test_the_report_says_which_basis_and_why_not_the_wall_clock(residual_runs: list[Run]) -> None:
    """The same benchmarked bricks assembled for an idle, a busy and a very busy machine:
    the report names its basis, gives the other basis's ratio beside it, and one line saying
    why the wall clock was not used or why neither figure is to be trusted."""
    import io

    from mltrace.analysis.bricks import MachineState, assemble
    from mltrace.viewers.bricks import print_report

    report = run_bricks(residual_runs[:1], warmup=1, n=2)  # traced and benchmarked with one thread
    assert report.extra["threads"] == 1 and report.choice.cpu_possible and report.other is not None
    # The trace side as on an idle machine (the real run's figures follow this machine's load).
    (traced,) = report.set.models
    bset = dataclasses.replace(report.set, models=[dataclasses.replace(traced, cpu_share=0.99, trace_others_cores=0.0)])
    kw: dict[str, Any] = {"warmup": 1, "n": 2, "runtime": "pytorch", "bench_wall_s": 0.0, "threads": 1}
    cases = {
        "idle": MachineState(2, 1, 0.05, (0.1, 0.2)),
        "busy": MachineState(2, 1, 0.4, (1.4, 1.5)),  # a little: the CPU basis stands
        "oversubscribed": MachineState(2, 1, 0.9, (3.0, 3.1)),  # too busy for CPU times too
    }
    texts, docs = {}, {}
    for name, state in cases.items():
        got = assemble(bset, report.timings, [], machine=state, **kw)
        out = io.StringIO()
        print_report(got, out)
        texts[name], docs[name] = out.getvalue(), got.to_json()
        assert got.choice.basis == "cpu" and [c.basis for c in got.constructions] == ["cpu"]
        assert got.other is not None and [c.basis for c in got.other] == ["wall"]
        assert "basis: thread CPU time" in texts[name] and "wall ratio" in texts[name]
    assert "machine: idle: other processes kept 0.05 of 2 cores busy" in texts["idle"]
    assert "note:" not in texts["idle"] and "warning:" not in texts["idle"]
    assert "note: load average 1.5 on 2 CPUs (other processes kept 0.4 cores busy while the bricks ran): wall-clock " in texts["busy"]
    assert "wall-clock bricks not comparable; CPU-time basis used" in texts["busy"] and docs["busy"]["basis"]["trusted"]
    assert "warning: load average 3.1 on 2 CPUs" in texts["oversubscribed"]
    assert "neither basis is comparable: rerun on an idle machine" in texts["oversubscribed"]
    doc = docs["oversubscribed"]
    assert doc["basis"]["used"] == "cpu" and doc["basis"]["trusted"] is False and doc["machine"]["idle"] is False
    (model,) = doc["models"]
    assert model["basis"] == "cpu" and model["measured_ns"] == round(report.set.models[0].measured_cpu_ns or 0)
    assert set(model["wall_basis"]) == {"measured_ns", "constructed_ns", "glue_ns", "ratio"}
    assert model["wall_basis"]["measured_ns"] == round(report.set.models[0].measured_ns)


def _model(threads: int | None = 1, cpu: float | None = 90.0, share: float | None = 0.95) -> ModelBricks:
    """A decomposition with known figures (no layers): what the basis choice reads."""
    return ModelBricks("Net (x.py:1)", "run", 100.0, 3, [], [], False, 0, threads=threads, measured_cpu_ns=cpu, cpu_share=share)


def test_the_basis_follows_threads_recorded_cpu_time_and_the_machine() -> None:
    from dataclasses import replace

    from mltrace.analysis.bricks import MachineState, choose_basis, trace_others_cores

    meta = {"counters_summary": {"cpu.utilization": {"mean": 90.0}}, "host": {"cpu_count": 2}, "threads": {"torch": 1}}
    assert trace_others_cores(meta) == pytest.approx(0.8) and trace_others_cores({}) is None

    idle, busy, over = MachineState(2, 1, 0.05, (0.2, 0.2)), MachineState(2, 1, 0.4, (3.1, 3.1)), MachineState(2, 2, 1.6, (7.0, 7.2))
    # One thread, CPU time recorded: CPU time, trusted; the wall clock's trouble said in a note.
    assert choose_basis([_model()], 1, idle) == BasisChoice("cpu", True, "", True)
    c = choose_basis([_model()], 1, busy)
    assert (c.basis, c.trusted) == ("cpu", True)
    busy_why = "load average 3.1 on 2 CPUs (other processes kept 0.4 cores busy while the bricks ran)"
    assert c.why == f"{busy_why}: wall-clock bricks not comparable; CPU-time basis used"
    # Others on more than half a core, or a preempted trace: neither basis is trusted.
    c = choose_basis([_model()], 1, MachineState(2, 1, 0.9, (2.4, 2.4)))
    assert (c.basis, c.trusted) == ("cpu", False) and c.why.startswith("load average 2.4 on 2 CPUs")
    assert c.why.endswith(
        "too busy for thread CPU time too (shared caches and memory bandwidth); neither basis is comparable: rerun on an idle machine"
    )
    c = choose_basis([replace(_model(), trace_others_cores=0.8)], 1, idle)  # busy while traced
    assert not c.trusted and c.why.startswith("other processes kept ≈ 0.8 cores busy while Net (x.py:1) was traced: too busy")
    c = choose_basis([replace(_model(), trace_others_cores=0.3)], 1, idle)
    assert c.trusted and c.why.endswith("was traced: wall-clock bricks not comparable; CPU-time basis used")
    c = choose_basis([_model(share=0.6)], 1, idle)
    assert not c.trusted and c.why.startswith("traced model calls ran on a CPU for 60% of their wall time (Net (x.py:1))")
    # Two intra-op threads: thread CPU time is not the latency; the wall clock, trusted only when idle.
    assert choose_basis([_model(threads=2)], 2, MachineState(2, 2, 0.05, (0.2, 0.2))) == BasisChoice("wall", True, "", False)
    c = choose_basis([_model(threads=2, share=0.6)], 2, over)
    assert (c.basis, c.trusted) == ("wall", False)
    assert c.why == (
        "intra-op threads = 2: CPU time is not the latency, and load average 7.2 on 2 CPUs (other processes kept 1.6 cores "
        "busy while the bricks ran): wall-clock constructed/measured not comparable; rerun with OMP_NUM_THREADS=1 or on an idle machine"
    )  # a multi-threaded call's CPU share says nothing of preemption: not a reason
    with pytest.raises(ValueError, match=r"no CPU-time basis: intra-op threads = 2: CPU time is not the latency"):
        choose_basis([_model(threads=2)], 2, idle, "cpu")
    # No thread CPU time in the runs (an older trace), or unknown threads: the wall clock.
    assert choose_basis([_model(cpu=None, share=None)], 1, idle).basis == "wall"
    with pytest.raises(ValueError, match="carry no thread CPU time"):
        choose_basis([_model(cpu=None, share=None)], 1, idle, "cpu")
    assert choose_basis([_model(threads=None)], None, idle).basis == "wall"
    # The wall clock asked for where CPU time could be had: untrusted on a busy machine, and says what is.
    c = choose_basis([_model()], 1, busy, "wall")
    assert (c.basis, c.trusted, c.cpu_possible) == ("wall", False, True) and c.why.endswith("the CPU-time basis (--basis auto) is")
    with pytest.raises(ValueError, match="basis must be"):
        choose_basis([_model()], 1, idle, "gpu")


def _cpu_run(tmp_path: Path, cpu: bool = True) -> Run:
    """Three calls of a model with one leaf layer: wall 100, 200, 400 ns, glue a fifth of
    each, thread CPU time 100 ns each (CPU / wall shares 1, 0.5, 0.25)."""
    relu = {"ml.layer.type": "ReLU", "ml.input.shapes": [[1, 4]], "ml.input.dtypes": ["float32"], "ml.layer.params": 0}
    spans, start = [], 0
    for i, wall in enumerate((100, 200, 400)):
        attrs: dict[str, Any] = {"ml.thread.cpu_ns": 100, "ml.thread.minor_faults": 10 + i} if cpu else {}
        spans.append(Span(2 * i + 1, None, Level.MODEL, "Net", start, start + wall, 1, attrs))
        spans.append(Span(2 * i + 2, 2 * i + 1, Level.LAYER, "relu", start + wall // 10, start + wall // 10 + wall * 4 // 5, 1, dict(relu)))
        start += 1000
    return Run(tmp_path, {"format": "mltrace-run", "threads": {"torch": 1}}, {1: Track(1, TrackKind.THREAD, "main", 1, 1)}, spans)


def test_a_cpu_construction_scales_the_glue_by_each_calls_cpu_share(tmp_path: Path) -> None:
    (m,) = extract([_cpu_run(tmp_path)], warmup=0).models
    assert (m.measured_ns, m.glue_ns, m.threads) == (200.0, 40.0, 1)
    assert (m.measured_cpu_ns, m.cpu_share, m.glue_cpu_ns) == (100.0, 0.5, 20.0)  # each call's glue x its share: 20, 20, 20
    relu = m.layers[0].brick
    c = construct(m, {relu: 70.0}, basis="cpu")
    assert (c.basis, c.measured_ns, c.bricks_ns, c.glue_ns, c.constructed_ns) == ("cpu", 100.0, 70.0, 20.0, 90.0)
    assert c.ratio == pytest.approx(0.9)
    c = construct(m, {}, basis="cpu")  # a layer that could not run alone: its traced latency (160) x the share
    assert (c.from_trace, c.bricks_ns, c.constructed_ns) == (1, 80.0, 100.0)
    assert construct(m, {relu: 70.0}).constructed_ns == 110.0  # the wall basis: the wall-clock glue
    (old,) = extract([_cpu_run(tmp_path, cpu=False)], warmup=0).models
    assert old.measured_cpu_ns is None and old.cpu_share is None and old.minor_faults is None
    with pytest.raises(ValueError, match="carry no thread CPU time"):
        construct(old, {relu: 70.0}, basis="cpu")


def test_page_faults_beyond_the_bricks_add_their_cost(tmp_path: Path) -> None:
    """The model took 11 faults a call (median of 10, 11, 12), its brick 3: 8 more, at 2 ns each."""
    (m,) = extract([_cpu_run(tmp_path)], warmup=0).models
    relu = m.layers[0].brick
    assert m.minor_faults == 11.0
    c = construct(m, {relu: 70.0}, basis="cpu", faults={relu: 3.0}, fault_cost_ns=2.0)
    assert (c.extra_faults, c.faults_ns, c.bricks_ns, c.glue_ns, c.constructed_ns) == (8.0, 16.0, 70.0, 20.0, 106.0)
    # Unknown: no cost of a fault, a brick whose faults were not counted, a layer from the trace.
    for kw in ({"faults": {relu: 3.0}}, {"faults": {}, "fault_cost_ns": 2.0}):
        c = construct(m, {relu: 70.0}, basis="cpu", **kw)  # type: ignore[arg-type]
        assert (c.extra_faults, c.faults_ns, c.constructed_ns) == (None, 0.0, 90.0)
    assert construct(m, {}, basis="cpu", faults={relu: 3.0}, fault_cost_ns=2.0).faults_ns == 0.0


def test_a_fault_costs_cpu_time_and_bricks_count_theirs() -> None:
    from mltrace.brickbench import fault_cost_ns

    cost = fault_cost_ns(rounds=3)  # 64 MiB of fresh pages, filled on this thread alone
    assert cost is not None and cost > 0  # a positive CPU time: not a timing bound
    brick = Brick("Linear", ((2, 16),), ("float32",), 16 * 16 + 16, (("bias", True), ("in_features", 16), ("out_features", 16)), "inferred")
    (t,) = benchmark_bricks([brick], warmup=1, n=3)
    assert t.minor_faults is not None and t.minor_faults >= 0


def test_model_spans_carry_the_calling_threads_cpu_time(residual_runs: list[Run]) -> None:
    """Every model call of a traced torch model has ``ml.thread.cpu_ns``: the calling thread's
    CPU time over the call, within its wall time; nothing else of the measurement is left behind."""
    for run in residual_runs:
        models = [s for s in run.spans if s.level == Level.MODEL]
        assert len(models) == 4
        for s in models:
            cpu, faults = s.attrs["ml.thread.cpu_ns"], s.attrs["ml.thread.minor_faults"]
            assert isinstance(cpu, int) and 0 < cpu <= s.duration_ns + 100_000  # read inside the span's clock reads
            assert isinstance(faults, int) and faults >= 0
            assert not any(k.startswith("_") for k in s.attrs)
        assert all("ml.thread.cpu_ns" not in s.attrs for s in run.spans if s.level == Level.LAYER)  # model spans only
    (m,) = extract(residual_runs[:1]).models
    assert m.measured_cpu_ns is not None and m.cpu_share is not None and 0 < m.cpu_share <= 1.01
    assert m.minor_faults is not None


def test_run_directories_with_one_name_are_told_apart_by_their_parents(rep_run: Any, tmp_path: Path) -> None:
    """Two runs of one script in directories of one name (``x/run``, ``y/run``): each row is
    named with as much of its path as tells them apart."""
    import shutil

    from mltrace.analysis.bricks import run_names

    a, b, c = tmp_path / "x" / "run", tmp_path / "y" / "run", tmp_path / "y" / "other"
    assert run_names([str(a), str(b), str(c)]) == {str(a): "x/run", str(b): "y/run", str(c): "other"}
    assert run_names([str(a)]) == {str(a): "run"}
    run, _ = rep_run
    shutil.copytree(run.path, a)
    shutil.copytree(run.path, b)
    bset = extract([mltrace.load_run(a), mltrace.load_run(b)])
    names = [m.model for m in bset.models]
    assert len(names) == 4 and len(set(names)) == 4
    assert sorted(n.rsplit(" [", 1)[1] for n in names) == ["x/run]", "x/run]", "y/run]", "y/run]"]
    # The table keeps the run's name, however long the label: the rows stay apart there too.
    import io

    from mltrace.analysis.bricks import BrickTiming, assemble
    from mltrace.viewers.bricks import fit_label, print_report

    timings = [BrickTiming(100.0, 3, "pytorch") for _ in bset.bricks]
    out = io.StringIO()
    print_report(assemble(bset, timings, [], warmup=1, n=3, runtime="pytorch", bench_wall_s=0.0), out)
    rows = [line for line in out.getvalue().splitlines() if line.startswith("Rep (") and " ms " in line]
    assert len(rows) == 4 and len({row.split(" ms ")[0].rsplit("]", 1)[0] for row in rows}) == 4
    assert fit_label("MobileNetV2 (mobilenet.py:120) [helper/r1]", 30) == "MobileNetV2 (mobi… [helper/r1]"


def test_a_construction_from_means_compares_with_the_models_mean(residual_runs: list[Run]) -> None:
    import statistics

    from mltrace.analysis.bricks import BrickTiming, assemble
    from mltrace.analysis.leveled import invocations

    run = residual_runs[0]
    bset = extract([run])
    (m,) = bset.models
    (calls,) = invocations(run).values()
    assert m.measured_mean_ns == statistics.fmean(c.root.duration_ns for c in calls[1:])
    assert m.measured_ns == statistics.median(c.root.duration_ns for c in calls[1:])
    timings = [BrickTiming(100.0, 3, "pytorch", mean_ns=300.0) for _ in bset.bricks]
    kw: dict[str, Any] = {"warmup": 1, "n": 3, "runtime": "pytorch", "bench_wall_s": 0.0}
    (by_median,) = assemble(bset, timings, [], **kw).constructions
    mean_report = assemble(bset, timings, [], statistic="mean", **kw)
    (by_mean,) = mean_report.constructions
    assert (by_median.bricks_ns, by_median.glue_ns, by_median.measured_ns) == pytest.approx((400.0, m.glue_ns, m.measured_ns), rel=1e-12)
    expected = (1200.0, m.glue_mean_ns, m.measured_mean_ns)  # sums of floats: equal to rounding
    assert (by_mean.bricks_ns, by_mean.glue_ns, by_mean.measured_ns) == pytest.approx(expected, rel=1e-12)
    assert mean_report.to_json()["protocol"]["statistic"] == "mean"
    with pytest.raises(ValueError, match="statistic"):
        assemble(bset, timings, [], statistic="mode", **kw)


def test_the_command_refuses_a_cpu_basis_it_cannot_have(residual_runs: list[Run]) -> None:
    """``mltrace bricks --basis cpu`` on a run traced with two threads: one stderr line saying
    why, exit status 2, before any brick is benchmarked; the default (auto) runs on the wall clock."""
    from conftest import run_cli

    two = str(residual_runs[1].path)
    res = run_cli("bricks", "--basis", "cpu", "-n", "1", "--warmup", "0", two)
    err = res.stderr.decode()
    assert res.returncode == 2 and "no CPU-time basis: intra-op threads = 2: CPU time is not the latency" in err
    assert "Traceback" not in err and "benchmarked" not in err
    res = run_cli("bricks", "-n", "1", "--warmup", "0", two)
    assert res.returncode == 0 and "basis: wall clock" in res.stdout.decode()
