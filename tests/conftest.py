"""Shared fixtures: leak checks for hooks, and a runner for the CLI as users run it."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Machine peaks measured by the report are cached; keep the suite's cache out of ~/.cache
# (subprocesses inherit this), in a folder removed when the run ends.
if "MLTRACE_CACHE_DIR" not in os.environ:
    _CACHE_DIR = tempfile.mkdtemp(prefix="mltrace-test-cache-")
    os.environ["MLTRACE_CACHE_DIR"] = _CACHE_DIR
    atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
SCRIPTS = Path(__file__).resolve().parent / "scripts"
#: Whether the layer level's C hot path (``mltrace._layercall``) is built here.
HAVE_LAYERCALL = importlib.util.find_spec("mltrace._layercall") is not None


@pytest.fixture(params=["c", "python"])
def hot_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The layer level's hot path a test runs with: the C helper (skipped where it is not
    built), then the Python wrapper."""
    from mltrace.tracer.sources.torch_modules import HOT_PATH_ENV

    if request.param == "c" and not HAVE_LAYERCALL:
        pytest.skip("the C helper mltrace._layercall is not built here")
    monkeypatch.setenv(HOT_PATH_ENV, request.param)
    return str(request.param)


@pytest.fixture(autouse=True)
def no_leaked_hooks() -> Iterator[None]:
    """Fails any test that leaves a profiler hook, import hook or session behind."""
    meta_path = list(sys.meta_path)
    profile = sys.getprofile()
    yield
    from mltrace.tracer import session

    assert session.active_session() is None, "a session was left running"
    assert list(sys.meta_path) == meta_path, "an import hook was left on sys.meta_path"
    assert sys.getprofile() is profile, "a profile hook was left installed"
    if "torch" in sys.modules:
        from torch.nn.modules import module as m

        assert not m._global_forward_pre_hooks, "a global forward pre-hook leaked"
        assert not m._global_forward_hooks, "a global forward hook leaked"
        assert m.Module.__call__ is m.Module._wrapped_call_impl, "nn.Module.__call__ was left wrapped"


def mltrace_cmd(*args: str) -> list[str]:
    """The command line a user would type, through this interpreter."""
    return [sys.executable, "-m", "mltrace", *args]


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    """Runs ``mltrace ARGS`` in a subprocess and captures its output (bytes)."""
    full_env = dict(os.environ)
    full_env.pop("MLTRACE_OUTPUT", None)
    full_env.update(env or {})
    return subprocess.run(mltrace_cmd(*args), cwd=cwd, capture_output=True, timeout=timeout, env=full_env, stdin=subprocess.DEVNULL)


def run_plain(script: Path, *args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[bytes]:
    """Runs the script with plain Python, for comparison."""
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
