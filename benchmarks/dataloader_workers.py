"""What following a DataLoader's workers costs the data loop: a loop over a DataLoader with
``--workers`` forked workers whose dataset makes each item with a few torch ops (randn, mean,
std, sub, div on a 3×32×32 tensor), plain and under ``mltrace python`` in each of
``--conditions``, in interleaved rounds. Reported: the median loop time per condition (the
loop's own ``time.perf_counter()``, which includes the workers' shutdown at its end, as a
program pays it) and its ratio to plain.

    python benchmarks/dataloader_workers.py                   # 5 rounds
    python benchmarks/dataloader_workers.py --rounds 9 --batches 128 --workers 4

Conditions: ``default`` (every level; workers at ``MLTRACE_WORKER_LEVEL``'s default),
``workers-op`` (the same with ``MLTRACE_WORKER_LEVEL=op``: the workers record their ops),
``no-follow`` (``--no-follow``: the workers are not traced).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LOOP = """
import sys, time, torch
from torch.utils.data import DataLoader, Dataset

class Items(Dataset):
    def __len__(self):
        return {items}

    def __getitem__(self, i):
        x = torch.randn(3, 32, 32)
        return (x - x.mean()) / (x.std() + 1e-5)

if __name__ == "__main__":
    loader = DataLoader(Items(), batch_size=32, num_workers={workers})
    t0 = time.perf_counter()
    for batch in loader:
        pass
    print(f"LOOP {{time.perf_counter() - t0:.6f}}")
"""

#: Each condition's extra ``mltrace python`` arguments and environment (None: plain Python).
CONDITIONS: dict[str, tuple[list[str], dict[str, str]] | None] = {
    "plain": None,
    "default": ([], {}),
    "workers-op": ([], {"MLTRACE_WORKER_LEVEL": "op"}),
    "no-follow": (["--no-follow"], {}),
}


def loop_s(script: Path, condition: str, tmp: Path, n: int) -> float:
    """One run of the loop under ``condition``: the loop's own time (s)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLTRACE_")}
    how = CONDITIONS[condition]
    if how is None:
        cmd = [sys.executable, str(script)]
    else:
        args, extra = how
        env.update(extra)
        cmd = [sys.executable, "-m", "mltrace", "python", "-q", *args, "-o", str(tmp / f"{condition}-{n}"), str(script)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL).stdout
    return float(next(line.split()[1] for line in out.splitlines() if line.startswith("LOOP ")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=64, help="batches of 32 items (default 64)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--conditions", default="default,workers-op,no-follow")
    args = ap.parse_args()
    conditions = ["plain", *[c for c in args.conditions.split(",") if c]]
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown:
        print(f"dataloader_workers: unknown condition(s) {', '.join(unknown)} (known: {', '.join(CONDITIONS)})", file=sys.stderr)
        return 2
    times: dict[str, list[float]] = {c: [] for c in conditions}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        script = tmp / "loop.py"
        script.write_text(LOOP.format(items=32 * args.batches, workers=args.workers))
        for r in range(args.rounds):
            order = conditions[r % len(conditions) :] + conditions[: r % len(conditions)]
            for c in order:
                times[c].append(loop_s(script, c, tmp, r))
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    plain = statistics.median(times["plain"])
    print(f"{args.batches} batches of 32, {args.workers} workers, {args.rounds} rounds; median loop time:")
    for c in conditions:
        med = statistics.median(times[c])
        print(f"  {c:12} {med:7.3f} s  {med / plain:5.2f}x plain")
    return 0


if __name__ == "__main__":
    sys.exit(main())
