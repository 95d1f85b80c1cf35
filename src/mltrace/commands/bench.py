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
from typing import IO, TYPE_CHECKING, Any

from mltrace.errors import UsageError

if TYPE_CHECKING:
    from mltrace.analysis.leveled import LeveledResult
    from mltrace.analysis.sweep import SweepResult


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


# -- text rendering (draws; computes nothing) --------------------------------


def _ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.3f} ms"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def print_leveled(result: LeveledResult, file: IO[str] | None = None) -> None:
    """Prints the leveled figures: per model, per level, with inflations and mismatches."""
    from mltrace.run.levels import Level

    out = file or sys.stdout
    levels = result.levels
    out.write(f"leveled runs: {', '.join(lv.label for lv in levels)}; 20% trimmed means after {result.warmup} warm-up call(s)\n")
    out.write("a level's time sums its leaf layers (layer level) or its outermost spans (other levels)\n")
    for label, why in result.skipped.items():
        out.write(f"  level {label} skipped: {why}\n")
    for m in result.models:
        out.write(f"\n{m.label}\n")
        if m.plain is not None:
            out.write(
                f"  plain (uninstrumented): median {_ms(m.plain.median_ns)}, trimmed mean {_ms(m.plain.mean_ns)}, "
                f"spread ±{m.plain.spread_pct:.1f}% (n={m.plain.n})\n"
            )
        head = f"  {'level':<8} {'leveled':>12}  " + "  ".join(f"{'in ' + lv.label + ' run':>14}" for lv in levels)
        out.write(head + "\n")
        for lt in m.levels:
            cells = []
            for lv in levels:
                if lv not in lt.by_run_ns:
                    cells.append(f"{'':>14}")
                elif lv == lt.source:
                    cells.append(f"{'(estimate)':>14}")
                else:
                    cells.append(f"{_pct(lt.inflation_pct(lv)):>14}")
            out.write(f"  {lt.level.label:<8} {_ms(lt.estimate_ns):>12}  " + "  ".join(cells) + "\n")
        model_row = m.level(Level.MODEL)
        if m.plain is not None and model_row is not None:
            full = model_row.by_run_ns.get(result.deepest)
            full_pct = 100.0 * (full / m.plain.median_ns - 1) if full is not None and m.plain.median_ns else None
            out.write(
                f"  vs plain median: leveled model {_pct(m.vs_plain_pct(Level.MODEL))}, "
                f"sum of leaf layers {_pct(m.vs_plain_pct(Level.LAYER))}, naive full trace ({result.deepest.label}) {_pct(full_pct)}\n"
            )
            if m.round_ratios:
                out.write(
                    f"  round by round (model-level run / plain run of the same round, median of {len(m.round_ratios)}): "
                    f"leveled model {_pct(m.paired_vs_plain_pct)}\n"
                )
    if result.overflows:
        out.write(f"\n{len(result.overflows)} parent(s) shorter than their children's estimates (children scaled to fit):\n")
        for o in result.overflows[:5]:
            out.write(f"  {o.model}: {o.path}: children {_ms(o.children_ns)} > parent {_ms(o.parent_ns)} (scale {o.scale:.3f})\n")
    if result.mismatches:
        out.write(f"\n{len(result.mismatches)} mismatch(es) across runs:\n")
        for x in result.mismatches[:10]:
            where = f" {x.path}" if x.path else ""
            out.write(f"  [{x.kind}] {x.model}:{where} {x.detail}\n")
        if len(result.mismatches) > 10:
            out.write(f"  … {len(result.mismatches) - 10} more in leveled.json\n")
    else:
        out.write("\nevery span matched across runs\n")


def print_sweep(result: SweepResult, file: IO[str] | None = None) -> None:
    """Prints one row per scenario and model: p50/p90/p99 latency and throughput."""
    out = file or sys.stdout
    out.write(f"{result.n} measured calls per scenario after {result.warmup} warm-up; trace level {result.level}\n")
    out.write(f"{'scenario':<18} {'model':<36} {'calls':>5} {'p50 ms':>10} {'p90 ms':>10} {'p99 ms':>10} {'samples/s':>11}\n")
    for s in result.scenarios:
        if s.status != 0 or not s.models:
            why = f"failed (exit {s.status})" if s.status != 0 else "no model calls traced"
            detail = s.error.splitlines()[-1] if s.error else ""
            out.write(f"{s.spec.label:<18} {why}: {detail}\n")
            continue
        for m in s.models:
            out.write(
                f"{s.spec.label:<18} {m.model[:36]:<36} {m.calls:>5} {m.p50_ms:>10.3f} {m.p90_ms:>10.3f} {m.p99_ms:>10.3f} "
                f"{m.throughput:>11.1f}\n"
            )
