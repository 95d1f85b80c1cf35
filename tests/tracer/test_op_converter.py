"""The op level's converter process (``formats/kineto_serve.py``): cycles of torch.profiler are
converted outside the traced process and streamed to the run; the process is not followed as
one of the program's children, holds no torch, and ends with the session, on a hard stop and
when the traced process is killed, which keeps the ops of the cycles converted before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mltrace
from conftest import SCRIPTS, mltrace_cmd
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.tracer.sources.torch_ops import PAUSED_TRACK
from support.helper_processes import default_nice_below, placement

torch = pytest.importorskip("torch")

HANG_S = 120


def _small_model_calls(run_dir: Path, calls: int, pause_s: float) -> Run:
    """``calls`` calls of a small torch model at the op level, ``pause_s`` apart; the run."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    with torch.inference_mode(), mltrace.profile(level="op", output=run_dir, summary=False):
        for _ in range(calls):
            model(torch.randn(2, 8))
            time.sleep(pause_s)
    return mltrace.load_run(run_dir)


def _converter_pids(parent: int) -> list[int]:
    """The converter processes started by process ``parent``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == parent and b"mltrace.formats.kineto_serve" in cmdline:
            found.append(int(entry.name))
    return found


def _nice(pid: int) -> int | None:
    """Process ``pid``'s nice value (None where it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[16])
    except (OSError, IndexError, ValueError):
        return None


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _wait_until(check: object, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_cycles_are_converted_by_a_process_of_their_own_that_ends_with_the_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The converter process writes the cycles' ops (counted in run.json), has neither torch nor
    the follow variables, and is reaped when the session stops."""
    monkeypatch.setenv("MLTRACE_OP_CYCLE_S", "0.05")
    monkeypatch.setenv("MLTRACE_FOLLOW", '{"run": "elsewhere"}')  # as in a followed program's child
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8)
    with torch.inference_mode(), mltrace.profile(level="op", output=tmp_path / "run", summary=False):
        for _ in range(20):
            model(x)
            time.sleep(0.02)
        assert _wait_until(lambda: _converter_pids(os.getpid()))  # started with the profiler
        (pid,) = _converter_pids(os.getpid())
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert not any(v.startswith(b"MLTRACE_FOLLOW=") or b"follow/bootstrap" in v for v in environ)
        assert b"libtorch" not in Path(f"/proc/{pid}/maps").read_bytes()
        # Its stderr is not the program's: where the library level captures fd 1 and 2
        # together, it would hold the capture's pipe, and the capture's stop would wait for it.
        assert os.readlink(f"/proc/{pid}/fd/2") == os.devnull
        # It runs below the program's CPU priority (MLTRACE_HELPER_NICE: nice 19 by default), in
        # the program's session and autogroup, where that priority weighs against the
        # program's threads, and in a process group of its own (Ctrl-C goes to the program).
        assert _wait_until(lambda: _nice(pid) == 19)
        assert placement(pid) == {
            "same_session": True,
            "same_autogroup": True,
            "own_group": True,
            "nice_below_parent": default_nice_below(pid),
        }
    assert not _running(pid) and not Path(f"/proc/{pid}").exists()  # ended and reaped
    run = mltrace.load_run(tmp_path / "run")
    profiler = run.meta["torch_profiler"]
    assert run.meta["errors"] == []
    assert profiler["converter_process"]["spans"] > 0 and profiler["cycles"] >= 2
    linear = [s for s in run.spans if s.name == "aten::linear"]
    assert len(linear) == 20
    assert profiler["spans_by_category"]["cpu_op"] == sum(1 for s in run.spans if s.level == Level.OP)
    # Every cycle's switch held the program's thread between two model calls, and is kept.
    assert profiler["switches"] == profiler["cycles"] <= len(profiler["pauses"])  # and any wait for the converter
    models = [s for s in run.spans if s.level == Level.MODEL]
    for _thread, begin, end in profiler["pauses"]:
        assert begin < end
        assert not [m for m in models if m.start_ns < end and m.end_ns > begin]
    (track,) = [t.id for t in run.tracks.values() if t.name == PAUSED_TRACK]
    steps = sorted((c.ts_ns, c.value) for c in run.counters if c.track_id == track)
    assert steps == sorted((ts, v) for _t, begin, end in profiler["pauses"] for ts, v in ((begin, 1), (end, 0)))
    # Each interval holds the switch's own timing (taken inside it; switch_s is rounded to 1 µs).
    paused_ns = sum(end - begin for _t, begin, end in profiler["pauses"])
    assert paused_ns >= profiler["switch_s"] * 1e9 - 1000 * len(profiler["pauses"]) > 0


def _start(out: Path, cycle_s: str) -> subprocess.Popen[str]:
    env = {**os.environ, "MLTRACE_OP_CYCLE_S": cycle_s}
    env.pop("MLTRACE_OUTPUT", None)
    proc = subprocess.Popen(
        # Model and layer spans flushed every 0.05 s: the converter process may write a cycle's
        # ops before the default flush has written the model spans around them.
        mltrace_cmd("python", "-q", "--flush-interval", "0.05", "-o", str(out), str(SCRIPTS / "signal_loop.py")),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n", proc.communicate(timeout=HANG_S)
    return proc


def test_a_killed_run_keeps_the_ops_of_its_converted_cycles(tmp_path: Path) -> None:
    """SIGKILL after some cycles were converted: the run (not complete) loads with their ops on
    the layer spans' thread, and the converter process ends at the end of its input."""
    out = tmp_path / "run"
    proc = _start(out, "0.1")
    try:
        assert _wait_until(lambda: _converter_pids(proc.pid))
        (pid,) = _converter_pids(proc.pid)
        assert _wait_until(lambda: b'"aten::conv2d"' in (out / "events.jsonl").read_bytes())
        time.sleep(0.3)
    finally:
        proc.kill()
        proc.communicate(timeout=HANG_S)
    assert _wait_until(lambda: not _running(pid), timeout_s=30)
    run = mltrace.load_run(out)
    assert not run.complete
    convs = [s for s in run.spans if s.name == "aten::conv2d"]
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert convs and models
    assert {s.track_id for s in convs} == {s.track_id for s in models}
    # each op up to the last model call streamed lies inside a model call (the model spans of
    # the calls after it, still in the killed process's recorder, are lost with it)
    last = max(m.end_ns for m in models)
    inside = [c for c in convs if c.end_ns <= last]
    assert inside and all(any(m.start_ns <= c.start_ns and c.end_ns <= m.end_ns for m in models) for c in inside)


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, -15), (signal.SIGINT, -2)])
def test_a_signal_reaps_the_converter_process(tmp_path: Path, sig: int, status: int) -> None:
    """SIGTERM or SIGINT: the program's status, a run with the ops, and no converter left."""
    out = tmp_path / "run"
    proc = _start(out, "0.1")
    assert _wait_until(lambda: _converter_pids(proc.pid))
    (pid,) = _converter_pids(proc.pid)
    time.sleep(0.5)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=HANG_S)
    assert proc.returncode == status, stderr
    assert not _running(pid)
    run = mltrace.load_run(out)
    assert run.complete, stderr
    assert {Level.MODEL, Level.OP} <= {s.level for s in run.spans}
    assert run.meta["torch_profiler"]["converter_process"]["spans"] > 0


