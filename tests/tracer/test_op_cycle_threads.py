"""Op-level cycles after the first record the main thread alone while it is the only thread that
calls models (an all-threads profiler stopped while another thread runs torch ops corrupts the
heap); they stop for good once a second thread calls models (a cycle's switch would drop the ops
other threads run meanwhile): the profiler then records every thread, held whole."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli
from mltrace.run.levels import Level
from mltrace.run.store import load_run

SCRIPT = """
import threading, time
import torch
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
x = torch.randn(2, 8)

def calls(n):
    with torch.inference_mode():
        for _ in range(n):
            model(x)
            time.sleep(0.12)

calls(4)  # one thread: cycles of 0.1 s switch
workers = [threading.Thread(target=calls, args=(6,)) for _ in range(2)]
for w in workers:
    w.start()
calls(6)
for w in workers:
    w.join()
"""


def test_cycles_stop_when_a_second_thread_calls_models(tmp_path: Path) -> None:
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    done = run_cli("python", "-q", "--level", "op", "-o", str(tmp_path / "run"), str(script), env={"MLTRACE_OP_CYCLE_S": "0.1"})
    assert done.returncode == 0, done.stderr.decode()
    meta = json.loads((tmp_path / "run" / "run.json").read_text())["torch_profiler"]
    assert meta["cycles_stopped"].startswith("model calls on more than one thread")
    assert meta["cycles"] >= 3 and meta["one_thread_cycles"] >= 1  # the single-threaded start had its cycles
    run = load_run(tmp_path / "run")
    models = [s for s in run.spans if s.level is Level.MODEL]
    linear = [s for s in run.spans if s.name == "aten::linear"]
    main = next(t.id for t in run.tracks.values() if t.name == "MainThread")
    assert len(models) == 4 + 3 * 6
    # The main thread's calls keep their ops; a worker's calls before the main thread's next
    # return ran while the main thread alone was recorded (one a worker at most), and it says so.
    assert sum(s.track_id == main for s in linear) == 4 + 6
    assert 2 * 6 - 2 <= sum(s.track_id != main for s in linear) <= 2 * 6
    limitations = json.loads((tmp_path / "run" / "run.json").read_text())["limitations"]
    if len(linear) < len(models):
        assert any("recorded the main thread alone" in text for text in limitations)


PRODUCER = """
import threading, time
import torch
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
stop, running = threading.Event(), threading.Event()

def producer():  # torch ops outside every model call, on a thread of their own
    while not stop.is_set():
        torch.randn(16, 16).mul(2).sum()
        running.set()
        time.sleep(0.001)

worker = threading.Thread(target=producer)
worker.start()
running.wait(30)  # the first cycle (until the first model call returns) has some of its ops
with torch.inference_mode():
    for _ in range(12):
        model(torch.randn(2, 8))
        time.sleep(0.05)
