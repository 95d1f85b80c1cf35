"""torch's own record_function ranges (``run/ranges.py``) are not counted as the program's user
spans: the ops inside them stay out of the name tables, the user level counts the program's
spans alone, and the DataLoader's batches between model calls are the idle time in which the
model waited for its input."""

from __future__ import annotations

from pathlib import Path

import pytest

import mltrace
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.peaks import Peaks, PeakSet
from mltrace.analysis.report_data import build_report
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.ranges import DATALOADER, torch_range_kind
from mltrace.run.store import Run, load_run

CPU = PeakSet(Peaks("cpu", "test CPU", 100e9, 10e9, "assumed"))
M, L, OP, U = Level.MODEL, Level.LAYER, Level.OP, Level.USER
BATCH = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"


def test_torchs_range_names_and_the_programs() -> None:
    assert torch_range_kind(BATCH) == DATALOADER
    assert torch_range_kind("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__") == DATALOADER
    assert torch_range_kind("Optimizer.step#SGD.step") == "optimizer"
    assert torch_range_kind("ProfilerStep#3") == "profiler step"
    assert torch_range_kind("Torch-Compiled Region: 0/0") == "torch.compile"
    for collective in ("gloo:all_reduce", "gloo:barrier", "nccl:all_gather", "nccl:_allgather_base"):
        assert torch_range_kind(collective) == "collectives"  # a DDP run's report had them as 108 ms of user spans
    for mine in ("preprocess", "DataLoader", "enumerate", "my ProfilerStep#1", "", "my gloo:step"):
        assert torch_range_kind(mine) is None


def test_torch_compiles_metadata_ranges_are_torchs() -> None:
    """TorchDynamo's compile events attach their metadata in empty ranges of their own."""
    for name in ("dynamo_data: compile_id=0/0", "entire_frame_compile_data: fn_name=_compile.compile_inner, compile_id=0/1"):
        assert torch_range_kind(name) == "torch.compile"
    for mine in ("load_data: batch=3", "my data_data: compile_id=1", "train_data: compile_id", "_data: compile_id=0/0"):
        assert torch_range_kind(mine) is None


COMPILED = """
import torch
from torch import nn

model = torch.compile(nn.Linear(8, 8).eval(), backend="eager")
with torch.no_grad():
    for _ in range(3):
        model(torch.randn(2, 8))
"""


