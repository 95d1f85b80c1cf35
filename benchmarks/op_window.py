"""What ending the op level early saves in memory, and how long the program waits for it.

Runs the example CNN (``resnet_small``, batch 8, 64×64) N times in a child process,
as a user would: plain; under ``mltrace python`` with every CPU level to the end;
at the layer level only; and with ``--op-inferences K`` for each K. For each it prints the child's resident
memory after its last inference (the program's view), the child's peak resident
memory over its whole life (the end of the run included, from ``wait4``), the
program's wall time, and, with a window, how long the program waited while the op
level ended (run.json ``op_window.pause_s``).

    python benchmarks/op_window.py                              # N = 600, K = 100, 300
    python benchmarks/op_window.py --inferences 1000 --windows 50,200,500
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

import harness

CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {examples!r})
    import torch
    from models import resnet_small

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    torch.manual_seed(0)
    model = resnet_small().eval()
    x = torch.randn(8, 3, 64, 64)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for _ in range({n}):
            model(x)
    print("RESULT", rss_mb(), time.perf_counter() - t0, flush=True)
    """
)


def run_child(args: list[str], script: Path, out: Path | None) -> dict[str, float]:
    """Runs one child; returns its last RSS (MB), peak RSS (MB), wall time (s) and pause (s)."""
    env = dict(os.environ, MLTRACE_OP_MEMORY_GIB="1000")  # only --op-inferences ends the op level here
    child = harness.run_child([*args, str(script)], env=env)
    rss, wall = child.result_line()
    result: dict[str, float] = {"rss_mb": float(rss), "peak_mb": child.peak_mb, "wall_s": float(wall), "pause_s": 0.0, "spans": 0}
    if out is not None:
        meta = json.loads((out / "run.json").read_text())
        result["pause_s"] = float(meta.get("op_window", {}).get("pause_s", 0.0))
        result["spans"] = int(meta.get("summary", {}).get("spans", 0))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inferences", type=int, default=600, help="model calls per child (default 600)")
    parser.add_argument("--windows", default="100,300", help="comma-separated --op-inferences values (default 100,300)")
    ns = parser.parse_args()
    windows = [int(k) for k in ns.windows.split(",") if k]
    with tempfile.TemporaryDirectory(prefix="mltrace-opwindow-") as tmp:
        script = Path(tmp) / "cnn_loop.py"
        script.write_text(CHILD.format(examples=str(harness.EXAMPLES), n=ns.inferences))
        rows: list[tuple[str, dict[str, float]]] = []
        conditions: list[tuple[str, list[str], Path | None]] = [("plain", [sys.executable], None)]
        full = Path(tmp) / "full"
        conditions.append(("mltrace, every CPU level to the end", [sys.executable, "-m", "mltrace", "python", "-q", "-o", str(full)], full))
        layer = Path(tmp) / "layer"
        layer_cmd = [sys.executable, "-m", "mltrace", "python", "-q", "--level", "layer", "-o", str(layer)]
        conditions.append(("mltrace --level layer", layer_cmd, layer))
        for k in windows:
            out = Path(tmp) / f"k{k}"
            cmd = [sys.executable, "-m", "mltrace", "python", "-q", "--op-inferences", str(k), "-o", str(out)]
            conditions.append((f"mltrace --op-inferences {k}", cmd, out))
        for label, cmd, run_dir in conditions:
            print(f"running: {label} ({ns.inferences} inferences)…", file=sys.stderr, flush=True)
            rows.append((label, run_child(cmd, script, run_dir)))
    print(f"example CNN, batch 8, 64×64, {ns.inferences} inferences a child")
    print(f"{'condition':<40} {'spans':>8} {'RSS after last call':>20} {'peak RSS':>10} {'program wall':>13} {'op-level end pause':>19}")
    for label, r in rows:
        pause = f"{r['pause_s']:.2f} s" if r["pause_s"] else "-"
        spans = f"{r['spans']:.0f}" if r["spans"] else "-"
        print(f"{label:<40} {spans:>8} {r['rss_mb']:>17.0f} MB {r['peak_mb']:>7.0f} MB {r['wall_s']:>11.2f} s {pause:>19}")


if __name__ == "__main__":
    main()