def _ten_calls(out: Path, level: str | None, no_converter: bool = False) -> Run:
    """Ten calls of a small model 20 ms apart in a session at ``level`` (None: every level),
    its run; ``no_converter``: checks that no converter process ran while the session did."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8)
    options: dict[str, object] = {} if level is None else {"level": level}
    with torch.inference_mode(), mltrace.profile(output=out, summary=False, **options):
        for _ in range(10):
            model(x)
            time.sleep(0.02)
        if no_converter:
            assert _converter_pids(os.getpid()) == []
    return mltrace.load_run(out)


def test_without_the_process_cycles_are_converted_on_a_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``MLTRACE_OP_CONVERTER=0``: no converter process, the same ops."""
    monkeypatch.setenv("MLTRACE_OP_CYCLE_S", "0.05")
    monkeypatch.setenv("MLTRACE_OP_CONVERTER", "0")
    run = _ten_calls(tmp_path / "run", "op", no_converter=True)
    assert "converter_process" not in run.meta["torch_profiler"]
    assert len([s for s in run.spans if s.name == "aten::linear"]) == 10


def test_with_cupti_python_kernels_the_profiler_runs_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No cycles where cupti-python records the kernels: each profiler start registers Kineto's
    CUPTI callbacks in place of cupti-python's (on an H200, the cupti-python path then recorded
    no kernel at all), so the profiler starts once, as it does with Kineto's CUDA activity.
    (Without CUDA, Kineto's path records no kernels and the cycles go on: the other tests.)"""
    monkeypatch.setenv("MLTRACE_OP_CYCLE_S", "0.05")
    monkeypatch.setenv("MLTRACE_KERNEL_PATH", "cupti-python")
    run = _ten_calls(tmp_path / "run", "kernel", no_converter=True)
    profiler = run.meta["torch_profiler"]
    assert profiler["cycles"] == 1 and "switches" not in profiler  # one profiler, converted at the end
    assert len([s for s in run.spans if s.name == "aten::linear"]) == 10


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, Kineto records kernels and the profiler runs whole")
def test_at_every_level_without_cuda_the_profiler_cycles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every level asked for (the default), on a machine where torch sees no CUDA device: no
    kernels are recorded, so the op level runs in cycles."""
    monkeypatch.setenv("MLTRACE_OP_CYCLE_S", "0.05")
    profiler = _ten_calls(tmp_path / "run", None).meta["torch_profiler"]
    assert profiler["cycles"] >= 2 and profiler["switches"] >= 2


def test_a_forked_child_that_outlives_the_session_does_not_hold_the_converter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child forked while the converter process runs drops its copies of the pipes: the
    session's stop sees the process end at once, not after its 5 s wait."""
    monkeypatch.setenv("MLTRACE_OP_CYCLE_S", "0.05")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8)
    child = 0
    try:
        with torch.inference_mode(), mltrace.profile(level="op", output=tmp_path / "run", summary=False):
            for _ in range(10):
                model(x)
                time.sleep(0.02)
            assert _wait_until(lambda: _converter_pids(os.getpid()))
            (pid,) = _converter_pids(os.getpid())
            child = os.fork()
            if child == 0:
                time.sleep(30)
                os._exit(0)
            t0 = time.monotonic()
        stop_s = time.monotonic() - t0
        assert not _running(pid)
        assert stop_s < 4.5, stop_s
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
    assert len([s for s in mltrace.load_run(tmp_path / "run").spans if s.name == "aten::linear"]) == 10


