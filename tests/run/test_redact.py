"""Secret-looking values out of the run directory and OTLP, as a user runs mltrace."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import mltrace
from conftest import mltrace_cmd
from mltrace.run.redact import REDACTED, looks_secret, redact_command
from mltrace.run.store import Run

SCRIPT = """
import os
import subprocess
import sys
import mltrace
print("argv", sys.argv[1:], flush=True)
with mltrace.span("request", api_key="{key}", batch=8):
    pass
pid = os.fork()  # a followed child with a session of its own (procs/<pid>/)
if pid == 0:
    with mltrace.span("child request", api_key="{key}"):
        pass
    sys.exit(0)
os.waitpid(pid, 0)
# a followed child that imports no framework: only named in the run (procs/process-<pid>.json)
subprocess.run([sys.executable, "-c", "pass", *sys.argv[1:]], check=True)
"""
SECRETS = ("abc123tok", "hunter2pw", "bearer-xyz", "s3cretdb", "k3yval")
needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (the script forks a followed child)")


def _trace(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = tmp_path / "serve.py"
    script.write_text(SCRIPT.replace("{key}", "k3yval"))
    out = tmp_path / "run"
    args = ["--token=abc123tok", "--password", "hunter2pw", "Authorization: Bearer bearer-xyz", "--batch", "8"]
    full_env = {**os.environ, "MLTRACE_DB_PASS": "s3cretdb", "OMP_NUM_THREADS": "2", **env}
    full_env.pop("MLTRACE_OUTPUT", None)
    cmd = mltrace_cmd("python", "-q", "--level", "model", "-o", str(out), str(script), *args)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=full_env, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    return res, out


def _children(run: Run) -> tuple[dict[str, Any], dict[str, Any]]:
    """The forked child's and the subprocess's entries in run.json's ``processes``."""
    main, forked, sub = run.meta["processes"]
    assert main["role"] == "main" and forked.get("start") == "fork" and forked["spans"] > 0
    assert sub["spans"] == 0 and sub["command"][:3] == [sys.executable, "-c", "pass"]
    return forked, sub


@needs_fork
def test_no_secret_reaches_the_run_directory(tmp_path: Path) -> None:
    res, out = _trace(tmp_path, {})
    assert "abc123tok" in res.stdout and "hunter2pw" in res.stdout  # the program sees its own arguments
    # The followed children's folders and notes are merged, then removed: nothing else is left.
    assert sorted(p.name for p in out.iterdir()) == ["events.jsonl", "run.json", "spans.bin", "trace.pftrace"]
    for path in out.rglob("*"):
        data = path.read_bytes()
        for secret in SECRETS:
            assert secret.encode() not in data, f"{secret} in {path.relative_to(out)}"
    run = mltrace.load_run(out)
    redacted = ["--token=[redacted]", "--password", REDACTED, "Authorization: [redacted]", "--batch", "8"]
    assert run.meta["command"][-6:] == redacted
    forked, sub = _children(run)
    assert forked["command"][-6:] == sub["command"][-6:] == redacted  # the children's command lines too
    assert run.meta["environment"]["MLTRACE_DB_PASS"] == REDACTED
    assert run.meta["environment"]["OMP_NUM_THREADS"] == "2"
    (span,) = [s for s in run.spans if s.name == "request"]
    assert span.attrs["api_key"] == REDACTED and span.attrs["batch"] == 8
    (child_span,) = [s for s in run.spans if s.name == "child request"]
    assert child_span.attrs["api_key"] == REDACTED
    assert run.tracks[child_span.track_id].pid == forked["pid"] != run.tracks[span.track_id].pid


@needs_fork
def test_otlp_command_args_are_redacted(tmp_path: Path) -> None:
    pytest.importorskip("opentelemetry.proto")
    from mltrace.exporters.otlp import resource_attributes

    _, out = _trace(tmp_path, {})
    args = resource_attributes(mltrace.load_run(out))["process.command_args"]
    assert "--token=[redacted]" in args and not any(s in " ".join(args) for s in SECRETS)


@needs_fork
def test_redaction_can_be_switched_off(tmp_path: Path) -> None:
    _, out = _trace(tmp_path, {"MLTRACE_REDACT": "0"})
    run = mltrace.load_run(out)
    assert "--token=abc123tok" in run.meta["command"] and "hunter2pw" in run.meta["command"]
    for child in _children(run):
        assert "--token=abc123tok" in child["command"] and "hunter2pw" in child["command"]
    (span,) = [s for s in run.spans if s.name == "request"]
    assert span.attrs["api_key"] == "k3yval"
    (child_span,) = [s for s in run.spans if s.name == "child request"]
    assert child_span.attrs["api_key"] == "k3yval"
    assert run.meta["environment"]["MLTRACE_DB_PASS"] == REDACTED  # variables: always


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-o", "run", "x.py"], ["-o", "run", "x.py"]),
        (["--secret", "s", "--n", "3"], ["--secret", REDACTED, "--n", "3"]),
        (["token=t", "path=/a"], [f"token={REDACTED}", "path=/a"]),
        (["--api-key=", "--keep"], ["--api-key=", "--keep"]),
        (["Authorization:Basic x"], [f"Authorization:{REDACTED}"]),
    ],
)
def test_redact_command(argv: list[str], expected: list[str]) -> None:
    assert redact_command(argv) == expected


@pytest.mark.parametrize("name", ["GITHUB_TOKEN", "db_pass", "--password", "AWS_SECRET_ACCESS_KEY", "Authorization", "MLTRACE_DB_PASS"])
def test_secret_names(name: str) -> None:
    assert looks_secret(name)


@pytest.mark.parametrize("name", ["OMP_NUM_THREADS", "--batch", "bypass", "passes", "MLTRACE_LEVEL", "/srv/infer.py"])
def test_plain_names(name: str) -> None:
    assert not looks_secret(name)
