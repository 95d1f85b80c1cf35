"""Tracing overhead, measured side by side in one process, in six modes.

Every mode times plain calls and traced calls of the same model in interleaved blocks, so that
machine noise hits all alike, and reports medians (pooled, and of each round's ratio to its
plain block). ``--json FILE`` writes the figures where a mode has a table.

``--mode sessions`` (the default): for the example CNN and Transformer encoder, median latency
plain and under each ``--conditions`` entry, each traced block inside a whole mltrace session
(or torch.profiler alone) started and stopped around it; the order of a round's blocks rotates
round by round. Also each condition's p90 and the user API's cost per span.

    python benchmarks/overhead.py                                    # --conditions layer
    python benchmarks/overhead.py --conditions layer,op,library,torch.profiler --rounds 10
    python benchmarks/overhead.py --device cuda --conditions layer,kernel,kernel-cupti,torch.profiler
    python benchmarks/overhead.py --device cuda --cnn resnet50 --dtype float16 --channels-last \\
        --batch 1 --encoder-batch 8 --conditions layer,kernel,torch.profiler

With ``--device cuda`` every timed call ends with ``torch.cuda.synchronize()`` and
``torch.profiler`` alone records CUDA activity too. ``kernel`` takes kernels through Kineto
(the default path with torch), ``kernel-cupti`` through cupti-python; ``kernel-no-counters``,
``kernel-no-library``, ``kernel-one-thread``, ``kernel-no-layers`` and ``kernel-bare`` are
``kernel`` with one part not started (``CONDITIONS`` below). ``library-mkl-timer`` is the full
CPU trace with oneMKL's own verbose timer. ``--cnn resnet50`` takes torchvision's ResNet-50
(random weights); ``--dtype`` and ``--channels-last`` convert both models and inputs.

``--mode parts``: where layer-level overhead comes from on the CNN, rounds of plain blocks and
blocks under four sessions: the default layer-level session, the torch module source alone
with the flusher streaming, that source plus the NVML/CPU counter sampler without streaming,
and the source alone without streaming.

    python benchmarks/overhead.py --mode parts [--rounds 12] [--iters 5]

``--mode layer-paired``: the layer level alone, tighter: one session whose ``Module.__call__``
wrapper is switched off and on between short blocks, so plain and traced blocks alternate a
few hundred milliseconds apart (rotating order, mirrored every other round). Each round also
times a block under two no-op global forward hooks (the reference the layer level's goal is
stated against) and, where the C helper is the hot path, the Python wrapper it replaces.
"with drain+write" adds what streaming the spans cost per inference: a timed flush after every
``--flush-every`` traced blocks (default 8 / batch, about the session's 0.5 s flush interval on
this CNN). Means and the cyclic garbage collector's work per kind of block (``gc.callbacks``)
are printed too: the layer level must not make the program's allocations trigger collections.

    python benchmarks/overhead.py --mode layer-paired [--pairs 100] [--block 3] [--batch 1] [--model cnn|encoder]
    python benchmarks/overhead.py --mode layer-paired --device cuda --cnn resnet50 --dtype float16 --channels-last

``--mode span-cost``: cost per module call of the model and layer levels, in isolation: a
forward calling 1000 ``nn.Identity`` children, plain, under two no-op global hooks, at the
model and layer levels, the layer level with streaming off (the wrapper alone) and the drain
and write of one span; then the same two figures for model spans (1000 outermost calls).
Then a launch-bound model's share (``--pairs``, default 60): a ResNet-50-shaped net of tiny
modules (182 module calls, about 4 ms on one CPU thread, as a b1 fp16 ResNet-50 on an H100),
in thread CPU time, plain against the layer level in interleaved blocks (median of per-round
differences, per module call), the flusher's drain per span in
thread CPU time (take, encode, write), and the wall time a program thread loses while another
thread drains under the GIL.

    python benchmarks/overhead.py --mode span-cost [--rounds 5] [--pairs 60]

``--mode cross-stack``: the full CPU trace against torch.profiler alone, in paired blocks.
A. Inside one library-level session, the ``Module.__call__`` wrapper and oneDNN's and MKL's
verbose output are switched off and on between blocks: ``op`` (the profiler alone),
``op+layer``, ``op+library`` and ``full``, the spans' drain timed and added. B. Plain blocks
against ``torch.profiler(record_shapes=True)`` and the profiler as the op level configures it
(every thread), each started and stopped around its block. The full trace ÷ torch.profiler is
``full / op`` (A) × B's profiler ratio, with a bootstrap 95 % interval.

    python benchmarks/overhead.py --mode cross-stack [--model cnn|encoder] [--pairs 60] [--block 3]

``--mode frameworks``: ONNX Runtime and Keras/TensorFlow models plain, at the model level and
at the op level (rounds of plain, model and op blocks, each traced block in a fresh session
with the default sources plus the ONNX Runtime and TensorFlow ones). ONNX Runtime profiles a
session from its creation, so every block builds its own InferenceSession; Keras's ``predict``
runs a graph function, ``model(x)`` runs eagerly.

    python benchmarks/overhead.py --mode frameworks [--frameworks onnxruntime,keras]

``--quick`` takes a few rounds of small inputs in every mode (a smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import harness
from harness import Rounds, interleave, loadavg, ratio_row, rotation, time_calls

NO_FLUSH_S = 60.0  # a flush interval longer than the measurement: nothing is streamed while timing

# ================================================================ --mode sessions

CONDITIONS: dict[str, dict[str, Any]] = {
    "model": {"level": "model"},
    "layer": {"level": "layer"},
    "op": {"level": "op"},
    "library": {"level": "library"},  # the full CPU trace: model + layer + op + library
    "library-mkl-timer": {"level": "library"},  # the same with oneMKL's own verbose timer (MLTRACE_MKL_TIMER=mkl)
    "kernel": {"level": "kernel"},  # GPU: every level, kernels through Kineto (the default path with torch)
    "kernel-cupti": {"level": "kernel"},  # GPU: every level, kernels through cupti-python
    # Attribution of the layer and kernel levels' cost: the level with one part taken out.
    "layer-no-counters": {"level": "layer"},  # without the CPU/NVML counter sampler
    "layer-no-streaming": {"level": "layer", "flush_interval_s": NO_FLUSH_S},  # spans drained at the session's stop only
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
#: Conditions compared with torch.profiler alone, round by round.
VS_TORCH_PROFILER = [c for c in CONDITIONS if c.startswith(("library", "kernel")) or c == "torch.profiler-all-threads"]


@contextlib.contextmanager
def _torch_profiler_alone(cuda: bool, all_threads: bool) -> Iterator[None]:
    """torch.profiler as users run it, for the side-by-side baseline (CUDA activity too on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    from mltrace.tracer.sources.torch_ops import _all_threads_config

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    config = _all_threads_config() if all_threads else None
    with profile(activities=activities, record_shapes=True, experimental_config=config):
        yield


@contextlib.contextmanager
def _condition(name: str, out: Path, cuda: bool) -> Iterator[None]:
    import mltrace

    if name.startswith("torch.profiler"):
        with _torch_profiler_alone(cuda, all_threads=name == "torch.profiler-all-threads"):
            yield
        return
    with harness.environ(CONDITION_ENV.get(name, {})), _part_off(name), mltrace.profile(output=out, summary=False, **CONDITIONS[name]):
        yield


@contextlib.contextmanager
def _part_off(name: str) -> Iterator[None]:
    """For the attribution conditions: the parts the condition names are not started (their
    sources report themselves unavailable, or torch.profiler gets no all-threads configuration)."""
    from mltrace.tracer.sources import torch_ops
    from mltrace.tracer.sources.cpu_library import CpuLibrarySource
    from mltrace.tracer.sources.nvml import NvmlSampler
    from mltrace.tracer.sources.torch_modules import TorchModuleSource

    def off(self: object) -> str:
        return "off for this benchmark condition"

    counters: tuple[Any, str, Any] = (NvmlSampler, "available", off)
    library: tuple[Any, str, Any] = (CpuLibrarySource, "available", off)
    layers: tuple[Any, str, Any] = (TorchModuleSource, "available", off)
    by_condition: dict[str, list[tuple[Any, str, Any]]] = {
        "kernel-no-counters": [counters],
        "layer-no-counters": [counters],
        "kernel-no-library": [library],
        "kernel-no-layers": [layers],
        "kernel-bare": [counters, library, layers],
        "kernel-one-thread": [(torch_ops, "_all_threads_config", lambda trace_only=False: None)],
    }
    parts = by_condition.get(name, [])
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in parts]
    for owner, attr, replacement in parts:
        setattr(owner, attr, replacement)
    try:
        yield
    finally:
        for owner, attr, value in saved:
            setattr(owner, attr, value)


