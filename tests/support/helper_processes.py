"""Where the kernel runs one of mltrace's helper processes (``tracer/helper_env.py``), for tests."""

from __future__ import annotations

import os
from pathlib import Path


def parent_pid(pid: int) -> int:
    """Process ``pid``'s parent (from ``/proc/PID/stat``)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def placement(pid: int) -> dict[str, object]:
    """How helper ``pid`` stands against its parent (the traced process): whether it is in the
    parent's session and autogroup (so that its nice value weighs against the program's
    threads), whether it leads a process group of its own (the terminal's Ctrl-C goes to the
    program alone), and how many nice steps below the parent it runs."""
    parent = parent_pid(pid)
    autogroup = Path(f"/proc/{pid}/autogroup")
    return {
        "same_session": os.getsid(pid) == os.getsid(parent),
        "same_autogroup": not autogroup.exists() or _group(pid) == _group(parent),
        "own_group": os.getpgid(pid) == pid,
        "nice_below_parent": os.getpriority(os.PRIO_PROCESS, pid) - os.getpriority(os.PRIO_PROCESS, parent),
    }


def _group(pid: int) -> str:
    """The autogroup ``pid`` is in (``/autogroup-N``, its nice value left out); empty where the
    kernel shows none because the process's cgroup, not an autogroup, holds its scheduling."""
    words = Path(f"/proc/{pid}/autogroup").read_text().split()
    return words[0] if words else ""


def default_nice_below(pid: int) -> int:
    """How many nice steps below its parent helper ``pid`` runs by default: down to nice 19."""
    return 19 - os.getpriority(os.PRIO_PROCESS, parent_pid(pid))
