"""Each leaf layer's thread CPU time inside the model against its brick alone (DLBricks).

The ResNet-18-style CNN of examples/models.py (batch 1, 224x224) runs with one thread;
forward hooks read ``time.thread_time_ns()`` around each leaf layer in the plain model (15
calls after 3), and each unique brick is benchmarked cold (``mltrace.brickbench``, twice,
median of the two CPU medians). Thread CPU time leaves out the time the thread was
preempted, so the comparison holds on a busy machine. Printed: the model's CPU time, the
sum inside its leaf layers, the time outside them (the glue: residual adds, flatten, the
hooks' own cost), the sum of the bricks, and both per layer type and width.

    python benchmarks/bricks_in_model.py
"""

from __future__ import annotations

import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import torch

import mltrace
from mltrace.analysis.bricks import Brick, extract
from mltrace.brickbench import benchmark_bricks


def in_model_cpu(model: torch.nn.Module, x: torch.Tensor, names: set[str], calls: int = 15) -> tuple[dict[str, list[int]], list[int]]:
    """Per leaf layer, its thread CPU time in each call (ns); and each whole call's."""
    per: dict[str, list[int]] = collections.defaultdict(list)
    started: dict[str, int] = {}
    for name, module in model.named_modules():
        if name in names:
            module.register_forward_pre_hook(lambda m, i, n=name: started.__setitem__(n, time.thread_time_ns()))
            module.register_forward_hook(lambda m, i, o, n=name: per[n].append(time.thread_time_ns() - started[n]))
    whole = []
    with torch.inference_mode():
        for _ in range(3):
            model(x)
        per.clear()
        for _ in range(calls):
            c0 = time.thread_time_ns()
            model(x)
            whole.append(time.thread_time_ns() - c0)
    return per, whole


def main() -> int:
    harness.use_examples()
    from models import resnet_small

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, x = resnet_small(), torch.randn(1, 3, 224, 224)
    out = Path(tempfile.mkdtemp(prefix="mltrace-bricks-"))
    with torch.inference_mode(), mltrace.profile(level="layer", output=out / "r", summary=False):
        for _ in range(4):
            model(x)
    (m,) = extract([mltrace.load_run(out / "r")]).models
    brick_of = {lc.path: lc.brick for lc in m.layers}
    per, whole = in_model_cpu(model, x, set(brick_of))
    own = list(dict.fromkeys(brick_of.values()))
    rounds = [benchmark_bricks(own, n=15) for _ in range(2)]
    alone: dict[Brick, float] = {b: statistics.median([r[i].cpu_median_ns or 0.0 for r in rounds]) for i, b in enumerate(own)}
    groups: dict[tuple[str, Any], list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for path, brick in brick_of.items():
        width = brick.input_shapes[0][1] if brick.input_shapes and len(brick.input_shapes[0]) > 1 else 0
        g = groups[(brick.type, width)]
        g[0] += statistics.median(per[path])
        g[1] += alone[brick]
        g[2] += 1
    inside = sum(g[0] for g in groups.values())
    total = statistics.median(whole)
    alone_ns = sum(g[1] for g in groups.values())
    print(f"model {total / 1e6:.2f} ms CPU; in its leaf layers {inside / 1e6:.2f} ms; ", end="")
    print(f"outside them {(total - inside) / 1e6:.2f} ms; ", end="")
    print(f"bricks alone {alone_ns / 1e6:.2f} ms")
    for (kind, width), (a, b, n) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"  {kind:<18} C={width:<4} n={n:<2} in the model {a / 1e6:7.2f} ms  alone {b / 1e6:7.2f} ms  ratio {b / a:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
