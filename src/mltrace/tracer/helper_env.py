"""The environment of mltrace's own helper processes (the op level's converter, the streamed
finish): the traced process's, without what would make mltrace follow them as children of the
program (``MLTRACE_FOLLOW``, the bootstrap folder on ``PYTHONPATH``), with mltrace's own folder
first on ``PYTHONPATH``."""

from __future__ import annotations

import os
from pathlib import Path

from mltrace.settings import FOLLOW


def helper_process_env() -> dict[str, str]:
    """The environment to start a helper process with (the module docstring)."""
    env = dict(os.environ)
    env.pop(FOLLOW.name, None)
    package_root = str(Path(__file__).resolve().parents[2])
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not p.rstrip("/").endswith("follow/bootstrap")]
    env["PYTHONPATH"] = os.pathsep.join([package_root, *kept])
    return env