stop.set()
worker.join()
"""


def test_after_the_first_cycle_other_threads_ops_outside_model_calls_are_not_recorded(tmp_path: Path) -> None:
    """A thread that runs torch ops beside the program's model calls is recorded by the first
    cycle (the program's set-up) only: later cycles record the main thread, and the run keeps
    every model call's ops."""
    script = tmp_path / "producer.py"
    script.write_text(PRODUCER)
    done = run_cli("python", "-q", "--level", "op", "-o", str(tmp_path / "run"), str(script), env={"MLTRACE_OP_CYCLE_S": "0.1"})
    assert done.returncode == 0, done.stderr.decode()
    meta = json.loads((tmp_path / "run" / "run.json").read_text())["torch_profiler"]
    assert meta["cycles"] >= 3 and meta["one_thread_cycles"] == meta["cycles"] - 1 and "cycles_stopped" not in meta
    run = load_run(tmp_path / "run")
    models = sorted((s for s in run.spans if s.level is Level.MODEL), key=lambda s: s.start_ns)
    assert len(models) == 12 and len([s for s in run.spans if s.name == "aten::linear"]) == 12
    main = next(t.id for t in run.tracks.values() if t.name == "MainThread")
    producer_ops = [s for s in run.spans if s.name == "aten::randn" and s.track_id != main]
    assert producer_ops and max(s.start_ns for s in producer_ops) < models[1].start_ns  # the first cycle's only


LATE_SPAN = """
import threading, time
import mltrace, torch
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
done = threading.Event()

def request():  # a span on another thread, begun while the main thread alone is recorded
    with torch.inference_mode(), mltrace.span("request"):
        for _ in range(200):
            torch.ones(4).add(1)
            time.sleep(0.001)
    done.set()

with torch.inference_mode():
    for _ in range(4):
        model(torch.randn(2, 8))
        time.sleep(0.12)
    worker = threading.Thread(target=request)
    worker.start()
    while not done.is_set():
        model(torch.randn(2, 8))
        time.sleep(0.01)
    worker.join()
    for _ in range(3):
        model(torch.randn(2, 8))
        time.sleep(0.12)
"""


def test_a_span_begun_on_another_thread_switches_the_cycles_to_every_thread(tmp_path: Path) -> None:
    """A span begun on another thread while a cycle records the main thread alone: the main
    thread's next model call switches at once to a cycle of every thread, which records the
    rest of the span's ops; the ops it ran before are said to be missing."""
    script = tmp_path / "late_span.py"
    script.write_text(LATE_SPAN)
    done = run_cli("python", "-q", "--level", "op", "-o", str(tmp_path / "run"), str(script), env={"MLTRACE_OP_CYCLE_S": "0.1"})
    assert done.returncode == 0, done.stderr.decode()
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    profiler = meta["torch_profiler"]
    assert 1 <= profiler["one_thread_cycles"] < profiler["cycles"] - 1 and "cycles_stopped" not in profiler
    assert any("spans or record_function ranges on another thread began" in text for text in meta["limitations"])
    run = load_run(tmp_path / "run")
    (request,) = [s for s in run.spans if s.name == "request"]
    adds = [s for s in run.spans if s.name == "aten::add" and s.track_id == request.track_id]
    assert 100 <= len(adds) <= 200  # those it ran before the switch (if any ran) are missing, the rest kept
    assert len([s for s in run.spans if s.name == "aten::linear"]) == len([s for s in run.spans if s.level is Level.MODEL])


def test_the_op_levels_end_waits_for_a_span_open_on_another_thread(tmp_path: Path) -> None:
    """The op level ends at a model call's return (``--op-inferences``) while another thread is
    inside a request: the all-threads profiler's last stop waits for the request's span to end
    (new spans there held meanwhile), so no op of it runs beside the stop, and all are kept."""
    import threading
    import time

    import torch

    import mltrace

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8)
    started = threading.Event()
    adds = 0

    def request() -> None:
        nonlocal adds
        with torch.inference_mode(), mltrace.span("request"):
            started.set()
            y = torch.zeros(16)
            deadline = time.monotonic() + 0.3
            while time.monotonic() < deadline:
                y = torch.add(y, 1)
                adds += 1
                time.sleep(0.001)

    def span_elsewhere() -> None:  # every cycle records all threads
        with mltrace.span("another thread"):
            pass

    with torch.inference_mode(), mltrace.profile(level="op", output=tmp_path / "run", summary=False, op_inferences=3):
        first = threading.Thread(target=span_elsewhere)
        first.start()
        first.join()
        model(x)
        model(x)
        worker = threading.Thread(target=request)
        worker.start()
        started.wait(10)
        model(x)  # its return ends the op level while the request runs
        worker.join()
        model(x)
    run = load_run(tmp_path / "run")
    assert run.meta["op_window"]["ended_after_model_calls"] == 3
    (span,) = [s for s in run.spans if s.name == "request"]
    *_, (_, stop_began, _) = run.meta["torch_profiler"]["pauses"]
    assert stop_began >= span.end_ns  # the stop waited for the request
    assert len([s for s in run.spans if s.name == "aten::add" and s.track_id == span.track_id]) == adds