def measure_model(name: str, fn: Callable[[], Any], rounds: int, iters: int, conditions: list[str], cuda: bool = False) -> dict[str, Any]:
    """Median ns per call, plain and per condition, from interleaved rounds."""
    for _ in range(3):
        fn()  # warm-up: allocator, oneDNN primitive cache
    with tempfile.TemporaryDirectory() as tmp:

        def block(kind: str, r: int) -> list[int]:
            if kind == "plain":
                return time_calls(fn, iters)
            with _condition(kind, Path(tmp) / f"{kind}-{r}", cuda):
                return time_calls(fn, iters, warm=1)  # the first call under a new session is not timed

        # Each kind takes every position of a round in turn: what follows a session's stop
        # (or a plain block) must not favour one kind.
        res = interleave(["plain", *conditions], rounds, block)
    plain = res.median("plain")
    out: dict[str, Any] = {"model": name, "plain_ms": plain / 1e6, "samples_per_condition": len(res.samples["plain"])}
    out["plain_p90_ms"] = res.p90("plain") / 1e6
    for c in conditions:
        out[f"{c}_ms"] = res.median(c) / 1e6
        out[f"{c}_p90_ms"] = res.p90(c) / 1e6
        out[f"{c}_overhead_pct"] = res.overhead_pct(c)
        # The same, round by round against that round's plain block (drift cancels).
        out[f"{c}_overhead_paired_pct"] = 100.0 * (res.paired_ratio(c) - 1)
    for c in VS_TORCH_PROFILER:
        if c in conditions and "torch.profiler" in conditions:
            out[f"{c}_vs_torch_profiler_paired"] = res.paired_ratio(c, "torch.profiler")
            out[f"{c}_vs_torch_profiler_p90"] = out[f"{c}_p90_ms"] / out["torch.profiler_p90_ms"]
    if "library" in conditions and "torch.profiler" in conditions:
        # The CPU cross-stack goal: mltrace's full CPU trace vs torch.profiler's own overhead.
        out["library_vs_torch_profiler_ratio"] = out["library_ms"] / out["torch.profiler_ms"]
    return out


def _cnn(kind: str) -> Any:
    if kind == "resnet50":
        try:
            from torchvision.models import resnet50
        except Exception as exc:  # torchvision absent, or a build that does not import beside this torch
            raise SystemExit(f"overhead.py: --cnn resnet50 needs torchvision ({exc})") from None
        return resnet50(weights=None).eval()
    harness.use_examples()
    from models import resnet_small

    return resnet_small()


def measure_api(n: int) -> dict[str, float]:
    """ns per call of a @trace'd function and a span() block, outside and inside a session."""
    import mltrace

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


def _workloads(args: argparse.Namespace, kinds: tuple[str, ...]) -> list[harness.Workload]:
    """The models ``kinds`` names (``cnn``, ``encoder``) as ``--device``, ``--cnn``, ``--dtype`` and
    ``--channels-last`` say, each called with its input (on CUDA, each call ends with
    ``torch.cuda.synchronize()``)."""
    import torch

    harness.use_examples()
    from models import encoder

    torch.manual_seed(0)
    size, seq, layers = (64, 32, 2) if args.quick else (224, 128, 12)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    out = []
    for kind in kinds:
        if kind == "cnn":
            memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
            model = _cnn(args.cnn).to(device=device, dtype=dtype, memory_format=memory_format).eval()
            x = torch.randn(args.batch, 3, size, size, device=device, dtype=dtype).to(memory_format=memory_format)
            label = f"{args.cnn} CNN, batch {args.batch}, {size}x{size}, {args.dtype}"
        else:
            batch = getattr(args, "encoder_batch", 0) or args.batch
            model = encoder(layers=layers).to(device=device, dtype=dtype).eval()
            x = torch.randint(0, 30522, (batch, seq), device=device)
            label = f"Transformer encoder ({layers}x768), batch {batch}, seq {seq}, {args.dtype}"
        out.append(_Synchronized(label, model, x) if args.device == "cuda" else harness.Workload(label, model, x))
    return out


