"""Levels ending early (tracer/windows.py), between two model calls: the op level after
--op-inferences model calls or past the memory budget (the model and layer levels go on), and
the layer level once --max-spans spans were streamed (the model level goes on)."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest

import mltrace
from conftest import SCRIPTS, run_cli, run_plain
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.coldstart import find_cold_start
from mltrace.analysis.summary import summarize
from mltrace.config import ProfileOptions
from mltrace.errors import UsageError
from mltrace.run.events import Event, Span
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.tracer.memwatch import SPAN_LIMIT_MAX, SPAN_LIMIT_MIN, default_span_limit
from mltrace.tracer.session import Session, active_session
from mltrace.tracer.sources.base import Source
from support.reference_breakdown import breakdown


class _EndableOps(Source):
    """An op-level source that can end early, as torch.profiler (without CUDA) can."""

    name = "endable.ops"
    levels = (Level.OP,)
    can_end_early = True
    profiling = True

    def __init__(self, thread_ident: int | None) -> None:
        self.thread_ident = thread_ident
        self.ended = 0
        self.stopped = 0
        self.after_start: list[object] = []

    @property
    def recording_ops(self) -> bool:
        return self.profiling  # as a real profiler's: its ops are recorded while it runs

    def around_profiler_start(self, before: object, after: object) -> None:
        self.after_start.append(after)

    def available(self) -> str | None:
        return None

    def start(self, session: Session) -> None:
        pass

    def end_early(self) -> None:
        self.ended += 1

    def stop(self) -> list[Event]:
        self.stopped += 1
        return []


def _session(tmp_path: Path, source: _EndableOps, **options: object) -> Session:
    opts = ProfileOptions.build(output=tmp_path / "run", summary=False, flush_interval_s=60, **options)
    return Session(opts, sources=[source]).start()


def test_the_op_level_ends_after_the_given_model_calls_and_stops_once(tmp_path: Path) -> None:
    source = _EndableOps(threading.get_ident())
    session = _session(tmp_path, source, op_inferences=2)
    try:
        window = session.op_windows.get(None)
        assert window is not None
        window.model_ended()
        assert source.ended == 0
        window.model_ended()
        assert source.ended == 1 and window.ended_ns is not None
        window.model_ended()  # later calls change nothing
        assert source.ended == 1 and window.calls == 2
    finally:
        run_dir = session.stop()
    assert source.stopped == 1  # its events are converted at the session's end, as usual
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["op_window"]["ended_after_model_calls"] == 2
    assert meta["op_window"]["reason"] == "--op-inferences 2"
    assert meta["op_window"]["sources"] == ["endable.ops"]
    assert any("ended after 2 model calls (--op-inferences 2)" in x for x in meta["limitations"])


class _SlowEndingOps(_EndableOps):
    """Its early end takes a while (torch.profiler's stop and export of what it held: seconds
    on a server's run); says whether an end was still under way when the session stopped it."""

    def __init__(self) -> None:
        super().__init__(None)  # the all-threads profiler: any thread ends it
        self.entered = threading.Event()
        self.release = threading.Event()
        self.ending = False
        self.stopped_while_ending: bool | None = None

    def end_early(self) -> None:
        self.ending = True
        self.entered.set()
        self.release.wait(10)
        self.ended += 1
        self.ending = False

    def stop(self) -> list[Event]:
        self.stopped_while_ending = self.ending
        return super().stop()


def test_the_stop_waits_for_an_op_level_end_under_way_on_another_thread(tmp_path: Path) -> None:
    """A server's request thread ends the op level (memory budget) and SIGTERM stops the session
    on the main thread meanwhile: the sources stop once the end has handed over their events,
    not while it writes them (the ops of a whole run were lost, 'write to closed file')."""
    source = _SlowEndingOps()
    session = _session(tmp_path, source, op_inferences=1)
    window = session.op_windows.get(None)
    assert window is not None
    request = threading.Thread(target=window.model_ended)
    request.start()
    assert source.entered.wait(10)
    timer = threading.Timer(2.0, source.release.set)  # the end is still writing as the stop begins
    timer.start()
    try:
        run_dir = session.stop()
    finally:
        source.release.set()
        timer.cancel()
        request.join(10)
    assert source.ended == 1 and source.stopped == 1
    assert source.stopped_while_ending is False
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["op_window"]["ended_after_model_calls"] == 1 and meta["errors"] == []


def test_only_the_thread_that_started_the_profiler_ends_it(tmp_path: Path) -> None:
    source = _EndableOps(thread_ident=-1)  # some other thread
    session = _session(tmp_path, source, op_inferences=1)
    try:
        assert session.op_windows.get(None) is not None
        session.op_windows.get(None).model_ended()
        assert source.ended == 0
    finally:
        run_dir = session.stop()
    meta = json.loads((run_dir / "run.json").read_text())
    assert "ended_ns" not in meta["op_window"]
    assert any("was to end (--op-inferences 1)" in x and "ran to the end" in x for x in meta["limitations"])


@pytest.mark.parametrize("owner", ["any", "other"])
def test_a_full_trace_ends_the_op_level_without_waiting_for_a_model_call(tmp_path: Path, owner: str) -> None:
    """Model calls on threads whose wrappers the fill takes out return no more: the fill ends
    the op level itself, on its own thread, unless only the profiler's thread may."""
    source = _EndableOps(None if owner == "any" else -1)
    session = _session(tmp_path, source, max_spans=10)
    try:
        assert session.op_windows.get(None) is not None
        session.op_windows.get(None).model_ended()  # one model call, no end asked for yet
        session.fill(20)
        assert session.full and source.ended == (1 if owner == "any" else 0)
        session.op_windows.get(None).model_ended()  # a later return changes nothing
        assert source.ended == (1 if owner == "any" else 0)
    finally:
        run_dir = session.stop()
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["trace_full"]["spans"] == 20
    if owner == "any":
        assert meta["op_window"]["reason"] == "the trace is full"
        assert meta["op_window"]["ended_after_model_calls"] == 1 and meta["op_window"]["sources"] == ["endable.ops"]
    else:
        assert "ended_ns" not in meta["op_window"]
        assert any("was to end (the trace is full)" in x and "on the thread that started torch.profiler" in x for x in meta["limitations"])


def test_growth_past_the_memory_budget_ends_the_op_level_at_the_next_model_call(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _EndableOps(threading.get_ident())
    session = _session(tmp_path, source, op_memory_gib=1e-6)  # about 1 KB
    try:
        assert session.op_windows.get(None) is not None
        for hook in source.after_start:  # what torch.profiler's start does: the budget counts from here
            hook()  # type: ignore[operator]
        held = bytearray(64 << 20)  # the process grows by 64 MB
        held[::4096] = b"x" * len(held[::4096])
        session.flush()
        assert source.ended == 0  # not in the middle of a model call
        assert session.op_windows.get(None).reason == "memory budget"
        session.op_windows.get(None).model_ended()
        assert source.ended == 1
        del held
    finally:
        run_dir = session.stop()
    err = capsys.readouterr().err
    assert "past the op level's memory budget" in err and "model and layer spans go on" in err
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["op_window"]["reason"] == "memory budget" and meta["op_window"]["ended_after_model_calls"] == 1


def test_bad_values_are_usage_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (0, -3, "x", 2.5, True):
        with pytest.raises(UsageError, match="op-inferences"):
            ProfileOptions.build(op_inferences=bad)
    for bad_gib in ("abc", "0", "-1"):
        monkeypatch.setenv("MLTRACE_OP_MEMORY_GIB", bad_gib)
        with pytest.raises(UsageError, match="MLTRACE_OP_MEMORY_GIB"):
            ProfileOptions.build()
    monkeypatch.setenv("MLTRACE_OP_MEMORY_GIB", "0.5")
    monkeypatch.setenv("MLTRACE_OP_INFERENCES", "7")
    opts = ProfileOptions.build()
    assert opts.op_memory_gib == 0.5 and opts.op_inferences == 7


def test_cli_refuses_a_bad_count_without_creating_the_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = run_cli("python", "--op-inferences", "0", "-o", str(out), str(SCRIPTS / "echo_env.py"))
    assert done.returncode == 2 and b"Traceback" not in done.stderr
    assert done.stderr.decode().strip() == "mltrace: error: --op-inferences must be at least 1"
    assert not out.exists()


def test_a_count_without_an_op_level_to_end_is_said_on_stderr_and_in_run_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _EndableOps(threading.get_ident())
    session = _session(tmp_path, source, op_inferences=4, level=Level.LAYER)
    try:
        assert not session.op_windows
    finally:
        run_dir = session.stop()
    text = "--op-inferences 4 has no effect: the op level is not recorded"
    assert f"mltrace: warning: {text}" in capsys.readouterr().err.splitlines()
    assert text in json.loads((run_dir / "run.json").read_text())["limitations"]


def _run_with_op_window(tmp_path: Path, script: str, level: str, ops_for: int, calls: int) -> tuple[Run, dict[str, Any]]:
    """Runs a test script under ``mltrace python --level LEVEL --op-inferences OPS_FOR`` as a
    user does (its stdout as in a plain run; stderr says the op level ended); the run and its
    run.json ``op_window``."""
    path = SCRIPTS / script
    plain = run_plain(path, str(calls))
    option = ["--op-inferences", str(ops_for)]
    traced = run_cli("python", "--level", level, *option, "-o", str(tmp_path / "run"), str(path), str(calls))
    assert traced.returncode == 0, traced.stderr.decode()
    assert traced.stdout == plain.stdout
    assert f"ended after {ops_for} model calls (--op-inferences {ops_for};" in traced.stderr.decode()
    run = mltrace.load_run(tmp_path / "run")
    return run, run.meta["op_window"]


def test_live_ops_stop_after_three_inferences_and_layers_go_on(tmp_path: Path) -> None:
    run, window = _run_with_op_window(tmp_path, "repeated_inference.py", "library", 3, 6)
    assert window["ended_after_model_calls"] == 3 and set(window["sources"]) == {"torch.profiler", "cpu.library"}
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert len(models) == 6
    ended = window["ended_ns"]
    assert models[2].end_ns <= ended <= models[3].start_ns
    by_id = run.span_by_id()

    def model_of(span_id: int | None) -> int | None:
        while span_id is not None:
            span = by_id[span_id]
            if span.level == Level.MODEL:
                return span.id
            span_id = span.parent_id
        return None

    # Layers in every call; ops and library calls only in the first three.
    layers_per_model: dict[int | None, int] = {}
    for s in run.spans:
        if s.level == Level.LAYER:
            layers_per_model[model_of(s.parent_id)] = layers_per_model.get(model_of(s.parent_id), 0) + 1
    assert [layers_per_model.get(m.id, 0) for m in models] == [layers_per_model[models[0].id]] * 6
    deep = [s for s in run.spans if s.level in (Level.OP, Level.LIBRARY)]
    assert all(s.start_ns < ended for s in deep)
    in_models = {model_of(s.parent_id) for s in deep} - {None}
    assert in_models == {m.id for m in models[:3]}
    assert {s.level for s in deep} == {Level.OP, Level.LIBRARY}
    # The report counts framework overhead over the calls that have ops.
    analysis = analyze(run)
    assert analysis.findings.framework_base_ns == sum(m.end_ns - m.start_ns for m in models[:3])
    assert any("ops were recorded in 3 of 6 model calls" in n for n in analysis.findings.notes)
    # Op and library shares are of those calls; layer shares of all six (both analyses agree).
    for b in (analysis.breakdown, breakdown(run)):
        assert b.base_ns(Level.OP) == b.base_ns(Level.LIBRARY) == sum(m.duration_ns for m in models[:3])
        assert b.calls_for(Level.OP) == 3 and b.calls_for(Level.LAYER) == 6 and b.base_ns(Level.LAYER) == b.model_ns
    # A convolution's work basis is its ops', as in the calls that had them.
    convs = [r for r in analysis.layers if r.stat.type == "Conv2d"]
    assert convs and {r.work_source for r in convs} == {"ops"}


def test_model_calls_only_on_a_worker_thread_end_the_op_level(tmp_path: Path) -> None:
    """torch.profiler (all threads) started on the main thread stops from the worker whose
    model call ended the window: a server's request threads bound the op level too."""
    run, window = _run_with_op_window(tmp_path, "worker_inference.py", "op", 2, 5)
    assert window["ended_after_model_calls"] == 2 and window["sources"] == ["torch.profiler"]
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert len(models) == 5 and len({m.track_id for m in models}) == 1
    assert run.tracks[models[0].track_id].tid != run.meta["pid"]  # the calls ran on the worker, not the main thread
    assert models[1].end_ns <= window["ended_ns"] <= models[2].start_ns
    ops = [s for s in run.spans if s.level == Level.OP]
    assert ops and all(s.end_ns <= window["ended_ns"] for s in ops)
    assert sum(1 for s in ops if models[0].start_ns <= s.start_ns and s.end_ns <= models[0].end_ns) > 10


class _FrameworkOps(_EndableOps):
    """An op source of one framework (``framework``), or shared (the library level) without."""

    def __init__(self, name: str, framework: str | None) -> None:
        super().__init__(None)
        self.name = name  # type: ignore[misc]
        if framework is not None:
            self.framework = framework


def _framework_session(tmp_path: Path, **options: object) -> tuple[Session, dict[str, _FrameworkOps]]:
    sources = {"a": _FrameworkOps("a.ops", "fa"), "b": _FrameworkOps("b.ops", "fb"), "lib": _FrameworkOps("lib", None)}
    opts = ProfileOptions.build(output=tmp_path / "run", summary=False, flush_interval_s=60, **options)
    return Session(opts, sources=list(sources.values())).start(), sources


def test_framework_windows_hold_the_shared_sources_until_the_last_framework_with_calls_ends(tmp_path: Path) -> None:
    session, src = _framework_session(tmp_path, op_inferences=2)
    try:
        assert set(session.op_windows) == {"fa", "fb"}
        session.model_call_ended("fb")
        session.model_call_ended("fa")
        session.model_call_ended("other")  # a framework without an op window counts nowhere
        assert [s.ended for s in src.values()] == [0, 0, 0]
        session.model_call_ended("fa")  # fa's second: fa ends; fb has made calls, so lib goes on
        assert [s.ended for s in src.values()] == [1, 0, 0]
        session.model_call_ended("fa")
        session.model_call_ended("fb")  # fb's second: fb ends, and lib with it
        assert [s.ended for s in src.values()] == [1, 1, 1]
    finally:
        session.stop()
    window = json.loads((tmp_path / "run" / "run.json").read_text())["op_window"]
    fa, fb = window["frameworks"]["fa"], window["frameworks"]["fb"]
    assert fa["ended_after_model_calls"] == fb["ended_after_model_calls"] == 2
    assert fa["sources"] == ["a.ops"] and fb["sources"] == ["lib", "b.ops"]
    assert fa["ended_ns"] < fb["ended_ns"] == window["ended_ns"]
    assert sorted(window["sources"]) == ["a.ops", "b.ops", "lib"]


def test_a_framework_without_model_calls_does_not_hold_the_shared_sources(tmp_path: Path) -> None:
    session, src = _framework_session(tmp_path, op_inferences=2)
    try:
        session.model_call_ended("fa")
        session.model_call_ended("fa")
        assert [s.ended for s in src.values()] == [1, 0, 1]  # fb made no calls: lib ends with fa
        session.model_call_ended("fb")
        session.model_call_ended("fb")  # fb's own window still counts its calls
        assert [s.ended for s in src.values()] == [1, 1, 1]
    finally:
        session.stop()
    assert all(s.stopped == 1 for s in src.values())


def test_the_memory_budget_ends_every_framework_at_the_next_model_call(tmp_path: Path) -> None:
    session, src = _framework_session(tmp_path, op_inferences=50)
    try:
        session.model_call_ended("fa")
        session._end_whole_op_level("memory budget")
        session.model_call_ended("other")  # any framework's return ends the whole op level
        assert [s.ended for s in src.values()] == [1, 1, 1]
        session.model_call_ended("fa")
        assert [s.ended for s in src.values()] == [1, 1, 1]  # once
    finally:
        session.stop()
    window = json.loads((tmp_path / "run" / "run.json").read_text())["op_window"]
    assert {e["reason"] for e in window["frameworks"].values()} == {"memory budget"}


def test_an_end_asked_for_without_a_model_call_after_it_is_noted_for_the_frameworks_that_recorded(tmp_path: Path) -> None:
    session, src = _framework_session(tmp_path, op_inferences=50)
    src["b"].profiling = False  # a framework the program never imported
    try:
        session._end_whole_op_level("memory budget")
    finally:
        session.stop()
    notes = json.loads((tmp_path / "run" / "run.json").read_text())["limitations"]
    ran_on = [n for n in notes if "was to end (memory budget) but no model call returned afterwards" in n]
    assert len(ran_on) == 1 and ran_on[0].startswith("the op level of fa was to end")


def test_each_framework_ends_its_op_level_after_its_own_model_calls(tmp_path: Path) -> None:
    """A program that calls a torch model, exports it and runs it with ONNX Runtime: with
    --op-inferences 2, torch's op level ends after two torch calls and ONNX Runtime's after
    two runs of its own, not after the torch calls that came first."""
    pytest.importorskip("onnxruntime")
    path = SCRIPTS / "torch_then_ort.py"
    plain = run_plain(path, "4")
    traced = run_cli("python", "--level", "op", "--op-inferences", "2", "-o", str(tmp_path / "run"), str(path), "4")
    assert traced.returncode == 0, traced.stderr.decode()
    assert traced.stdout == plain.stdout
    run = mltrace.load_run(tmp_path / "run")
    frameworks = run.meta["op_window"]["frameworks"]
    assert set(frameworks) == {"pytorch", "onnxruntime"}
    assert frameworks["pytorch"]["ended_after_model_calls"] == frameworks["onnxruntime"]["ended_after_model_calls"] == 2
    assert frameworks["pytorch"]["sources"] == ["torch.profiler"] and frameworks["onnxruntime"]["sources"] == ["onnxruntime"]
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    torch_calls = [m for m in models if m.attrs.get("ml.framework") == "pytorch"]
    ort_calls = [m for m in models if m.attrs.get("ml.framework") == "onnxruntime"]
    # The export traces the model once more: a fifth torch model call.
    assert len(torch_calls) == 5 and len(ort_calls) == 4 and torch_calls[-1].end_ns < ort_calls[0].start_ns
    torch_end, ort_end = frameworks["pytorch"]["ended_ns"], frameworks["onnxruntime"]["ended_ns"]
    assert torch_calls[1].end_ns <= torch_end <= torch_calls[2].start_ns
    assert ort_calls[1].end_ns <= ort_end <= ort_calls[2].start_ns
    # Ops in the first two calls of each framework, none in the others.
    ops = [s for s in run.spans if s.level == Level.OP]
    with_ops = [m for m in models if any(m.start_ns <= o.start_ns and o.end_ns <= m.end_ns for o in ops)]
    assert with_ops == torch_calls[:2] + ort_calls[:2]
    # The analyses count each call against its own framework's end.
    analysis = analyze(run)
    assert any("ops were recorded in 4 of 9 model calls (onnxruntime: 2 of 4, pytorch: 2 of 5)" in n for n in analysis.findings.notes)
    for b in (analysis.breakdown, breakdown(run)):
        assert b.calls_for(Level.OP) == 4
        assert b.base_ns(Level.OP) == sum(m.duration_ns for m in with_ops)
    assert "of its model calls (--op-inferences 2" in traced.stderr.decode()
    # The exporter's traced call sees sizes as 0-dim tensors: its layers still get int shapes.
    traced_layers = [s for s in run.spans if s.level == Level.LAYER and torch_calls[4].start_ns <= s.start_ns <= torch_calls[4].end_ns]
    assert traced_layers and all(type(d) is int for s in traced_layers for shape in s.attrs["ml.input.shapes"] for d in shape)


# -- the layer level's end (--max-spans) ------------------------------------------------


def _models_and_layers(run: Run) -> tuple[list[int], list[int]]:
    """Model span ids in time order, and the number of layer spans under each."""
    by_id = run.span_by_id()
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    count = dict.fromkeys((m.id for m in models), 0)
    for s in run.spans:
        if s.level != Level.LAYER:
            continue
        p = s.parent_id
        while p is not None and by_id[p].level != Level.MODEL:
            p = by_id[p].parent_id
        assert p is not None, f"layer span {s.name} outside every model span"
        count[p] += 1
    return [m.id for m in models], [count[m.id] for m in models]


@pytest.mark.parametrize("hot_path", ["c", "python"])
def test_the_layer_level_ends_at_the_model_call_after_the_span_limit(
    tmp_path: Path, hot_path: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    try:
        from models import resnet_small
    finally:
        sys.path.pop(0)
    monkeypatch.setenv("MLTRACE_LAYER_HOT_PATH", hot_path)
    torch.manual_seed(0)
    cnn = resnet_small().eval()
    x = torch.randn(1, 3, 32, 32)
    original = torch.nn.Module.__call__
    with torch.inference_mode():
        with mltrace.profile(level="layer", output=tmp_path / "run", max_spans=60, flush_interval_s=60, summary=True):
            session = active_session()
            assert session is not None and session.layer_window is not None and session.span_limit == 60
            assert session.meta["sources"]["torch.modules"]["layer_hot_path"].startswith(hot_path)
            cnn(x)  # one call's layer spans (more than 60) reach the limit: the level ends at its return
            assert session.layer_window.reason is not None and session.layer_window.ended_ns is not None
            assert torch.nn.Module.__call__ is not original
            for _ in range(4):
                cnn(x)
            session.flush()
    assert torch.nn.Module.__call__ is original
    err = capsys.readouterr().err
    said = re.search(r"the layer level ended after 1 model call \(([\d,]+) spans recorded, --max-spans 60\); model spans go on", err)
    assert said is not None, err
    run = mltrace.load_run(tmp_path / "run")
    window = run.meta["layer_window"]
    assert run.meta["max_spans"] == 60 and window["ended_after_model_calls"] == 1
    assert window["sources"] == ["torch.modules"] and window["reason"] == f"{said[1]} spans recorded, --max-spans 60"
    assert any("the layer level ended after 1 model call" in x for x in run.meta["limitations"])
    models, layers = _models_and_layers(run)
    assert len(models) == 5
    assert layers[0] > 60 and layers == [layers[0], 0, 0, 0, 0]
    assert int(said[1].replace(",", "")) == layers[0] + 1  # before any flush: the call's layer frames and its model span
    # Layer shares are of the call that has layers, in both analyses.
    by_id = run.span_by_id()
    two = by_id[models[0]].duration_ns
    analysis = analyze(run)
    # The model row's self time is its time outside layers in that call only.
    top_layers = [s for s in run.spans if s.level == Level.LAYER and by_id[s.parent_id].level == Level.MODEL]
    model_self = two - sum(s.duration_ns for s in top_layers)
    for b in (analysis.breakdown, breakdown(run)):
        assert b.model_calls == 5 and b.layer_model_calls == 1 and b.layer_model_ns == two
        assert b.base_ns(Level.LAYER) == two and b.base_ns(Level.MODEL) == b.model_ns > two
        (model_row,) = [x for x in b.layers if x.level == Level.MODEL]
        assert model_row.calls == 5 and model_row.total_ns == b.model_ns and model_row.self_ns == model_self
    assert any("layers were recorded in 1 of 5 model calls" in n for n in analysis.findings.notes)
    # The summary counts the steady calls: the one call with layers, unless it was judged cold.
    (calls,) = find_cold_start(run).models
    assert run.meta["summary"]["layer_model_time_ns"] == (0 if 0 in calls.cold else two)
    assert summarize(run, include_cold=True)["layer_model_time_ns"] == two


def test_the_default_span_limit_follows_available_memory() -> None:
    assert default_span_limit(None) == SPAN_LIMIT_MAX
    assert default_span_limit(1 << 30) == 107_374  # 10 % of 1 GiB at 1000 bytes a span
    assert default_span_limit(512 << 20) == SPAN_LIMIT_MIN  # 53,687 fit: at least 100,000
    assert default_span_limit(8 << 30) == 858_993  # 10 % of 8 GiB at 1000 bytes a span
    assert default_span_limit(1 << 40) == SPAN_LIMIT_MAX


def test_max_spans_values(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for bad in (-1, "x", 2.5, True):
        with pytest.raises(UsageError, match="max-spans"):
            ProfileOptions.build(max_spans=bad)
    monkeypatch.setenv("MLTRACE_MAX_SPANS", "1234")
    assert ProfileOptions.build().max_spans == 1234
    assert ProfileOptions.build(max_spans=0).max_spans == 0
    out = tmp_path / "run"
    done = run_cli("python", "--max-spans", "lots", "-o", str(out), str(SCRIPTS / "echo_env.py"))
    assert done.returncode == 2 and b"Traceback" not in done.stderr
    assert done.stderr.decode().strip() == "mltrace: error: --max-spans takes a whole number of spans (0: no limit), not 'lots'"
    assert not out.exists()


class _Layers(Source):
    """A layer-level source that cannot end early: its spans only count."""

    name = "plain.layers"
    levels = (Level.LAYER,)

    def __init__(self, spans: int) -> None:
        self.spans = spans
        self.recorded = 0

    def available(self) -> str | None:
        return None

    def start(self, session: Session) -> None:
        self.record(session, self.spans)

    def record(self, session: Session, n: int) -> None:
        for _ in range(n):
            session.recorder.end(session.recorder.begin(f"layer{self.recorded}", Level.LAYER))
            self.recorded += 1

    def stop(self) -> list[Event]:
        return []


def test_a_layer_level_that_cannot_end_warns_at_the_limit_and_fills_at_twice_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    opts = ProfileOptions.build(output=tmp_path / "run", summary=False, flush_interval_s=60, max_spans=4)
    source = _Layers(5)
    session = Session(opts, sources=[source]).start()
    try:
        assert session.layer_window is None
        session.flush()
        session.flush()
        assert not session.full
        source.record(session, 3)
        session.flush()  # 8 spans: full
        assert session.full
        with mltrace.span("after"):  # a no-op now
            pass
    finally:
        run_dir = session.stop()
    err = [line for line in capsys.readouterr().err.splitlines() if "spans recorded" in line]
    assert err == [
        "mltrace: warning: 5 spans recorded (--max-spans 4) and the layer level of plain.layers cannot end early: the "
        "end of the run loads every span (≈ 0.0 GiB so far); the trace is full at 8",
        "mltrace: warning: the trace is full (8 spans recorded, twice --max-spans 4): mltrace records nothing more, the program goes on",
    ]
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["max_spans"] == 4 and "layer_window" not in meta and meta["trace_full"]["spans"] == 8
    assert sum("--max-spans" in x for x in meta["limitations"]) == 3  # said at the start, at the limit, when full
    assert [s.name for s in mltrace.load_run(run_dir).spans] == [f"layer{i}" for i in range(8)]


def test_no_limit_and_a_model_level_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    opts = ProfileOptions.build(output=tmp_path / "a", summary=False, flush_interval_s=60, max_spans=0)
    source = _Layers(5)
    session = Session(opts, sources=[source]).start()
    try:
        source.record(session, 20)
        session.flush()
        assert not session.full
    finally:
        session.stop()
    assert "--max-spans" not in capsys.readouterr().err
    opts = ProfileOptions.build(output=tmp_path / "b", summary=False, level=Level.MODEL, max_spans=10)
    meta = json.loads((Session(opts, sources=[_Layers(5)]).start().stop() / "run.json").read_text())
    assert meta["max_spans"] == 10 and "layer_window" not in meta and not meta["limitations"]
    assert "--max-spans" not in capsys.readouterr().err  # (the fake source gives no model level: that is said)


def test_model_spans_alone_fill_the_trace_at_twice_the_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--level model in a long run: at 2 × --max-spans streamed spans mltrace puts torch's own
    Module.__call__ back and records nothing more; the program's results are unchanged."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    x = torch.randn(1, 4)
    expected = model(x)
    original = torch.nn.Module.__call__
    with mltrace.profile(level="model", output=tmp_path / "run", summary=False, max_spans=3, flush_interval_s=60):
        session = active_session()
        assert session is not None and session.layer_window is None
        for _ in range(6):
            model(x)
        session.flush()
        assert session.full and torch.nn.Module.__call__ is original
        with mltrace.span("after the trace filled"):
            assert torch.equal(model(x), expected)
    assert "the trace is full (6 spans recorded, twice --max-spans 3)" in capsys.readouterr().err
    run = mltrace.load_run(tmp_path / "run")
    assert [s.level for s in run.spans] == [Level.MODEL] * 6
    assert run.meta["trace_full"]["spans"] == 6 and not run.meta["limitations"][1:]


def test_live_layer_spans_end_and_model_spans_go_on(tmp_path: Path) -> None:
    """As a user runs it: the flusher counts the spans while the program runs."""
    script = SCRIPTS / "repeated_inference.py"
    plain = run_plain(script, "40")
    traced = run_cli(
        "python", "--level", "layer", "--max-spans", "1000", "--flush-interval", "0.01", "-o", str(tmp_path / "run"), str(script), "40"
    )
    assert traced.returncode == 0, traced.stderr.decode()
    assert traced.stdout == plain.stdout
    run = mltrace.load_run(tmp_path / "run")
    window = run.meta["layer_window"]
    k = window["ended_after_model_calls"]
    # 1000 spans take 13 calls (78 spans each) and twice that 26: the flusher, every 10 ms, checks in between
    assert 13 <= k < 40, window
    assert f"the layer level ended after {k} model calls" in traced.stderr.decode()
    models, layers = _models_and_layers(run)
    assert len(models) == 40
    assert layers == [layers[0]] * k + [0] * (40 - k)
    assert run.meta["complete"] is True


def test_the_ended_op_level_waits_in_the_run_directory_until_the_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without cycles (MLTRACE_OP_CYCLE_S=0), torch.profiler's exported trace sits in the run
    directory between the op level's end and the session's (so a killed process leaves it where
    ``mltrace import`` finds it), then goes."""
    import torch

    from mltrace.tracer.sources.torch_ops import EXPORT_FILE

    monkeypatch.setenv("MLTRACE_OP_CYCLE_S", "0")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8)
    run_dir = tmp_path / "run"
    with torch.inference_mode(), mltrace.profile(level="op", output=run_dir, op_inferences=1, summary=False):
        model(x)
        exported = run_dir / EXPORT_FILE
        assert exported.is_file() and json.loads(exported.read_text())["traceEvents"]
        model(x)
    assert not (run_dir / EXPORT_FILE).exists()
    run = mltrace.load_run(run_dir)
    assert run.meta["op_window"]["ended_after_model_calls"] == 1
    assert run.meta["torch_profiler"]["cycles"] == 1
    assert any(s.level == Level.OP and s.name == "aten::linear" for s in run.spans)


def _streamed_ops(run_dir: Path) -> list[Any]:
    """The op spans events.jsonl holds now (the run still going, or killed)."""
    from mltrace.run import store

    return [s for s in store.load_run(run_dir).spans if s.level == Level.OP]


def test_the_op_level_streams_in_cycles_while_the_program_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In cycles, each stopped cycle is converted on mltrace's thread and streamed while the
    program runs: the first model call's ops are in events.jsonl before the session stops, and
    no cycle's trace file is left behind; the finish nests every op under its layer."""
    import time

    import torch

    monkeypatch.setenv("MLTRACE_OP_CYCLE_S", "0.05")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8)
    run_dir = tmp_path / "run"
    with torch.inference_mode(), mltrace.profile(level="op", output=run_dir, summary=False, flush_interval_s=0.05):
        model(x)  # the first cycle ends at the first model call's return
        deadline = time.monotonic() + 60
        while not any(s.name == "aten::linear" for s in _streamed_ops(run_dir)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(s.name == "aten::linear" for s in _streamed_ops(run_dir))
        for _ in range(10):
            model(x)
            time.sleep(0.02)
    assert not list(run_dir.glob("torch-profiler*.json"))
    run = mltrace.load_run(run_dir)
    assert run.meta["torch_profiler"]["cycles"] > 2 and "op_window" not in run.meta or "ended_ns" not in run.meta["op_window"]
    by_id = run.span_by_id()
    linear = [s for s in run.spans if s.name == "aten::linear"]
    assert len(linear) == 11
    assert all(by_id[s.parent_id].level == Level.LAYER and by_id[s.parent_id].name == "0" for s in linear)
    assert run.meta["correlation"]["check_containment"]["outside_parent"] == 0


def test_a_cycle_waits_while_another_thread_has_a_span_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The all-threads profiler's stop drops the ops running on other threads at that moment, so
    a cycle does not end while another thread is inside a span (a request): every op of the
    request thread is kept, and cycles go on once it is done. (A span begun on another thread
    before the first switch keeps every cycle on all threads.)"""
    import threading
    import time

    import torch

    monkeypatch.setenv("MLTRACE_OP_CYCLE_S", "0.01")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8)
    started, done = threading.Event(), threading.Event()
    adds = 0

    def request() -> None:
        nonlocal adds
        with torch.inference_mode(), mltrace.span("request"):
            started.set()
            y = torch.zeros(64)
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                y = torch.add(y, 1)
                adds += 1
        done.set()

    def span_elsewhere() -> None:
        with mltrace.span("another thread"):
            pass

    with torch.inference_mode(), mltrace.profile(level="op", output=tmp_path / "run", summary=False):
        first = threading.Thread(target=span_elsewhere)
        first.start()
        first.join()
        model(x)
        worker = threading.Thread(target=request)
        worker.start()
        started.wait(10)
        calls_during = 0
        while not done.is_set():
            model(x)  # each return may end a cycle: none may while the request is open
            calls_during += 1
            time.sleep(0.002)
        worker.join()
        for _ in range(5):
            model(x)
            time.sleep(0.02)
    run = mltrace.load_run(tmp_path / "run")
    assert calls_during > 5
    assert run.meta["torch_profiler"]["cycles"] >= 2  # the first call's, and one after the request
    assert run.meta["torch_profiler"]["one_thread_cycles"] == 0
    assert len([s for s in run.spans if s.name == "aten::add"]) == adds


KILLED = """
import sys, time
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
x = torch.randn(2, 8)
calls = 0
with torch.inference_mode():
    t0 = time.monotonic()
    while True:
        model(x)
        calls += 1
        time.sleep(0.005)
        if calls == 60:
            print("ready", flush=True)
"""


def test_a_killed_run_keeps_the_ops_of_its_converted_cycles(tmp_path: Path) -> None:
    """SIGKILL while the op level records: the run loads with the ops of every cycle converted
    and flushed before the kill, nested under their layers once correlated."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from mltrace.run import store
    from mltrace.tracer.passes import correlate

    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    run_dir = tmp_path / "run"
    env = {**os.environ, "MLTRACE_OP_CYCLE_S": "0.1"}
    env.pop("MLTRACE_OUTPUT", None)
    cmd = [sys.executable, "-m", "mltrace", "python", "--level", "op", "--flush-interval", "0.05", "-q", "-o", str(run_dir), str(script)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 60
        while sum(s.name == "aten::linear" for s in _streamed_ops(run_dir)) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)  # 40 calls' ops streamed, at least
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    run = store.load_run(run_dir)
    assert run.meta.get("complete") is not True
    # The converter process finishes the cycle in hand after the kill: its last calls' ops may
    # reach the run while their model spans were still unflushed in the killed process.
    models = [(s.start_ns, s.end_ns) for s in run.spans if s.level == Level.MODEL]

    def in_a_model(op: Span) -> bool:
        return any(start <= op.start_ns and op.end_ns <= end for start, end in models)

    assert sum(in_a_model(s) for s in run.spans if s.name == "aten::linear") >= 40
    run = correlate(run)
    by_id = run.span_by_id()
    linear = [s for s in run.spans if s.name == "aten::linear" and in_a_model(s)]
    assert all(s.parent_id is not None and by_id[s.parent_id].level == Level.LAYER for s in linear)
    assert run.meta["correlation"]["check_containment"]["outside_parent"] == 0


@pytest.mark.parametrize("hot_path", ["c", "python"])
def test_model_calls_in_flight_on_other_threads_keep_all_their_layers(
    tmp_path: Path, hot_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model call that is running on another thread when the layer level ends gets all its
    layer spans; the calls that begin afterwards get none."""
    import torch

    class Gate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.entered, self.release = threading.Event(), threading.Event()
            self.hold = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.hold:
                self.hold = False
                self.entered.set()
                assert self.release.wait(30)
            return x

    monkeypatch.setenv("MLTRACE_LAYER_HOT_PATH", hot_path)
    gate = Gate()
    served = torch.nn.Sequential(torch.nn.Linear(4, 4), gate, torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    other = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    x = torch.randn(1, 4)
    with mltrace.profile(level="layer", output=tmp_path / "run", summary=False, flush_interval_s=60):
        session = active_session()
        assert session is not None and session.layer_window is not None
        worker = threading.Thread(target=served, args=(x,))
        worker.start()
        assert gate.entered.wait(30)  # the worker's call is inside its second layer
        session.layer_window.request("a test")
        other(x)  # its return ends the layer level
        assert session.layer_window.ended_ns is not None
        gate.release.set()
        worker.join(30)
        served(x)  # begins after the end: no layer spans
        second = threading.Thread(target=served, args=(x,))
        second.start()
        second.join(30)
    run = mltrace.load_run(tmp_path / "run")
    assert run.meta["layer_window"]["ended_after_model_calls"] == 1
    by_model: dict[int, list[str]] = {}
    for s in sorted(run.spans, key=lambda s: s.start_ns):
        if s.level == Level.LAYER:
            assert s.parent_id is not None
            by_model.setdefault(s.parent_id, []).append(s.name)
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert [by_model.get(m.id, []) for m in models] == [["0", "1", "2", "3"], ["0"], [], []]
    end = run.meta["layer_window"]["ended_ns"]
    assert models[0].start_ns < end < models[0].end_ns and models[2].start_ns > end
    b = breakdown(run)
    assert b.layer_model_calls == 2 and b.layer_model_ns == models[0].duration_ns + models[1].duration_ns


def test_a_layer_level_that_fails_to_end_goes_on_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Someone else wrapped ``Module.__call__`` over mltrace's: the layer level cannot end, says so,
    and records on in every call; run.json then has no end for the analysis to count."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    x = torch.randn(1, 4)
    with mltrace.profile(level="layer", output=tmp_path / "run", summary=False, flush_interval_s=60):
        session = active_session()
        assert session is not None and session.layer_window is not None
        ours = torch.nn.Module.__call__

        def theirs(module: torch.nn.Module, *args: object, **kwargs: object) -> object:
            return ours(module, *args, **kwargs)

        torch.nn.Module.__call__ = theirs  # type: ignore[method-assign]
        try:
            session.layer_window.request("a test")
            model(x)
            model(x)
        finally:
            torch.nn.Module.__call__ = ours  # type: ignore[method-assign]
    assert "failed to end the layer level: nn.Module.__call__ was re-wrapped" in capsys.readouterr().err
    run = mltrace.load_run(tmp_path / "run")
    assert run.meta["layer_window"]["reason"] == "a test" and "ended_ns" not in run.meta["layer_window"]
    assert any("ending the layer level failed" in e for e in run.meta["errors"])
    assert _models_and_layers(run)[1] == [2, 2]
    assert breakdown(run).layer_model_calls is None


def test_a_framework_imported_after_the_trace_is_full_is_not_traced(tmp_path: Path) -> None:
    """The trace fills on user spans; torch, imported afterwards, gets no wrapper and no spans."""
    script = SCRIPTS / "import_after_full.py"
    args = ("--level", "model", "--max-spans", "1", "--flush-interval", "0.05", "-o", str(tmp_path / "run"), str(script))
    traced = run_cli("python", *args)
    assert traced.returncode == 0, traced.stderr.decode()
    assert traced.stdout == b"(1, 3)\n"
    assert b"the trace is full (3 spans recorded" in traced.stderr
    run = mltrace.load_run(tmp_path / "run")
    assert [s.name for s in run.spans] == ["s0", "s1", "s2"] and run.meta["trace_full"]["spans"] == 3


def test_the_span_limit_ends_the_deepest_levels_first_and_says_so_once_for_the_framework_that_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch-only program at the library level, with every default source (TensorFlow's and
    ONNX Runtime's op windows among them, never used): at --max-spans N the op and library
    levels end, at 1.5 N the layer level, at 2 N the trace is full, each at a model call's
    return, and each said once, with the calls that really had them, under pytorch alone."""
    import time

    import torch

    monkeypatch.setenv("MLTRACE_OP_CYCLE_S", "2")  # the running cycle's ops count as recorded
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(1, 8)
    with torch.inference_mode():
        with mltrace.profile(level="library", output=tmp_path / "run", max_spans=400, flush_interval_s=60, summary=True):
            session = active_session()
            assert session is not None and {"pytorch", "tensorflow", "onnxruntime"} <= set(session.op_windows)
            for _ in range(400):
                model(x)
                time.sleep(0.001)  # the first cycle (one call) is converted while the loop runs
            assert session.full
    err = capsys.readouterr().err
    run = mltrace.load_run(tmp_path / "run")
    op_window, layer_window = run.meta["op_window"], run.meta["layer_window"]
    assert list(op_window.get("frameworks", {})) == ["pytorch"]
    ops_calls = op_window["ended_after_model_calls"]
    assert op_window["frameworks"]["pytorch"]["ended_after_model_calls"] == ops_calls
    assert set(op_window["sources"]) >= {"torch.profiler"}
    assert 0 < ops_calls < layer_window["ended_after_model_calls"]
    assert op_window["ended_ns"] < layer_window["ended_ns"] < run.meta["trace_full"]["at_ns"]
    ended = [line for line in err.splitlines() if " ended after " in line]
    assert len(ended) == 2, err
    assert ended[0].startswith(f"mltrace: the op and library levels ended after {ops_calls} model calls (")
    assert "spans recorded, --max-spans 400; the program waited" in ended[0]
    assert ended[1].startswith(f"mltrace: the layer level ended after {layer_window['ended_after_model_calls']} model calls (")
    assert re.search(r"\b0 model calls", err) is None
    # Each model call has ops exactly when it ended before the op level did.
    by_id = run.span_by_id()
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    with_ops = set()
    for s in run.spans:
        if s.level == Level.OP:
            p = s.parent_id
            while p is not None and by_id[p].level != Level.MODEL:
                p = by_id[p].parent_id
            if p is not None:
                with_ops.add(p)
    assert [m.id in with_ops for m in models] == [i < ops_calls for i in range(len(models))]
    # Ops count as they are recorded (the running cycle's by the ops per call of the last one
    # converted), so the run stops near 2 N spans, not 2 N model and layer spans plus every op.
    assert 800 <= run.meta["trace_full"]["spans"] and len(run.spans) <= 1.25 * 800


GROWING = """
import mmap, time, torch
from mltrace.tracer.session import active_session

model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
x = torch.randn(2, 8)
held = []
with torch.inference_mode():
    for _ in range(16):
        block = mmap.mmap(-1, 20 << 20)  # 20 MB of new pages a call, written and kept: the process grows
        for offset in range(0, len(block), mmap.PAGESIZE):
            block[offset] = 1
        held.append(block)
        model(x)
        time.sleep(0.06)  # past a cycle
        active_session().flush()  # the flusher's check, at once: no flush waits on the machine's load
print("done")
"""


@pytest.mark.parametrize("cycle_s", ["0.05", "0"])
def test_the_programs_own_growth_ends_the_op_level_only_where_the_profiler_holds_every_op(tmp_path: Path, cycle_s: str) -> None:
    """A program that keeps 320 MB of its own memory, under a 0.1 GiB budget: torch.profiler in
    cycles holds only the running cycle, so the growth is the program's and the op level goes
    on (every call has its ops); held whole (``MLTRACE_OP_CYCLE_S=0``) it holds every op, and
    the growth ends the op level at the next model call's return. In a process of its own, so
    that nothing an earlier test left (a freed heap, a range) decides it."""
    pytest.importorskip("torch")
    script = tmp_path / "growing.py"
    script.write_text(GROWING)
    env = {"MLTRACE_OP_CYCLE_S": cycle_s, "MLTRACE_OP_MEMORY_GIB": "0.1"}
    done = run_cli("python", "-q", "--level", "op", "-o", str(tmp_path / "run"), str(script), env=env)
    assert done.returncode == 0 and done.stdout == b"done\n", done.stderr.decode()
    run = mltrace.load_run(tmp_path / "run")
    window = run.meta["op_window"]
    linear = sum(s.name == "aten::linear" for s in run.spans)
    if cycle_s == "0":
        assert window["reason"] == "memory budget" and linear < 16
        assert b"this process grew by" in done.stderr
    else:
        assert "reason" not in window and linear == 16, (window, run.meta["torch_profiler"].get("switches_deferred"))
        assert b"memory budget" not in done.stderr