def test_a_compiled_model_adds_no_user_spans_to_the_report(tmp_path: Path) -> None:
    """A program that opens no range of its own has no user spans in its report: the ranges
    torch.compile opens while it compiles (its regions, its compile events' metadata) are
    torch's."""
    import json

    from conftest import run_cli

    pytest.importorskip("torch._dynamo")
    (tmp_path / "prog.py").write_text(COMPILED)
    res = run_cli("python", "-q", "--level", "op", "-o", str(tmp_path / "run"), "prog.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr.decode()
    names = {s.name for s in load_run(tmp_path / "run").spans if s.level == Level.USER}
    assert any("_data: " in n and "compile_id=" in n for n in names)  # torch opened some
    report = run_cli("report", str(tmp_path / "run"), "--format", "json", "--include-cold", cwd=tmp_path)
    levels = {lv["level"] for lv in json.loads(report.stdout)["run"]["levels"]}
    assert "user" not in levels and "model" in levels


def _run() -> Run:
    """Two model calls (0–1000, 3000–4000); between them a DataLoader batch (1200–2800) whose
    collate the program wraps in a span of its own (1250–2750) around an op, after an op of
    torch's own (1210–1240); a span of the
    program's (4200–4600) with an op; an optimizer step (4700–4900) with an op."""
    return Run(
        path=Path("hand-made"),
        meta={"name": "hand-made", "complete": True},
        tracks={1: Track(1, TrackKind.THREAD, "MainThread", 10, 10)},
        spans=[
            Span(1, None, M, "Net", 0, 1000, 1, {"ml.layer.type": "Net"}),
            Span(2, 1, OP, "aten::linear", 100, 900, 1, {}),
            Span(3, None, U, BATCH, 1200, 2800, 1, {"torch.range": DATALOADER}),
            Span(12, 3, OP, "aten::empty", 1210, 1240, 1, {}),
            Span(11, 3, U, "my_collate", 1250, 2750, 1, {}),
            Span(4, 11, OP, "aten::stack", 1300, 2700, 1, {}),
            Span(5, None, M, "Net", 3000, 4000, 1, {"ml.layer.type": "Net"}),
            Span(6, 5, OP, "aten::linear", 3100, 3900, 1, {}),
            Span(7, None, U, "preprocess", 4200, 4600, 1, {}),
            Span(8, 7, OP, "aten::div", 4300, 4500, 1, {}),
            Span(9, None, U, "Optimizer.step#SGD.step", 4700, 4900, 1, {"torch.range": "optimizer"}),
            Span(10, 9, OP, "aten::add_", 4750, 4850, 1, {}),
        ],
    )


def test_torchs_ranges_are_counted_apart_and_their_ops_left_out() -> None:
    a = analyze(_run(), CPU)
    assert a.torch_ranges == {DATALOADER: (1, 1600), "optimizer": (1, 200)}
    assert a.torch_ranges_text() == (
        "torch's own record_function ranges, not counted as user spans: DataLoader batches 1 (1.6 µs), optimizer steps 1 (200 ns)"
    )
    levels = {lt.level: (lt.spans, lt.time_ns) for lt in a.breakdown.levels}
    assert levels[U] == (2, 1500 + 400)  # the program's spans alone, the one inside torch's range too
    assert {r.name for r in a.ops} == {"aten::linear", "aten::div", "aten::stack"}  # the program's span holds the stack
    assert a.level_ns_in_scope[OP] == 800 + 800 + 1400 + 200
    assert a.unscoped_ops == (2, 30 + 100) and a.unscoped_ops_loading == 1
    assert "; 1 of them in DataLoader batches" in a.unscoped_text()


def test_the_dataloaders_batches_between_model_calls_are_waiting_for_input() -> None:
    idle = analyze(_run(), CPU).findings.idle[0]
    assert (idle.window_ns, idle.busy_ns, idle.idle_ns, idle.loading_ns) == (4000, 2000, 2000, 1600)
    assert idle.spent_text() == "; 1.6 µs of it (80%) in DataLoader batches: the model waits for its input"
    run = _run()
    (entry,) = [f for f in build_report(run, analyze(run, CPU))["findings"] if f["kind"] == "idle"]
    assert entry["loading_ns"] == 1600 and idle.spent_text() in entry["text"]


def test_without_torchs_ranges_nothing_changes() -> None:
    run = _run()
    run.spans = [s for s in run.spans if s.id in (1, 2, 5, 6, 7, 8)]
    a = analyze(run, CPU)
    assert a.torch_ranges == {} and a.torch_ranges_text() == "" and a.unscoped_ops_loading == 0
    assert a.findings.idle[0].loading_ns == 0 and a.findings.idle[0].spent_text() == ""


def test_a_traced_dataloader_loop(tmp_path: Path) -> None:
    """Live: torch.profiler's DataLoader ranges carry ``torch.range``; the program's own
    ``record_function`` range stays a user span; the report says the model waited for input."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(64, 16))
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()).eval()
    with torch.inference_mode(), mltrace.profile(level="op", output=tmp_path / "run", summary=False):
        for (x,) in DataLoader(data, batch_size=8):
            with torch.profiler.record_function("preprocess"):
                x = x * 2
            model(x)
    run = load_run(tmp_path / "run")
    batches = [s for s in run.spans if s.name.startswith("enumerate(DataLoader)#")]
    assert len(batches) == 9 and all(s.attrs["torch.range"] == DATALOADER for s in batches)  # the 9th ends the loop
    (mine,) = {s.attrs.get("torch.range") for s in run.spans if s.name == "preprocess"}
    assert mine is None
    a = analyze(run, CPU, include_cold=False)
    assert a.torch_ranges[DATALOADER][0] == 9
    assert {lt.level: lt.spans for lt in a.breakdown.levels}[U] == 8  # "preprocess" alone
    assert "aten::stack" not in {r.name for r in a.ops} and "aten::mul" in {r.name for r in a.ops}
    idle = a.findings.idle[0]
    assert 0 < idle.loading_ns <= idle.idle_ns


def test_ops_outside_model_calls_in_the_idle_time_are_the_programs_own_work() -> None:
    """An op of the program's own between two model calls, outside torch's DataLoader batch
    (a training step's backward, pre-processing): counted apart from the loading, of what is
    left; one inside the batch counts as loading only, one after the last call not at all."""
    run = _run()
    run.spans.append(Span(13, None, OP, "aten::mul", 2850, 2950, 1, {}))
    run.spans.append(Span(14, None, OP, "aten::mul", 1500, 1600, 1, {}))  # inside the batch's time
    idle = analyze(run, CPU).findings.idle[0]
    assert (idle.idle_ns, idle.loading_ns, idle.ops_ns) == (2000, 1600, 100)
    assert idle.spent_text() == (
        "; 1.6 µs of it (80%) in DataLoader batches: the model waits for its input; 100 ns of it (5%) in ops outside "
        "model calls (the program's own tensor code: backward, optimizer, pre- and post-processing)"
    )


def test_torchs_ranges_after_the_op_level_ended_early_are_said_to_be_partial() -> None:
    """torch.profiler records torch's ranges: where the op level ended before the run did, the
    line says over which model calls they were counted."""
    run = _run()
    run.meta["op_window"] = {"ended_ns": 2900, "ended_after_model_calls": 1}
    text = analyze(run, CPU).torch_ranges_text()
    assert text.endswith(" (recorded while the op level ran: the first 1 of 2 model calls)"), text
