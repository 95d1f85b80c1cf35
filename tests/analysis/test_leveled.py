"""Leveled experimentation: matching, estimates, inflation, the leveled trace, and the harness."""

from __future__ import annotations

import collections
import itertools
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import mltrace
from conftest import run_cli
from mltrace.analysis.leveled import (
    Stats,
    analyze,
    build_leveled_run,
    invocations,
    load_plain_timings,
    model_key,
    path_label,
    trimmed_mean,
)
from mltrace.bench import run_leveled
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run
from support.pftrace import parse_pftrace

M, L, OP, U = Level.MODEL, Level.LAYER, Level.OP, Level.USER

# A span tree: (name, level, duration ns, children); children run back to back from 1 ns after the parent starts.
Tree = tuple[str, Level, int, list[Any]]


def _emit(tree: Tree, start: int, parent: int | None, ids: Iterator[int], out: list[Span]) -> None:
    name, level, dur, kids = tree
    attrs: dict[str, Any] = {"ml.call.file.path": "/w/work.py", "ml.call.line.number": 9} if level == M else {}
    span = Span(next(ids), parent, level, name, start, start + dur, 1, attrs)
    out.append(span)
    t = start + 1
    for kid in kids:
        _emit(kid, t, span.id, ids, out)
        t += kid[2] + 1
    assert t <= start + dur + 1, f"children of {name} do not fit"


def make_run(calls: list[Tree], recorded: dict[str, bool] | None = None) -> Run:
    """A run holding one tree per model call, 1 ms apart."""
    ids = itertools.count(1)
    spans: list[Span] = []
    for i, tree in enumerate(calls):
        _emit(tree, 1_000_000 * (i + 1), None, ids, spans)
    meta: dict[str, Any] = {"format": "mltrace-run", "name": "t"}
    if recorded is not None:
        meta["levels"] = {k: {"recorded": v, "reason": None if v else "no source here"} for k, v in recorded.items()}
    return Run(path=Path("."), meta=meta, tracks={1: Track(1, TrackKind.THREAD, "main", 1, 1)}, spans=spans)


def model(dur: int, *kids: Tree) -> Tree:
    return ("Net", M, dur, list(kids))


def layer(name: str, dur: int, *kids: Tree) -> Tree:
    return (name, L, dur, list(kids))


def op(name: str, dur: int) -> Tree:
    return (name, OP, dur, [])


KEY = ("Net", "/w/work.py", 9)


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        ([5], 5.0),
        ([1, 2, 3, 100], 26.5),  # n=4: floor(0.8) = 0 cut
        ([1, 2, 3, 4, 100], 3.0),  # n=5: one cut from each end
        (list(range(1, 11)), 5.5),  # n=10: two cut from each end
        ([10, 1, 9, 2, 8, 3, 7, 4, 6, 5, 1000, -1000], 5.5),
    ],
)
def test_trimmed_mean(samples: list[int], expected: float) -> None:
    assert trimmed_mean(samples) == expected


def test_stats() -> None:
    st = Stats.of([10, 20, 30, 40, 1000])
    assert (st.n, st.mean_ns, st.median_ns, st.min_ns, st.max_ns) == (5, 30.0, 30.0, 10, 1000)
    assert st.spread_pct == pytest.approx(100 * st.stdev_ns / 30)
    with pytest.raises(ValueError):
        Stats.of([])


def test_path_keys_count_calls_per_parent_and_name() -> None:
    run = make_run([model(100, layer("relu", 5), layer("b", 40, layer("b.0", 10), layer("relu", 5)), layer("relu", 5))])
    (calls,) = invocations(run).values()
    assert [path_label(k) for k in calls[0].spans] == ["Net", "Net > relu", "Net > b", "Net > b > b.0", "Net > b > relu", "Net > relu[1]"]


def test_user_span_above_model_is_not_part_of_the_invocation() -> None:
    run = make_run([("infer", U, 200, [model(100, layer("a", 10))])])
    inv = invocations(run)
    assert list(inv) == [KEY]
    assert [path_label(k) for k in inv[KEY][0].spans] == ["Net", "Net > a"]


