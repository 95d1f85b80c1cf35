"""``mltrace merge RUN... -o OUT``: several run directories as one run.

Runs of the processes of one program that were traced apart, or of the hosts of a
multi-host job, become one run with a process track each (``run/merge.py``). Times are put on
the first run's clock: as they are for runs of one host since one boot (one CLOCK_MONOTONIC),
else through each run's clock anchor, so the hosts' epoch clocks must agree (NTP, PTP) to the
precision wanted. The merged run is correlated and written as a finished run.

Examples::

    mltrace merge host0-run host1-run -o job-run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mltrace.errors import UsageError


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "merge",
        help="merge run directories into one run (processes, hosts)",
        description="Merge run directories into one run: a process track each, one clock.",
    )
    p.add_argument("runs", metavar="RUN", nargs="+", help="run directories (the first one's clock and metadata lead)")
    p.add_argument("-o", "--output", metavar="DIR", required=True, help="run directory to create (must be absent or empty)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mltrace.finish import finalize_run
    from mltrace.run import store
    from mltrace.run.gcpause import gc_paused
    from mltrace.run.merge import merge_runs
    from mltrace.tracer.session import prepare_run_dir

    if len(args.runs) < 2:
        raise UsageError("merge needs two run directories or more")
    if len({Path(r).resolve() for r in args.runs}) < len(args.runs):
        raise UsageError("a run directory is given twice")
    with gc_paused():
        merged = merge_runs([store.load_run(r) for r in args.runs])
        out = prepare_run_dir(Path(args.output))
        store.write_meta(out, merged.meta)
        store.write_events_atomically(out / store.EVENTS_FILE, merged)
        finalize_run(out, merged.meta)
    sys.stdout.write(f"merged {len(args.runs)} runs ({merged.span_count:,} spans, {len(merged.meta['processes'])} processes) into {out}\n")
    return 0