class _Synchronized(harness.Workload):
    """A workload on CUDA: each call waits for its kernels."""

    def __call__(self) -> Any:
        import torch

        y = self.model(self.x)
        torch.cuda.synchronize()
        return y


def mode_sessions(args: argparse.Namespace) -> int:
    import torch

    conditions = [c for c in args.conditions.split(",") if c]
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown:
        return _usage(f"unknown condition(s): {', '.join(unknown)} (known: {', '.join(CONDITIONS)})")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        return _usage("--device cuda: torch sees no CUDA device")
    cnn, enc = _workloads(args, ("cnn", "encoder"))
    results = []
    with torch.inference_mode():
        for name, fn in ((cnn.label, cnn), (enc.label, enc)):
            print(f"measuring {name} on {args.device} ...", file=sys.stderr, flush=True)
            results.append(measure_model(name, fn, args.rounds, args.iters, conditions, cuda))
    api = measure_api(20_000 if args.quick else 200_000)
    where = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"\ntorch {torch.__version__}, {where}, threads {torch.get_num_threads()}, cpu count {os.cpu_count()}, load {loadavg()}")
    _print_sessions(results, conditions)
    print("\nuser API cost per call (ns):")
    for k, v in api.items():
        print(f"  {k:40} {v:8.0f}")
    harness.write_json(args.json, {"models": results, "api": api})
    return 0


def _print_sessions(results: list[dict[str, Any]], conditions: list[str]) -> None:
    print(f"{'model':52} {'plain ms':>9}" + "".join(f" {c + ' ms':>10} {c + ' %':>9}" for c in conditions))
    for r in results:
        print(
            f"{r['model']:52} {r['plain_ms']:9.2f}" + "".join(f" {r[f'{c}_ms']:10.2f} {r[f'{c}_overhead_pct']:+8.2f}%" for c in conditions)
        )
        paired = ", ".join(f"{c} {r[f'{c}_overhead_paired_pct']:+.2f}%" for c in conditions)
        print(f"{'':52} median of per-round ratios to plain: {paired}")
        p90s = ", ".join(f"{c} {r[f'{c}_p90_ms']:.2f}" for c in conditions)
        print(f"{'':52} p90 ms: plain {r['plain_p90_ms']:.2f}, {p90s}")
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


# ================================================================ --mode parts


def _layer_sessions() -> dict[str, Callable[[Path], Any]]:
    """The sessions ``--mode parts`` compares, each made on a run directory."""
    from mltrace.config import ProfileOptions
    from mltrace.run.levels import Level
    from mltrace.tracer.session import Session
    from mltrace.tracer.sources.nvml import NvmlSampler
    from mltrace.tracer.sources.torch_modules import TorchModuleSource

    def options(d: Path, flush_s: float | None = None) -> Any:
        opts = ProfileOptions(output=d, summary=False, level=Level.LAYER)
        return opts if flush_s is None else dataclasses.replace(opts, flush_interval_s=flush_s)

    return {
        "layer, default session": lambda d: Session(options(d)),
        "torch source + streaming": lambda d: Session(options(d), sources=[TorchModuleSource()]),
        "torch source + counters": lambda d: Session(options(d, NO_FLUSH_S), sources=[TorchModuleSource(), NvmlSampler()]),
        "torch source only": lambda d: Session(options(d, NO_FLUSH_S), sources=[TorchModuleSource()]),
    }


def mode_parts(args: argparse.Namespace) -> int:
    import torch

    work = harness.example_model("cnn", batch=args.batch, size=64 if args.quick else 224)
    sessions = _layer_sessions()

    def block(kind: str, r: int) -> list[int]:
        if kind == "plain":
            return time_calls(work, args.iters)
        with tempfile.TemporaryDirectory() as tmp:
            session = sessions[kind](Path(tmp) / "run").start()
            try:
                return time_calls(work, args.iters, warm=1)  # the first call under the session is not timed
            finally:
                session.stop()

    with torch.inference_mode():
        time_calls(work, 0, warm=3)
        res = interleave(["plain", *sessions], args.rounds, block, order=lambda kinds, i: list(kinds), progress="parts")
    print(f"{work.label}; torch threads {torch.get_num_threads()}; {args.rounds} rounds of {args.iters}; load {loadavg()}")
    for name in res.samples:
        print(f"  {name:28} {res.median(name) / 1e6:7.2f} ms  {res.overhead_pct(name):+6.2f} %")
    harness.write_json(
        args.json, {"model": work.label, "plain_ms": res.median("plain") / 1e6, **{k: res.overhead_pct(k) for k in sessions}}
    )
    return 0


# ================================================================ --mode layer-paired


class _GcWatch:
    """The cyclic garbage collector's work (collections by generation, ns) per kind of block."""

    def __init__(self) -> None:
        self.kind = "plain"
        self.work: dict[str, list[float]] = {}
        self._t0 = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
            return
        work = self.work.setdefault(self.kind, [0, 0, 0, 0])
        work[info["generation"]] += 1
        work[3] += time.perf_counter_ns() - self._t0


