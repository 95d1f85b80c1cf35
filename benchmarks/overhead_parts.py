"""Where layer-level overhead comes from on the example CNN, measured side by side.

Interleaved rounds in one process: plain; the default layer-level session; the
torch module source alone with the flusher streaming; the torch source plus the
NVML/CPU counter sampler without streaming; the torch source alone without
streaming. Each session starts and stops outside the measured calls.

    python benchmarks/overhead_parts.py [--rounds 12] [--iters 5]

``--paired`` gives a tighter figure for the layer level alone (the torch module
source, no background streaming): one session, whose ``Module.__call__``
wrapper is switched off and on between short blocks of inferences, so plain
and traced blocks alternate (rotating order) a few hundred milliseconds apart
and drift cancels out. Each round also times a block under two no-op global
forward hooks, the reference the overhead goal is stated against. Each round
gives ratios of the blocks' medians; the report is the median ratio with a
bootstrap 95 % interval and the spread. Where the C helper is the hot path, each
round also times the Python wrapper it replaces. "with
drain+write" adds what streaming the spans to disk cost per inference: a
timed flush after every ``--flush-every`` traced blocks (default 8, about the
session's 0.5 s flush interval on this CNN; a flush has fixed costs, so
flushing after every block would overstate it); the flusher thread does that
work under the GIL while the program runs. Medians hide rare costs, so each
kind also gets the ratio of its mean (traced: with the flush) and the cyclic
garbage collector's work in its blocks (collections by generation, time), seen
through ``gc.callbacks``: the layer level must not make the program's
allocations trigger collections it would not have had.

    python benchmarks/overhead_parts.py --paired [--pairs 100] [--block 3] [--batch 1]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402
from models import resnet_small  # noqa: E402

from mltrace.config import ProfileOptions  # noqa: E402
from mltrace.run.levels import Level  # noqa: E402
from mltrace.tracer.session import Session  # noqa: E402
from mltrace.tracer.sources.nvml import NvmlSampler  # noqa: E402
from mltrace.tracer.sources.torch_modules import TorchModuleSource  # noqa: E402

NO_FLUSH_S = 60.0  # longer than the measurement: nothing is streamed while timing

CONDITIONS: dict[str, Callable[[Path], Session]] = {
    "layer, default session": lambda d: Session(ProfileOptions(output=d, summary=False, level=Level.LAYER)),
    "torch source + streaming": lambda d: Session(
        ProfileOptions(output=d, summary=False, level=Level.LAYER), sources=[TorchModuleSource()]
    ),
    "torch source + counters": lambda d: Session(
        ProfileOptions(output=d, summary=False, level=Level.LAYER, flush_interval_s=NO_FLUSH_S),
        sources=[TorchModuleSource(), NvmlSampler()],
    ),
    "torch source only": lambda d: Session(
        ProfileOptions(output=d, summary=False, level=Level.LAYER, flush_interval_s=NO_FLUSH_S), sources=[TorchModuleSource()]
    ),
}


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def timed_block(fn: Callable[[], object], n: int) -> list[int]:
    """ns of each of ``n`` calls of ``fn``, after one call not measured (the first after a switch)."""
    fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return out


def bootstrap_median(values: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval for the median of ``values``."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def paired(cnn: torch.nn.Module, x: torch.Tensor, pairs: int, block: int, flush_every: int) -> None:
    """Plain and traced blocks, alternating inside one layer-level session (see the module docstring).

    Each round also times a block under two no-op global forward hooks (torch's
    own ``register_module_forward_pre_hook``/``register_module_forward_hook``),
    the reference the layer level's overhead goal is stated against.
    """
    from torch.nn.modules import module as module_mod

    def timed() -> list[int]:
        cnn(x)  # the first call after a switch: not measured
        out = []
        for _ in range(block):
            t0 = time.perf_counter_ns()
            cnn(x)
            out.append(time.perf_counter_ns() - t0)
        return out

    def noop(*_: object) -> None:
        return None

    def drain() -> None:
        """One flush of everything recorded since the last, timed: the flusher's work."""
        pending = len(session.recorder.done) + len(source._frames)
        gc_kind[0] = "flush"
        t0 = time.perf_counter_ns()
        session.flush()
        flushed[0] += time.perf_counter_ns() - t0
        flushed[1] += pending

    load_before = loadavg()
    sums: dict[str, int] = {}  # ns timed per kind ("flush": the traced blocks' flushes)
    gc_work: dict[str, list[float]] = {}  # per kind: collections of gen 0, 1, 2 and ns spent
    gc_kind = ["plain"]
    gc_t0 = [0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_t0[0] = time.perf_counter_ns()
            return
        work = gc_work.setdefault(gc_kind[0], [0, 0, 0, 0])
        work[info["generation"]] += 1
        work[3] += time.perf_counter_ns() - gc_t0[0]

    flushed = [0, 0]  # ns spent in flushes, spans they wrote
    traced_blocks = 0
    traced_ns: list[float] = []  # each round's traced median
    hot: list[float] = []  # traced / plain, per round
    hooks: list[float] = []  # no-op global hooks / plain, per round
    plain_ns: list[float] = []
    kinds = ["plain", "traced", "hooks"]
    python: list[float] = []  # the Python hot path / plain, per round, where the C helper is the one installed
    with tempfile.TemporaryDirectory() as tmp:
        source = TorchModuleSource()
        options = ProfileOptions(output=Path(tmp) / "run", summary=False, level=Level.LAYER, flush_interval_s=NO_FLUSH_S)
        session = Session(options, sources=[source]).start()
        try:
            assert source._wrapped is not None, "the torch module source did not wrap Module.__call__"
            module_cls, original, wrapper = source._wrapped
            if source.python_call is not wrapper:
                kinds.append("python")
            installed = {"plain": original, "traced": wrapper, "hooks": original, "python": source.python_call}
            cnn(x)
            session.flush()  # the first flush has one-off costs: not counted
            gc.callbacks.append(on_gc)
            frames_before = 0
            for i in range(pairs):
                med: dict[str, float] = {}
                order = kinds[i % len(kinds) :] + kinds[: i % len(kinds)]
                for kind in order if i % 2 == 0 else reversed(order):
                    module_cls.__call__ = installed[kind]
                    handles = []
                    if kind == "hooks":
                        handles = [module_mod.register_module_forward_pre_hook(noop), module_mod.register_module_forward_hook(noop)]
                    gc_kind[0] = kind
                    try:
                        times = timed()
                        med[kind] = statistics.median(times)
                        sums[kind] = sums.get(kind, 0) + sum(times)
                    finally:
                        for h in handles:
                            h.remove()
                        module_cls.__call__ = wrapper
                    if kind == "python":  # not written: the drain figure is the installed hot path's
                        for _ in range(len(source._frames) - frames_before):
                            source._frames.pop()
                    if kind == "traced":
                        traced_blocks += 1
                        if traced_blocks % flush_every == 0:
                            drain()
                    frames_before = len(source._frames)
                plain_ns.append(med["plain"])
                traced_ns.append(med["traced"])
                hot.append(med["traced"] / med["plain"])
                hooks.append(med["hooks"] / med["plain"])
                if "python" in med:
                    python.append(med["python"] / med["plain"])
                if (i + 1) % 10 == 0:
                    print(f"round {i + 1}/{pairs}", file=sys.stderr, flush=True)
            drain()  # what the last blocks recorded
        finally:
            if on_gc in gc.callbacks:
                gc.callbacks.remove(on_gc)
            session.stop()
    drain_per_inference = flushed[0] / (traced_blocks * (block + 1))  # ns
    total = [(t + drain_per_inference) / p for t, p in zip(traced_ns, plain_ns)]
    sums["flush"] = int(drain_per_inference * pairs * block)
    print(f"ResNet-18-style CNN, batch {len(x)}, 224x224; torch threads {torch.get_num_threads()}")
    print(f"plain inference: median {statistics.median(plain_ns) / 1e6:.2f} ms")
    per_inference = flushed[1] / (traced_blocks * (block + 1))
    print(
        f"{pairs} rounds of plain, traced and hooked blocks of {block} timed inferences, "
        f"{per_inference:.0f} spans per inference, a flush every {flush_every} traced blocks"
    )
    print(f"load average before {load_before}, after {loadavg()}")
    print(
        f"drain + write, one flush every {flush_every} traced blocks: {flushed[0] / max(flushed[1], 1) / 1e3:.2f} µs a span, "
        f"{drain_per_inference / 1e3:.0f} µs an inference"
    )
    hot_path = "C" if python else "Python"
    rows = [(f"layer level, hot path ({hot_path})", hot), ("with drain+write", total), ("no-op global hooks", hooks)]
    if python:
        rows.insert(1, ("layer level, Python hot path", python))
    for name, ratios in rows:
        pct = sorted(100 * (r - 1) for r in ratios)
        lo, hi = bootstrap_median(pct)
        q1, q3 = pct[len(pct) // 4], pct[(3 * len(pct)) // 4]
        print(
            f"  {name:22} {statistics.median(pct):+6.2f} %  95% CI [{lo:+.2f}, {hi:+.2f}]  "
            f"IQR [{q1:+.2f}, {q3:+.2f}]  min/max [{pct[0]:+.2f}, {pct[-1]:+.2f}]"
        )
    print("means over all timed inferences (noise spikes included), vs plain:")
    means = [(f"layer level, hot path ({hot_path})", sums["traced"]), ("with drain+write", sums["traced"] + sums["flush"])]
    means += [("layer level, Python hot path", sums["python"])] if python else []
    means.append(("no-op global hooks", sums["hooks"]))
    for name, total_ns in means:
        print(f"  {name:22} {100 * (total_ns / sums['plain'] - 1):+6.2f} %")
    inferences = pairs * block
    print(f"cyclic GC during the {inferences} timed inferences of each kind (flush: the traced blocks' flushes):")
    for kind in (*kinds, "flush"):
        g0, g1, g2, ns = gc_work.get(kind, [0, 0, 0, 0])
        per = ns / inferences / 1e3
        print(f"  {kind:8} collections gen0/1/2 {g0:4.0f} {g1:3.0f} {g2:2.0f}  {ns / 1e6:8.1f} ms  ({per:6.1f} µs per inference)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--paired", action="store_true", help="alternating plain/traced blocks in one session")
    parser.add_argument("--pairs", type=int, default=100, help="--paired: rounds of plain/traced/hooked blocks")
    parser.add_argument("--block", type=int, default=3, help="--paired: timed inferences per block")
    parser.add_argument(
        "--flush-every",
        type=int,
        default=0,
        help="--paired: traced blocks per flush (default 8 / batch: about the session's 0.5 s on the CNN)",
    )
    parser.add_argument("--batch", type=int, default=1, help="images per inference (default 1)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cnn = resnet_small()
    if args.batch < 1:
        parser.error("--batch must be at least 1")
    x = torch.randn(args.batch, 3, 224, 224)
    flush_every = args.flush_every or max(1, round(8 / args.batch))
    if args.paired:
        with torch.inference_mode():
            for _ in range(3):
                cnn(x)
            paired(cnn, x, args.pairs, args.block, flush_every)
        return 0

    def block() -> list[int]:
        out = []
        for _ in range(args.iters):
            t0 = time.perf_counter_ns()
            cnn(x)
            out.append(time.perf_counter_ns() - t0)
        return out

    samples: dict[str, list[int]] = {"plain": [], **{k: [] for k in CONDITIONS}}
    with torch.inference_mode():
        for _ in range(3):
            cnn(x)
        for r in range(args.rounds):
            samples["plain"] += block()
            for name, make in CONDITIONS.items():
                with tempfile.TemporaryDirectory() as tmp:
                    session = make(Path(tmp) / "run").start()
                    try:
                        cnn(x)  # first call under the session: not measured
                        samples[name] += block()
                    finally:
                        session.stop()
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    plain = statistics.median(samples["plain"])
    print(f"ResNet-18-style CNN, batch {len(x)}, 224x224; torch threads {torch.get_num_threads()}")
    for name, values in samples.items():
        med = statistics.median(values)
        print(f"  {name:28} {med / 1e6:7.2f} ms  {100 * (med - plain) / plain:+6.2f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