def _two_level_runs(b_layer: int = 30) -> dict[Level, list[Run]]:
    model_run = make_run([model(100), model(50), model(52), model(48)])
    layer_run = make_run(
        [
            model(130, layer("a", 50), layer("b", 60)),
            model(60, layer("a", 20), layer("b", b_layer)),
            model(62, layer("a", 21), layer("b", b_layer + 1)),
            model(58, layer("a", 19), layer("b", b_layer - 1)),
        ]
    )
    return {M: [model_run], L: [layer_run]}


def test_estimates_come_from_the_run_where_the_level_is_deepest() -> None:
    runs = _two_level_runs()
    result = analyze({KEY: [[90, 49, 50, 51]]}, runs, warmup=1)
    assert result.levels == [M, L] and result.mismatches == []
    (m,) = result.models
    est = {path_label(e.path): e for e in m.spans}
    assert est["Net"].source == M and est["Net"].stats.mean_ns == 50  # not 60, as in the layer run
    assert est["Net"].full.mean_ns == 60
    assert est["Net > a"].source == L and est["Net > a"].stats.mean_ns == 20
    assert est["Net > b"].stats.mean_ns == 30 and est["Net > b"].stats.n == 3
    model_row, layer_row = m.levels
    assert (model_row.level, model_row.estimate_ns, model_row.by_run_ns[L]) == (M, 50, 60)
    assert model_row.inflation_pct(L) == pytest.approx(20.0)  # enabling layers inflated the model by 20 %
    assert (layer_row.level, layer_row.spans, layer_row.estimate_ns) == (L, 2, 50)
    assert m.plain is not None and m.plain.median_ns == 50
    assert m.vs_plain_pct(M) == 0.0 and m.vs_plain_pct(L) == 0.0
    assert m.invocations == {"model r0": 4, "layer r0": 4, "plain r0": 4}
    doc = json.loads(json.dumps(result.to_json()))
    assert doc["models"][0]["levels"][0]["inflation_by_next_level_pct"] == 20.0
    assert doc["models"][0]["full_trace_model_vs_plain_pct"] == 20.0


def test_round_by_round_ratio_cancels_drift_between_rounds() -> None:
    # The machine slows down 2x in round 1: pooled medians mislead, per-round ratios do not.
    model_runs = [make_run([model(100), model(101), model(102)]), make_run([model(200), model(202), model(204)])]
    plain = {KEY: [[98, 99, 100], [196, 198, 200]]}
    result = analyze(plain, {M: model_runs}, warmup=1)
    (m,) = result.models
    assert m.round_ratios == [pytest.approx(101.5 / 99.5), pytest.approx(203 / 199)]
    assert m.paired_vs_plain_pct == pytest.approx(100 * ((101.5 / 99.5 + 203 / 199) / 2 - 1))
    doc = json.loads(json.dumps(result.to_json()))
    assert doc["models"][0]["leveled_model_vs_plain_paired_pct"] == round(m.paired_vs_plain_pct, 2)
    assert analyze(None, {M: model_runs}, warmup=1).models[0].paired_vs_plain_pct is None


def test_leveled_trace_durations_are_the_estimates() -> None:
    runs = _two_level_runs()
    result = analyze(None, runs, warmup=1)
    run = build_leveled_run(result, runs, Path("out"))
    by_name = {s.name: s for s in run.spans}
    net, a, b = by_name["Net"], by_name["a"], by_name["b"]
    assert (net.duration_ns, a.duration_ns, b.duration_ns) == (50, 20, 30)
    assert a.parent_id == net.id and b.parent_id == net.id and net.parent_id is None
    assert net.start_ns <= a.start_ns and a.end_ns <= b.start_ns and b.end_ns <= net.end_ns
    assert a.attrs["mltrace.leveled.source_level"] == "layer" and a.attrs["mltrace.leveled.samples"] == 3
    assert net.attrs["mltrace.leveled.full_trace_ns"] == 60 and net.attrs["mltrace.leveled.matched"] is True
    assert result.overflows == []
    assert run.meta["kind"] == "leveled"


