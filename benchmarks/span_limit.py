"""What the span limit (``--max-spans``) saves at the end of a long layer-level run.

A layer-level run streams its spans while the program runs, but the end of the run
loads every one of them to correlate them and write the final files. This runs a
small model with many layers (``--layers`` pairs of ``nn.Linear(16, 16)`` and
``nn.ReLU``) N times in a child process under ``mltrace python --level layer``,
with each ``--max-spans`` value given (0: no limit), and plain. For each it prints
the spans the run kept, the child's peak resident memory over its whole life (the
end of the run included, from ``wait4``), the program's own wall time, and how long
the end of the run took (the child's wall time after its last inference).

    python benchmarks/span_limit.py                               # N = 20000, limits 0, 500000, default
    python benchmarks/span_limit.py --inferences 40000 --limits 0,1000000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
from pathlib import Path

import harness

CHILD = textwrap.dedent(
    """
    import sys, time
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*[m for _ in range({layers}) for m in (nn.Linear(16, 16), nn.ReLU())]).eval()
    x = torch.randn(1, 16)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for _ in range({n}):
            model(x)
    print("RESULT", time.perf_counter() - t0, time.time(), flush=True)
    """
)


def run_child(args: list[str], script: Path, out: Path | None) -> dict[str, float]:
    """Runs one child; returns its peak RSS (MB), program wall (s), stop time (s) and kept spans."""
    child = harness.run_child([*args, str(script)])
    wall, loop_end = child.result_line()
    result = {"peak_mb": child.peak_mb, "wall_s": float(wall), "stop_s": child.exited_at - float(loop_end), "spans": 0.0}
    if out is not None:
        meta = json.loads((out / "run.json").read_text())
        result["spans"] = float(meta.get("summary", {}).get("spans", 0))
        result["ended_after"] = float(meta.get("layer_window", {}).get("ended_after_model_calls", 0))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inferences", type=int, default=20000, help="model calls per child (default 20000)")
    parser.add_argument("--layers", type=int, default=60, help="Linear+ReLU pairs in the model (default 60)")
    parser.add_argument("--limits", default="0,500000,default", help="--max-spans values; 'default' for none given")
    ns = parser.parse_args()
    calls = ns.inferences * (2 * ns.layers + 1)
    with tempfile.TemporaryDirectory(prefix="mltrace-spanlimit-") as tmp:
        script = Path(tmp) / "mlp_loop.py"
        script.write_text(CHILD.format(layers=ns.layers, n=ns.inferences))
        conditions: list[tuple[str, list[str], Path | None]] = [("plain", [sys.executable], None)]
        for limit in (x for x in ns.limits.split(",") if x):
            out = Path(tmp) / f"limit-{limit}"
            cmd = [sys.executable, "-m", "mltrace", "python", "-q", "--level", "layer", "-o", str(out)]
            if limit != "default":
                cmd[5:5] = ["--max-spans", limit]
            conditions.append((f"--level layer --max-spans {limit}", cmd, out))
        rows = []
        for label, cmd, run_dir in conditions:
            print(f"running: {label} ({ns.inferences} inferences, {calls:,} module calls)…", file=sys.stderr, flush=True)
            rows.append((label, run_child(cmd, script, run_dir)))
    print(f"{2 * ns.layers}-layer MLP, {ns.inferences} inferences a child ({calls:,} module calls)")
    print(f"{'condition':<38} {'spans kept':>11} {'layers ended after':>19} {'peak RSS':>10} {'program wall':>13} {'end of run':>11}")
    for label, r in rows:
        spans = f"{r['spans']:,.0f}" if r["spans"] else "-"
        ended = f"{r.get('ended_after', 0):,.0f} calls" if r.get("ended_after") else "-"
        print(f"{label:<38} {spans:>11} {ended:>19} {r['peak_mb']:>7.0f} MB {r['wall_s']:>11.2f} s {r['stop_s']:>9.2f} s")


if __name__ == "__main__":
    main()
