"""DLBricks on three real torch.nn models: constructed vs measured latency, unique-layer counts, speedup.

Models (random weights, batch 1): the ResNet-18-style CNN and the Transformer
encoder of examples/models.py, and the MobileNetV2-style CNN of
examples/mobilenet.py. Each is traced once at layer level in this process;
bricks are extracted from the three runs together (deduplicated across them).

Then, in ``--rounds`` interleaved rounds: every model is timed end to end
(plain, no tracing: warm-up then median of ``--calls``), and every unique brick
is benchmarked in isolation (``mltrace.brickbench.benchmark_bricks``,
cold cache by default) and each model's latency constructed from them. The
figures are medians over rounds, so drift on a busy machine hits both alike.
Both wall-clock latency and the calling thread's CPU time are reported: with
one thread, CPU time is the latency minus the time the benchmark was
preempted, which on a shared machine stretches a 100 ms model call far more
often than a 1 ms brick call (whose median then hides it).

    python benchmarks/bricks.py                # ~3 minutes on 2 busy cores
    python benchmarks/bricks.py --quick        # smoke run
    python benchmarks/bricks.py --onnxruntime  # also construct from ONNX Runtime bricks
    python benchmarks/bricks.py --json out.json

Speedup: the time benchmarking every model end to end takes over the time
benchmarking each unique brick takes, under the same protocol (warm-up +
calls): measured here as both the ratio of summed latencies and the ratio of
the wall times the two actually took in the last round.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import torch

import mltrace
from mltrace.analysis.bricks import construct, extract
from mltrace.brickbench import MachineWatch, benchmark_bricks


def _plain(fn: Callable[[], Any], warmup: int, calls: int) -> tuple[list[int], list[int]]:
    """Wall-clock and thread-CPU durations (ns) of ``calls`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(calls):
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        fn()
        wall.append(time.perf_counter_ns() - t0)
        cpu.append(time.thread_time_ns() - c0)
    return wall, cpu


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="small inputs, two rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="timed calls per model and per brick (default 10)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: stable on a shared machine)")
    parser.add_argument("--cache", choices=("cold", "warm"), default="cold")
    parser.add_argument("-H", "--granularity", type=int, default=1, help="also construct from sequences of up to H layers")
    parser.add_argument("--onnxruntime", action="store_true", help="also benchmark the bricks in ONNX Runtime (one round)")
    parser.add_argument("--models", default="cnn,mobilenet,encoder", help="comma-separated subset of cnn, mobilenet, encoder")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    harness.use_examples()
    from mobilenet import mobilenet_v2
    from models import encoder, resnet_small

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rounds = 2 if args.quick else args.rounds
    size, seq = (96, 32) if args.quick else (224, 128)
    known: dict[str, Callable[[], tuple[str, torch.nn.Module, torch.Tensor]]] = {
        "cnn": lambda: (f"ResNet-18-style CNN {size}x{size}", resnet_small(), torch.randn(1, 3, size, size)),
        "mobilenet": lambda: (f"MobileNetV2-style CNN {size}x{size}", mobilenet_v2(), torch.randn(1, 3, size, size)),
        "encoder": lambda: (f"Transformer encoder 4x768, seq {seq}", encoder(layers=4), torch.randint(0, 30522, (1, seq))),
    }
    cases = [known[name.strip()]() for name in args.models.split(",")]
    watch = MachineWatch(args.threads)
    watch.__enter__()
    tmp = Path(tempfile.mkdtemp(prefix="mltrace-bricks-"))
    runs = []
    with torch.inference_mode():
        for i, (name, model, x) in enumerate(cases):
            print(f"tracing {name} ...", file=sys.stderr, flush=True)
            with mltrace.profile(level="layer", output=tmp / f"m{i}", summary=False):
                for _ in range(4):
                    model(x)
            runs.append(mltrace.load_run(tmp / f"m{i}"))
    bset = extract(runs, granularity=args.granularity, warmup=1)
    plain: dict[int, list[int]] = {i: [] for i in range(len(cases))}
    plain_cpu: dict[int, list[int]] = {i: [] for i in range(len(cases))}
    constructed: dict[int, list[float]] = {i: [] for i in range(len(cases))}
    constructed_cpu: dict[int, list[float]] = {i: [] for i in range(len(cases))}
    seq_constructed: dict[int, list[float]] = {i: [] for i in range(len(cases))}
    by_means: dict[int, list[float]] = {i: [] for i in range(len(cases))}  # constructed from means / plain mean, per round
    failures: list[str] = []
    wall_models = wall_bricks = 0.0
    brick_medians: list[float] = []
    for r in range(rounds):
        wall_models = wall_bricks = 0.0
        last: dict[Any, Any] = {}
        seq_ns: dict[Any, float] | None = None
        if args.granularity > 1:
            st = benchmark_bricks(bset.sequences, warmup=args.warmup, n=args.calls, cache=args.cache)
            seq_ns = {sq: t.median_ns for sq, t in zip(bset.sequences, st) if t.median_ns is not None}
        for i, (_, model, x) in enumerate(cases):
            # Each model's plain timing and its bricks back to back: both see the same machine state.
            t0 = time.perf_counter()
            with torch.inference_mode():
                wall, cpu = _plain(functools.partial(model, x), args.warmup, args.calls)
            wall_models += time.perf_counter() - t0
            plain[i] += wall
            plain_cpu[i] += cpu
            mb = bset.models[i]
            own = list(dict.fromkeys(lc.brick for lc in mb.layers))
            timings = benchmark_bricks(own, warmup=args.warmup, n=args.calls, cache=args.cache)
            for b, t in zip(own, timings):
                if b not in last:
                    wall_bricks += t.wall_s  # each unique brick counted once
                last[b] = t
            brick_ns = {b: t.median_ns for b, t in zip(own, timings) if t.median_ns is not None}
            brick_cpu = {b: t.cpu_median_ns for b, t in zip(own, timings) if t.cpu_median_ns is not None}
            constructed[i].append(construct(mb, brick_ns).constructed_ns)
            brick_mean = {b: t.mean_ns for b, t in zip(own, timings) if t.mean_ns is not None}
            by_means[i].append(construct(mb, brick_mean, statistic="mean").constructed_ns / statistics.fmean(wall))
            constructed_cpu[i].append(construct(mb, brick_cpu).constructed_ns)
            if seq_ns is not None:
                seq_constructed[i].append(construct(mb, brick_ns, seq_ns).constructed_ns)
        failures = [f"{b.type}: {t.error}" for b, t in last.items() if t.median_ns is None]
        brick_medians = [t.median_ns for t in last.values() if t.median_ns is not None]
        print(f"round {r + 1}/{rounds}: models {wall_models:.1f} s, unique bricks {wall_bricks:.1f} s", file=sys.stderr, flush=True)
    ort: dict[int, float] = {}
    ort_failures: list[str] = []
    if args.onnxruntime:
        print("benchmarking bricks in ONNX Runtime ...", file=sys.stderr, flush=True)
        ot = benchmark_bricks(bset.bricks, warmup=args.warmup, n=args.calls, runtime="onnxruntime")
        ort_ns = {b: t.median_ns for b, t in zip(bset.bricks, ot) if t.median_ns is not None}
        ort_failures = [f"{b.type}: {t.error}" for b, t in zip(bset.bricks, ot) if t.median_ns is None]
        ort = {i: construct(mb, ort_ns).constructed_ns for i, mb in enumerate(bset.models)}
    watch.__exit__(None, None, None)
    rows = []
    for i, (name, _, _) in enumerate(cases):
        mb = bset.models[i]
        p = statistics.median(plain[i])
        c = statistics.median(constructed[i])
        row: dict[str, Any] = {
            "model": name,
            "layers": len(mb.layers),
            "unique_layers": len({lc.brick for lc in mb.layers}),
            "plain_ms": p / 1e6,
            "traced_layer_level_ms": mb.measured_ns / 1e6,
            "constructed_ms": c / 1e6,
            "constructed_over_plain": c / p,
            "means_constructed_over_plain": statistics.median(by_means[i]),
            "bricks_only_over_plain": (c - mb.glue_ns) / p,
            "plain_cpu_ms": statistics.median(plain_cpu[i]) / 1e6,
            "constructed_cpu_ms": statistics.median(constructed_cpu[i]) / 1e6,
            "constructed_over_plain_cpu": statistics.median(constructed_cpu[i]) / statistics.median(plain_cpu[i]),
            "unattributed_in_trace_ms": mb.unattributed_ns / 1e6,
            "glue_in_trace_ms": mb.glue_ns / 1e6,
        }
        if seq_constructed[i]:
            row["constructed_sequences_over_plain"] = statistics.median(seq_constructed[i]) / p
        if i in ort:
            row["onnxruntime_constructed_ms"] = ort[i] / 1e6
        rows.append(row)
    protocol = args.warmup + args.calls
    e2e_cost = sum(protocol * statistics.median(plain[i]) for i in plain)
    bricks_cost = sum(protocol * ns for ns in brick_medians)
    summary = {
        "torch": torch.__version__,
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "cache": args.cache,
        "rounds": rounds,
        "layers_total": bset.total_layers,
        "layers_unique": len(bset.bricks),
        "speedup_by_latency_sum": e2e_cost / bricks_cost if bricks_cost else None,
        "wall_models_s": wall_models,
        "wall_bricks_s": wall_bricks,
        "brick_failures": failures,
        "machine": None if watch.state is None else {"others_cores": watch.state.others_cores, "loadavg": watch.state.loadavg},
        "onnxruntime_failures": ort_failures,
        "models": rows,
    }
    print(f"\ntorch {torch.__version__}, {args.threads} thread(s), {args.cache} cache, medians over {rounds} rounds")
    if watch.state is not None:
        m = watch.state
        print(f"machine: others kept {m.others_cores:.2f} of {m.cores} cores busy (load {m.loadavg[0]:.1f} -> {m.loadavg[1]:.1f})")
    print(
        f"{'model':<38} {'layers':>6} {'unique':>6} {'plain ms':>9} {'constructed':>11} {'ratio':>6} "
        f"{'cpu: plain':>10} {'constructed':>11} {'ratio':>6} {'glue ms':>8} {'means':>6}" + ("  ORT ms" if ort else "")
    )
    for row in rows:
        line = (
            f"{row['model']:<38} {row['layers']:>6} {row['unique_layers']:>6} {row['plain_ms']:>9.2f} "
            f"{row['constructed_ms']:>11.2f} {row['constructed_over_plain']:>6.3f} "
            f"{row['plain_cpu_ms']:>10.2f} {row['constructed_cpu_ms']:>11.2f} {row['constructed_over_plain_cpu']:>6.3f} "
            f"{row['glue_in_trace_ms']:>8.2f} {row['means_constructed_over_plain']:>6.3f}"
        )
        if "onnxruntime_constructed_ms" in row:
            line += f"  {row['onnxruntime_constructed_ms']:.2f}"
        print(line)
    print(
        f"all models: {bset.total_layers} leaf-layer calls, {len(bset.bricks)} unique bricks; "
        f"benchmarking-time speedup {summary['speedup_by_latency_sum']:.2f}x by latency sums "
        f"(wall: models end to end {wall_models:.2f} s vs bricks {wall_bricks:.2f} s with construction)"
    )
    if failures:
        print(f"{len(failures)} brick(s) could not run alone: {failures[:3]}")
    if ort_failures:
        print(f"{len(ort_failures)} brick(s) could not run in ONNX Runtime: {ort_failures[:3]}")
    if args.json:
        harness.write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
