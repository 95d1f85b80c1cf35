"""Hard stops, end to end in subprocesses: forked children, signals during the run and the
finish, ``os._exit``. Each test runs the program as a user would and checks its exit status,
its output and the run directory it leaves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import mltrace
from conftest import SCRIPTS, mltrace_cmd
from mltrace.tracer.levels import Level

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
@pytest.mark.parametrize("level", [None, "model"])
def test_a_forked_child_that_exits_never_hangs(tmp_path: Path, level: str | None) -> None:
    """At the default level torch.profiler runs: its Kineto configuration thread is not in the
    child, whose C++ teardown used to wait for it forever. The children leave with their own
    status, their C stdio output is kept, and the parent's run is whole."""
    pytest.importorskip("torch")
    args = ["python", "-q", "-o", str(tmp_path / "run"), *(["--level", level] if level else []), str(FORK_EXIT), "7"]
    res = _run(mltrace_cmd(*args), tmp_path)
    assert res.returncode == 0, res.stderr
    for status in (7, 0):
        assert f"child {status} done" in res.stdout
        assert f"child {status} wrote through C stdio" in res.stdout
        assert f"parent: child status {status}" in res.stdout
    assert res.stdout.rstrip().endswith("parent done")
    run = mltrace.load_run(tmp_path / "run")
    assert run.complete and run.meta["exit_status"] == 0
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert len(models) == 2  # the parent's calls only
    if level is None:
        assert any(s.level == Level.OP for s in run.spans)


@needs_fork
def test_a_forked_child_of_a_profiled_region_never_hangs(tmp_path: Path) -> None:
    """``mltrace.profile()`` around a fork, and a fork after it ended: both children exit."""
    pytest.importorskip("torch")
    res = _run([sys.executable, str(FORK_EXIT), "profile", str(tmp_path / "run")], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "parent: child status 5" in res.stdout and "parent: child status 6" in res.stdout
    assert "child 6 wrote through C stdio" in res.stdout
    assert mltrace.load_run(tmp_path / "run").complete