def test_a_cycle_that_fails_to_export_is_lost_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An export that fails (a full disk) loses that cycle's ops, says so, and the cycles go on."""
    from mltrace.tracer.sources import torch_ops

    real = torch_ops.TorchOpSource._export_cycle

    def failing_second(self: torch_ops.TorchOpSource, prof: object, number: int) -> Path:
        if number == 2 and not getattr(self, "_failed", False):
            self._failed = True  # type: ignore[attr-defined]
            raise OSError(28, "No space left on device")
        return real(self, prof, number)

    monkeypatch.setattr(torch_ops.TorchOpSource, "_export_cycle", failing_second)
    monkeypatch.setenv("MLTRACE_OP_CYCLE_S", "0.05")
    run = _small_model_calls(tmp_path / "run", 20, 0.02)
    assert [e for e in run.meta["errors"] if "exporting cycle 2 failed: [Errno 28] No space left on device" in e]
    linear = [s for s in run.spans if s.name == "aten::linear"]
    assert 0 < len(linear) < 20
    last = max((m for m in run.spans if m.level == Level.MODEL), key=lambda m: m.start_ns)
    assert [s for s in linear if last.start_ns <= s.start_ns and s.end_ns <= last.end_ns]  # recorded after the loss
    assert run.meta["torch_profiler"]["cycles"] >= 3  # the cycles after the lost one were converted