def test_children_longer_than_parent_are_scaled_and_reported() -> None:
    runs = _two_level_runs(b_layer=35)  # a + b = 55 > model 50
    result = analyze(None, runs, warmup=1)
    run = build_leveled_run(result, runs, Path("out"))
    (ov,) = result.overflows
    assert (ov.parent_ns, ov.children_ns) == (50, 55) and ov.scale == pytest.approx(50 / 55)
    by_name = {s.name: s for s in run.spans}
    assert by_name["a"].attrs["mltrace.leveled.estimate_ns"] == 20  # the estimate is kept as an attribute
    assert by_name["a"].duration_ns + by_name["b"].duration_ns <= by_name["Net"].duration_ns
    assert by_name["b"].attrs["mltrace.leveled.fit_scale"] == pytest.approx(50 / 55, abs=1e-4)


def test_container_layers_carry_nested_instrumentation() -> None:
    model_run = make_run([model(50)] * 3)
    layer_run = make_run([model(66, layer("seq", 58, layer("seq.0", 20), layer("seq.1", 25)), layer("head", 3))] * 3)
    result = analyze(None, {M: [model_run], L: [layer_run]}, warmup=1)
    row = result.models[0].level(L)
    assert row is not None
    assert (row.spans, row.estimate_ns) == (3, 48)  # innermost: seq.0 + seq.1 + head
    assert row.outer_by_run_ns[L] == 61  # seq (with its children's hooks) + head
    run = build_leveled_run(result, {M: [model_run], L: [layer_run]}, Path("out"))
    by_name = {s.name: s for s in run.spans}
    assert by_name["seq"].duration_ns == 45 and by_name["seq"].attrs["mltrace.leveled.sized_by_children"] is True
    assert by_name["seq"].attrs["mltrace.leveled.estimate_ns"] == 58
    assert by_name["seq.1"].duration_ns == 25 and by_name["head"].duration_ns == 3 and by_name["Net"].duration_ns == 50
    assert result.overflows == []


def test_an_overflow_is_reported_once_not_down_a_nested_chain() -> None:
    model_run = make_run([model(50)] * 3)
    layer_run = make_run([model(60, layer("a", 20), layer("b", 20))] * 3)
    chain = ("aten::conv2d", OP, 30, [("aten::convolution", OP, 28, [op("aten::mkldnn_convolution", 26)])])
    op_run = make_run([model(90, layer("a", 35, chain), layer("b", 20))] * 3)
    runs = {M: [model_run], L: [layer_run], OP: [op_run]}
    result = analyze(None, runs, warmup=1)
    run = build_leveled_run(result, runs, Path("out"))
    assert [(o.path, o.parent_ns, o.children_ns) for o in result.overflows] == [("Net > a", 20, 26)]
    by_name = {s.name: s for s in run.spans}
    assert by_name["a"].duration_ns == 20 and by_name["aten::mkldnn_convolution"].duration_ns == 20
    assert by_name["aten::conv2d"].attrs["mltrace.leveled.fit_scale"] == pytest.approx(20 / 26, abs=1e-4)
    assert "mltrace.leveled.fit_scale" not in by_name["b"].attrs


def test_mismatches_are_reported_not_hidden() -> None:
    model_run = make_run([model(50)] * 4)
    layer_run = make_run([model(60, layer("a", 20), layer("b", 20), layer("c", 10))] * 3)
    op_run = make_run([model(90, layer("a", 40, op("aten::addmm", 10), op("aten::addmm", 12)), layer("b", 20), layer("x", 15))] * 3)
    result = analyze({("Other", None, None): [[1, 2]]}, {M: [model_run], L: [layer_run], OP: [op_run]}, warmup=1)
    kinds = sorted((x.kind, x.path or "") for x in result.mismatches)
    assert kinds == [("extra", "Net > c"), ("invocations", ""), ("missing", "Net > x"), ("plain", ""), ("plain", "")]
    est = {path_label(e.path): e for e in result.models[0].spans}
    assert est["Net > x"].matched is False and est["Net > x"].source is None and est["Net > x"].stats.mean_ns == 15
    assert est["Net > a > aten::addmm[1]"].source == OP and est["Net > a > aten::addmm[1]"].stats.mean_ns == 12
    assert est["Net > a"].stats.mean_ns == 20 and est["Net > a"].full.mean_ns == 40
    op_row = result.models[0].level(OP)
    assert op_row is not None and op_row.estimate_ns == 22 and op_row.spans == 2


