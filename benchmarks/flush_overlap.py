"""mltrace's flushes beside a generate() loop: what a flush costs, and how much longer the model
calls that overlap one run than those that do not.

Runs ``decode_fidelity.py``'s program (a small GPT-2 built from a config, ``--calls`` greedy
generate() calls of 16 new tokens after two warm-up calls, ``--threads`` torch threads) under
``mltrace python`` at the default level (every CPU level: the library level's MKL lines are
parsed on the flusher thread), ``--rounds`` times, a plain run before each traced one. From
each traced run's run.json ``flushes`` and its model calls (``analysis/flushes.py``, the cold
calls left out as the report leaves them): the flushes, the flusher's CPU time a flush, and per
phase (prefill, decode) the steady calls that overlapped a flush, with the medians of those and
of the others. The plain run's median token time is the program's own.

    python benchmarks/flush_overlap.py
    python benchmarks/flush_overlap.py --rounds 5 --calls 40 --threads 2 --json out.json
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from decode_fidelity import CHILD
from harness import add_json, loadavg, parser, run_child, write_json


def overlap_rows(run_dir: Path) -> dict[str, Any]:
    """One traced run's flushes and, per generate phase, its steady calls against them."""
    from mltrace.analysis.coldstart import find_cold_start
    from mltrace.analysis.flushes import flush_intervals
    from mltrace.run.levels import Level
    from mltrace.run.store import load_run

    run = load_run(run_dir)
    summary = run.meta.get("flushes") or {}
    intervals = flush_intervals(run.meta)
    cold = {(m.name, i) for m in find_cold_start(run).models for i in (*m.cold, *m.failed)}
    calls = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    index: dict[str, int] = {}
    phases: dict[str, dict[str, list[float]]] = {}
    for span in calls:
        i = index[span.name] = index.get(span.name, -1) + 1
        if (span.name, i) in cold:
            continue
        phase = str((span.attrs or {}).get("ml.generate.phase", "call"))
        hit = any(b < span.end_ns and e > span.start_ns for b, e in intervals)
        phases.setdefault(phase, {"with": [], "without": []})["with" if hit else "without"].append((span.end_ns - span.start_ns) / 1e6)
    count = int(summary.get("count", 0))
    row: dict[str, Any] = {
        "flushes": count,
        "flusher_cpu_ms": summary.get("cpu_ns", 0) / 1e6,
        "cpu_ms_a_flush": summary.get("cpu_ns", 0) / 1e6 / max(count, 1),
        "library_lines": ((run.meta.get("sources_info") or {}).get("cpu.library") or {}).get("lines", 0),
    }
    for phase, groups in phases.items():
        row[phase] = {
            "steady": len(groups["with"]) + len(groups["without"]),
            "overlapped": len(groups["with"]),
            "with_flush_median_ms": statistics.median(groups["with"]) if groups["with"] else None,
            "without_median_ms": statistics.median(groups["without"]) if groups["without"] else None,
        }
    return row


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=30, help="timed generate() calls per run")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads in the program")
    p.add_argument("--flush-interval", type=float, help="mltrace's --flush-interval (default: its own)")
    add_json(p)
    args = p.parse_args()
    child_args = [str(args.layers), str(args.calls), str(args.threads)]
    options = ["--flush-interval", str(args.flush_interval)] if args.flush_interval else []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mltrace-flush-") as tmp:
        script = Path(tmp) / "decode.py"
        script.write_text(CHILD)
        for i in range(args.rounds):
            _, plain_token, _ = (float(x) for x in run_child([sys.executable, str(script), *child_args]).result_line())
            out = Path(tmp) / f"run{i}"
            cmd = [sys.executable, "-m", "mltrace", "python", "-q", "-o", str(out), *options, str(script), *child_args]
            run_child(cmd, env=dict(os.environ))
            row = overlap_rows(out)
            row["plain_token_ms"] = plain_token / 1e6
            rows.append(row)
            print(f"round {i + 1} of {args.rounds} done (load {loadavg()})", file=sys.stderr)
    print(f"GPT-2 {args.layers}x128, 16 new tokens, {args.calls} timed calls a run, {args.threads} torch thread(s), {args.rounds} rounds")
    for i, row in enumerate(rows):
        line = f"round {i + 1}: {row['flushes']} flushes, {row['cpu_ms_a_flush']:.2f} ms CPU a flush, {row['library_lines']} library lines"
        for phase in ("prefill", "decode", "call"):
            if phase in row:
                g = row[phase]
                with_ms = "n/a" if g["with_flush_median_ms"] is None else f"{g['with_flush_median_ms']:.2f}"
                without_ms = "n/a" if g["without_median_ms"] is None else f"{g['without_median_ms']:.2f}"
                line += f"; {phase} {g['overlapped']} of {g['steady']} overlapped, median {with_ms} ms against {without_ms} ms"
        print(line + f"; plain token median {row['plain_token_ms']:.2f} ms")
    write_json(args.json, {"rounds": rows})


if __name__ == "__main__":
    main()
