"""What the C hot path's JIT tracing check costs a module call, read two ways.

At every nested module call the C hot path asks whether a JIT trace is being recorded (inside
one it reads no shapes and calls torch's own ``_call_impl``). It reads libtorch's per-thread
tracing state itself where ``bind_tracing_state`` found libtorch's function, else it calls
``torch._C._is_tracing`` through pybind11. This times a forward of 1,000 ``nn.Identity`` calls
under one layer-level session, switching the check between the two ways in interleaved blocks
of 10 forwards (thread CPU time, block medians), and prints the median and quartiles over the
rounds of (pybind11 − libtorch) per module call.

    python benchmarks/jit_tracing_check.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

CALLS = 1000
BLOCK = 10


def _block_median_ns(call: object) -> float:
    samples = []
    for _ in range(BLOCK):
        t0 = time.thread_time_ns()
        call()  # type: ignore[operator]
        samples.append(time.thread_time_ns() - t0)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds (default 40)")
    args = parser.parse_args()

    import torch
    from torch import nn

    import mltrace
    from mltrace.tracer.sources.torch_modules import _libtorch_paths

    try:
        from mltrace import _layercall
    except ImportError:
        print("the C helper mltrace._layercall is not built: nothing to compare")
        return 1
    torch.set_num_threads(1)
    many = nn.Sequential(*[nn.Identity() for _ in range(CALLS)])
    x = torch.randn(2, 2)
    paths = [p for p in _libtorch_paths() if _layercall.bind_tracing_state(p)]
    if not paths:
        print("libtorch's tracing state was not found: nothing to compare")
        return 1
    ways = {"libtorch": paths[0], "pybind11": None}
    diffs = []
    with tempfile.TemporaryDirectory() as tmp, mltrace.profile(output=Path(tmp) / "r", summary=False, level="layer"):
        many(x)
        for r in range(args.rounds):
            medians = {}
            for way in sorted(ways, reverse=bool(r % 2)):
                _layercall.bind_tracing_state(ways[way])
                medians[way] = _block_median_ns(lambda: many(x))
            diffs.append((medians["pybind11"] - medians["libtorch"]) / CALLS)
        _layercall.bind_tracing_state(paths[0])
    q1, median, q3 = statistics.quantiles(diffs, n=4)
    print(f"tracing check, pybind11 - libtorch: {median:.0f} ns a module call (quartiles {q1:.0f}, {q3:.0f}; {len(diffs)} rounds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
