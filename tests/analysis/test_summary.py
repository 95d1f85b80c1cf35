"""run.json's summary, computed on the span table, equals the one the plain reference
(``analysis.breakdown``) gives, on hand-made edge cases and on real runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import mltrace
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.coldstart import find_cold_start, without_rows
from mltrace.analysis.gcpauses import gc_by_row
from mltrace.analysis.summary import summarize
from mltrace.config import ProfileOptions
from mltrace.importers import import_kineto
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.tracer.session import Session
from support.reference_breakdown import breakdown

KINETO = Path(__file__).resolve().parents[1] / "data" / "kineto"


def reference(run: Run, top: int = 5, include_cold: bool = False) -> dict[str, Any]:
    """The summary from ``breakdown``, the definitions' plain implementation, of the run
    without its cold calls unless ``include_cold`` (as ``mltrace report`` counts)."""
    cold = find_cold_start(run)
    counted = run if include_cold or cold.rows is None else without_rows(run, cold.rows)
    b = breakdown(counted)
    gc = {name: g.ns for (name, lv), g in gc_by_row(counted.table, counted.tracks, counted.meta).own.items() if lv is Level.LAYER}
    layers = sorted((x for x in b.layers if x.level == Level.LAYER), key=lambda x: -(x.self_ns - gc.get(x.name, 0)))[:top]
    return {
        "spans": b.span_count,
        "flows": len(run.flows),
        "counters": len(run.counters),
        "levels": {lt.level.label: {"spans": lt.spans, "time_ns": lt.time_ns} for lt in b.levels},
        "model_calls": b.model_calls,
        "model_time_ns": b.model_ns,
        "wall_ns": b.wall_ns,
        "cold_calls": cold.cold_calls,
        "cold_ns": cold.cold_ns,
        "include_cold": include_cold,
        **({"layer_model_calls": b.layer_model_calls, "layer_model_time_ns": b.layer_model_ns} if b.layer_model_ns is not None else {}),
        "top_layers_by_self_time": [
            {"layer": x.name, "type": x.type, "calls": x.calls, "self_ns": x.self_ns, "gc_ns": gc.get(x.name, 0), "location": x.location}
            for x in layers
        ],
    }


def _run(spans: list[Span], meta: dict[str, Any] | None = None) -> Run:
    return Run(path=Path("."), meta=meta or {}, tracks={1: Track(1, "thread", "main", 1, 1)}, spans=spans)


def test_hand_made_edge_cases() -> None:
    layer = {"ml.layer.type": "Linear", "code.file.path": "m.py", "code.line.number": 3}
    spans = [
        Span(1, None, Level.MODEL, "Net", 0, 100, 1),
        Span(2, 1, Level.LAYER, "a", 10, 50, 1, layer),
        Span(3, 2, Level.LAYER, "a.inner", 20, 30, 1, {"ml.layer.type": "ReLU"}),  # nested layer: counted once
        Span(4, 2, Level.OP, "aten::addmm", 31, 49, 1),  # content, not a child
        Span(5, 4, Level.OP, "aten::mm", 32, 48, 1),  # an op in an op
        Span(6, 1, Level.USER, "decode", 55, 95, 1),
        Span(7, 6, Level.LAYER, "b", 60, 90, 1, {"ml.layer.type": "Linear"}),  # under a user span
        Span(8, 99, Level.LAYER, "orphan", 0, 5, 1),  # parent not in the run
        Span(9, 7, Level.LAYER, "tie1", 61, 71, 1),  # ties in self time: by total, then name
        Span(10, 7, Level.LAYER, "tie0", 72, 82, 1),
        Span(11, None, Level.MODEL, "Net", 200, 260, 1),
        Span(12, 11, Level.LAYER, "a", 210, 280, 1, layer),  # longer than its parent's room: self ≥ 0
        Span(13, None, Level.SOURCE, "line", 0, 1, 1),  # counted as a span, listed at no level
    ]
    meta = {"layer_window": {"ended_ns": 150}}
    for top in (1, 3, 5, 20):
        for include_cold in (False, True):
            assert summarize(_run(spans, meta), top=top, include_cold=include_cold) == reference(_run(spans, meta), top, include_cold)
    got = summarize(_run(spans, meta), include_cold=True)
    assert got["levels"]["layer"] == {"spans": 7, "time_ns": 40 + 30 + 5 + 70}
    assert got["levels"]["op"]["time_ns"] == 18 and got["layer_model_calls"] == 1
    assert got["top_layers_by_self_time"][0] == {
        "layer": "a",
        "type": "Linear",
        "calls": 2,
        "self_ns": 30 + 70,
        "gc_ns": 0,
        "location": "m.py:3",
    }
    assert summarize(_run([])) == reference(_run([]))
    # The first Net call (100 ns) is an outlier against the second (60 ns): cold, and left out
    # with its spans by default, as ``mltrace report`` does.
    steady = summarize(_run(spans, meta))
    assert (steady["cold_calls"], steady["cold_ns"], got["cold_calls"]) == (1, 100, 1)
    assert (steady["model_calls"], steady["model_time_ns"], got["model_calls"]) == (1, 60, 2)
    assert steady["levels"]["layer"] == {"spans": 2, "time_ns": 70 + 5}  # the second call's layer, and the orphan


def test_a_live_library_level_run_with_an_early_layer_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLTRACE_OP_CYCLE_S", "0")  # torch.profiler held whole: its ops count once it stops
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Sequential(nn.Conv2d(8, 8, 3), nn.ReLU()), nn.Flatten()).eval()
    x = torch.randn(1, 3, 32, 32)
    options = ProfileOptions.build(output=tmp_path / "r", summary=False, level="library", max_spans=20, flush_interval_s=60)
    with torch.inference_mode():
        session = Session(options).start()
        try:
            for _ in range(4):
                model(x)
            session.flush()  # the limit is checked after every model call: a flush ends nothing more
            for _ in range(4):
                model(x)
        finally:
            session.stop()
    run = mltrace.load_run(tmp_path / "r")
    # A call records 7 spans (the model, 6 layers; the ops count once the profiler stops), and
    # its library calls count as their verbose lines are read (a read may come after the call
    # returned): the op level ends first, after the 3rd call (21 + at most 6 lines ≥ 20, where
    # after the 2nd 14 + at most 4 < 20), and the layer level at 1.5 × 20 after the 4th call
    # (28 + its lines); 28 + 6 < 40, so these never fill the trace. The 3 calls' ops count once
    # the converter has read the stopped profiler, which a loaded machine may finish before the
    # 4th call's flush: the trace may fill then (2 × 20 spans), never before.
    library = run.meta["sources_info"]["cpu.library"]["lines"]
    assert library >= 2  # here one MKL SGEMM for each of the 6 convolutions
    assert run.meta["op_window"]["ended_after_model_calls"] == 3
    assert 21 <= _recorded(run.meta["op_window"]["reason"]) <= 21 + library
    assert run.meta["layer_window"]["ended_after_model_calls"] == 4
    assert 28 <= _recorded(run.meta["layer_window"]["reason"]) <= 28 + library
    models = sorted((s for s in run.spans if s.level is Level.MODEL), key=lambda s: s.start_ns)
    assert "trace_full" not in run.meta or run.meta["trace_full"]["at_ns"] > models[3].end_ns
    assert summarize(run) == reference(run) == run.meta["summary"]
    # The summary counts the steady calls: of the 4 calls with layers, those not judged cold
    # (on a loaded machine the 4 calls with layers and ops may all read as cold beside the 4
    # without, and the stored summary then has the model level alone).
    (calls,) = find_cold_start(run).models
    assert {"model", "layer", "op"} <= set(summarize(run, include_cold=True)["levels"])
    if any(i not in calls.cold for i in range(4)):
        assert {"model", "layer"} <= set(run.meta["summary"]["levels"])
    assert run.meta["summary"]["layer_model_calls"] == 4 - sum(1 for i in calls.cold if i < 4)
    assert summarize(run, include_cold=True)["layer_model_calls"] == 4


MS = 1_000_000
TID = 10


def gc_run() -> Run:
    """Six calls of Net: ``fc`` (2 ms) and ``tag`` (0.1 ms). The first call is cold (its fc takes
    40 ms) and holds a 30 ms collection in fc; the fourth call's tag holds a 20 ms one."""
    spans: list[Span] = []
    pauses: list[list[int]] = []
    for c in range(6):
        t, i = c * 100 * MS, 10 * c + 1
        fc_ns = 40 * MS if c == 0 else 2 * MS
        tag_ns = 20 * MS + MS // 10 if c == 3 else MS // 10
        spans += [
            Span(i, None, Level.MODEL, "Net", t, t + fc_ns + tag_ns + 2, 1, {"ml.layer.type": "Net"}),
            Span(i + 1, i, Level.LAYER, "fc", t + 1, t + 1 + fc_ns, 1, {"ml.layer.type": "Linear"}),
            Span(i + 2, i, Level.LAYER, "tag", t + 1 + fc_ns, t + 1 + fc_ns + tag_ns, 1, {"ml.layer.type": "Tag"}),
        ]
        if c == 0:
            pauses.append([TID, t + 2, t + 2 + 30 * MS, 2])
        if c == 3:
            pauses.append([TID, t + 2 + fc_ns, t + 2 + fc_ns + 20 * MS, 2])
    meta = {"name": "gc", "complete": True, "pid": 5, "gc": {"pauses": pauses}}
    return Run(path=Path("gc"), meta=meta, tracks={1: Track(1, TrackKind.THREAD, "MainThread", 5, TID)}, spans=spans)


