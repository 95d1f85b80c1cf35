"""Cost per module call of the model and layer levels, in isolation.

A module whose forward calls 1000 ``nn.Identity`` children: the difference
between traced and plain medians, divided by 1000, is the cost of one module
call under each condition, measured side by side in one process. Also: torch's
own cost of having (no-op) global forward hooks at all.

At 1000 spans per ~1 ms forward the flusher thread (which drains and writes
spans every 0.5 s, under the GIL) is busy much of the time, so the default
layer session's figure swings with where its flushes fall. Two more rows split
it: the layer level with streaming off (the ``Module.__call__`` wrapper's own
cost; the session is flushed untimed after each call), and the mean cost of
draining and writing one span in those flushes, garbage collections included.
Last, the same two figures for model spans: the outermost call of an
``nn.Identity``, made 1000 times in a row.

    python benchmarks/span_cost.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules import module as module_mod

import mltrace
from mltrace.config import ProfileOptions
from mltrace.run.levels import Level
from mltrace.tracer.session import Session
from mltrace.tracer.sources.torch_modules import TorchModuleSource

CALLS = 1000
NO_FLUSH_S = 60.0  # longer than the measurement: nothing is streamed while timing


class Many(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ids = nn.ModuleList([nn.Identity() for _ in range(CALLS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.ids:
            x = m(x)
        return x


def median_ns(fn, n: int = 30, after=None) -> float:  # type: ignore[no-untyped-def]
    """Median time of ``fn()``; ``after()``, if given, runs untimed after each call."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
        if after is not None:
            after()
    return statistics.median(samples)


def streaming_off(call) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """A layer session that never flushes by itself: median ns per call, mean flush ns per span."""
    with tempfile.TemporaryDirectory() as tmp:
        opts = ProfileOptions(output=Path(tmp) / "r", summary=False, level=Level.LAYER, flush_interval_s=NO_FLUSH_S)
        session = Session(opts).start()
        flush_ns = spans = 0
        # Layer calls wait in the torch source as frames until the drain builds their spans.
        frames = [s._frames for s in session.started if isinstance(s, TorchModuleSource)]

        def flush() -> None:  # untimed after each call, summed apart
            nonlocal flush_ns, spans
            spans += len(session.recorder.done) + sum(len(f) for f in frames)
            t0 = time.perf_counter_ns()
            session.flush()
            flush_ns += time.perf_counter_ns() - t0

        try:
            call()
            session.flush()  # the first flush has one-off costs: not counted
            return median_ns(call, after=flush), flush_ns / max(spans, 1)  # a mean: it spreads the GC runs spans cause
        finally:
            session.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    m = Many()
    x = torch.randn(2, 2)

    def call() -> None:
        m(x)

    identity = nn.Identity()

    def model_calls() -> None:  # CALLS outermost calls: each one is a model span
        for _ in range(CALLS):
            identity(x)

    rows = []
    for rnd in range(args.rounds):
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
        quiet, flush_per_span = streaming_off(call)
        plain_models = median_ns(model_calls)
        quiet_models, flush_per_model = streaming_off(model_calls)
        rows.append((plain, noop, traced["model"], traced["layer"], quiet, flush_per_span, plain_models, quiet_models, flush_per_model))
        print(f"round {rnd}: done", file=sys.stderr)
    plain, noop, model, layer, quiet, flush, plain_models, quiet_models, flush_model = (statistics.median(c) for c in zip(*rows))
    print(f"plain forward with {CALLS} module calls: {plain / 1e6:.2f} ms")
    print(f"  torch's hooked path (no-op global hooks): {(noop - plain) / CALLS / 1e3:6.2f} µs per module call")
    print(f"  mltrace --level model:                    {(model - plain) / CALLS / 1e3:6.2f} µs per module call")
    print(f"  mltrace --level layer (one span each):    {(layer - plain) / CALLS / 1e3:6.2f} µs per module call")
    print(f"    the same, streaming off (wrapper only): {(quiet - plain) / CALLS / 1e3:6.2f} µs per module call")
    print(f"    draining + writing one span (flusher):  {flush / 1e3:6.2f} µs per span")
    print(f"a model call (the outermost call of an nn.Identity, {CALLS} in a row; plain {plain_models / CALLS / 1e3:.2f} µs a call):")
    print(f"  its model span, streaming off:            {(quiet_models - plain_models) / CALLS / 1e3:6.2f} µs per model call")
    print(f"    draining + writing one model span:      {flush_model / 1e3:6.2f} µs per span")
    return 0


if __name__ == "__main__":
    sys.exit(main())
