"""``mltrace bricks RUN…``: model latency constructed from deduplicated layer benchmarks (DLBricks).

Examples::

    mltrace python --level layer -o runs/resnet examples/infer.py --model cnn
    mltrace bricks runs/resnet runs/encoder                 # layers, deduplicated across both
    mltrace bricks -H 3 --json bricks.json runs/resnet      # also sequences of up to 3 layers
    mltrace bricks --no-bench runs/resnet                   # counts only
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from mltrace.errors import UsageError

if TYPE_CHECKING:
    from mltrace.analysis.bricks import BrickSet, BricksReport


def add_parser(subparsers: Any) -> None:
    """Registers ``bricks`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "bricks",
        help="construct model latency from benchmarks of its unique layers (DLBricks)",
        description=(
            "Extract each model's leaf layers from traced runs (type, shapes, parameters, constructor arguments; never "
            "weights), deduplicate them across models, benchmark each unique layer in isolation, and compare the "
            "constructed model latency with the traced one. Runs must be traced at --level layer or deeper."
        ),
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (layer level or deeper; leveled runs work too)")
    p.add_argument("-H", "--granularity", type=int, default=1, metavar="H", help="also benchmark sequences of up to H layers (default 1)")
    p.add_argument("-n", type=int, default=10, metavar="N", help="timed calls per brick (default 10)")
    p.add_argument("--warmup", type=int, default=3, metavar="W", help="untimed calls per brick first (default 3)")
    p.add_argument(
        "--cache",
        choices=("cold", "warm"),
        default="cold",
        help="cold (default): cycle through copies so no call finds the last call's data cached, as inside a model; "
        "warm: back-to-back calls on the same data",
    )
    p.add_argument("--runtime", choices=("pytorch", "onnxruntime"), default="pytorch", help="where bricks run (default pytorch)")
    p.add_argument("--threads", type=int, metavar="T", help="torch intra-op threads while benchmarking")
    p.add_argument("--trace-warmup", type=int, default=1, metavar="W", help="model calls of each run skipped (default 1)")
    p.add_argument("--no-bench", action="store_true", help="extract and count only")
    p.add_argument("--json", metavar="FILE", help="also write the full result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Extracts, benchmarks and prints the bricks report."""
    from mltrace.analysis.bricks import extract, run_bricks
    from mltrace.run.store import load_run

    if args.granularity < 1 or args.n < 1 or args.warmup < 0 or args.trace_warmup < 0:
        raise UsageError("need -H >= 1, -n >= 1, --warmup >= 0 and --trace-warmup >= 0")
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be at least 1")
    runs = [load_run(p) for p in args.runs]
    if args.no_bench:
        try:
            bset = extract(runs, args.granularity, args.trace_warmup)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        print_counts(bset)
        if args.json:
            doc = {
                "format": "mltrace-bricks",
                "version": 1,
                "granularity": bset.granularity,
                "counts": _counts(bset),
                "bricks": [b.to_json() for b in bset.bricks],
            }
            Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        return 0
    try:
        import torch
    except ImportError:
        raise UsageError("benchmarking bricks needs PyTorch (pip install 'mltrace[torch]'); --no-bench counts without it") from None
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def progress(done: int, total: int) -> None:
        if done == total or done % 20 == 0:
            sys.stderr.write(f"mltrace bricks: benchmarked {done}/{total}\n")
            sys.stderr.flush()

    try:
        report = run_bricks(
            runs,
            granularity=args.granularity,
            warmup=args.warmup,
            n=args.n,
            runtime=args.runtime,
            cache=args.cache,
            trace_warmup=args.trace_warmup,
            progress=progress,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
        sys.stdout.write(f"results: {args.json}\n")
    return 0


def _counts(bset: BrickSet) -> dict[str, int]:
    return {
        "models": len(bset.models),
        "layers_total": bset.total_layers,
        "layers_unique": len(bset.bricks),
        "sequences_total": bset.total_sequences,
        "sequences_unique": len(bset.sequences),
    }


def print_counts(bset: BrickSet, file: IO[str] | None = None) -> None:
    """Prints total and unique layer (and sequence) counts per model and overall."""
    out = file or sys.stdout
    c = _counts(bset)
    out.write(f"{c['models']} model(s): {c['layers_total']} leaf-layer calls, {c['layers_unique']} unique layer bricks")
    if bset.granularity > 1:
        out.write(f"; {c['sequences_total']} sequences of up to {bset.granularity} layers, {c['sequences_unique']} unique")
    out.write("\n")
    for m in bset.models:
        out.write(f"  {m.model}: {len(m.layers)} layers, {len({lc.brick for lc in m.layers})} unique")
        if m.parallel:
            out.write(" (parallel branches)")
        out.write("\n")
    inferred = sum(1 for b in bset.bricks if b.config_source == "inferred")
    none = [b.type for b in bset.bricks if b.config_source == "none"]
    out.write(f"constructor arguments: {inferred} inferred from shapes and parameters, {len(bset.bricks) - inferred - len(none)} recorded")
    out.write(f", {len(none)} unknown ({', '.join(sorted(set(none)))})\n" if none else "\n")


def print_report(report: BricksReport, file: IO[str] | None = None) -> None:
    """Prints counts, constructed vs measured per model, and the benchmarking-time speedup."""
    out = file or sys.stdout
    print_counts(report.set, out)
    out.write(
        f"\nbricks on {report.runtime}, {report.extra.get('cache', 'cold')} cache, median of {report.n} calls after {report.warmup}\n"
    )
    out.write(f"{'model':<40} {'measured':>11} {'constructed':>12} {'ratio':>7}  method\n")
    for c in report.constructions:
        ratio = "-" if math.isnan(c.ratio) else f"{c.ratio:.3f}"
        note = f" ({c.from_trace} layer(s) from the trace)" if c.from_trace else ""
        out.write(f"{c.model[:40]:<40} {c.measured_ns / 1e6:>8.3f} ms {c.constructed_ns / 1e6:>9.3f} ms {ratio:>7}  {c.method}{note}\n")
    sp = report.speedup
    out.write(
        f"\nbenchmarking-time speedup: {'-' if math.isnan(sp) else f'{sp:.2f}x'} "
        f"(every model end to end: {report.end_to_end_cost_ns / 1e9:.3f} s; unique bricks: {report.bricks_cost_ns / 1e9:.3f} s; "
        f"{report.warmup + report.n} calls each); wall time spent on bricks, with construction: {report.bench_wall_s:.2f} s\n"
    )
    failed = [(b, t) for b, t in zip(report.set.bricks, report.timings) if t.median_ns is None]
    if failed:
        out.write(f"{len(failed)} brick(s) could not run alone (their traced latency was used):\n")
        for b, t in failed[:8]:
            out.write(f"  {b.type}: {t.error}\n")
