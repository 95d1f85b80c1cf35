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
import sys
from pathlib import Path
from typing import Any

from mltrace.errors import UsageError


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
    p.add_argument(
        "--statistic",
        choices=("median", "mean"),
        default="median",
        help="of the bricks' calls and the traced model calls (default median; mean is stretched by preemption in "
        "proportion to a call's length, the model's and the bricks' alike, so it is less biased on a busy machine)",
    )
    p.add_argument(
        "--basis",
        choices=("auto", "cpu", "wall"),
        default="auto",
        help="what constructed/measured compares: cpu, the calling thread's CPU time (the work, not stretched when a "
        "busy machine preempts it; the latency only with one intra-op thread); wall, the wall clock (comparable on an "
        "idle machine); auto (default): cpu where models and bricks ran on one thread and the runs recorded it, else wall",
    )
    p.add_argument("--runtime", choices=("pytorch", "onnxruntime"), default="pytorch", help="where bricks run (default pytorch)")
    p.add_argument("--threads", type=int, metavar="T", help="torch intra-op threads while benchmarking (default: those the runs used)")
    p.add_argument("--trace-warmup", type=int, default=1, metavar="W", help="model calls of each run skipped (default 1)")
    p.add_argument("--no-bench", action="store_true", help="extract and count only")
    p.add_argument("--json", metavar="FILE", help="also write the full result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Extracts, benchmarks and prints the bricks report."""
    from mltrace.analysis.bricks import extract
    from mltrace.run.store import load_run
    from mltrace.viewers.bricks import brick_counts, print_counts, print_report

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
                "counts": brick_counts(bset),
                "bricks": [b.to_json() for b in bset.bricks],
            }
            Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        return 0
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UsageError("benchmarking bricks needs PyTorch (pip install 'mltrace[torch]'); --no-bench counts without it") from None
    from mltrace.brickbench import run_bricks

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
            threads=args.threads,
            statistic=args.statistic,
            basis=args.basis,
            progress=progress,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
        sys.stdout.write(f"results: {args.json}\n")
    return 0
