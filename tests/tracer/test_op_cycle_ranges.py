"""The op level's cycle switch never stops and restarts torch.profiler inside a torch range
open on the program's thread: a range that outlives the stop writes its end into the stopped
profiler's freed events once the next one runs, and a later stop crashes the process."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from conftest import run_cli

torch = pytest.importorskip("torch")

from mltrace.run.levels import Level  # noqa: E402
from mltrace.run.store import load_run  # noqa: E402
from mltrace.tracer.sources import torch_open_ranges  # noqa: E402
from mltrace.tracer.sources.torch_open_ranges import RecordFunctionDepth, range_frame_on_stack  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"

RANGES = """
import time, torch
from torch.autograd.profiler import record_function
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
x = torch.randn(2, 8)
with torch.inference_mode():
    with record_function("all calls"):
        for _ in range(6):
            model(x)
            time.sleep(0.03)
    for _ in range(12):
        with record_function("one call"):
            model(x)
        time.sleep(0.03)
print("done")
"""


def _op_level(tmp_path: Path, script: Path, *args: str, **env: str) -> subprocess.CompletedProcess[bytes]:
    """Runs ``script`` (with ``args``) at the op level with 1 ms cycles and ``env`` added, into
    ``tmp_path/run``."""
    out = str(tmp_path / "run")
    return run_cli("python", "-q", "--level", "op", "-o", out, str(script), *args, env={"MLTRACE_OP_CYCLE_S": "0.001", **env})


def _traced(tmp_path: Path, script: Path) -> tuple[dict[str, Any], Any]:
    """Runs ``script`` at the op level with 1 ms cycles: run.json's ``torch_profiler`` and the run."""
    done = _op_level(tmp_path, script)
    assert done.returncode == 0, done.stderr.decode()
    meta = json.loads((tmp_path / "run" / "run.json").read_text())["torch_profiler"]
    return meta, load_run(tmp_path / "run")


def _switches_inside(meta: dict[str, Any], ranges: list[Any]) -> list[tuple[str, list[int]]]:
    """The cycle switches (run.json's pauses) that began inside one of ``ranges`` (a range open
    at a stop ends there in the stopped cycle's trace)."""
    return [(r.name, p) for p in meta["pauses"] for r in ranges if r.start_ns < p[1] < r.end_ns]


def test_switches_wait_for_the_programs_record_function_ranges(tmp_path: Path) -> None:
    script = tmp_path / "ranges.py"
    script.write_text(RANGES)
    meta, run = _traced(tmp_path, script)
    ranges = [s for s in run.spans if s.name in ("all calls", "one call")]
    assert sorted({r.name for r in ranges}) == ["all calls", "one call"] and len(ranges) == 13
    assert _switches_inside(meta, ranges) == []
    models = sorted((s for s in run.spans if s.level is Level.MODEL), key=lambda s: s.start_ns)
    (whole,) = [r for r in ranges if r.name == "all calls"]
    assert whole.start_ns < models[0].start_ns and models[5].end_ns < whole.end_ns  # not cut at a stop
    assert meta["switches_deferred"]["record_function"] >= 6  # every call inside "all calls" at least
    assert meta["cycles"] >= 3  # the switches happened at the ranges' ends
    linear = [s for s in run.spans if s.name == "aten::linear"]
    assert len(models) == 18 and len(linear) == 18  # no call lost its ops


OTHER_THREAD = """
import threading, time, torch
from torch.autograd.profiler import record_function

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        with record_function("inside forward"):
            y = self.a(x)
        time.sleep(0.002)
        return self.b(y)

model = Net().eval()
x = torch.randn(2, 8)
done = threading.Event()

def prefetch():
    while not done.is_set():
        with record_function("prefetch"):
            torch.ones(4).sum()
            time.sleep(0.02)
        time.sleep(0.01)

def watch():  # a span of the program's open on another thread: its ops would be cut
    import mltrace
    for _ in range(3):
        with mltrace.span("watch"):
            torch.ones(4).sum()
            time.sleep(0.05)
        time.sleep(0.02)

thread, watcher = threading.Thread(target=prefetch), threading.Thread(target=watch)
thread.start()
watcher.start()
with torch.inference_mode():
    for _ in range(30):
        model(x)
        time.sleep(0.005)
done.set()
thread.join()
watcher.join()
"""


