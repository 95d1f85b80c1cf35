"""Hard stops, end to end in subprocesses: forked children, signals during the run and the
finish, ``os._exit``. Each test runs the program as a user would and checks its exit status,
its output and the run directory it leaves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import mltrace
from conftest import SCRIPTS, mltrace_cmd
from mltrace.run.levels import Level

FORK_EXIT = SCRIPTS / "fork_exit.py"
#: A hang is a failure: no test here needs more than this, even on a loaded machine.
HANG_S = 120


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MLTRACE_OUTPUT", None)
    env.pop("PYTHONUNBUFFERED", None)  # C stdio buffered, as in a real pipe
    return env


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=HANG_S, env=_env(), stdin=subprocess.DEVNULL)


needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@needs_fork
@pytest.mark.parametrize("follow", [True, False], ids=["follow", "no-follow"])
@pytest.mark.parametrize("level", [None, "model"])
def test_a_forked_child_that_exits_never_hangs(tmp_path: Path, level: str | None, follow: bool) -> None:
    """At the default level torch.profiler runs: its Kineto configuration thread is not in the
    child, whose C++ teardown used to wait for it forever. The children leave with their own
    status, their C stdio output is kept, and the parent's run is whole. Followed (the default),
    each child's three calls are merged into the run on its own process; with --no-follow the
    run has the parent's calls only."""
    pytest.importorskip("torch")
    args = ["python", "-q", *([] if follow else ["--no-follow"]), "-o", str(tmp_path / "run")]
    args += [*(["--level", level] if level else []), str(FORK_EXIT), "7"]
    res = _run(mltrace_cmd(*args), tmp_path)
    assert res.returncode == 0, res.stderr
    for status in (7, 0):
        assert f"child {status} done" in res.stdout
        assert f"child {status} wrote through C stdio" in res.stdout
        assert f"parent: child status {status}" in res.stdout
    assert res.stdout.rstrip().endswith("parent done")
    assert not (tmp_path / "run" / "procs").exists()
    run = mltrace.load_run(tmp_path / "run")
    assert run.complete and run.meta["exit_status"] == 0
    models = Counter(run.tracks[s.track_id].pid for s in run.spans if s.level == Level.MODEL)
    if follow:
        main, *children = run.meta["processes"]
        assert main["pid"] == run.meta["pid"] and len(children) == 2
        assert all(c["start"] == "fork" and c["finished"] and c["ppid"] == main["pid"] for c in children)
        assert models == {main["pid"]: 2, children[0]["pid"]: 3, children[1]["pid"]: 3}
    else:
        assert "processes" not in run.meta
        assert models == {run.meta["pid"]: 2}  # the parent's calls only
    if level is None:
        ops = {run.tracks[s.track_id].pid for s in run.spans if s.level == Level.OP}
        assert run.meta["pid"] in ops
        if follow:  # each child ran torch.profiler in its own session
            assert ops == set(models)


