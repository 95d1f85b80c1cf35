"""mltrace's own helper processes (the op level's converter, the streamed finish): their start
(``start_helper``), their environment, the traced process's without what would make mltrace
follow them as children of the program (``MLTRACE_FOLLOW``, the bootstrap folder on
``PYTHONPATH``), with mltrace's own folder first on ``PYTHONPATH``; their lower CPU priority;
their end; a forked child's letting go of their pipes.

A helper runs in a process group of its own, so that the terminal's Ctrl-C goes to the program
alone, but in the program's session: Linux's autogroup scheduling (``sched_autogroup_enabled``)
gives each session an equal share of the CPU and weighs a process's nice value only against the
others of its session, so a helper in a session of its own took a core from the program's
threads whatever its nice value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from mltrace.settings import FOLLOW, HELPER_NICE
from mltrace.tracer import c_environ


def start_helper(module: str, *args: str) -> subprocess.Popen[bytes]:
    """Starts ``python -m module args`` as a helper (the module docstring), its stdin and stdout
    pipes to this process and its stderr discarded (a helper says what failed in its answers;
    where the library level captures fd 1 and 2, it would hold the capture's pipe open), and
    lowers its priority (``lower_priority``) before its interpreter has started in earnest.
    Raises OSError where it cannot start."""
    with c_environ.own_child():  # the follow wrapper leaves its environment as it is
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=helper_process_env(),
            close_fds=True,
            **_own_process_group(),
        )
    lower_priority(proc.pid)
    return proc


def _own_process_group() -> dict[str, Any]:
    """``Popen``'s arguments for a process group of its own in this session (Python 3.11+); a
    session of its own before (``process_group`` is new in 3.11, and ``preexec_fn`` is unsafe in
    a process with threads)."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"start_new_session": True}


def helper_process_env() -> dict[str, str]:
    """The environment to start a helper process with (the module docstring)."""
    env = dict(os.environ)
    env.pop(FOLLOW.name, None)
    package_root = str(Path(__file__).resolve().parents[2])
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not p.rstrip("/").endswith("follow/bootstrap")]
    env["PYTHONPATH"] = os.pathsep.join([package_root, *kept])
    return env


def end_helper(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Closes the helper's pipes (the end of its input) and reaps it; one that does not end in
    ``timeout_s`` is killed."""
    for pipe in (proc.stdin, proc.stdout):
        try:
            if pipe is not None:
                pipe.close()
        except OSError:
            pass
    if not wait_for_exit(proc, timeout_s):
        proc.kill()
    proc.wait()


def wait_for_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether ``proc`` ended within ``timeout_s`` (it is not reaped). Wakes as it ends, through
    a pidfd where the system has one: ``Popen.wait(timeout)`` polls at up to 50 ms intervals,
    which the end of a traced program would wait for each helper."""
    import select

    if proc.returncode is not None:
        return True
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # not Linux 5.3+, or already reaped
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(pidfd)


def forget_helper(proc: subprocess.Popen[bytes]) -> None:
    """In a forked child of the traced process: closes its copies of the helper's pipes (the
    helper then sees the end of its input when the traced process closes its own), touching
    nothing else."""
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            try:
                os.close(pipe.fileno())
            except (OSError, ValueError):
                pass
    proc.stdin = proc.stdout = None


#: A helper's ``nice`` increment where ``MLTRACE_HELPER_NICE`` says none: the lowest priority
#: there is (nice 19). Beside a program that wants every core, a helper at 10 steps below it
#: still stretched the model calls it ran beside (docs/PERFORMANCE.md, "The helper processes'
#: priority"); at 19, where the program leaves a core idle (between calls, at its end) the
#: helper still has all of it.
DEFAULT_NICE = 19


def lower_priority(pid: int) -> int:
    """Lowers process ``pid``'s CPU priority (a helper's, right after its start, by the traced
    process) by ``MLTRACE_HELPER_NICE`` below the caller's (19 where unset or not an integer; 0
    or less leaves it): where the traced program's threads want every core, the scheduler runs
    them first, so the helper's start and work stretch no model call it measures. Returns the
    increment applied."""
    text = (HELPER_NICE.get() or "").strip()
    try:
        increment = int(text) if text else DEFAULT_NICE
    except ValueError:
        increment = DEFAULT_NICE
    if increment <= 0 or not hasattr(os, "setpriority"):
        return 0
    try:
        os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + increment))
    except OSError:
        return 0
    return increment