def test_switches_wait_for_record_function_ranges_on_other_threads(tmp_path: Path) -> None:
    """A thread that prefetches inside ``record_function`` calls no model: a switch while its
    range is open would leave it spanning the next start. The end of a range inside the
    model's ``forward`` is no place for a put-off switch either: it would split the call."""
    script = tmp_path / "prefetch.py"
    script.write_text(OTHER_THREAD)
    meta, run = _traced(tmp_path, script)
    ranges = [s for s in run.spans if s.name == "prefetch"]
    assert len(ranges) >= 5
    assert _switches_inside(meta, ranges) == []
    models = [s for s in run.spans if s.level is Level.MODEL]
    assert len(models) == 30 and _switches_inside(meta, models) == []
    assert len([s for s in run.spans if s.name == "aten::linear"]) == 60
    assert meta["switches_deferred"]["record_function on another thread"] >= 1
    watches = [s for s in run.spans if s.name == "watch"]
    assert len(watches) == 3 and _switches_inside(meta, watches) == []
    assert meta["switches_deferred"]["span open on another thread"] >= 1
    assert meta["cycles"] >= 3


def test_a_model_called_from_compiled_code_switches_no_cycle_inside_it(tmp_path: Path) -> None:
    """The repro of the crash: a compiled function calls a model whose forward breaks the graph,
    so each model call returns inside the function's "Torch-Compiled Region" range."""
    meta, run = _traced(tmp_path, SCRIPTS / "compiled_with_break.py")
    regions = [s for s in run.spans if s.name.startswith("Torch-Compiled Region")]
    assert regions
    assert _switches_inside(meta, regions) == []
    assert meta["switches_deferred"]["compiled code"] >= 1
    assert len([s for s in run.spans if s.level is Level.MODEL]) == 4


CHECKPOINTED = """
import time, torch
from torch.utils.checkpoint import checkpoint

class Pause(torch.nn.Module):  # every call, the recomputed ones too, outlasts a 1 ms cycle
    def forward(self, x):
        time.sleep(0.002)
        return x

torch.manual_seed(0)
blocks = [torch.nn.Sequential(torch.nn.Linear(32, 64), Pause(), torch.nn.ReLU(), torch.nn.Linear(64, 32)) for _ in range(3)]
head = torch.nn.Linear(32, 4)
x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
for step in range(20):
    h = x
    for block in blocks:
        h = checkpoint(block, h, use_reentrant=False)
    loss = torch.nn.functional.cross_entropy(head(h), y)
    time.sleep(0.05)  # the converter (below the program's priority) catches up: a switch is due in the backward pass
    loss.backward()
print("done")
"""


def test_a_model_recomputed_in_the_backward_pass_switches_no_cycle_inside_it(tmp_path: Path) -> None:
    """torch.utils.checkpoint calls each block again inside the autograd engine's ranges (one per
    node it evaluates): a switch at such a call's return would leave them open across the next
    start (a program like this one with four blocks and 30 steps crashed 7 of 10 runs so)."""
    script = tmp_path / "checkpointed.py"
    script.write_text(CHECKPOINTED)
    meta, run = _traced(tmp_path, script)
    engine = [s for s in run.spans if s.name.startswith("autograd::engine::evaluate_function")]
    assert engine
    assert _switches_inside(meta, engine) == []
    assert meta["switches_deferred"]["autograd backward"] >= 1
    assert len([s for s in run.spans if s.level is Level.MODEL]) == 20 * (3 + 1 + 3)  # the recomputed calls too
    assert meta["cycles"] >= 3


def test_the_backward_pass_runs_inside_a_range() -> None:
    seen: list[str | None] = []
    x = torch.ones(2, requires_grad=True)
    for run_backward in (lambda y: y.sum().backward(), lambda y: torch.autograd.grad(y.sum(), x)):
        y = x * 2
        y.register_hook(lambda grad: seen.append(range_frame_on_stack()))
        run_backward(y)
    assert seen == ["autograd backward", "autograd backward"]
    assert range_frame_on_stack() is None