def test_level_requested_but_not_recorded_is_skipped() -> None:
    runs = _two_level_runs()
    runs[OP] = [make_run([model(60, layer("a", 20), layer("b", 30))] * 4, recorded={"model": True, "layer": True, "op": False})]
    result = analyze(None, runs, warmup=1)
    assert result.levels == [M, L]
    assert result.skipped == {"op": "no source here"}


def test_plain_timings_file(tmp_path: Path) -> None:
    doc = {
        "format": "mltrace-plain-timings",
        "models": [{"name": "Net", "call_file": "/w/work.py", "call_line": 9, "durations_ns": [5, 6]}],
    }
    (tmp_path / "p.json").write_text(json.dumps(doc))
    assert load_plain_timings([tmp_path / "p.json", tmp_path / "p.json"]) == {KEY: [[5, 6], [5, 6]]}
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a plain-timings file"):
        load_plain_timings([tmp_path / "bad.json"])


NAMED_MODELS = """
import sys
import torch
from torch import nn

sys.path.insert(0, sys.argv[1])  # a site-packages folder holding an installed helper
import fakeinfer

class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc3 = nn.Linear(4, 4), nn.Linear(4, 4)
    def decode(self, z):
        return self.fc3(z)
    def forward(self, x):
        return self.decode(self.fc1(x))

vae = VAE().eval()
compiled = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), backend="eager")
exported = torch.export.export(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),)).module()
x = torch.randn(2, 4)
with torch.no_grad():
    for _ in range(3):
        vae.decode(x)
        vae(x)
        compiled(x)
        exported(x)
        fakeinfer.infer(vae, x)
"""


def test_plain_timings_name_models_as_the_tracer_does(tmp_path: Path) -> None:
    """The plain run's keys are the traced run's: a submodule called from its holder's method
    (``VAE.fc3``), a compiled model, an exported one and a model an installed library calls
    (at the script's line that called the library) are named and placed alike in both, so
    the leveled estimates find their plain timings."""
    pytest.importorskip("torch")
    script = tmp_path / "named.py"
    script.write_text(NAMED_MODELS)
    library = tmp_path / "lib" / "site-packages"
    library.mkdir(parents=True)
    (library / "fakeinfer.py").write_text("def infer(model, x):\n    return model(x)\n")
    plain = subprocess.run(
        [sys.executable, "-m", "mltrace.bench", "plain", str(tmp_path / "plain.json"), str(script), str(library)], capture_output=True
    )
    assert plain.returncode == 0, plain.stderr.decode()
    traced = run_cli("python", "-q", "--level", "model", "-o", str(tmp_path / "run"), str(script), str(library))
    assert traced.returncode == 0, traced.stderr.decode()
    plain_keys = {key: len(runs[0]) for key, runs in load_plain_timings([tmp_path / "plain.json"]).items()}
    run = mltrace.load_run(tmp_path / "run")
    traced_keys = collections.Counter(model_key(s) for s in run.spans if s.level == M)
    assert plain_keys == dict(traced_keys)
    assert {key[0] for key in plain_keys} == {"VAE", "VAE.fc3", "Sequential (compiled)", "Sequential (exported)"}
    lines = NAMED_MODELS.splitlines()
    sites = {(str(script), lines.index(text) + 1) for text in ("        vae(x)", "        fakeinfer.infer(vae, x)")}
    assert {(key[1], key[2]) for key in plain_keys if key[0] == "VAE"} == sites


# Known per-layer costs (ms) of the synthetic workload below.
COSTS = {"a": 4.0, "b.0": 2.0, "b.1": 6.0, "c": 2.0}

WORKLOAD = textwrap.dedent(
    """
    import time
    import torch
    from torch import nn
    from mltrace.bench import scenario

    class Cost(nn.Module):
        def __init__(self, ms):
            super().__init__()
            self.ms = ms
        def forward(self, x):
            time.sleep(self.ms / 1000)
            return x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = Cost(4.0)
            self.b = nn.Sequential(Cost(2.0), Cost(6.0))
            self.c = Cost(2.0)
        def forward(self, x):
            return self.c(self.b(self.a(self.c(x))))

    net = Net()
    x = torch.zeros(1)
    for _ in range(scenario().iters_or(2)):
        net(x)
    print("ok")
    """
)