def mode_layer_paired(args: argparse.Namespace) -> int:
    """Plain and traced blocks, alternating inside one layer-level session (see the module docstring)."""
    import torch
    from torch.nn.modules import module as module_mod

    from mltrace.config import ProfileOptions
    from mltrace.run.levels import Level
    from mltrace.tracer.session import Session
    from mltrace.tracer.sources.torch_modules import TorchModuleSource

    if args.device == "cuda" and not torch.cuda.is_available():
        return _usage("--device cuda: torch sees no CUDA device")
    work = _workloads(args, (args.model,))[0]
    flush_every = args.flush_every or max(1, round(8 / args.batch))
    pairs, block = args.pairs, args.block

    def noop(*_: object) -> None:
        return None

    load_before = loadavg()
    sums: dict[str, int] = {}  # ns timed per kind ("flush": the traced blocks' flushes)
    watch = _GcWatch()
    flushed = [0, 0]  # ns spent in flushes, spans they wrote
    traced_blocks = 0
    res = Rounds()
    kinds = ["plain", "traced", "hooks"]
    with torch.inference_mode(), tempfile.TemporaryDirectory() as tmp:
        time_calls(work, 0, warm=3)
        source = TorchModuleSource()
        options = ProfileOptions(output=Path(tmp) / "run", summary=False, level=Level.LAYER, flush_interval_s=NO_FLUSH_S)
        session = Session(options, sources=[source]).start()

        def drain() -> None:
            """One flush of everything recorded since the last, timed: the flusher's work."""
            pending = len(session.recorder.done) + len(source._frames)
            watch.kind = "flush"
            t0 = time.perf_counter_ns()
            session.flush()
            flushed[0] += time.perf_counter_ns() - t0
            flushed[1] += pending

        try:
            assert source._wrapped is not None, "the torch module source did not wrap Module.__call__"
            module_cls, original, wrapper = source._wrapped
            if source.python_call is not wrapper:
                kinds.append("python")  # the C helper is the installed hot path: time the Python one beside it
            installed = {"plain": original, "traced": wrapper, "hooks": original, "python": source.python_call}
            work()
            session.flush()  # the first flush has one-off costs: not counted
            gc.callbacks.append(watch)
            frames_before = 0
            for i in range(pairs):
                for kind in rotation(kinds, i, mirror=True):
                    module_cls.__call__ = installed[kind]
                    handles = []
                    if kind == "hooks":
                        handles = [module_mod.register_module_forward_pre_hook(noop), module_mod.register_module_forward_hook(noop)]
                    watch.kind = kind
                    try:
                        times = time_calls(work, block, warm=1)  # the first call after a switch is not timed
                        res.add(kind, times)
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
                if (i + 1) % 10 == 0:
                    print(f"round {i + 1}/{pairs}", file=sys.stderr, flush=True)
            drain()  # what the last blocks recorded
        finally:
            if watch in gc.callbacks:
                gc.callbacks.remove(watch)
            session.stop()
    drain_per_inference = flushed[0] / (traced_blocks * (block + 1))  # ns
    total = [(t + drain_per_inference) / p for t, p in zip(res.medians["traced"], res.medians["plain"])]
    sums["flush"] = int(drain_per_inference * pairs * block)
    print(f"{work.label}; torch threads {torch.get_num_threads()}")
    print(f"plain inference: median {statistics.median(res.medians['plain']) / 1e6:.2f} ms")
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
    has_python = "python" in kinds
    hot_path = "C" if has_python else "Python"
    rows = [
        (f"layer level, hot path ({hot_path})", res.ratios("traced")),
        ("with drain+write", total),
        ("no-op global hooks", res.ratios("hooks")),
    ]
    if has_python:
        rows.insert(1, ("layer level, Python hot path", res.ratios("python")))
    for name, ratios in rows:
        print(ratio_row(name, ratios, 22, extremes=True))
    print("means over all timed inferences (noise spikes included), vs plain:")
    means = [(f"layer level, hot path ({hot_path})", sums["traced"]), ("with drain+write", sums["traced"] + sums["flush"])]
    means += [("layer level, Python hot path", sums["python"])] if has_python else []
    means.append(("no-op global hooks", sums["hooks"]))
    for name, total_ns in means:
        print(f"  {name:22} {100 * (total_ns / sums['plain'] - 1):+6.2f} %")
    inferences = pairs * block
    print(f"cyclic GC during the {inferences} timed inferences of each kind (flush: the traced blocks' flushes):")
    for kind in (*kinds, "flush"):
        g0, g1, g2, ns = watch.work.get(kind, [0, 0, 0, 0])
        per = ns / inferences / 1e3
        print(f"  {kind:8} collections gen0/1/2 {g0:4.0f} {g1:3.0f} {g2:2.0f}  {ns / 1e6:8.1f} ms  ({per:6.1f} µs per inference)")
    return 0


# ================================================================ --mode span-cost

SPAN_CALLS = 1000