def test_a_program_with_a_large_set_up_keeps_every_calls_ops(tmp_path: Path) -> None:
    """The first cycle holds 20,000 tensors' set-up and one model call. Counting every later call
    as that many ops, the span limit ended the op level after 21-108 of 300 calls (and the
    program waited for the converter at each call): every call keeps its ops now, and the
    program waits for nothing."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLTRACE_OUTPUT", "MLTRACE_OP_CYCLE_S")}
    proc = subprocess.run(
        mltrace_cmd("python", "-o", str(tmp_path / "run"), str(SCRIPTS / "setup_then_loop.py")),
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_S,
    )
    assert proc.returncode == 0 and proc.stdout == "20000 (4, 64)\n", proc.stderr
    assert "ended after" not in proc.stderr and "full" not in proc.stderr
    run = mltrace.load_run(tmp_path / "run")
    profiler = run.meta["torch_profiler"]
    assert "waited_for_conversion_s" not in profiler and "reason" not in run.meta["op_window"]
    assert len([s for s in run.spans if s.level == Level.MODEL]) == 300
    assert len([s for s in run.spans if s.name == "aten::linear"]) == 600


def test_a_wait_for_the_converter_is_kept_as_a_pause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A program quicker than the conversion waits for it between two model calls (a cycle past
    ``CYCLE_OPS_MAX``): the wait is kept with the switches (``torch_profiler.pauses``), so the
    report counts it neither as the program's idle time nor in its model calls."""
    from mltrace.analysis.bottleneck import analyze
    from mltrace.tracer.sources import torch_ops

    real = torch_ops._Converter._convert

    def slow(self: torch_ops._Converter, path: Path) -> None:
        time.sleep(0.2)
        real(self, path)

    monkeypatch.setattr(torch_ops._Converter, "_convert", slow)
    monkeypatch.setattr(torch_ops, "CYCLE_OPS_MAX", 1)
    monkeypatch.setenv("MLTRACE_OP_CYCLE_S", "0.01")
    run = _small_model_calls(tmp_path / "run", 100, 0.01)  # a cycle's ops are estimated from the second cycle on
    profiler = run.meta["torch_profiler"]
    assert profiler["waited_for_conversion_s"] > 0.1
    waits = len(profiler["pauses"]) - profiler["switches"]
    assert waits > 0
    held = sum(end - begin for _t, begin, end in profiler["pauses"])
    assert held >= profiler["waited_for_conversion_s"] * 1e9
    idle = analyze(run).findings.idle[0]
    assert idle.tracer_ns >= profiler["waited_for_conversion_s"] * 1e9 * 0.9
    assert idle.idle_ns < 100 * 0.01e9 * 2  # the program's own sleeps, not the waits


@pytest.mark.parametrize(("value", "increment"), [(None, 19), ("5", 5), ("0", 0), ("-3", 0), ("soon", 19)])
def test_a_helper_process_runs_below_the_programs_priority(value: str | None, increment: int) -> None:
    """The traced process lowers a helper process's CPU priority as it starts it
    (``MLTRACE_HELPER_NICE``, 19 unless set), so a program that wants every core runs its
    model calls first."""
    env = {k: v for k, v in os.environ.items() if k != "MLTRACE_HELPER_NICE"}
    if value is not None:
        env["MLTRACE_HELPER_NICE"] = value
    code = (
        "import os, subprocess, sys; from mltrace.tracer.helper_env import lower_priority; "
        "child = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], stdin=subprocess.PIPE); "
        "done = lower_priority(child.pid); print(done, os.getpriority(os.PRIO_PROCESS, child.pid) - os.nice(0)); "
        "child.communicate(b'')"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(increment), str(increment)]


