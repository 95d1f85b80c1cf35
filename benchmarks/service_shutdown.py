"""How long a served model takes to exit after SIGTERM, plain and under ``mltrace python`` at the
default level, in interleaved rounds, medians reported.

The service (this file with ``--serve``) is a threaded ``http.server`` running a small torch MLP;
a client in the same process sends REQUESTS requests, CONCURRENCY at a time, then the service
prints ``served`` and waits. Like a uvicorn app, it handles SIGTERM itself: the handler sets an
event, the main thread shuts the server down and returns (``--default-sigterm`` leaves SIGTERM's
default action: the plain process dies at once; the traced one finishes its trace through
mltrace's handler, then dies by the signal too, without atexit handlers or teardown).
The benchmark sends SIGTERM once ``served`` arrives and times until the process has exited, split
at two marks: the service's ``atexit`` handler (it writes the clock and the number of modules
loaded to stderr; it runs after the program and, traced, after mltrace's finish, before the
interpreter tears its modules down) and, traced, the session's stop (run.json
``stopped_at_epoch_ns``). So a round is: the program's own shutdown (and the session's stop),
then the finish (loading the event stream, correlating, writing trace.pftrace, spans.bin and
run.json), then the interpreter's teardown.

    python benchmarks/service_shutdown.py                      # 5 rounds, 40 requests, 8-way
    python benchmarks/service_shutdown.py --rounds 3 --requests 200
    python benchmarks/service_shutdown.py --default-sigterm    # a service that leaves SIGTERM alone
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def serve(requests: int, concurrency: int, own_sigterm: bool) -> None:
    """The service: serve, send ``requests`` requests to itself, print ``served``, wait for SIGTERM."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)).eval()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's method name
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            with torch.no_grad():
                label = int(torch.argmax(model(torch.randn(4, 64))[0]))
            payload = json.dumps({"label": label}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    import atexit
    import os

    atexit.register(lambda: os.write(2, f"atexit {time.monotonic_ns()} {len(sys.modules)}\n".encode()))
    stop = threading.Event()
    if own_sigterm:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"

    def post(_: int) -> None:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"{}"), timeout=60) as r:
            r.read()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(post, range(requests)))
    print("served", flush=True)
    while not stop.wait(0.05):
        pass
    server.shutdown()
    server.server_close()


@dataclass
class Round:
    """One round's times in seconds from SIGTERM: to the session's stop (traced), to the
    service's atexit handler (None where the process died by the signal, as a plain service with
    SIGTERM's default action does), to the exit; and the modules loaded at exit."""

    stop_s: float | None
    atexit_s: float | None
    exit_s: float
    modules: int | None


def one_round(cmd: list[str], run_dir: Path | None) -> Round:
    """Starts the service, waits for ``served``, sends SIGTERM and times the way out."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "served":
        proc.kill()
        raise SystemExit(f"service_shutdown: the service said {line!r}, not 'served'")
    time.sleep(0.5)  # let the flusher settle, as a service that has been idle a moment
    sent_epoch, t0 = time.time_ns(), time.monotonic_ns()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    t1 = time.monotonic_ns()
    marks = [ln.split() for ln in err.splitlines() if ln.startswith("atexit ")]
    if not marks and proc.returncode != -signal.SIGTERM:
        raise SystemExit(f"service_shutdown: the service exited with {proc.returncode} and its atexit handler did not run")
    stop = None
    if run_dir is not None:
        stopped = json.loads((run_dir / "run.json").read_text()).get("stopped_at_epoch_ns")
        stop = (int(stopped) - sent_epoch) / 1e9 if isinstance(stopped, int) else None
    if not marks:
        return Round(stop, None, (t1 - t0) / 1e9, None)
    return Round(stop, (int(marks[-1][1]) - t0) / 1e9, (t1 - t0) / 1e9, int(marks[-1][2]))


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s"


def _summary(label: str, rounds: list[Round]) -> str:
    """``traced  3.37 s  (rounds …): stop 0.62 s, finish 0.40 s, teardown 2.35 s (2105 modules)``."""
    exits = [r.exit_s for r in rounds]
    marked = [(r.stop_s, r.atexit_s, r.exit_s, r.modules) for r in rounds if r.atexit_s is not None]
    if not marked:
        stopped = [r.stop_s for r in rounds if r.stop_s is not None]
        at = f", session stop at {_median(stopped)}" if stopped else ""
        return f"  {label} {_median(exits)}  (rounds: {', '.join(f'{x:.2f}' for x in exits)}): killed by the signal{at}"
    parts = []
    stops = [(stop, at) for stop, at, _, _ in marked if stop is not None]
    if stops:
        parts += [f"session stop at {_median([s for s, _ in stops])}", f"finish {_median([at - s for s, at in stops])}"]
    else:
        parts.append(f"program's own shutdown {_median([at for _, at, _, _ in marked])}")
    parts.append(f"teardown {_median([end - at for _, at, end, _ in marked])} ({marked[0][3]} modules)")
    return f"  {label} {_median(exits)}  (rounds: {', '.join(f'{x:.2f}' for x in exits)}): " + ", ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--default-sigterm", action="store_true", help="the service leaves SIGTERM's default action")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.requests, args.concurrency, not args.default_sigterm)
        return
    service = [__file__, "--serve", "--requests", str(args.requests), "--concurrency", str(args.concurrency)]
    service += ["--default-sigterm"] if args.default_sigterm else []
    plain: list[Round] = []
    traced: list[Round] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            plain.append(one_round([sys.executable, *service], None))
            run_dir = Path(tmp) / f"run{i}"
            traced.append(one_round([sys.executable, "-m", "mltrace", "python", "-q", "-o", str(run_dir), *service], run_dir))
    mode = "default SIGTERM" if args.default_sigterm else "the service's own SIGTERM handler"
    print(
        f"SIGTERM to exit, {args.requests} requests {args.concurrency}-way served, {mode}, medians of {args.rounds} (seconds from SIGTERM):"
    )
    print(_summary("plain ", plain))
    print(_summary("traced", traced))


if __name__ == "__main__":
    main()
