"""mltrace's own helper processes (the op level's converter, the streamed finish): their
environment, the traced process's without what would make mltrace follow them as children of
the program (``MLTRACE_FOLLOW``, the bootstrap folder on ``PYTHONPATH``), with mltrace's own
folder first on ``PYTHONPATH``; their end; a forked child's letting go of their pipes; and the
converter's lower CPU priority."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from mltrace.settings import FOLLOW, OP_CONVERTER_NICE


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


#: The converter's ``nice`` increment where ``MLTRACE_OP_CONVERTER_NICE`` says none.
DEFAULT_NICE = 10


def lower_priority(pid: int) -> int:
    """Lowers process ``pid``'s CPU priority (the converter process's, right after its start, by
    the traced process) by ``MLTRACE_OP_CONVERTER_NICE`` below the caller's (10 where unset or
    not an integer; 0 or less leaves it): where the traced program's threads want every core,
    the scheduler runs them first, so the process's start and conversions stretch no model
    call it measures. Returns the increment applied."""
    text = (OP_CONVERTER_NICE.get() or "").strip()
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
