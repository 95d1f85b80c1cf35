"""The traced program sees the environment it has without mltrace (``tracer/c_environ.py``): its
``os.environ`` holds none of the variables mltrace sets for the libraries (``ONEDNN_VERBOSE_TIMESTAMP``
at the library level) or for following its children (``MLTRACE_FOLLOW``, the bootstrap on
``PYTHONPATH``), and a user's value mltrace overrides reads as the user's. A child it starts
through ``subprocess`` has the same environment, plus the follow variables where it is followed
(docs/ARCHITECTURE.md, "The program's environment")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import run_cli

PROGRAM = """\
import json, os, subprocess, sys
show = "import json, os; print(json.dumps(dict(os.environ), sort_keys=True))"
print(json.dumps(dict(os.environ), sort_keys=True))
for env in (None, dict(os.environ)):
    out = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True, check=True).stdout
    print(out, end="")
"""

#: The user's own values: one that mltrace overrides in the C environment at the library level.
USERS = {"ONEDNN_VERBOSE_TIMESTAMP": "0", "PYTHONPATH": "/nowhere/users-path", "MLTRACE_OUTPUT": ""}

FOLLOW_VARIABLES = ("MLTRACE_FOLLOW", "PYTHONPATH")


def _environments(stdout: bytes) -> list[dict[str, Any]]:
    """The program's environment, its child's (``env=None``) and its copy's (``env=os.environ``)."""
    return [json.loads(line) for line in stdout.decode().splitlines()]


def _without_follow(env: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in env.items() if k not in FOLLOW_VARIABLES}


@pytest.mark.parametrize("level", ["model", "library"])
def test_program_sees_the_environment_it_has_without_mltrace(tmp_path: Path, level: str) -> None:
    script = tmp_path / "environ.py"
    script.write_text(PROGRAM)
    env = {**os.environ, **USERS}
    plain = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    traced = run_cli("python", "-q", "--level", level, "-o", str(tmp_path / "run"), str(script), cwd=tmp_path, env=USERS)
    assert plain.returncode == traced.returncode == 0, traced.stderr.decode()
    (program, *children), (plain_program, *plain_children) = _environments(traced.stdout), _environments(plain.stdout)
    assert program == plain_program
    assert program["ONEDNN_VERBOSE_TIMESTAMP"] == "0" and "MLTRACE_FOLLOW" not in program
    for child, plain_child in zip(children, plain_children, strict=True):
        # A followed child: the follow spec, and the bootstrap before the user's PYTHONPATH.
        assert _without_follow(child) == _without_follow(plain_child)
        assert json.loads(child["MLTRACE_FOLLOW"])["run"] == str((tmp_path / "run").resolve())
        assert child["PYTHONPATH"].split(os.pathsep)[1:] == [USERS["PYTHONPATH"]]
        assert child["PYTHONPATH"].split(os.pathsep)[0].endswith(os.path.join("follow", "bootstrap"))


def test_unfollowed_children_see_the_programs_environment(tmp_path: Path) -> None:
    """With ``--no-follow`` a child started with an environment the program built has exactly it."""
    script = tmp_path / "environ.py"
    script.write_text(PROGRAM)
    traced = run_cli("python", "-q", "--no-follow", "-o", str(tmp_path / "run"), str(script), cwd=tmp_path, env=USERS)
    assert traced.returncode == 0, traced.stderr.decode()
    program, _, copied = _environments(traced.stdout)
    assert copied == program and "MLTRACE_FOLLOW" not in program
