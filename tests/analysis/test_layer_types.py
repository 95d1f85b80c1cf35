"""The "By layer type" table: each call counts what it does itself, so a container
(``Sequential``, a custom block, an exported module around its ORT nodes) holds its own time
and its own ops' work, never its children's again, and the FLOP column sums to the model's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mltrace.analysis.bottleneck import Bound, TypeRow, analyze
from mltrace.analysis.peaks import Peaks, PeakSet
from mltrace.analysis.report_data import build_report
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run

CPU = PeakSet(Peaks("cpu", "test CPU", 100e9, 10e9, "assumed"))
M, L, OP = Level.MODEL, Level.LAYER, Level.OP
CALLS = 3
MM_FLOPS = 1_000_000  # each Linear's matmul
ADD_FLOPS = 4_096  # the block's residual add


def nested_calls() -> list[Span]:
    """``CALLS`` model calls of Net → seq (Sequential) → seq.0 (Sequential) → seq.0.0 (Linear),
    then block (Block: its own add around a child Linear, block.fc)."""
    spans: list[Span] = []
    for c in range(CALLS):
        t, i = c * 100_000, 100 * c + 1
        spans += [
            Span(i, None, M, "Net", t, t + 50_000, 1, {"ml.layer.type": "Net"}),
            Span(i + 1, i, L, "seq", t + 1_000, t + 21_000, 1, {"ml.layer.type": "Sequential"}),
            Span(i + 2, i + 1, L, "seq.0", t + 2_000, t + 20_000, 1, {"ml.layer.type": "Sequential"}),
            Span(i + 3, i + 2, L, "seq.0.0", t + 3_000, t + 19_000, 1, {"ml.layer.type": "Linear"}),
            Span(i + 4, i + 3, OP, "aten::linear", t + 3_500, t + 18_500, 1, {"ml.flops": MM_FLOPS}),
            Span(i + 5, i, L, "block", t + 22_000, t + 45_000, 1, {"ml.layer.type": "Block"}),
            Span(i + 6, i + 5, L, "block.fc", t + 23_000, t + 39_000, 1, {"ml.layer.type": "Linear"}),
            Span(i + 7, i + 6, OP, "aten::linear", t + 23_500, t + 38_500, 1, {"ml.flops": MM_FLOPS}),
            Span(i + 8, i + 5, OP, "aten::add", t + 40_000, t + 44_000, 1, {"ml.flops": ADD_FLOPS}),
        ]
    return spans


def nested_run() -> Run:
    return Run(
        path=Path("hand-made"),
        meta={"name": "hand-made", "complete": True},
        tracks={1: Track(1, TrackKind.THREAD, "MainThread", 10, 10)},
        spans=nested_calls(),
    )


def types_of(run: Run) -> dict[str, TypeRow]:
    return {t.type: t for t in analyze(run, CPU).types}


def test_containers_hold_their_own_work_and_the_flops_sum_to_the_models() -> None:
    """The Sequentials held 2 and 1 MFLOP per call and the Block 1 MFLOP + its add: four times
    the model's work over three rows. Each now counts its own ops alone."""
    a = analyze(nested_run(), CPU)
    types = {t.type: t for t in a.types}
    assert types["Linear"].flops == CALLS * 2 * MM_FLOPS
    assert types["Sequential"].flops == 0 and types["Sequential"].bytes == 0
    assert types["Block"].flops == CALLS * ADD_FLOPS
    (model,) = [r for r in a.layers if r.stat.level is Level.MODEL]
    assert sum(t.flops for t in a.types) == model.flops == CALLS * (2 * MM_FLOPS + ADD_FLOPS)
    # Self time: 2 µs per call for each Sequential, 7 µs for the Block (4 of them its add).
    assert types["Sequential"].self_ns == CALLS * 4_000 and types["Block"].self_ns == CALLS * 7_000
    assert sum(t.self_ns for t in a.types) == sum(r.stat.self_ns for r in a.layers if r.stat.level is Level.LAYER)


def test_a_container_in_one_of_its_type_is_counted_once_in_total_time() -> None:
    """seq.0 runs inside seq: the Sequential row's total is seq's 20 µs a call, not 20 + 18."""
    assert types_of(nested_run())["Sequential"].total_ns == CALLS * 20_000


