"""``mltrace export RUN``: send a finished run over OTLP, or write it in another format.

Examples::

    mltrace export mltrace-runs/infer-20250101-120000 --otlp                 # OTEL_* or localhost:4317
    mltrace export RUN --otlp http://jaeger:4318 --protocol http
    mltrace export RUN --format jaeger-json -o resnet.json                 # Jaeger UI → Upload JSON
    mltrace export RUN --format perfetto -o resnet.pftrace
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mltrace.errors import UsageError

#: Formats written to a file, with the default file name inside the run directory.
FORMATS = {
    "jaeger-json": "trace.jaeger.json",
    "chrome-json": "trace.chrome.json",
    "perfetto": "export.pftrace",
}


def add_parser(subparsers: Any) -> None:
    """Registers ``export`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "export",
        help="send a run over OTLP (Jaeger, an OpenTelemetry Collector) or write it as Jaeger JSON, Chrome JSON or Perfetto",
        description="Send a finished run over OTLP, or write it in another format. Nothing is re-run.",
    )
    p.add_argument("run", metavar="RUN", nargs="?", help="run directory")
    p.add_argument(
        "--otlp",
        nargs="?",
        const="",
        metavar="URL",
        help="send every span over OTLP to URL (default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else localhost:4317 / :4318)",
    )
    p.add_argument(
        "--protocol",
        choices=("grpc", "http", "http/protobuf"),
        help="OTLP transport (default: OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, else HTTP for port 4318 or a /v1/traces URL, else gRPC)",
    )
    p.add_argument(
        "--trace-per",
        choices=("invocation", "run"),
        default="invocation",
        help="one trace per model invocation (default) or one for the whole run",
    )
    p.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="longest wait on a down or stalled OTLP receiver (default: OTEL_EXPORTER_OTLP_TIMEOUT, else 5)",
    )
    p.add_argument("--format", choices=tuple(FORMATS), help="write the run in this format")
    p.add_argument("-o", "--output", metavar="DEST", help="file to create, or an existing directory (default: inside RUN)")
    p.set_defaults(func=run)


def _destination(run_dir: Path, fmt: str, output: str | None) -> Path:
    default_name = FORMATS[fmt]
    if output is None:
        dest = run_dir / default_name
    else:
        dest = Path(output)
        if dest.is_dir():
            dest = dest / default_name
    if dest.exists():
        raise UsageError(f"{dest} exists; mltrace export never overwrites (give another -o)")
    if not dest.parent.is_dir():
        raise UsageError(f"cannot write {dest}: no directory {dest.parent}")
    return dest


def _write(run_obj: Any, fmt: str, dest: Path, trace_per: str) -> Path:
    if fmt == "jaeger-json":
        from mltrace.exporters.jaeger_json import export_jaeger_json

        return export_jaeger_json(run_obj, dest, trace_per=trace_per)
    if fmt == "chrome-json":
        from mltrace.exporters.chrome_json import export_chrome_json

        return export_chrome_json(run_obj, dest)
    from mltrace.run.perfetto import export_perfetto

    return export_perfetto(run_obj, dest)


def run(args: argparse.Namespace) -> int:
    """Runs ``mltrace export``; returns 0, or 1 when spans could not be delivered.

    Raises:
        UsageError: no run, nothing to do, an unreadable run, or an existing destination.
    """
    from mltrace.run.store import RunError, load_run

    run_arg, otlp = args.run, args.otlp
    if run_arg is None and otlp and Path(otlp).is_dir():
        run_arg, otlp = otlp, ""  # "mltrace export --otlp RUN": the run was taken as the URL
    if run_arg is None:
        raise UsageError("export needs a run directory: mltrace export RUN [--otlp [URL]] [--format FORMAT] [-o DEST]")
    if otlp is None and args.format is None:
        raise UsageError("nothing to export: give --otlp [URL] and/or --format jaeger-json|chrome-json|perfetto")
    if args.output is not None and args.format is None:
        raise UsageError("-o needs --format (OTLP sends to a URL, not a file)")
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError("--timeout must be a positive number of seconds")
    try:
        run_obj = load_run(run_arg)
    except RunError as exc:
        raise UsageError(str(exc)) from None
    if not run_obj.complete:
        why = "it ended in a torn write" if run_obj.torn else "it did not finish normally"
        sys.stderr.write(f"mltrace: note: {run_obj.path} is incomplete ({why}); exporting what was recorded\n")

    status = 0
    if args.format is not None:
        dest = _destination(run_obj.path, args.format, args.output)
        try:
            written = _write(run_obj, args.format, dest, args.trace_per)
        except FileExistsError:
            raise UsageError(f"{dest} exists; mltrace export never overwrites (give another -o)") from None
        except OSError as exc:
            raise UsageError(f"cannot write {dest}: {exc.strerror or exc}") from None
        print(f"mltrace: wrote {len(run_obj.spans)} spans as {args.format} to {written}")

    if otlp is not None:
        from mltrace.exporters.otlp import export_otlp

        result = export_otlp(
            run_obj,
            otlp or None,
            protocol=args.protocol,
            trace_per=args.trace_per,
            timeout_s=args.timeout,
        )
        # a failure has already been logged as one warning line by export_otlp
        if result.spans_sent or result.ok:
            print(f"mltrace: {result.summary()}")
        if not result.ok:
            status = 1
    return status