def _median_ns(fn: Callable[[], object], n: int = 30, after: Callable[[], None] | None = None) -> float:
    """Median time of ``fn()`` after 3 untimed calls; ``after()``, if given, runs untimed after each call."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(n):
        samples += time_calls(fn, 1)
        if after is not None:
            after()
    return statistics.median(samples)


def _streaming_off(call: Callable[[], object]) -> tuple[float, float]:
    """A layer session that never flushes by itself: median ns per call, mean flush ns per span."""
    from mltrace.config import ProfileOptions
    from mltrace.run.levels import Level
    from mltrace.tracer.session import Session
    from mltrace.tracer.sources.torch_modules import TorchModuleSource

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
            return _median_ns(call, after=flush), flush_ns / max(spans, 1)  # a mean: it spreads the GC runs spans cause
        finally:
            session.stop()


def _span_cost_round() -> tuple[float, ...]:
    import torch
    from torch import nn
    from torch.nn.modules import module as module_mod

    import mltrace

    class Many(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ids = nn.ModuleList([nn.Identity() for _ in range(SPAN_CALLS)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for m in self.ids:
                x = m(x)
            return x

    many = Many()
    x = torch.randn(2, 2)
    identity = nn.Identity()

    def call() -> None:
        many(x)

    def model_calls() -> None:  # SPAN_CALLS outermost calls: each one is a model span
        for _ in range(SPAN_CALLS):
            identity(x)

    plain = _median_ns(call)
    h1 = module_mod.register_module_forward_pre_hook(lambda mod, a: None)
    h2 = module_mod.register_module_forward_hook(lambda mod, a, o: None, always_call=True)
    try:
        noop = _median_ns(call)
    finally:
        h1.remove()
        h2.remove()
    traced = {}
    for level in ("model", "layer"):
        with tempfile.TemporaryDirectory() as tmp, mltrace.profile(output=Path(tmp) / "r", summary=False, level=level):
            traced[level] = _median_ns(call)
    quiet, flush_per_span = _streaming_off(call)
    plain_models = _median_ns(model_calls)
    quiet_models, flush_per_model = _streaming_off(model_calls)
    return plain, noop, traced["model"], traced["layer"], quiet, flush_per_span, plain_models, quiet_models, flush_per_model


def _tiny_resnet50() -> Any:
    """ResNet-50's module structure (bottlenecks 3, 4, 6, 3; 182 module calls) at 8 to 64
    channels on 16x16: every call costs the CPU about what launching it costs on a GPU."""
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, mid: int, stride: int) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
            self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
            self.conv3, self.bn3 = nn.Conv2d(mid, mid * 4, 1, bias=False), nn.BatchNorm2d(mid * 4)
            self.relu = nn.ReLU(inplace=True)
            down = cin != mid * 4 or stride != 1
            self.downsample = nn.Sequential(nn.Conv2d(cin, mid * 4, 1, stride, bias=False), nn.BatchNorm2d(mid * 4)) if down else None

        def forward(self, x: Any) -> Any:
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            return self.relu(out + (self.downsample(x) if self.downsample is not None else x))

    stages, cin = [], 8
    for i, n in enumerate((3, 4, 6, 3)):
        mid = 2 << i
        stages.append(nn.Sequential(*(Bottleneck(cin if j == 0 else mid * 4, mid, 2 if i and j == 0 else 1) for j in range(n))))
        cin = mid * 4
    stem = [nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    return nn.Sequential(*stem, *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)).eval()


def _gil_lost(session: Any, frames: Any, call: Callable[[], object], calls: int) -> tuple[float, float]:
    """Wall ns per ``call`` lost while a second thread drains (``session.flush()`` after every
    call) against blocks whose frames are discarded undrained (median of per-round differences),
    and the drain thread's CPU ns per call."""
    import threading

    go, done = threading.Event(), threading.Event()
    drain_cpu = [0]

    def drainer() -> None:
        while go.wait() and not done.is_set():
            go.clear()
            t0 = time.thread_time_ns()
            session.flush()
            drain_cpu[0] += time.thread_time_ns() - t0

    thread = threading.Thread(target=drainer, daemon=True)
    thread.start()
    walls: dict[bool, list[float]] = {True: [], False: []}  # each block's wall ns per call
    try:
        for r in range(calls // 10):
            for drained in (True, False) if r % 2 else (False, True):
                t0 = time.perf_counter_ns()
                for _ in range(10):
                    call()
                    if drained:
                        go.set()  # the drain of the calls so far runs beside the next ones
                walls[drained].append((time.perf_counter_ns() - t0) / 10)
                if not drained:
                    frames.clear()
                time.sleep(0.002)  # the drainer ends its flush outside the timed blocks
    finally:
        done.set()
        go.set()
        thread.join()
    lost = statistics.median(a - b for a, b in zip(walls[True], walls[False]))
    return lost, drain_cpu[0] / (len(walls[True]) * 10)


def _launch_bound_share(pairs: int) -> dict[str, float]:
    """The figures of ``_tiny_resnet50`` under the layer level (ns; see the module docstring)."""
    import torch

    from mltrace.config import ProfileOptions
    from mltrace.run.levels import Level
    from mltrace.tracer.session import Session
    from mltrace.tracer.sources.torch_modules import TorchModuleSource

    net, x = _tiny_resnet50(), torch.randn(1, 3, 16, 16)
    tt = time.thread_time_ns
    with torch.inference_mode(), tempfile.TemporaryDirectory() as tmp:
        time_calls(lambda: net(x), 0, warm=10)
        source = TorchModuleSource()
        options = ProfileOptions(output=Path(tmp) / "r", summary=False, level=Level.LAYER, flush_interval_s=NO_FLUSH_S)
        session = Session(options, sources=[source]).start()
        try:
            assert source._wrapped is not None, "the torch module source did not wrap Module.__call__"
            module_cls, original, wrapper = source._wrapped
            installed = {"plain": original, "layer": wrapper}
            net(x)
            calls = len(source._frames)
            session.flush()
            res = Rounds()
            parts = {"take": 0, "encode": 0, "write": 0, "spans": 0}
            for i in range(pairs):
                for kind in rotation(list(installed), i, mirror=True):
                    module_cls.__call__ = installed[kind]
                    try:
                        res.add(kind, time_calls(lambda: net(x), 10, warm=1, clock=tt))
                    finally:
                        module_cls.__call__ = wrapper
                t0 = tt()
                batch = source._take_frames(source._frames)
                t1 = tt()
                templates, rows, count = source._encode_chunks(batch, int(Level.LAYER))
                del batch
                t2 = tt()
                session._writer.write(span_rows=[rows], span_templates=[templates])  # type: ignore[union-attr]
                parts["write"] += tt() - t2
                parts["take"] += t1 - t0
                parts["encode"] += t2 - t1
                parts["spans"] += count
            lost, drain_cpu = _gil_lost(session, source._frames, lambda: net(x), 20 * pairs)
        finally:
            module_cls.__call__ = wrapper
            session.stop()
    plain = res.medians["plain"]
    out = {"calls": calls, "plain_ns": statistics.median(plain)}
    out["layer"] = statistics.median(b - a for a, b in zip(plain, res.medians["layer"])) / calls
    spans = max(parts.pop("spans"), 1)
    out.update({k: v / spans for k, v in parts.items()})
    out["gil_lost"], out["drain_cpu"] = lost / calls, drain_cpu / calls
    return out


def _print_launch_bound(f: dict[str, float]) -> None:
    plain_us, calls = f["plain_ns"] / 1e3, int(f["calls"])
    share = 100 * calls / f["plain_ns"]  # % of an inference per ns a call

    def line(name: str, ns: float) -> None:
        print(f"  {name + ':':46} {ns:6.0f} ns per module call  ({ns * share:+5.2f} % of an inference)")

    print(f"ResNet-50-shaped net of tiny modules: {calls} module calls, plain {plain_us:.0f} µs (thread CPU time)")
    line("layer level, C hot path (program thread CPU)", f["layer"])
    drain = f["take"] + f["encode"] + f["write"]
    line(f"drain a span (take {f['take']:.0f}, encode {f['encode']:.0f}, write {f['write']:.0f})", drain)
    line("program wall lost to a drain on another thread", f["gil_lost"])
    print(f"    (that drain thread's own CPU: {f['drain_cpu']:.0f} ns a span)")


def mode_span_cost(args: argparse.Namespace) -> int:
    launch_bound = _launch_bound_share(args.pairs)
    _print_launch_bound(launch_bound)
    rows = []
    for rnd in range(args.rounds):
        rows.append(_span_cost_round())
        print(f"round {rnd}: done", file=sys.stderr)
    plain, noop, model, layer, quiet, flush, plain_models, quiet_models, flush_model = (statistics.median(c) for c in zip(*rows))
    per_call = {
        "torch's hooked path (no-op global hooks)": noop,
        "mltrace --level model": model,
        "mltrace --level layer (one span each)": layer,
        "  the same, streaming off (wrapper only)": quiet,
    }
    print(f"plain forward with {SPAN_CALLS} module calls: {plain / 1e6:.2f} ms; load {loadavg()}")
    for name, ns in per_call.items():
        print(f"  {name + ':':42} {(ns - plain) / SPAN_CALLS / 1e3:6.2f} µs per module call")
    print(f"    draining + writing one span (flusher):  {flush / 1e3:6.2f} µs per span")
    print(
        f"a model call (the outermost call of an nn.Identity, {SPAN_CALLS} in a row; "
        f"plain {plain_models / SPAN_CALLS / 1e3:.2f} µs a call):"
    )
    print(f"  its model span, streaming off:            {(quiet_models - plain_models) / SPAN_CALLS / 1e3:6.2f} µs per model call")
    print(f"    draining + writing one model span:      {flush_model / 1e3:6.2f} µs per span")
    figures = {name.strip(): (ns - plain) / SPAN_CALLS for name, ns in per_call.items()}
    harness.write_json(
        args.json,
        {
            "plain_ns": plain,
            "per_module_call_ns": figures,
            "drain_ns_per_span": flush,
            "model_drain_ns": flush_model,
            "launch_bound": launch_bound,
        },
    )
    return 0


# ================================================================ --mode cross-stack

IN_SESSION = ("op", "op+layer", "op+library", "full")  # phase A: (wrapper on, verbose on)
SWITCHES = {"op": (False, False), "op+layer": (True, False), "op+library": (False, True), "full": (True, True)}
PROFILERS = ("plain", "torch.profiler", "mltrace's profiler")  # phase B


def _set_verbose(on: bool) -> None:
    import torch

    verbose = torch._C._verbose
    if torch.backends.mkldnn.is_available():
        verbose.mkldnn_set_verbose(1 if on else 0)
    if torch.backends.mkl.is_available():
        verbose.mkl_set_verbose(1 if on else 0)


def _in_session(fn: Callable[[], Any], pairs: int, block: int, flush_every: int) -> dict[str, Any]:
    """Phase A: block medians per kind and round, inside one library-level session."""
    from mltrace.config import ProfileOptions
    from mltrace.run.levels import Level
    from mltrace.tracer.session import Session
    from mltrace.tracer.sources.cpu_library import CpuLibrarySource
    from mltrace.tracer.sources.torch_modules import TorchModuleSource

    res = Rounds()
    flush_ns = spans_inferences = verbose_inferences = 0
    with tempfile.TemporaryDirectory() as tmp:
        options = ProfileOptions(
            output=Path(tmp) / "run", summary=False, level=Level.LIBRARY, flush_interval_s=NO_FLUSH_S, op_memory_gib=16, max_spans=0
        )
        session = Session(options).start()
        try:
            modules = next(s for s in session.started if isinstance(s, TorchModuleSource))
            library = next(s for s in session.started if isinstance(s, CpuLibrarySource))
            assert modules._wrapped is not None, "the torch module source did not wrap Module.__call__"
            assert library._tap is not None, "the library level's fd tap did not start"
            module_cls, original, wrapper = modules._wrapped
            fn()
            session.flush()  # the first flush has one-off costs: not counted
            lines_before = len(library._tap.lines())
            for i in range(pairs):
                for kind in rotation(IN_SESSION, i, mirror=True):
                    wrapped, verbose = SWITCHES[kind]
                    module_cls.__call__ = wrapper if wrapped else original
                    _set_verbose(verbose)
                    try:
                        res.add(kind, time_calls(fn, block, warm=1))
                    finally:
                        module_cls.__call__ = wrapper
                        _set_verbose(True)
                    spans_inferences += (block + 1) * wrapped
                    verbose_inferences += (block + 1) * verbose
                if (i + 1) % flush_every == 0 or i == pairs - 1:
                    t0 = time.perf_counter_ns()
                    session.flush()
                    flush_ns += time.perf_counter_ns() - t0
                if (i + 1) % 10 == 0:
                    print(f"in-session round {i + 1}/{pairs}", file=sys.stderr, flush=True)
            time.sleep(0.05)  # the reader's last batch
            lines = (len(library._tap.lines()) - lines_before) / max(verbose_inferences, 1)
        finally:
            module_cls.__call__ = wrapper
            print("stopping the session (converting the trace) ...", file=sys.stderr, flush=True)
            session.stop()
    drain = flush_ns / max(spans_inferences, 1)  # ns an inference that recorded spans
    op = res.medians["op"]
    ratios = {k: [(m + drain * SWITCHES[k][0]) / o for m, o in zip(res.medians[k], op)] for k in IN_SESSION[1:]}
    return {"ratios": ratios, "drain_ns": drain, "lines_per_inference": lines}


def _profilers(fn: Callable[[], Any], pairs: int, block: int) -> dict[str, Any]:
    """Phase B: plain, torch.profiler(record_shapes=True) and the op level's profiler configuration."""
    from torch.profiler import ProfilerActivity, profile

    from mltrace.tracer.sources.torch_ops import _all_threads_config

    config = _all_threads_config()

    def timed(kind: str, _: int) -> list[int]:
        if kind == "plain":
            return time_calls(fn, block, warm=1)
        kwargs: dict[str, Any] = {"activities": [ProfilerActivity.CPU], "record_shapes": True}
        if kind != "torch.profiler" and config is not None:
            kwargs["experimental_config"] = config
        prof = profile(**kwargs)
        prof.start()
        try:
            return time_calls(fn, block, warm=1)
        finally:
            prof.stop()

    res = interleave(PROFILERS, pairs, timed, order=lambda kinds, i: rotation(kinds, i, mirror=True), progress="profiler")
    ratios = {
        "torch.profiler / plain": res.ratios("torch.profiler"),
        "mltrace's profiler / torch.profiler": res.ratios("mltrace's profiler", "torch.profiler"),
    }
    return {"plain_ns": statistics.median(res.medians["plain"]), "ratios": ratios, "all_threads": config is not None}


def mode_cross_stack(args: argparse.Namespace) -> int:
    import torch

    work = harness.example_model(args.model, size=64 if args.quick else 224, seq=32 if args.quick else 128)
    load_before = loadavg()
    with torch.inference_mode():
        time_calls(work, 0, warm=3)
        a = _in_session(work, args.pairs, args.block, args.flush_every)
        b = _profilers(work, args.pairs, args.block)
    print(f"{work.label}; torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"plain inference: median {b['plain_ns'] / 1e6:.2f} ms; load average before {load_before}, after {loadavg()}")
    print(
        f"A. inside one library-level session, {args.pairs} rounds of {len(IN_SESSION)} blocks of {args.block}: "
        f"{a['lines_per_inference']:.0f} verbose lines an inference, drain+write {a['drain_ns'] / 1e3:.0f} µs an inference"
    )
    for kind, ratios in a["ratios"].items():
        print(ratio_row(f"{kind} / op", ratios, 38))
    config = "every thread" if b["all_threads"] else "the starting thread only (no profile_all_threads here)"
    print(f"B. {args.pairs} rounds of {len(PROFILERS)} blocks of {args.block}, profilers started and stopped around each block")
    for name, ratios in b["ratios"].items():
        print(ratio_row(name + (f" ({config})" if name.startswith("mltrace") else ""), ratios, 38))
    full = a["ratios"]["full"]
    config_ratio = b["ratios"]["mltrace's profiler / torch.profiler"]
    estimate = statistics.median(full) * statistics.median(config_ratio)
    lo, hi = harness.bootstrap_product(full, config_ratio)
    print(f"full CPU trace / torch.profiler alone = {estimate:.3f}x  95% CI [{lo:.3f}, {hi:.3f}]  (A full/op x B)")
    profiler_cost = statistics.median(b["ratios"]["torch.profiler / plain"])
    full_cost = estimate * profiler_cost
    if profiler_cost > 1:
        print(
            f"as overheads: torch.profiler +{100 * (profiler_cost - 1):.2f} %, full CPU trace +{100 * (full_cost - 1):.2f} % "
            f"({(full_cost - 1) / (profiler_cost - 1):.2f}x torch.profiler's overhead)"
        )
    harness.write_json(
        args.json, {"model": work.label, "full_vs_torch_profiler": estimate, "ci95": [lo, hi], "in_session": a, "profilers": b}
    )
    return 0


# ================================================================ --mode frameworks

FRAMEWORK_LEVELS = ("model", "op")


def _framework_session(level: str, out: Path) -> Any:
    """A session at ``level`` with the default sources plus the ONNX Runtime and TensorFlow ones."""
    from mltrace.config import ProfileOptions
    from mltrace.run.levels import Level
    from mltrace.tracer.session import Session
    from mltrace.tracer.sources import default_sources
    from mltrace.tracer.sources.onnxruntime import OrtSource
    from mltrace.tracer.sources.tensorflow import TensorFlowSource

    sources = default_sources()
    names = {s.name for s in sources}
    sources += [s for s in (OrtSource(), TensorFlowSource()) if s.name not in names]
    return Session(ProfileOptions(output=out, summary=False, level=Level.parse(level)), sources=sources)


def measure_framework(name: str, make: Callable[[], Callable[[], Any]], rounds: int, iters: int, warmup: int = 3) -> dict[str, Any]:
    """Median ns per call plain and per level; ``make()`` builds the callable (inside the traced session for those)."""
    with tempfile.TemporaryDirectory() as tmp:

        def block(kind: str, r: int) -> list[int]:
            # Every block builds its callable alike (a fresh ORT session each time); its first
            # calls (arena growth, weight prepacking, a new tracing session) are not timed.
            if kind == "plain":
                return time_calls(make(), iters, warm=warmup)
            session = _framework_session(kind, Path(tmp) / f"{kind}-{r}").start()
            try:
                return time_calls(make(), iters, warm=warmup)
            finally:
                session.stop()

        res = interleave(["plain", *FRAMEWORK_LEVELS], rounds, block, order=lambda kinds, i: list(kinds))
    out: dict[str, Any] = {"model": name, "plain_ms": res.median("plain") / 1e6, "samples": len(res.samples["plain"])}
    for c in FRAMEWORK_LEVELS:
        out[f"{c}_ms"] = res.median(c) / 1e6
        out[f"{c}_overhead_pct"] = res.overhead_pct(c)
    return out


def _ort_cases(size: int) -> list[tuple[str, Callable[[], Callable[[], Any]]]]:
    import numpy as np
    import onnxruntime as ort

    harness.use_examples()
    from ort_infer import export

    path = os.path.join(tempfile.gettempdir(), "mltrace-examples", f"resnet_small_dynamo_{size}.onnx")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        export(path + ".tmp", "dynamo", size)
        os.replace(path + ".tmp", path)
    images = np.random.default_rng(0).standard_normal((1, 3, size, size), dtype=np.float32)

    def make(level: Any) -> Callable[[], Callable[[], Any]]:
        def build() -> Callable[[], Any]:
            options = ort.SessionOptions()
            options.graph_optimization_level = level
            sess = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            name = sess.get_inputs()[0].name
            return lambda: sess.run(None, {name: images})

        return build

    def tiny() -> Callable[[], Any]:
        # One Neg node: what is left is the cost per run() call of ORT and of tracing it.
        from onnx import TensorProto, helper

        graph = helper.make_graph(
            [helper.make_node("Neg", ["x"], ["y"], name="neg")],
            "tiny",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        x = np.ones(4, np.float32)
        return lambda: sess.run(None, {"x": x})

    return [
        (f"ORT ResNet-18-style, {size}x{size}, optimisations on", make(ort.GraphOptimizationLevel.ORT_ENABLE_ALL)),
        (f"ORT ResNet-18-style, {size}x{size}, optimisations off", make(ort.GraphOptimizationLevel.ORT_DISABLE_ALL)),
        ("ORT one-node model (cost per run call)", tiny),
    ]


def _keras_cases(size: int) -> list[tuple[str, Callable[[], Callable[[], Any]]]]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(weights=None, input_shape=(size, size, 3))
    images = np.random.default_rng(0).standard_normal((1, size, size, 3)).astype(np.float32)
    model.predict(images, verbose=0)
    dense = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="fc")], name="tiny")
    row = np.ones((1, 4), np.float32)
    dense(row)
    return [
        (f"Keras MobileNetV2 predict(), {size}x{size}", lambda: lambda: model.predict(images, verbose=0)),
        (f"Keras MobileNetV2 eager model(x), {size}x{size}", lambda: lambda: model(images, training=False)),
        ("Keras one-Dense model eager (cost per call)", lambda: lambda: dense(row)),
    ]


