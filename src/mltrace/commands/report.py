"""``mltrace report RUN``: the bottleneck report of a run (text, JSON, Markdown, or one HTML file)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mltrace.errors import UsageError
from mltrace.run.gcpause import gc_paused

if TYPE_CHECKING:
    from mltrace.analysis.bottleneck import Analysis
    from mltrace.run.store import Run

FORMATS = ("text", "json", "md")
#: Narrower than this, a table cannot show its headers.
MIN_WIDTH = 40


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "report",
        help="print the bottleneck report of a run directory (or write it as HTML)",
        description=(
            "The layers that cost most, each with its source, its op/library/kernel breakdown and a verdict "
            "(compute-, memory- or overhead-bound, from a roofline against this machine's measured peaks), "
            "idle gaps, data movement, framework overhead, and tables by layer type, op and kernel."
        ),
    )
    p.add_argument("run", metavar="RUN", help="run directory")
    p.add_argument("--top", type=int, default=15, help="rows per table (default 15)")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        help="text (default): tables for a terminal; json: the report's data (schema: docs/CONVENTIONS.md, "
        "'Report JSON'); md: Markdown to paste into a pull request",
    )
    p.add_argument(
        "--width",
        type=int,
        metavar="N",
        help="draw the text report N columns wide (default: COLUMNS, else the terminal's width; a pipe gets every line whole)",
    )
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report to FILE instead of printing")
    p.add_argument(
        "--include-cold",
        action="store_true",
        help="count every model call in the tables and verdicts; by default the cold calls (warm-up: compile, autotune, "
        "lazy init; docs/ANALYSIS.md) are shown apart and left out",
    )
    p.add_argument("--remeasure", action="store_true", help="measure this machine's peak FLOP/s and bandwidth again")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mltrace.analysis.bottleneck import analyze
    from mltrace.analysis.peaks import cache_dir, peaks_for_run, read_cached, this_host_key
    from mltrace.run.store import load_run

    if args.top < 1:
        raise UsageError("--top must be at least 1")
    if args.width is not None and args.width < MIN_WIDTH:
        raise UsageError(f"--width must be at least {MIN_WIDTH}")
    if args.html and args.format != "text":
        raise UsageError(f"--html and --format {args.format}: choose one")
    html_path = Path(args.html) if args.html else None
    if html_path is not None and html_path.is_dir():
        raise UsageError(f"--html {html_path}: is a directory (give a file name)")
    # A run is millions of small objects built once and never freed before exit.
    with gc_paused():
        _say_if_slow(Path(args.run))
        run_obj = load_run(args.run, cache_table=True)
        has_gpu = any(t.kind == "gpu_stream" for t in run_obj.tracks.values())
        peaks = None
        if run_obj.spans:  # nothing to judge in a run without spans: no peaks measured for it
            if args.remeasure or read_cached(this_host_key()) is None:
                sys.stderr.write(f"mltrace: measuring this machine's peak FLOP/s and bandwidth (once; cached in {cache_dir()})\n")
            peaks = peaks_for_run(run_obj.meta, has_gpu, remeasure=args.remeasure)
        analysis = analyze(run_obj, peaks, include_cold=args.include_cold)
        if html_path is None:
            _print(run_obj, analysis, args)
            return 0
        from mltrace.analysis.bottleneck import timeline
        from mltrace.viewers.html import render_html

        text = render_html(run_obj, analysis, timeline(run_obj), top=args.top)
    try:
        html_path.parent.mkdir(parents=True, exist_ok=True)
        html_path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--html {html_path}: {exc.strerror}") from None
    sys.stdout.write(f"HTML report: {html_path}\n")
    return 0


def _print(run_obj: Run, analysis: Analysis, args: argparse.Namespace) -> None:
    """Writes the report to stdout in ``args.format``."""
    if args.format == "text":
        from mltrace.viewers.terminal import render_report

        render_report(run_obj, analysis, top=args.top, width=args.width)
        return
    from mltrace.analysis.report_data import build_report

    data = build_report(run_obj, analysis)
    if args.format == "json":
        from mltrace.viewers.json_report import render_json

        sys.stdout.write(render_json(data))
    else:
        from mltrace.viewers.markdown import render_markdown

        sys.stdout.write(render_markdown(data, top=args.top))


def _say_if_slow(run_dir: Path) -> None:
    """Tells the user when the first report of a large run will take a while."""
    from mltrace.run.store import EVENTS_FILE, TABLE_FILE

    events = run_dir / EVENTS_FILE
    try:
        size = events.stat().st_size
    except OSError:
        return  # load_run says what is wrong
    if size >= 50_000_000 and not (run_dir / TABLE_FILE).exists():
        sys.stderr.write(
            f"mltrace: reading {EVENTS_FILE} ({size / 1e6:.0f} MB) and writing {TABLE_FILE} once; later reports of this run are quick\n"
        )
