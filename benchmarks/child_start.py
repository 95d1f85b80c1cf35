"""How much later a followed child's own code starts: the time from ``Popen`` to the child's first
statement, for a Python child started with and without mltrace's follow bootstrap
(``mltrace/follow/``: ``PYTHONPATH`` + ``MLTRACE_FOLLOW``, as ``mltrace python`` sets them), in
interleaved rounds, medians reported. The child's session starts during that time (imports,
run directory, sources' import hooks); its end, at the child's exit, is not counted.

    python benchmarks/child_start.py               # 20 rounds
    python benchmarks/child_start.py --rounds 40 --level op
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mltrace.follow import BOOTSTRAP_DIR, PROCS_DIR
from mltrace.settings import FOLLOW

CHILD = "import time, sys; sys.stdout.write(str(time.monotonic_ns()))"


def start_delay_ns(env: dict[str, str]) -> int:
    """Nanoseconds from just before ``Popen`` to the child's first statement."""
    t0 = time.monotonic_ns()
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, check=True, text=True).stdout
    return int(out) - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--level", default=None, help="the level the child records (default: all)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / PROCS_DIR).mkdir()
        plain = dict(os.environ)
        spec = {"run": tmp, "name": "bench", "level": args.level, "traceparent": None, "parent_pid": os.getpid()}
        followed = {
            **plain,
            FOLLOW.name: json.dumps(spec),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(BOOTSTRAP_DIR), plain.get("PYTHONPATH")])),
        }
        bare: list[int] = []
        traced: list[int] = []
        start_delay_ns(plain), start_delay_ns(followed)  # warm the page cache and .pyc files
        for _ in range(args.rounds):
            bare.append(start_delay_ns(plain))
            traced.append(start_delay_ns(followed))
    b, t = statistics.median(bare) / 1e6, statistics.median(traced) / 1e6
    print(f"child start, median of {args.rounds}: plain {b:.1f} ms, followed {t:.1f} ms, delay {t - b:+.1f} ms")


if __name__ == "__main__":
    main()
