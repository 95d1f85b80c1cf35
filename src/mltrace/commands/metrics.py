"""``mltrace metrics tta``: time to accuracy and ATTMT from a training log.

Examples::

    mltrace metrics tta --thresholds 70:77:1 train_log.csv
    mltrace metrics tta --thresholds 0.5:0.3:0.05 --metric loss --lower-is-better log.jsonl
    mltrace metrics tta --thresholds 70:77:1 mltrace-runs/train-20250101-120000   # its metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mltrace.errors import UsageError


def add_parser(subparsers: Any) -> None:
    """Registers ``metrics`` (with its ``tta`` subcommand) on the CLI's subparsers."""
    p = subparsers.add_parser(
        "metrics",
        help="training metrics from a log: time to accuracy (TTA) and ATTMT",
        description="Metrics computed from a training log (CSV or JSONL with a time column and a metric column).",
    )
    sub = p.add_subparsers(dest="metrics_command", metavar="METRIC", parser_class=type(p))
    t = sub.add_parser(
        "tta",
        help="TTA(θ) and ATTMT(θ) for thresholds START:STOP:STEP",
        description=(
            "For each threshold θ_k from START to STOP: TTA(θ_k), the first time the metric reaches θ_k, and "
            "ATTMT(θ_k), the mean of TTA(θ_1 … θ_k). Times are in the log's unit."
        ),
    )
    t.add_argument("log", metavar="LOG", help="CSV or JSONL training log, or a run directory with metrics.jsonl")
    t.add_argument("--thresholds", required=True, metavar="START:STOP:STEP", help="thresholds, e.g. 70:77:1 (or a comma list)")
    t.add_argument("--metric", default="accuracy", help="the metric's column or key (default: accuracy)")
    t.add_argument("--time-column", metavar="COL", help="the time column (default: the first of time, time_s, elapsed, …)")
    t.add_argument(
        "--lower-is-better",
        action="store_true",
        help="the metric improves downwards (loss): reaching θ means value <= θ; give thresholds from high to low",
    )
    t.add_argument("--json", action="store_true", help="print the table as JSON")
    t.set_defaults(func=run_tta)
    p.set_defaults(func=_no_metric, metrics_parser=p)


def _no_metric(args: argparse.Namespace) -> int:
    raise UsageError("metrics needs a metric to compute (choose from: tta)")


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def run(args: argparse.Namespace) -> int:
    """Dispatches to the chosen metric (the CLI calls ``args.func`` directly)."""
    return int(args.func(args))


def run_tta(args: argparse.Namespace) -> int:
    """Prints the TTA/ATTMT table of ``args.log``."""
    from mltrace.analysis.metrics import MetricLogError, parse_thresholds, read_metric_log, tta_table

    higher = not args.lower_is_better
    try:
        thresholds = parse_thresholds(args.thresholds)
        if args.lower_is_better and ":" in args.thresholds:
            thresholds.reverse()  # loss improves downwards: θ_1 is the easiest, i.e. the highest
        log = read_metric_log(args.log, args.metric, args.time_column)
    except MetricLogError as exc:
        raise UsageError(str(exc)) from None
    if not log.points:
        raise UsageError(f"{log.source}: no numeric {log.metric!r} values")
    rows = tta_table(log.points, thresholds, higher)
    if args.json:
        doc = {
            "log": log.source,
            "metric": log.metric,
            "time_column": log.time_column,
            "points": len(log.points),
            "higher_is_better": higher,
            "rows": [{"threshold": r.threshold, "tta": r.tta, "attmt": r.attmt} for r in rows],
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    out = sys.stdout
    out.write(f"{log.metric} from {log.source} ({len(log.points)} points, time column {log.time_column!r})\n")
    width = max(9, *(len(_fmt(r.threshold)) for r in rows))
    out.write(f"{'threshold':>{width}}  {'TTA':>10}  {'ATTMT':>10}\n")
    for r in rows:
        tta = _fmt(r.tta) if r.tta is not None else "not reached"
        out.write(f"{_fmt(r.threshold):>{width}}  {tta:>10}  {_fmt(r.attmt):>10}\n")
    unreached = [r for r in rows if r.tta is None]
    if unreached:
        best = max(v for _, v in log.points) if higher else min(v for _, v in log.points)
        out.write(
            f"{len(unreached)} threshold(s) never reached (best {log.metric}: {_fmt(best)}); ATTMT is undefined from the first of them\n"
        )
    return 0
