"""Cost per module call of the model and layer levels, in isolation.

A module whose forward calls 1000 ``nn.Identity`` children: the difference
between traced and plain medians, divided by 1000, is the cost of one module
call under each condition, measured side by side in one process. Also: torch's
own cost of having (no-op) global forward hooks at all.

    python benchmarks/span_cost.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules import module as module_mod

import mltrace

CALLS = 1000


class Many(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ids = nn.ModuleList([nn.Identity() for _ in range(CALLS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.ids:
            x = m(x)
        return x


def median_ns(fn, n: int = 30) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples)


def main() -> int:
    m = Many()
    x = torch.randn(2, 2)

    def call() -> None:
        m(x)

    rows = []
    for rnd in range(3):
        plain = median_ns(call)
        h1 = module_mod.register_module_forward_pre_hook(lambda mod, a: None)
        h2 = module_mod.register_module_forward_hook(lambda mod, a, o: None, always_call=True)
        try:
            noop = median_ns(call)
        finally:
            h1.remove()
            h2.remove()
        traced = {}
        for level in ("model", "layer"):
            with tempfile.TemporaryDirectory() as tmp, mltrace.profile(output=Path(tmp) / "r", summary=False, level=level):
                traced[level] = median_ns(call)
        rows.append((plain, noop, traced["model"], traced["layer"]))
        print(f"round {rnd}: done", file=sys.stderr)
    plain, noop, model, layer = (statistics.median(c) for c in zip(*rows))
    print(f"plain forward with {CALLS} module calls: {plain / 1e6:.2f} ms")
    print(f"  torch's hooked path (no-op global hooks): {(noop - plain) / CALLS / 1e3:6.2f} µs per module call")
    print(f"  mltrace --level model:                    {(model - plain) / CALLS / 1e3:6.2f} µs per module call")
    print(f"  mltrace --level layer (one span each):    {(layer - plain) / CALLS / 1e3:6.2f} µs per module call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
