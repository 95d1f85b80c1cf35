"""``mltrace report RUN``: the bottleneck report of a run."""

from __future__ import annotations

import argparse
from typing import Any

from mltrace.errors import UsageError


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("report", help="print the report of a run directory")
    p.add_argument("run", metavar="RUN", help="run directory")
    p.add_argument("--top", type=int, default=15, help="rows per table (default 15)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mltrace.viewers.terminal import print_report

    if args.top < 1:
        raise UsageError("--top must be at least 1")
    print_report(args.run, top=args.top)
    return 0
