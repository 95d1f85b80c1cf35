"""``mltrace bench``: leveled experimentation and scenario sweeps.

Examples::

    mltrace bench --leveled -n 20 examples/mobilenet.py            # model; +layer; +op; … one run each
    mltrace bench --batch 1,2,4,8 --precision fp32,bf16 --threads 1,2 examples/mobilenet.py
    mltrace bench examples/mobilenet.py --iters 5                  # one scenario (the defaults)

Everything from SCRIPT on belongs to the script. Scripts read the scenario
through ``mltrace.bench.scenario()`` (or the ``MLTRACE_BATCH``,
``MLTRACE_PRECISION``, ``MLTRACE_THREADS`` and ``MLTRACE_ITERS`` variables).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mltrace.errors import UsageError


def add_parser(subparsers: Any) -> None:
    """Registers ``bench`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark a script: --leveled (overhead-free per-level latencies) or a batch/precision/threads sweep",
        description=(
            "Run SCRIPT in fresh subprocesses and measure its model calls. --leveled runs it once per level "
            "(model; +layer; +op; …) plus once uninstrumented and builds a trace where every span lasts its "
            "overhead-free estimate. Otherwise it runs one traced scenario per point of the --batch × "
            "--precision × --threads grid and writes a table, an SVG plot and a manifest."
        ),
    )
    p.add_argument("--leveled", action="store_true", help="leveled experimentation instead of a sweep")
    p.add_argument("-n", type=int, default=10, metavar="N", help="measured model calls per model and run (default 10)")
    p.add_argument("--warmup", type=int, default=2, metavar="W", help="model calls dropped first in each process (default 2)")
    p.add_argument("--rounds", type=int, default=1, metavar="R", help="--leveled: repeat every run R times, interleaved (default 1)")
    p.add_argument("--levels", metavar="L,L,…", help="--leveled: levels to run (default: every available level)")
    p.add_argument("--batch", metavar="B,B,…", help="batch sizes to sweep (default 1)")
    p.add_argument("--precision", metavar="P,P,…", help="precisions to sweep: fp32, fp16, bf16, int8 (default fp32)")
    p.add_argument("--threads", metavar="T,T,…", help="thread counts to sweep (default: the framework's)")
    p.add_argument("--level", default="model", help="sweep: trace level of each scenario's run (default model)")
    p.add_argument("-o", "--output", metavar="DIR", help="output directory (absent or empty)")
    p.add_argument("--name", help="name of the output (default: the script's stem)")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="limit per subprocess")
    p.add_argument(
        "--steady-malloc",
        action="store_true",
        help="run every subprocess with glibc heap trimming off and a fixed mmap threshold, so memory-bound "
        "models do not pay page faults that depend on allocation history (docs/METHODS.md)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("script", metavar="SCRIPT", help="the script to benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's arguments")
    p.set_defaults(func=run)


def _ints(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--{what} takes a comma list of integers, not {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"--{what} values must be integers >= 1")
    return values


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark and prints its summary."""
    from mltrace.bench import BenchError, run_leveled, run_sweep
    from mltrace.viewers.bench import print_leveled, print_sweep

    progress = None if args.quiet else sys.stderr
    sweep_opts = [o for o in ("batch", "precision", "threads") if getattr(args, o) is not None]
    try:
        if args.leveled:
            if sweep_opts:
                raise UsageError(f"--leveled runs one scenario; drop --{sweep_opts[0]} (or run the sweep without --leveled)")
            levels = [x.strip() for x in args.levels.split(",") if x.strip()] if args.levels else None
            report = run_leveled(
                args.script,
                args.args,
                n=args.n,
                warmup=args.warmup,
                rounds=args.rounds,
                levels=levels,
                output=args.output,
                name=args.name,
                progress=progress,
                timeout_s=args.timeout,
                steady_malloc=args.steady_malloc,
            )
            print_leveled(report.result)
            sys.stdout.write(f"leveled trace: {report.path}/trace.pftrace   results: {report.path}/leveled.json\n")
            return 0
        if args.levels or args.rounds != 1:
            raise UsageError("--levels and --rounds go with --leveled")
        precision = [x.strip().lower() for x in args.precision.split(",") if x.strip()] if args.precision else ["fp32"]
        parsed_threads = _ints(args.threads, "threads")
        threads: list[int | None] = list(parsed_threads) if parsed_threads else [None]
        sweep = run_sweep(
            args.script,
            args.args,
            batch=_ints(args.batch, "batch") or [1],
            precision=precision,
            threads=threads,
            n=args.n,
            warmup=args.warmup,
            level=args.level,
            output=args.output,
            name=args.name,
            progress=progress,
            timeout_s=args.timeout,
            steady_malloc=args.steady_malloc,
        )
    except BenchError as exc:
        sys.stderr.write(f"mltrace: error: {exc}\n")
        return 1
    print_sweep(sweep.result)
    p = sweep.path
    sys.stdout.write(f"table: {p}/sweep.csv   plot: {p}/sweep.svg   manifest: {p}/manifest.json   traces: {p}/scenarios/\n")
    failed = [s for s in sweep.result.scenarios if s.status != 0]
    return 1 if failed and len(failed) == len(sweep.result.scenarios) else 0
