"""``mltrace diff RUN_A RUN_B``: what changed from run A to run B.

Layer by layer, layer type by type, op by op and kernel by kernel: added,
removed, slower, faster, with call counts and times; totals per level.

Examples::

    mltrace diff mltrace-runs/bs1 mltrace-runs/bs8
    mltrace diff fp32 bf16 --threshold 0.05 --top 30
"""

from __future__ import annotations

import argparse
from typing import Any

from mltrace.errors import UsageError
from mltrace.run.gcpause import gc_paused


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "diff",
        help="compare two runs layer by layer and op by op",
        description="Compare run B against run A: layers, layer types, ops and GPU kernels added, removed, slower or faster.",
    )
    p.add_argument("run_a", metavar="RUN_A", help="the reference run directory")
    p.add_argument("run_b", metavar="RUN_B", help="the run directory compared with it")
    p.add_argument("--top", type=int, default=15, help="rows per table (default 15)")
    p.add_argument("--threshold", type=float, default=0.10, help="relative change that counts (default 0.10 = 10%%)")
    p.add_argument("--min-delta-us", type=float, default=1.0, help="absolute change below which a row is unchanged, µs (default 1)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--per-call", dest="per_call", action="store_const", const=True, help="compare times per model call")
    mode.add_argument("--totals", dest="per_call", action="store_const", const=False, help="compare total times")
    p.set_defaults(func=run, per_call=None)


def run(args: argparse.Namespace) -> int:
    from mltrace.analysis.diff import diff_runs
    from mltrace.run.store import load_run
    from mltrace.viewers.terminal import render_diff

    if args.top < 1:
        raise UsageError("--top must be at least 1")
    if not args.threshold >= 0:
        raise UsageError("--threshold must be 0 or more")
    if not args.min_delta_us >= 0:
        raise UsageError("--min-delta-us must be 0 or more")
    with gc_paused():  # millions of objects, none of them garbage
        a = load_run(args.run_a)
        b = load_run(args.run_b)
        d = diff_runs(a, b, threshold=args.threshold, min_delta_ns=int(args.min_delta_us * 1000), per_call=args.per_call)
    render_diff(d, top=args.top)
    return 0
