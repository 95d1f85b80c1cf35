"""What the op level's converter process does to the model calls it measures, at two priorities.

The op level converts each stopped cycle of torch.profiler in a process of its own, which
runs while the program goes on. Where the program wants every core (torch's intra-op threads
on all of them), that process takes cores from the program's model calls and stretches them.
This runs one CPU-bound program (a small CNN, torch threads = cores, 60 timed calls after 5
untimed ones) three ways in interleaved rounds:

- plain: ``python prog.py``;
- nice 0: ``mltrace python --level op`` with ``MLTRACE_OP_CONVERTER_NICE=0`` (the converter at
  the program's priority);
- nice 10: the same with the default (the converter 10 steps below).

The program times each call itself (``time.perf_counter``); this prints, per way, the median
over rounds of the calls' median and p90, and the loop's wall time, against plain.

    python benchmarks/converter_priority.py [--rounds 6]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import harness
from harness import rotation

PROGRAM = """
import json, os, sys, time, torch
from torch import nn
torch.set_num_threads(os.cpu_count() or 1)
net = nn.Sequential(*[m for _ in range(6) for m in (nn.Conv2d(32, 32, 3, padding=1), nn.ReLU())]).eval()
x = torch.randn(4, 32, 48, 48)
times = []
with torch.inference_mode():
    for _ in range(5):
        net(x)
    t0 = time.perf_counter()
    for _ in range(60):
        t = time.perf_counter()
        net(x)
        times.append(time.perf_counter() - t)
    loop = time.perf_counter() - t0
json.dump({"calls": times, "loop": loop}, open(sys.argv[1], "w"))
"""
WAYS = {"plain": None, "nice 0": "0", "nice 10": "10"}


def _one(way: str, prog: Path, home: Path) -> dict[str, list[float] | float]:
    """The program's own timings in one run of ``way``."""
    out = home / "times.json"
    run_dir = home / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    nice = WAYS[way]
    if nice is None:
        cmd = [sys.executable, str(prog), str(out)]
        env = None
    else:
        cmd = [sys.executable, "-m", "mltrace", "python", "-q", "--level", "op", "-o", str(run_dir), str(prog), str(out)]
        env = {**os.environ, "MLTRACE_OP_CONVERTER_NICE": nice}
    harness.run_child(cmd, env=env)  # exits with a line where the run fails
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    harness.add_json(p)
    args = p.parse_args()
    results: dict[str, list[dict[str, list[float] | float]]] = {w: [] for w in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        prog = home / "prog.py"
        prog.write_text(PROGRAM)
        for i in range(args.rounds):
            for way in rotation(list(WAYS), i):
                results[way].append(_one(way, prog, home))
            print(f"round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)

    def per_round(way: str, stat: str) -> float:
        values = []
        for r in results[way]:
            calls = sorted(r["calls"])  # type: ignore[arg-type]
            values.append({"median": statistics.median(calls), "p90": harness.p90(calls), "loop": r["loop"]}[stat])  # type: ignore[dict-item]
        return statistics.median(values)

    print(f"the program's own timings, median over {args.rounds} rounds; load {harness.loadavg()}")
    for stat in ("median", "p90", "loop"):
        base = per_round("plain", stat)
        cells = "  ".join(f"{way} {per_round(way, stat) * 1e3:8.2f} ms ({per_round(way, stat) / base:4.2f}x)" for way in WAYS)
        print(f"  call {stat:6s} " if stat != "loop" else "  loop        ", cells)
    harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