def mode_frameworks(args: argparse.Namespace) -> int:
    ort_size, keras_size = (64, 64) if args.quick else (112, 96)
    wanted = {f for f in args.frameworks.split(",") if f}
    unknown = wanted - {"onnxruntime", "keras"}
    if unknown:
        return _usage(f"--frameworks: unknown {', '.join(sorted(unknown))} (onnxruntime, keras)")
    cases: list[tuple[str, Callable[[], Callable[[], Any]]]] = []
    cases += _ort_cases(ort_size) if "onnxruntime" in wanted else []
    cases += _keras_cases(keras_size) if "keras" in wanted else []
    results = []
    for name, make in cases:
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        per_call = "cost per" in name  # microseconds per call: many calls per block
        results.append(measure_framework(name, make, args.rounds, args.iters * 50 if per_call else args.iters))
    versions = [f"{mod} {sys.modules[mod].__version__}" for mod in ("onnxruntime", "tensorflow", "keras") if mod in sys.modules]
    print(f"\n{', '.join(versions)}; cpu count {os.cpu_count()}; load {loadavg()}; {args.rounds} rounds x {args.iters} calls per condition")
    print(f"{'model':48} {'plain ms':>9}" + "".join(f" {c + ' ms':>10} {c + ' %':>9}" for c in FRAMEWORK_LEVELS))
    for r in results:
        line = f"{r['model']:48} {r['plain_ms']:9.3f}"
        line += "".join(f" {r[f'{c}_ms']:10.3f} {r[f'{c}_overhead_pct']:+8.1f}%" for c in FRAMEWORK_LEVELS)
        print(line)
    harness.write_json(args.json, results)
    return 0


