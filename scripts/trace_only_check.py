"""Compares the kernel level's trace with and without Kineto's ``trace_only``.

Usage: python scripts/trace_only_check.py on|off

Traces 20 calls of a small CNN and a transformer encoder (on CUDA where torch sees a device,
else on the CPU) at the kernel level, with torch.profiler's ``trace_only`` forced on or off,
and prints one JSON line: spans by level, GPU activities, launch flows, kernels under an op
and a layer, total kernel time, and the session's stop time. Run each mode in its own process
(Kineto keeps one session per process) and compare the lines.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import Counter

import torch
from torch import nn

import mltrace
from mltrace.analysis.gpu import is_gpu_activity
from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.tracer.sources import torch_ops


def main(mode: str) -> None:
    """Traces the models with ``trace_only`` set as ``mode`` says and prints the counts."""
    default_config = torch_ops._all_threads_config
    torch_ops._all_threads_config = lambda trace_only=False: default_config(trace_only=mode == "on")
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    cnn = (
        nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        )
        .to(dev)
        .eval()
    )
    layer = nn.TransformerEncoderLayer(128, 4, 256, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(dev).eval()
    x, t = torch.randn(8, 3, 64, 64, device=dev), torch.randn(4, 32, 128, device=dev)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        cnn(x), enc(t), sync()
        with mltrace.profile(level="kernel", output=f"{tmp}/run", summary=False) as p:
            for _ in range(20):
                cnn(x), enc(t)
            sync()
            t0 = time.perf_counter()
        stop_s = time.perf_counter() - t0
        assert p.run_dir is not None
        print(json.dumps({"trace_only": mode, "stop_s": round(stop_s, 3), **_counts(mltrace.load_run(p.run_dir))}))


def _counts(run: Run) -> dict[str, object]:
    by_id = run.span_by_id()

    def ancestors(s: Span) -> set[Level]:
        out, cur = set(), by_id.get(s.parent_id) if s.parent_id is not None else None
        while cur is not None:
            out.add(cur.level)
            cur = by_id.get(cur.parent_id) if cur.parent_id is not None else None
        return out

    gpu = [s for s in run.spans if is_gpu_activity(s)]
    kernels = [s for s in gpu if s.attrs["gpu.activity"] == "kernel"]
    return {
        "levels": dict(Counter(s.level.label for s in run.spans)),
        "gpu": dict(Counter(s.attrs["gpu.activity"] for s in gpu)),
        "launch_flows": sum(f.kind == "launch" for f in run.flows),
        "kernels_under_op": sum(Level.OP in ancestors(s) for s in kernels),
        "kernels_under_layer": sum(Level.LAYER in ancestors(s) for s in kernels),
        "kernel_ns": sum(s.end_ns - s.start_ns for s in kernels),
        "op_names": len({s.name for s in run.spans if s.level == Level.OP}),
    }


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("on", "off"):
        sys.exit("usage: trace_only_check.py on|off")
    main(sys.argv[1])