def test_a_container_is_judged_on_what_it_does_itself() -> None:
    """Block did its add (4 kFLOP in 4 µs, self 7 µs) and its Linear's matmul: judged on its own
    work it is not the Linear's compute-bound row again; the Sequentials did no work."""
    types = types_of(nested_run())
    linear, block, seq = types["Linear"].verdict, types["Block"].verdict, types["Sequential"].verdict
    assert linear is not None and linear.bound is Bound.COMPUTE
    assert block is not None and block.bound is Bound.OVERHEAD
    assert block.achieved_flops == pytest.approx(ADD_FLOPS / 7e-6)
    assert seq is not None and seq.bound is not Bound.COMPUTE


def test_an_exported_module_around_its_node_holds_nothing_twice() -> None:
    """An ONNX Runtime run: the torch module (layer type ``Module`` where the exporter named no
    class) holds the node that ran its convolution; the node's type has the FLOPs, the module's
    none, and the rows sum to the model's."""
    spans: list[Span] = []
    for c in range(CALLS):
        t, i = c * 10_000, 10 * c + 1
        spans += [
            Span(i, None, M, "legacy", t, t + 9_000, 1, {"ml.layer.type": "InferenceSession"}),
            Span(i + 1, i, L, "stem", t + 500, t + 8_500, 1, {"ml.layer.type": "Module"}),
            Span(i + 2, i + 1, L, "/stem/Conv", t + 500, t + 8_500, 1, {"ml.layer.type": "Conv"}),
            Span(i + 3, i + 2, OP, "Conv", t + 500, t + 8_500, 1, {"ml.flops": MM_FLOPS, "ml.bytes": 10_000}),
        ]
    run = Run(Path("ort"), {"name": "ort", "complete": True}, {1: Track(1, TrackKind.THREAD, "MainThread", 10, 10)}, spans)
    types = types_of(run)
    assert (types["Conv"].flops, types["Module"].flops) == (CALLS * MM_FLOPS, 0)
    assert types["Module"].self_ns == 0


def test_json_types_are_the_tables() -> None:
    a = analyze(nested_run(), CPU)
    data = build_report(nested_run(), a)
    want = [(t.type, t.calls, t.total_ns, t.self_ns, t.flops, t.bytes, t.verdict.bound.value if t.verdict else None) for t in a.types]
    got = [(x["type"], x["calls"], x["total_ns"], x["self_ns"], x["flops"], x["bytes"], x["verdict"]) for x in data["types"]]
    assert got == want
    assert [x["type"] for x in data["types"]][:1] == ["Linear"]


def test_a_traced_cnns_type_rows_add_up_to_its_flops(tmp_path: Path) -> None:
    """A Conv-BatchNorm-ReLU CNN, traced: the ops of its AdaptiveAvgPool2d count no FLOPs, so
    the pool's work is its formula's (1 per input element) while its parent's came from the
    parent's ops alone; the type rows then summed one pool's work a call above the model's.
    A call's work is now its own ops' and its child layers' (each on its own basis)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    from torch import nn

    import mltrace

    class Block(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.conv, self.bn, self.act = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()

        def forward(self, x: Any) -> Any:
            return F.relu(self.act(self.bn(self.conv(x))) + x)

    torch.manual_seed(0)
    stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
    net = nn.Sequential(stem, Block(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).eval()
    with torch.no_grad(), mltrace.profile(output=tmp_path / "run", summary=False, level="op"):
        for _ in range(CALLS):
            net(torch.randn(2, 3, 16, 16))
    a = analyze(mltrace.load_run(tmp_path / "run"), CPU)
    (model,) = [r for r in a.layers if r.stat.level == M]
    pool = next(r for r in a.layers if r.stat.type == "AdaptiveAvgPool2d")
    assert pool.work_source == "formula" and pool.flops == CALLS * 2 * 8 * 16 * 16
    types = {t.type: t for t in a.types}
    assert {"Conv2d", "BatchNorm2d", "ReLU", "AdaptiveAvgPool2d", "Block"} <= set(types)
    assert sum(t.flops for t in types.values()) == pytest.approx(model.flops, rel=1e-12)
    assert types["Block"].flops == CALLS * 2 * (2 * 8 * 16 * 16)  # its residual add and F.relu
