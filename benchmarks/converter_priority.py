"""What the op level's converter process does to the model calls it measures, at three priorities.

The op level converts each stopped cycle of torch.profiler in a process of its own, which
runs while the program goes on. Where the program wants every core (torch's intra-op threads
on all of them), that process takes cores from the program's model calls and stretches them.
This runs one CPU-bound program four ways in interleaved rounds: the example models of
``examples/models.py`` as ``examples/infer.py`` runs them (the ResNet-style CNN at batch 1, 12
calls, then the encoder, 8 calls; torch's default threads), each model's calls timed after its
first, with no warm-up, so that the set-up cycle's conversion runs beside the first calls:

- plain: ``python prog.py``;
- nice 0: ``mltrace python --level op`` with ``MLTRACE_HELPER_NICE=0`` (the converter at
  the program's priority);
- nice 10: the same, 10 steps below the program;
- nice 19: the same at the default, the lowest priority.

The program times each call itself (``time.perf_counter``); this prints, per way, the median
over rounds of the calls' median and p90, and the wall time from building the first model to
the last call, against plain.

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
import json, sys, time, torch
sys.path.insert(0, sys.argv[2])
from models import encoder, resnet_small
torch.manual_seed(0)
times, t0 = [], time.perf_counter()
with torch.inference_mode():
    for model, x, calls in ((resnet_small(), torch.randn(1, 3, 224, 224), 12), (encoder(), torch.randint(0, 30522, (1, 128)), 8)):
        for i in range(calls):
            t = time.perf_counter()
            model(x)
            if i:  # the first call of each model is cold, plain too
                times.append(time.perf_counter() - t)
loop = time.perf_counter() - t0
json.dump({"calls": times, "loop": loop}, open(sys.argv[1], "w"))
"""
WAYS = {"plain": None, "nice 0": "0", "nice 10": "10", "nice 19": "19"}
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _one(way: str, prog: Path, home: Path) -> dict[str, list[float] | float]:
    """The program's own timings in one run of ``way``."""
    out = home / "times.json"
    run_dir = home / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    nice = WAYS[way]
    if nice is None:
        cmd = [sys.executable, str(prog), str(out), str(EXAMPLES)]
        env = None
    else:
        cmd = [sys.executable, "-m", "mltrace", "python", "-q", "--level", "op", "-o", str(run_dir), str(prog), str(out), str(EXAMPLES)]
        env = {**os.environ, "MLTRACE_HELPER_NICE": nice}
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