# ================================================================ the command line

MODES: dict[str, Callable[[argparse.Namespace], int]] = {
    "sessions": mode_sessions,
    "parts": mode_parts,
    "layer-paired": mode_layer_paired,
    "span-cost": mode_span_cost,
    "cross-stack": mode_cross_stack,
    "frameworks": mode_frameworks,
}
#: The flags that pick and convert the models of ``_workloads`` (sessions and layer-paired), defaults as below.
_MODEL_FLAGS: dict[str, tuple[Any, Any]] = {
    "device": ("cpu", "cpu"),
    "cnn": ("resnet18-style", "resnet18-style"),
    "dtype": ("float32", "float32"),
    "channels_last": (False, False),
}
#: Each mode's defaults (normal, --quick) for the flags it takes; a flag a mode does not list is refused there.
DEFAULTS: dict[str, dict[str, tuple[Any, Any]]] = {
    "sessions": {
        "rounds": (8, 2),
        "iters": (5, 2),
        "batch": (1, 1),
        "threads": (0, 0),
        "conditions": ("layer", "layer"),
        "encoder_batch": (0, 0),
        **_MODEL_FLAGS,
    },
    "parts": {"rounds": (12, 2), "iters": (5, 2), "batch": (1, 1), "threads": (0, 0)},
    "layer-paired": {
        "pairs": (100, 4),
        "block": (3, 1),
        "flush_every": (0, 0),
        "batch": (1, 1),
        "threads": (0, 0),
        "model": ("cnn", "cnn"),
        **_MODEL_FLAGS,
    },
    "span-cost": {"rounds": (5, 1), "pairs": (60, 4), "threads": (0, 0)},
    "cross-stack": {"model": ("cnn", "cnn"), "pairs": (60, 2), "block": (3, 1), "flush_every": (2, 1), "threads": (0, 0)},
    "frameworks": {"rounds": (5, 2), "iters": (6, 2), "frameworks": ("onnxruntime,keras", "onnxruntime,keras")},
}