def test_a_converter_that_falls_behind_pauses_the_op_level_instead_of_the_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its allowance for waiting (``BACKLOG_WAIT_FREE_S``, ``BACKLOG_WAIT_SHARE``), the
    program waits no longer for a starved converter (here its process idles while the thread
    that hands it cycles sleeps: no CPU): the running cycle stops and none starts until the
    converter has caught up. The intervals are kept (``torch_profiler.unrecorded``), the model
    calls in them have no ops, later calls have them again, and the report counts the calls
    with ops only."""
    from mltrace.analysis.bottleneck import analyze
    from mltrace.tracer.session import active_session
    from mltrace.tracer.sources import torch_ops

    real = torch_ops._Converter._convert

    def slow_at_first(self: torch_ops._Converter, path: Path) -> None:
        if self.cycles < 3:  # behind at first, then quicker than the program
            time.sleep(0.3)
        real(self, path)

    monkeypatch.setattr(torch_ops._Converter, "_convert", slow_at_first)
    monkeypatch.setattr(torch_ops, "CYCLE_OPS_MAX", 1)
    monkeypatch.setattr(torch_ops, "BACKLOG_WAIT_FREE_S", 0.05)
    monkeypatch.setattr(torch_ops, "BACKLOG_WAIT_SHARE", 0.0)
    monkeypatch.setenv("MLTRACE_OP_CYCLE_S", "0.01")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    with torch.inference_mode(), mltrace.profile(level="op", output=tmp_path / "run", summary=False):
        session = active_session()
        assert session is not None
        after_resume = 0
        for _ in range(2000):  # until 30 calls after the first pause's end
            model(torch.randn(2, 8))
            time.sleep(0.005)
            (source,) = [s for s in session.started if s.name == "torch.profiler"]
            after_resume += bool(source.unrecorded)  # type: ignore[attr-defined]
            if after_resume > 30:
                break
    run = mltrace.load_run(tmp_path / "run")
    profiler = run.meta["torch_profiler"]
    gaps = profiler["unrecorded"]
    # its allowance, then per pause the least wait that tells a starved converter, and overshoots
    assert profiler["waited_for_conversion_s"] < 0.05 + len(gaps) * (torch_ops.STARVED_WINDOW_S + 0.1)
    assert gaps and profiler["unrecorded_calls"] > 0
    calls = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    with_ops = {s.parent_id for s in run.spans if s.name == "aten::linear"} | {
        p.parent_id for p in run.spans if p.level == Level.LAYER and p.id in {s.parent_id for s in run.spans if s.name == "aten::linear"}
    }
    in_gap = [any(c.start_ns < end and c.end_ns > begin for begin, end in gaps) for c in calls]
    for call, gapped in zip(calls, in_gap, strict=True):
        assert (call.id in with_ops) != gapped, (call, gapped)
    assert sum(in_gap) == profiler["unrecorded_calls"]
    assert any(c.start_ns > gaps[0][1] and c.id in with_ops for c in calls), "no cycle ran after the first pause"
    assert any("its converter fell behind the program; rather than" in note for note in run.meta["limitations"])
    notes = analyze(run).findings.notes
    recorded = len(calls) - sum(in_gap)
    assert any(f"paused while its converter caught up: ops were recorded in {recorded} of" in n for n in notes), notes


def test_the_stop_converts_the_cycles_the_converter_has_not_begun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the session's stop, the cycles waiting for a busy converter are converted by the
    stopping thread beside it (the program is done with its model calls), and every op of
    every cycle reaches the run once."""
    import threading

    from mltrace.tracer.sources import torch_ops

    real_elsewhere = torch_ops._Converter._convert_elsewhere
    real_here = torch_ops._Converter._convert_here
    converted_by: list[str] = []

    def slow_elsewhere(self: torch_ops._Converter, path: Path) -> int | None:
        time.sleep(0.3)
        return real_elsewhere(self, path)

    def noted_here(self: torch_ops._Converter, path: Path) -> None:
        converted_by.append(threading.current_thread().name)
        real_here(self, path)

    monkeypatch.setattr(torch_ops._Converter, "_convert_elsewhere", slow_elsewhere)
    monkeypatch.setattr(torch_ops._Converter, "_convert_here", noted_here)
    monkeypatch.setenv("MLTRACE_OP_CYCLE_S", "0.01")
    run = _small_model_calls(tmp_path / "run", 40, 0.005)
    assert threading.main_thread().name in converted_by
    calls = [s for s in run.spans if s.level == Level.MODEL]
    assert len(calls) == 40
    assert len([s for s in run.spans if s.name == "aten::linear"]) == 40 - run.meta["torch_profiler"].get("unrecorded_calls", 0)


def test_a_converter_that_gets_a_core_is_waited_for_past_the_allowance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A converter behind the program but not starved (its process gets a core while the
    program waits: ``STARVED_CPU_SHARE``) is waited for as long as it takes: no pause, every
    call's ops recorded. Its CPU time reads as the wall clock here."""
    from mltrace.tracer.sources import torch_ops

    real = torch_ops._Converter._convert

    def slow(self: torch_ops._Converter, path: Path) -> None:
        time.sleep(0.3)
        real(self, path)

    monkeypatch.setattr(torch_ops._Converter, "_convert", slow)
    monkeypatch.setattr(torch_ops._ConverterProcess, "cpu_ns", lambda self: time.monotonic_ns())
    monkeypatch.setattr(torch_ops, "CYCLE_OPS_MAX", 1)
    monkeypatch.setattr(torch_ops, "BACKLOG_WAIT_FREE_S", 0.05)
    monkeypatch.setattr(torch_ops, "BACKLOG_WAIT_SHARE", 0.0)
    monkeypatch.setenv("MLTRACE_OP_CYCLE_S", "0.01")
    run = _small_model_calls(tmp_path / "run", 30, 0.005)
    profiler = run.meta["torch_profiler"]
    assert "unrecorded" not in profiler and profiler["waited_for_conversion_s"] > 0.3
    assert len([s for s in run.spans if s.name == "aten::linear"]) == 30
