"""Run diffs: the status rule from a table, hand-made runs, and two real runs."""

from __future__ import annotations

from pathlib import Path

import pytest

import mltrace
from mltrace.analysis.diff import ADDED, FASTER, REMOVED, SAME, SLOWER, diff_runs, status_of
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run


@pytest.mark.parametrize(
    ("calls_a", "calls_b", "time_a", "time_b", "status"),
    [
        (0, 3, 0, 300, ADDED),
        (3, 0, 300, 0, REMOVED),
        (0, 0, 0, 0, SAME),
        (3, 3, 100_000, 150_000, SLOWER),  # +50%
        (3, 3, 150_000, 100_000, FASTER),
        (3, 3, 100_000, 105_000, SAME),  # +5% < 10%
        (3, 3, 1_000, 1_900, SAME),  # +90% but only 900 ns < 1 µs
        (3, 5, 100_000, 100_000, SAME),  # call counts alone change nothing
    ],
)
def test_status_rule(calls_a: int, calls_b: int, time_a: float, time_b: float, status: str) -> None:
    assert status_of(calls_a, calls_b, time_a, time_b, threshold=0.10, min_delta_ns=1_000) == status


def make_run(name: str, model_calls: int, layers: dict[str, tuple[str, int, dict[str, int]]]) -> Run:
    """model_calls calls of a model whose layers run one after another.

    layers: path → (type, duration per call ns, {op name: duration ns}).
    """
    spans: list[Span] = []
    ids = iter(range(1, 1_000_000))
    t = 0
    for _ in range(model_calls):
        model_id, model_start = next(ids), t
        for path, (ltype, dur, ops) in layers.items():
            lid, start = next(ids), t
            ot = t + 1
            for op, odur in ops.items():
                spans.append(Span(next(ids), lid, Level.OP, op, ot, ot + odur, 1, {}))
                ot += odur
            t = max(ot, start + dur)
            spans.append(Span(lid, model_id, Level.LAYER, path, start, t, 1, {"ml.layer.type": ltype}))
        spans.append(Span(model_id, None, Level.MODEL, "Net", model_start, t, 1, {}))
        t += 1000
    return Run(Path(name), {"name": name}, {1: Track(1, TrackKind.THREAD, "main", 1, 1)}, spans)


A = {
    "conv": ("Conv2d", 100_000, {"aten::conv2d": 90_000}),
    "relu": ("ReLU", 10_000, {"aten::relu": 8_000}),
    "fc": ("Linear", 50_000, {"aten::linear": 45_000}),
}
B = {
    "conv": ("Conv2d", 300_000, {"aten::conv2d": 280_000}),  # slower
    "fc": ("Linear", 20_000, {"aten::linear": 18_000}),  # faster
    "gelu": ("GELU", 10_000, {"aten::gelu": 8_000}),  # added; relu removed
}


def test_layers_types_and_ops() -> None:
    d = diff_runs(make_run("a", 2, A), make_run("b", 2, B))
    assert d.basis == "totals" and d.model_calls == (2, 2)
    status = {r.name: r.status for r in d.layers}
    assert status == {"conv": SLOWER, "relu": REMOVED, "fc": FASTER, "gelu": ADDED, "Net": SLOWER}
    conv = d.row("layers", "conv")
    assert conv is not None and (conv.calls_a, conv.calls_b, conv.time_a, conv.time_b) == (2, 2, 200_000, 600_000)
    assert conv.delta_ns == 400_000
    assert [r.name for r in d.layers][:2] == ["conv", "Net"]  # largest change first: +400 µs, +340 µs
    assert {r.name: r.status for r in d.types} == {"Conv2d": SLOWER, "ReLU": REMOVED, "Linear": FASTER, "GELU": ADDED}
    assert {r.name: r.status for r in d.ops} == {"aten::conv2d": SLOWER, "aten::relu": REMOVED, "aten::linear": FASTER, "aten::gelu": ADDED}
    assert d.kernels == []
    totals = {name: (a, b) for name, a, b in d.totals}
    assert totals["model time"] == (2 * 160_000, 2 * 330_000)
    assert set(totals) == {"model time", "model level", "layer level", "op level"}


def test_different_iteration_counts_compare_per_model_call() -> None:
    d = diff_runs(make_run("a", 2, A), make_run("b", 6, A))
    assert d.basis == "per model call"
    assert all(r.status == SAME for r in d.layers + d.ops + d.types)
    conv = d.row("layers", "conv")
    assert conv is not None and (conv.calls_a, conv.calls_b, conv.time_a, conv.time_b) == (2, 6, 100_000, 100_000)
    forced = diff_runs(make_run("a", 2, A), make_run("b", 6, A), per_call=False)
    assert forced.basis == "totals" and {r.status for r in forced.layers} == {SLOWER}


@pytest.mark.parametrize("ended", ["layer_window", "op_window"])
def test_a_level_that_ended_early_compares_per_call_it_recorded(ended: str) -> None:
    """B recorded layers (or ops) in 2 of its 4 model calls: per call, nothing changed."""
    b = make_run("b", 4, A)
    models = sorted((s for s in b.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    end = models[1].end_ns + 1
    model_of = {s.id: s.parent_id for s in b.spans if s.level == Level.LAYER}
    dropped = {Level.LAYER, Level.OP} if ended == "layer_window" else {Level.OP}

    def late(s: Span) -> bool:
        model = model_of.get(s.parent_id) if s.level == Level.OP else s.parent_id
        return s.level in dropped and model in {models[2].id, models[3].id}

    b.spans = [s for s in b.spans if not late(s)]
    b.meta[ended] = {"ended_ns": end}
    d = diff_runs(make_run("a", 4, A), b)
    assert d.basis == "per model call" and d.model_calls == (4, 4)
    assert {r.status for r in d.layers + d.types + d.ops} == {SAME}
    conv = d.row("layers", "conv")
    assert conv is not None and (conv.time_a, conv.time_b) == (100_000, 100_000)
    op = d.row("ops", "aten::conv2d")
    assert op is not None and (op.time_a, op.time_b) == (90_000, 90_000)
    for name, in_a, in_b in d.totals:
        assert in_a == in_b, name


def test_identical_runs_have_no_changes() -> None:
    d = diff_runs(make_run("a", 3, A), make_run("a", 3, A))
    assert {r.status for r in d.layers + d.types + d.ops} == {SAME}


def test_real_runs_batch_1_against_batch_8(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 10)).eval()
    for batch in (1, 8):
        with torch.inference_mode(), mltrace.profile(output=tmp_path / f"bs{batch}", level="layer", summary=False):
            for _ in range(2):
                model(torch.randn(batch, 3, 16, 16))
    d = diff_runs(mltrace.load_run(tmp_path / "bs1"), mltrace.load_run(tmp_path / "bs8"))
    assert d.model_calls == (2, 2)
    assert {r.name for r in d.layers} == {"Sequential", "0", "1", "2", "3"}
    assert all(r.status not in (ADDED, REMOVED) and r.calls_a == r.calls_b == 2 for r in d.layers)
    assert {r.name for r in d.types} == {"Conv2d", "ReLU", "Flatten", "Linear"}