@needs_fork
def test_a_forked_child_of_a_profiled_region_never_hangs(tmp_path: Path) -> None:
    """``mltrace.profile()`` around a fork, and a fork after it ended: both children exit."""
    pytest.importorskip("torch")
    res = _run([sys.executable, str(FORK_EXIT), "profile", str(tmp_path / "run")], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "parent: child status 5" in res.stdout and "parent: child status 6" in res.stdout
    assert "child 6 wrote through C stdio" in res.stdout
    assert mltrace.load_run(tmp_path / "run").complete


SIGNAL_LOOP = SCRIPTS / "signal_loop.py"


def _start_loop(out: Path, *extra: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        mltrace_cmd("python", "-q", "--flush-interval", "0.2", "-o", str(out), *extra, str(SIGNAL_LOOP)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=_env(),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == "ready\n", proc.communicate(timeout=HANG_S)
    time.sleep(0.5)  # more than the flush interval
    return proc


def _no_mltrace_traceback(stderr: str) -> None:
    """The program's own traceback may name mltrace's layer wrapper; mltrace's finish may not appear."""
    for frame in ("mltrace/cli.py", "mltrace/tracer/session.py", "mltrace/tracer/finishguard.py", "__main__.py"):
        assert frame not in stderr, stderr


@pytest.mark.parametrize(
    ("signals", "status"),
    [
        ((signal.SIGINT, signal.SIGINT), -2),
        ((signal.SIGTERM, signal.SIGTERM), -15),
        ((signal.SIGINT, signal.SIGINT, signal.SIGINT, signal.SIGINT), -2),
    ],
)
def test_repeated_signals_keep_the_status_and_the_spans(tmp_path: Path, signals: tuple[int, ...], status: int) -> None:
    """A second (third, fourth) signal 0.15 s after the first, as an impatient user sends them:
    the program's own status, no traceback of mltrace's, and a readable run with the op spans
    the session held (a small run's finish ends within the grace, or its spans were written
    before it was cut short)."""
    pytest.importorskip("torch")
    out = tmp_path / "run"
    proc = _start_loop(out)
    for i, sig in enumerate(signals):
        if i:
            time.sleep(0.15)
        proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=HANG_S)
    assert proc.returncode == status, stderr
    _no_mltrace_traceback(stderr)
    run = mltrace.load_run(out)
    assert run.complete or run.meta["stopped_early"]["signal"] == signal.Signals(signals[0]).name
    assert run.meta["exit_status"] == status
    levels = {s.level for s in run.spans}
    assert Level.MODEL in levels and Level.OP in levels


def test_a_signal_cuts_a_long_finish_short(tmp_path: Path) -> None:
    """A finish that outlasts the grace (a source whose stop takes minutes) is cut short: the
    program's status, what was streamed kept, run.json says where the finish stopped."""
    script = tmp_path / "slow_finish.py"
    script.write_text(SLOW_FINISH)
    out = tmp_path / "run"
    pipe = subprocess.PIPE
    argv = [sys.executable, str(script), str(out)]
    proc = subprocess.Popen(argv, stdout=pipe, stderr=pipe, stdin=subprocess.DEVNULL, text=True, env=_env())
    assert proc.stdout is not None
    assert proc.stdout.readline() == "finishing\n", proc.communicate(timeout=HANG_S)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, stderr  # the program handled it: its own status
    assert "SIGTERM during the finish: stopped early" in stderr
    assert "after stop: SIGTERM handler restored" in stdout
    run = mltrace.load_run(out)
    assert not run.complete
    assert run.meta["stopped_early"] == {"signal": "SIGTERM", "during": "stopping slow"}
    assert [s.name for s in run.spans if s.level == Level.USER] == ["streamed"]
    assert not list(out.glob("*.tmp"))


SLOW_FINISH = """
import signal, sys, time
import mltrace
from mltrace.config import ProfileOptions
from mltrace.tracer.session import Session
from mltrace.tracer.sources.base import Source

class Slow(Source):
    name = "slow"
    levels = ()
    def available(self): return None
    def start(self, session): pass
    def stop(self):
        for _ in range(6000):  # 60 s of Python: the grace cuts it short
            time.sleep(0.01)
        return []

mine = lambda s, f: None
signal.signal(signal.SIGTERM, mine)
session = Session(ProfileOptions.build(output=sys.argv[1], summary=True, flush_interval_s=0.05), sources=[Slow()]).start()
with mltrace.span("streamed"):
    pass
time.sleep(0.3)
print("finishing", flush=True)
session.stop()
print("after stop: SIGTERM handler", "restored" if signal.getsignal(signal.SIGTERM) is mine else "lost", flush=True)
"""


def test_os_exit_finishes_the_trace_first(tmp_path: Path) -> None:
    """``os._exit(7)`` runs no ``finally``: the session's wrapper finishes the run before the
    process ends, op spans and Perfetto trace included, with the program's status."""
    pytest.importorskip("torch")
    out = tmp_path / "run"
    res = _run(mltrace_cmd("python", "-q", "-o", str(out), str(SIGNAL_LOOP), "_exit", "7"), tmp_path)
    assert res.returncode == 7, res.stderr
    assert res.stdout.endswith("leaving\n")
    _no_mltrace_traceback(res.stderr)
    assert (out / "trace.pftrace").is_file()
    run = mltrace.load_run(out)
    assert run.complete and run.meta["exit_status"] == 7 and run.meta["exit_via"] == "os._exit"
    assert sum(1 for s in run.spans if s.level == Level.MODEL) == 21
    assert any(s.level == Level.OP for s in run.spans)


def test_os_exit_is_put_back_after_the_session(tmp_path: Path) -> None:
    """The wrapper is in place only while a session runs."""
    from mltrace.config import ProfileOptions
    from mltrace.tracer.session import Session

    original = os._exit
    session = Session(ProfileOptions.build(output=tmp_path / "run", summary=False), sources=[]).start()
    try:
        assert os._exit is not original
    finally:
        session.stop()
    assert os._exit is original