@pytest.fixture(scope="module")
def leveled_report(tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = tmp_path_factory.mktemp("leveled")
    script = base / "work.py"
    script.write_text(WORKLOAD)
    return run_leveled(str(script), n=5, warmup=1, levels=["model", "layer"], output=base / "out", progress=None)


def test_harness_on_known_costs(leveled_report: Any) -> None:
    result = leveled_report.result
    assert result.levels == [M, L] and result.mismatches == []
    assert [c.label for c in leveled_report.children] == ["plain-r0", "model-r0", "layer-r0"]
    assert all(c.status == 0 for c in leveled_report.children)
    (m,) = result.models
    assert m.key[0] == "Net" and m.key[1].endswith("work.py")
    assert m.plain is not None and m.plain.n == 5
    assert m.invocations == {"model r0": 6, "layer r0": 6, "plain r0": 6}
    est = {path_label(e.path): e for e in m.spans}
    # Sleep-based layers: each estimate within ±50 % of its constructed cost.
    for path, ms in [
        ("Net > a", COSTS["a"]),
        ("Net > b > b.0", COSTS["b.0"]),
        ("Net > b > b.1", COSTS["b.1"]),
        ("Net > c", 2.0),
        ("Net > c[1]", 2.0),
    ]:
        assert 0.5 * ms * 1e6 <= est[path].stats.mean_ns <= 1.5 * ms * 1e6, (path, est[path].stats)
        assert est[path].source == L
    total = sum(COSTS.values()) + COSTS["c"]
    for ns in (est["Net"].stats.mean_ns, m.plain.median_ns):
        assert 0.5 * total * 1e6 <= ns <= 1.5 * total * 1e6
    assert est["Net"].source == M


def test_harness_writes_a_leveled_run(leveled_report: Any) -> None:
    out: Path = leveled_report.path
    doc = json.loads((out / "leveled.json").read_text())
    assert doc["format"] == "mltrace-leveled" and doc["levels"] == ["model", "layer"] and doc["n"] == 5
    assert (out / "runs" / "layer-r0" / "run.json").exists() and (out / "runs" / "plain-r0.json").exists()
    run = mltrace.load_run(out)
    assert run.complete and run.meta["kind"] == "leveled" and run.meta["leveled"]["levels"] == ["model", "layer"]
    est = {path_label(e.path): e for e in leveled_report.result.models[0].spans}
    by_id = run.span_by_id()
    (net,) = [s for s in run.spans if s.level == M]
    assert net.duration_ns == round(est["Net"].stats.mean_ns)
    assert sorted(s.name for s in run.spans if s.level == L) == ["a", "b", "b.0", "b.1", "c", "c"]
    for s in run.spans:
        if s.parent_id is not None:
            p = by_id[s.parent_id]
            assert p.start_ns <= s.start_ns and s.end_ns <= p.end_ns
    trace = parse_pftrace(out / "trace.pftrace")
    assert len(trace.slices) == len(run.spans)


def test_steady_malloc_reaches_every_child(tmp_path: Path) -> None:
    from mltrace.bench import STEADY_MALLOC_ENV

    script = tmp_path / "env.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            import torch
            print("trim=" + os.environ.get("MALLOC_TRIM_THRESHOLD_", "unset"), "mmap=" + os.environ.get("MALLOC_MMAP_THRESHOLD_", "unset"))
            for _ in range(2):
                torch.nn.ReLU()(torch.zeros(1))
            """
        )
    )
    report = run_leveled(str(script), n=1, warmup=1, levels=["model"], output=tmp_path / "out", progress=None, steady_malloc=True)
    expected = f"trim={STEADY_MALLOC_ENV['MALLOC_TRIM_THRESHOLD_']} mmap={STEADY_MALLOC_ENV['MALLOC_MMAP_THRESHOLD_']}"
    assert [c.label for c in report.children] == ["plain-r0", "model-r0"]
    for child in report.children:
        assert expected in child.log.read_text()
    doc = json.loads((report.path / "leveled.json").read_text())
    assert doc["steady_malloc"] == STEADY_MALLOC_ENV
