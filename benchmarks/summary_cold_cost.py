"""The end-of-run summary's CPU time with and without the cold-start pass it now runs.

Traces 3,000 calls of a 20-block MLP at the op level (about 0.9 million spans), then times,
side by side on the same span table (thread CPU time, median of 5 rounds, the table's tree
cache cleared before each): the summary as it was before it left cold calls out (from git,
``--before REV``), the summary now, and ``find_cold_start`` alone.

    python benchmarks/summary_cold_cost.py --before da3fab9^
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROGRAM = """
import torch, torch.nn as nn
torch.manual_seed(0)
m = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(20)]).eval()
x = torch.randn(4, 32)
with torch.no_grad():
    for _ in range(3000):
        m(x)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="git revision whose analysis/summary.py is the baseline")
    args = ap.parse_args()
    import mltrace
    from mltrace.analysis.coldstart import find_cold_start
    from mltrace.analysis.summary import summarize

    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        old = home / "old_summary.py"
        old.write_text(
            subprocess.run(
                ["git", "show", f"{args.before}:src/mltrace/analysis/summary.py"], check=True, capture_output=True, text=True
            ).stdout
        )
        spec = importlib.util.spec_from_file_location("old_summary", old)
        assert spec is not None and spec.loader is not None
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
        (home / "prog.py").write_text(PROGRAM)
        subprocess.run(
            [sys.executable, "-m", "mltrace", "python", "-q", "--level", "op", "-o", str(home / "run"), str(home / "prog.py")], check=True
        )
        run = mltrace.load_run(home / "run")
        t = run.table
        print(f"spans {len(t):,}, cold calls {summarize(run, table=t)['cold_calls']}")
        cases = {
            "summary before": lambda: before.summarize(run, table=t),
            "summary now": lambda: summarize(run, table=t),
            "find_cold_start alone": lambda: find_cold_start(run.replace(spans=None, table=t)),
        }
        times: dict[str, list[int]] = {k: [] for k in cases}
        for _ in range(5):
            for name, case in cases.items():
                t.cache.clear()
                t0 = time.thread_time_ns()
                case()
                times[name].append(time.thread_time_ns() - t0)
        for name, ns in times.items():
            print(f"{name}: median {statistics.median(ns) / 1e6:.0f} ms CPU")


if __name__ == "__main__":
    main()
