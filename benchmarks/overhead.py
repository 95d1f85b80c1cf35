"""Tracing overhead, measured side by side in one process.

For each example model: median latency plain and under each tracing
condition, in interleaved rounds (a block of each, the order rotating round by
round) so that machine noise hits all alike, as pooled medians and as the
median of each round's ratio to its plain block. Also the per-span cost of the
user API inside and outside a session.

    python benchmarks/overhead.py            # full (a few minutes on 2 cores)
    python benchmarks/overhead.py --quick    # smoke run
    python benchmarks/overhead.py --device cuda --conditions layer,kernel,kernel-cupti,torch.profiler
    python benchmarks/overhead.py --device cuda --cnn resnet50 --dtype float16 --channels-last \
        --batch 1 --encoder-batch 8 --conditions layer,kernel,torch.profiler

Prints a table; ``--json FILE`` writes the figures. With ``--device cuda`` the
models run on the GPU, every timed call ends with ``torch.cuda.synchronize()``,
``torch.profiler`` alone records CUDA activity too, and two kernel-level
conditions compare the kernel paths: ``kernel`` (Kineto, the default path with
torch) and ``kernel-cupti`` (``MLTRACE_KERNEL_PATH=cupti-python``).
``--cnn resnet50`` takes torchvision's ResNet-50 (random weights) where
torchvision imports; ``--dtype`` and ``--channels-last`` convert both models
and inputs. Each condition's p90 per call is reported beside its median, since
a tracer that delays the program now and then shows in the tail first.

ONNX Runtime and Keras are
measured the same way by ``benchmarks/overhead_frameworks.py``; per-call costs
by ``benchmarks/span_cost.py``. The full CPU trace against torch.profiler alone
is measured tighter, in paired blocks a few hundred milliseconds apart, by
``benchmarks/cross_stack_paired.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402

import mltrace  # noqa: E402


def _time_block(fn: Callable[[], Any], iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return out


CONDITIONS: dict[str, dict[str, Any]] = {
    "model": {"level": "model"},
    "layer": {"level": "layer"},
    "op": {"level": "op"},
    "library": {"level": "library"},  # the full CPU trace: model + layer + op + library
    "library-mkl-timer": {"level": "library"},  # the same with oneMKL's own verbose timer (MLTRACE_MKL_TIMER=mkl)
    "kernel": {"level": "kernel"},  # GPU: every level, kernels through Kineto (the default path with torch)
    "kernel-cupti": {"level": "kernel"},  # GPU: every level, kernels through cupti-python
    # Attribution of the kernel level's cost: "kernel" with one part taken out.
    "kernel-no-counters": {"level": "kernel"},  # without the CPU/NVML counter sampler
    "kernel-no-library": {"level": "kernel"},  # without the library level's fd tap and verbose output
    "kernel-one-thread": {"level": "kernel"},  # torch.profiler on the starting thread only (no profile_all_threads)
    "kernel-no-layers": {"level": "kernel"},  # without the layer spans (torch.modules source)
    "kernel-bare": {"level": "kernel"},  # torch.profiler through mltrace only: no layers, library level or counters
    "torch.profiler": {},  # torch.profiler(record_shapes=True) alone, no mltrace
    "torch.profiler-all-threads": {},  # the same with profile_all_threads, as mltrace configures it
}
#: Environment each condition runs under (read when its session starts).
CONDITION_ENV: dict[str, dict[str, str]] = {
    "kernel-cupti": {"MLTRACE_KERNEL_PATH": "cupti-python"},
    "library-mkl-timer": {"MLTRACE_MKL_TIMER": "mkl"},
}


class _TorchProfilerAlone:
    """torch.profiler as users run it, for the side-by-side baseline (CUDA activity too on a GPU)."""

    def __init__(self, cuda: bool, all_threads: bool = False) -> None:
        self.cuda = cuda
        self.all_threads = all_threads

    def __enter__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        from mltrace.tracer.sources.torch_ops import _all_threads_config

        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.cuda else [])]
        config = _all_threads_config() if self.all_threads else None
        self._prof = profile(activities=activities, record_shapes=True, experimental_config=config)
        self._prof.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(None, None, None)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Any:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _condition(name: str, out: Path, cuda: bool = False) -> Any:
    if name.startswith("torch.profiler"):
        with _TorchProfilerAlone(cuda, all_threads=name == "torch.profiler-all-threads"):
            yield
        return
    with (
        _environ(CONDITION_ENV.get(name, {})),
        _part_off(name),
        mltrace.profile(output=out, summary=False, **CONDITIONS[name]),
    ):
        yield


@contextlib.contextmanager
def _part_off(name: str) -> Any:
    """For the attribution conditions: the parts the condition names are not started (their
    sources report themselves unavailable, or torch.profiler gets no all-threads configuration)."""
    from mltrace.tracer.sources import torch_ops
    from mltrace.tracer.sources.cpu_library import CpuLibrarySource
    from mltrace.tracer.sources.nvml import NvmlSampler
    from mltrace.tracer.sources.torch_modules import TorchModuleSource

    def off(self: object) -> str:
        return "off for this benchmark condition"

    counters = (NvmlSampler, "available", off)
    library = (CpuLibrarySource, "available", off)
    layers = (TorchModuleSource, "available", off)
    parts: list[tuple[Any, str, Any]] = {
        "kernel-no-counters": [counters],
        "kernel-no-library": [library],
        "kernel-no-layers": [layers],
        "kernel-bare": [counters, library, layers],
        "kernel-one-thread": [(torch_ops, "_all_threads_config", lambda: None)],
    }.get(name, [])
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in parts]
    for owner, attr, replacement in parts:
        setattr(owner, attr, replacement)
    try:
        yield
    finally:
        for owner, attr, value in saved:
            setattr(owner, attr, value)


#: Conditions compared with torch.profiler alone, round by round.
VS_TORCH_PROFILER = [c for c in CONDITIONS if c.startswith(("library", "kernel")) or c == "torch.profiler-all-threads"]


def measure_model(name: str, fn: Callable[[], Any], rounds: int, iters: int, conditions: list[str], cuda: bool = False) -> dict[str, Any]:
    """Median ns per call, plain and per condition, from interleaved rounds."""
    for _ in range(3):
        fn()  # warm-up: allocator, oneDNN primitive cache
    samples: dict[str, list[float]] = {"plain": [], **{c: [] for c in conditions}}
    blocks: dict[str, list[float]] = {c: [] for c in samples}  # each round's block median
    kinds = list(samples)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            # Each kind takes every position of a round in turn: what follows a session's
            # stop (or a plain block) must not favour one kind.
            for c in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                if c == "plain":
                    block = _time_block(fn, iters)
                else:
                    with _condition(c, Path(tmp) / f"{c}-{r}", cuda):
                        fn()  # first call under a new session: outside the measured block
                        block = _time_block(fn, iters)
                samples[c] += block
                blocks[c].append(statistics.median(block))
    plain = statistics.median(samples["plain"])
    res: dict[str, Any] = {"model": name, "plain_ms": plain / 1e6, "samples_per_condition": len(samples["plain"])}
    res["plain_p90_ms"] = _p90(samples["plain"]) / 1e6
    for c in conditions:
        med = statistics.median(samples[c])
        res[f"{c}_ms"] = med / 1e6
        res[f"{c}_p90_ms"] = _p90(samples[c]) / 1e6
        res[f"{c}_overhead_pct"] = 100.0 * (med - plain) / plain
        # The same, round by round against that round's plain block (drift cancels).
        res[f"{c}_overhead_paired_pct"] = 100.0 * (statistics.median(a / b for a, b in zip(blocks[c], blocks["plain"])) - 1)
    for c in VS_TORCH_PROFILER:
        if c in conditions and "torch.profiler" in conditions:
            res[f"{c}_vs_torch_profiler_paired"] = statistics.median(a / b for a, b in zip(blocks[c], blocks["torch.profiler"]))
            res[f"{c}_vs_torch_profiler_p90"] = res[f"{c}_p90_ms"] / res["torch.profiler_p90_ms"]
    if "library" in conditions and "torch.profiler" in conditions:
        # The CPU cross-stack goal: mltrace's full CPU trace vs torch.profiler's own overhead.
        res["library_vs_torch_profiler_ratio"] = res["library_ms"] / res["torch.profiler_ms"]
        # The same, round by round: both blocks of a round ran seconds apart, so drift cancels.
    return res


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


def _cnn(kind: str) -> torch.nn.Module:
    if kind == "resnet50":
        try:
            from torchvision.models import resnet50
        except Exception as exc:  # torchvision absent, or a build that does not import beside this torch
            raise SystemExit(f"overhead.py: --cnn resnet50 needs torchvision ({exc})") from None
        return resnet50(weights=None).eval()
    from models import resnet_small

    return resnet_small()


def measure_api(n: int) -> dict[str, float]:
    """ns per call of a @trace'd function and a span() block, outside and inside a session."""

    def plain() -> None:
        pass

    traced = mltrace.trace(plain)

    def loop(f: Callable[[], None]) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            f()
        return (time.perf_counter_ns() - t0) / n

    def span_loop() -> float:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            with mltrace.span("s"):
                pass
        return (time.perf_counter_ns() - t0) / n

    base = min(loop(plain) for _ in range(3))
    off_trace = min(loop(traced) for _ in range(3)) - base
    off_span = min(span_loop() for _ in range(3))
    with tempfile.TemporaryDirectory() as tmp, mltrace.profile(output=Path(tmp) / "api", summary=False, level="model"):
        on_trace = min(loop(traced) for _ in range(3)) - base
        on_span = min(span_loop() for _ in range(3))
    return {
        "trace_decorator_outside_session_ns": off_trace,
        "span_outside_session_ns": off_span,
        "trace_decorator_in_session_ns": on_trace,
        "span_in_session_ns": on_span,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few rounds, small inputs (smoke run)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--conditions", default="layer", help="comma list of: " + ", ".join(CONDITIONS))
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the models run (default: cpu)")
    parser.add_argument("--batch", type=int, default=1, help="batch size of both models (default: 1)")
    parser.add_argument("--encoder-batch", type=int, help="batch size of the encoder (default: --batch)")
    parser.add_argument("--cnn", choices=("resnet18-style", "resnet50"), default="resnet18-style", help="the CNN measured")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32", help="both models' dtype")
    parser.add_argument("--channels-last", action="store_true", help="the CNN and its input in channels_last")
    args = parser.parse_args()
    conditions = [c for c in args.conditions.split(",") if c]
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown:
        parser.error(f"unknown condition(s): {', '.join(unknown)}")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("overhead.py: --device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    from models import encoder

    torch.manual_seed(0)
    rounds, iters = (2, 2) if args.quick else (args.rounds, args.iters)
    size, seq, layers = (64, 32, 2) if args.quick else (224, 128, 12)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    cnn = _cnn(args.cnn).to(device=device, dtype=dtype, memory_format=memory_format).eval()
    enc = encoder(layers=layers).to(device=device, dtype=dtype).eval()
    images = torch.randn(args.batch, 3, size, size, device=device, dtype=dtype).to(memory_format=memory_format)
    encoder_batch = args.encoder_batch or args.batch
    tokens = torch.randint(0, 30522, (encoder_batch, seq), device=device)

    def run(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], Any]:
        if not cuda:
            return lambda: model(x)

        def synchronized() -> Any:
            y = model(x)
            torch.cuda.synchronize()
            return y

        return synchronized

    results = []
    with torch.inference_mode():
        for name, fn in (
            (f"{args.cnn} CNN, batch {args.batch}, {size}x{size}, {args.dtype}", run(cnn, images)),
            (f"Transformer encoder ({layers}x768), batch {encoder_batch}, seq {seq}, {args.dtype}", run(enc, tokens)),
        ):
            print(f"measuring {name} on {args.device} ...", file=sys.stderr, flush=True)
            results.append(measure_model(name, fn, rounds, iters, conditions, cuda))
    api = measure_api(20_000 if args.quick else 200_000)
    where = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"\ntorch {torch.__version__}, {where}, threads {torch.get_num_threads()}, cpu count {os.cpu_count()}")
    header = f"{'model':52} {'plain ms':>9}" + "".join(f" {c + ' ms':>10} {c + ' %':>9}" for c in conditions)
    print(header)
    for r in results:
        row = f"{r['model']:52} {r['plain_ms']:9.2f}"
        for c in conditions:
            row += f" {r[f'{c}_ms']:10.2f} {r[f'{c}_overhead_pct']:+8.2f}%"
        print(row)
        paired = ", ".join(f"{c} {r[f'{c}_overhead_paired_pct']:+.2f}%" for c in conditions)
        print(f"{'':52} median of per-round ratios to plain: {paired}")
        p90 = ", ".join(f"{c} {r[f'{c}_p90_ms']:.2f}" for c in conditions)
        print(f"{'':52} p90 ms: plain {r['plain_p90_ms']:.2f}, {p90}")
        if "library_vs_torch_profiler_ratio" in r:
            print(
                f"{'':52} full CPU trace / torch.profiler alone = {r['library_vs_torch_profiler_ratio']:.3f}x "
                f"(pooled medians), {r['library_vs_torch_profiler_paired']:.3f}x (median of per-round ratios)"
            )
        for c in VS_TORCH_PROFILER:
            if c != "library" and f"{c}_vs_torch_profiler_paired" in r:
                print(
                    f"{'':52} {c} / torch.profiler alone = {r[f'{c}_vs_torch_profiler_paired']:.3f}x "
                    f"(median of per-round ratios), p90 {r[f'{c}_vs_torch_profiler_p90']:.3f}x"
                )
    print("\nuser API cost per call (ns):")
    for k, v in api.items():
        print(f"  {k:40} {v:8.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"models": results, "api": api}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