def test_a_custom_functions_forward_runs_inside_a_range() -> None:
    assert range_frame_on_stack() is None
    ctx_seen: list[str | None] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            ctx_seen.append(range_frame_on_stack())
            return x * 2

    Probe.apply(torch.ones(2))
    assert ctx_seen == ["autograd Function"]


def test_compiled_code_runs_inside_a_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by TorchDynamo's map of the code it wrote, and by the names it gives that code."""
    dynamo = pytest.importorskip("torch._dynamo")
    seen: list[str | None] = []

    def probe(x: Any) -> Any:
        seen.append(range_frame_on_stack())
        with monkeypatch.context() as without_map:
            without_map.setattr(torch_open_ranges, "_dynamo_output_codes", lambda: None)
            seen.append(range_frame_on_stack())
        return x

    def function(x: Any) -> Any:
        y = x + 1
        dynamo.graph_break()
        return probe(y) * 2

    dynamo.reset()
    compiled = torch.compile(function, backend="eager")
    compiled(torch.ones(2))
    assert seen == ["compiled code", "compiled code"]
    dynamo.reset()


def test_record_function_depth_counts_per_thread_and_puts_torch_back() -> None:
    from torch.autograd.profiler import record_function

    enter, exit_ = record_function.__dict__["__enter__"], record_function.__dict__["__exit__"]
    closed: list[int] = []
    depth = RecordFunctionDepth(lambda: closed.append(depth.open_here()))
    depth.install(torch)
    try:
        with record_function("outer"):
            with record_function("inner"):
                assert depth.open_here() == 2
            assert depth.open_here() == 1 and closed == []

        @record_function("decorated")
        def decorated() -> int:
            return depth.open_here()

        assert decorated() == 1
        assert depth.open_here() == 0 and closed == [0, 0]
        entered, leave = threading.Event(), threading.Event()

        def hold() -> None:
            with record_function("elsewhere"):
                entered.set()
                leave.wait(30)

        other = threading.Thread(target=hold)
        other.start()
        entered.wait(30)
        assert depth.open_elsewhere() and depth.open_here() == 0
        leave.set()
        other.join(30)
        assert not depth.open_elsewhere()
    finally:
        depth.uninstall()
    assert record_function.__dict__["__enter__"] is enter and record_function.__dict__["__exit__"] is exit_


HELD_WHOLE = """
import sys, time, torch
from torch.autograd.profiler import record_function
layers = []
for _ in range(20):
    layers += [torch.nn.Linear(16, 16), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers).eval()
x = torch.randn(2, 16)
with torch.inference_mode():
    for _ in range(int(sys.argv[1])):  # the first two cycles: the set-up, then one call (its ops per call)
        model(x)
    with record_function("everything"):  # holds every later switch, as LBFGS's step does
        for _ in range(300):
            model(x)
            time.sleep(0.01)
print("done")
"""


@pytest.mark.parametrize("calls_before", [2, 0])
def test_a_cycle_held_by_a_range_ends_at_the_memory_budget_its_stop_would_pass(tmp_path: Path, calls_before: int) -> None:
    """Recording an op costs a fifth of what its stop adds: the budget counts the stop ahead, so
    a cycle that a range holds over many calls ends the op level before its stop blows past.
    (The process's own growth does not count while the profiler cycles: the stop alone does.)
    With no call before the range, no cycle has said its ops per call: the held cycle's stop is
    estimated from the process's growth since it began."""
    script = tmp_path / "held.py"
    script.write_text(HELD_WHOLE)
    done = _op_level(tmp_path, script, str(calls_before), MLTRACE_OP_MEMORY_GIB="0.06")
    assert done.returncode == 0 and done.stdout == b"done\n", done.stderr.decode()
    assert b"stopping torch.profiler's running cycle would take about" in done.stderr
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["op_window"]["reason"] == "memory budget"
    assert calls_before < meta["op_window"]["ended_after_model_calls"] < calls_before + 300
    assert meta["torch_profiler"]["switches_deferred"]["record_function"] >= 1