@pytest.mark.parametrize("include_cold", [False, True])
def test_the_top_layers_are_ranked_as_the_report_ranks_them(include_cold: bool) -> None:
    """``tag`` spent 20.5 ms of self time in the steady calls, 20 of them in a collection: the
    report ranks it below ``fc``'s 10 ms and shows the collection; so does the summary. The cold call's collection is
    in fc's self time only where the cold call counts, as in the report."""
    run = gc_run()
    top = summarize(run, include_cold=include_cold)["top_layers_by_self_time"]
    report = analyze(run, include_cold=include_cold).top_by_self(5)
    assert [x["layer"] for x in top] == [r.stat.name for r in report] == ["fc", "tag"]
    got = [(x["layer"], x["self_ns"], x["gc_ns"]) for x in top]
    assert got == [(r.stat.name, r.stat.self_ns, r.gc.ns if r.gc is not None else 0) for r in report]
    fc_ns, fc_gc, tags = (50 * MS, 30 * MS, 6) if include_cold else (10 * MS, 0, 5)
    assert got == [("fc", fc_ns, fc_gc), ("tag", 20 * MS + tags * MS // 10, 20 * MS)]
    assert summarize(run, include_cold=include_cold) == reference(run, include_cold=include_cold)


@pytest.mark.parametrize("name", ["a100_alexnet_train.json.gz", "h100_cuda_models.json.gz", "cpu_modules_torch.json.gz"])
def test_imported_kineto_traces(tmp_path: Path, name: str) -> None:
    run = mltrace.load_run(import_kineto(KINETO / name, tmp_path / "r"))
    assert summarize(run) == reference(run) == run.meta["summary"]
    assert run.meta["summary"]["spans"] > 20


def _recorded(reason: str) -> int:
    """The span count a level's end names ("N spans recorded, --max-spans 20")."""
    count, rest = reason.split(" spans recorded, ", 1)
    assert rest == "--max-spans 20"
    return int(count)


def test_a_layer_path_of_two_models_is_named_after_each_as_in_the_report(tmp_path: Path) -> None:
    """Two models with layers at the same paths (an encoder and a decoder, each a Sequential of
    its own class): the summary names each ``Enc.0``, ``Dec.0``, as the report's layer rows
    do (``layers_named_by_model``), where it used to add both models' calls under ``0``."""

    class Enc(nn.Sequential):
        pass

    class Dec(nn.Sequential):
        pass

    enc = Enc(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    dec = Dec(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad(), mltrace.profile(output=tmp_path / "run", summary=False, level="layer"):
        for _ in range(6):
            dec(enc(torch.randn(2, 8)))
    run = mltrace.load_run(tmp_path / "run")
    summary = summarize(run, top=10, include_cold=True)
    layers = {row["layer"]: row["calls"] for row in summary["top_layers_by_self_time"]}
    assert layers == {f"{m}.{i}": 6 for m in ("Enc", "Dec") for i in range(3)}
    report_rows = {r.name for r in analyze(run, include_cold=True).breakdown.layers if r.level == Level.LAYER}
    assert set(layers) == report_rows