def build_parser() -> argparse.ArgumentParser:
    p = harness.parser(__doc__)
    p.add_argument("--mode", choices=list(MODES), default="sessions", help="what to measure (default: sessions)")
    harness.add_quick(p)
    harness.add_json(p)
    p.add_argument("--rounds", type=int, help="interleaved rounds (sessions 8, parts 12, span-cost 5, frameworks 5)")
    p.add_argument("--iters", type=int, help="timed calls a block (sessions 5, parts 5, frameworks 6)")
    p.add_argument("--batch", type=int, help="images per inference (default 1)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    g = p.add_argument_group("--mode sessions (--device, --cnn, --dtype, --channels-last: layer-paired too)")
    g.add_argument("--conditions", help="comma list of: " + ", ".join(CONDITIONS) + " (default: layer)")
    g.add_argument("--device", choices=("cpu", "cuda"), help="where the models run (default: cpu)")
    g.add_argument("--encoder-batch", type=int, help="batch size of the encoder (default: --batch)")
    g.add_argument("--cnn", choices=("resnet18-style", "resnet50"), help="the CNN measured (default: resnet18-style)")
    g.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), help="both models' dtype (default: float32)")
    g.add_argument("--channels-last", action="store_const", const=True, help="the CNN and its input in channels_last")
    g = p.add_argument_group("--mode layer-paired and cross-stack")
    g.add_argument("--pairs", type=int, help="rounds of paired blocks (layer-paired 100, cross-stack 60, span-cost 60)")
    g.add_argument("--block", type=int, help="timed inferences a block (default 3)")
    g.add_argument(
        "--flush-every", type=int, help="traced blocks (layer-paired; default 8 / batch) or rounds (cross-stack; 2) a timed flush"
    )
    g.add_argument("--model", choices=("cnn", "encoder"), help="layer-paired and cross-stack: the model (default: cnn)")
    g = p.add_argument_group("--mode frameworks")
    g.add_argument("--frameworks", help="comma list of onnxruntime, keras (default: both)")
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, each mode's defaults filled in; a flag the mode does not take is an error."""
    p = build_parser()
    args = p.parse_args(argv)
    taken = DEFAULTS[args.mode]
    for dest in ("rounds", "iters", "batch", "threads", *{d for m in DEFAULTS.values() for d in m}):
        value = getattr(args, dest)
        if value is not None and dest not in taken:
            p.error(f"--{dest.replace('_', '-')} does not apply to --mode {args.mode}")
        if value is None and dest in taken:
            setattr(args, dest, taken[dest][1 if args.quick else 0])
    for dest in ("rounds", "iters", "batch", "pairs", "block"):
        if dest in taken and getattr(args, dest) < 1:
            p.error(f"--{dest} must be at least 1")
    if args.mode == "cross-stack" and (args.pairs < 2 or args.flush_every < 1):
        p.error("--mode cross-stack: --pairs must be at least 2, --flush-every at least 1")
    return args


def _usage(message: str) -> int:
    print(f"overhead.py: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if getattr(args, "threads", 0):
        import torch

        torch.set_num_threads(args.threads)
    return MODES[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
