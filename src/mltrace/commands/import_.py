"""``mltrace import FILE -o RUN``: a torch.profiler (Kineto) trace → an mltrace run.

Examples::

    mltrace import trace.json.gz -o mltrace-runs/resnet-a100
    mltrace import worker0.pt.trace.json          # → ./mltrace-runs/worker0-<YYYYmmdd-HHMMSS>/

The run then works with every other command: ``mltrace report RUN``,
``mltrace view RUN``, ``mltrace export RUN …``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mltrace.errors import UsageError


def add_parser(subparsers: Any) -> None:
    """Registers ``import`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "import",
        help="turn a torch.profiler (Kineto) trace (.json or .json.gz) into an mltrace run",
        description=(
            "Turn a torch.profiler (Kineto) Chrome-trace file into an mltrace run directory: ops, CUDA API calls, "
            "kernels, memcpys and memsets, each kernel linked to its launch and its op."
        ),
    )
    p.add_argument("file", metavar="FILE", help="the Kineto trace (.json or .json.gz)")
    p.add_argument(
        "-o",
        "--output",
        metavar="RUN",
        help="run directory to create, absent or empty (default: ./mltrace-runs/<file name>-<YYYYmmdd-HHMMSS>)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Runs ``mltrace import``; returns 0, or 1 when the run could not be finalized.

    Raises:
        UsageError: a missing input, or an output that exists and is not an empty directory.
        RunError: an input that is not a readable Kineto trace (nothing is written).
    """
    from mltrace.importers import import_kineto
    from mltrace.run.store import read_meta
    from mltrace.tracer.session import default_run_dir

    src = Path(args.file)
    if not src.exists():
        raise UsageError(f"{src}: no such file")
    if src.is_dir():
        raise UsageError(f"{src} is a directory; give the trace file (.json or .json.gz)")
    dest = Path(args.output) if args.output else default_run_dir(src.name.split(".")[0] or "import")
    run_dir = import_kineto(src, dest)
    meta = read_meta(run_dir)
    stats = meta.get("kineto", {})
    spans = stats.get("spans_by_category", {})
    gpu = stats.get("gpu_activities", 0)
    linked = stats.get("gpu_activities_launched", 0)
    parts = [f"{sum(spans.values())} spans"]
    if spans.get("cpu_op"):
        parts.append(f"{spans['cpu_op']} ops")
    if gpu:
        parts.append(f"{gpu} GPU activities, {linked} linked to their launch")
    print(f"mltrace: imported {src} → {run_dir} ({', '.join(parts)})")
    return 0 if meta.get("complete") else 1
