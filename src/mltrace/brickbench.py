"""DLBricks' benchmark runner: builds each brick as a fresh ``torch.nn`` layer and times it.

``mltrace.analysis.bricks`` extracts the bricks from traced runs and constructs each
model's latency from their timings (pure data); this module does what needs torch and
the machine: ``build_brick`` makes a layer of the brick's type and configuration with
random weights and inputs of the recorded shapes, ``benchmark_bricks`` times each (warm-up,
then the median of timed calls under ``torch.inference_mode()``, cycling through copies so
that no call finds the previous call's data in cache, as inside a model; a sequence runs
its layers back to back; optionally exported to ONNX and timed in an ONNX Runtime
``InferenceSession``), and ``run_bricks`` runs the whole pipeline in the state the model
ran in (the runs' thread count) while watching how busy the machine is (``MachineWatch``).
``commands/bricks.py`` calls it; ``viewers/bricks.py`` draws the report.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from mltrace.analysis.bricks import (
    NO_ARG_TYPES,
    Brick,
    BrickSet,
    BricksReport,
    BrickTiming,
    MachineState,
    assemble,
    extract,
)
from mltrace.run.store import Run

#: Extra keyword arguments a layer is called with in isolation (as its usual caller does).
_CALL_KWARGS: dict[str, dict[str, Any]] = {"MultiheadAttention": {"need_weights": False}}


class UnsupportedBrick(Exception):
    """A brick that cannot be instantiated or run in isolation (message says why)."""


_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "float64": "float64"}


def build_brick(brick: Brick) -> tuple[Any, list[Any], dict[str, Any]]:
    """A fresh ``torch.nn`` layer for the brick, random inputs, and call keyword arguments.

    Raises:
        UnsupportedBrick: unknown type, unknown arguments, or inputs it cannot make.
    """
    import torch

    cls = getattr(torch.nn, brick.type, None)
    if cls is None or not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise UnsupportedBrick(f"{brick.type} is not a torch.nn layer")
    if brick.config_source == "none" and brick.type not in NO_ARG_TYPES:
        raise UnsupportedBrick(f"{brick.type}: constructor arguments neither recorded nor inferable")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in brick.config}
    try:
        module = cls(**kwargs).eval()
    except Exception as exc:
        raise UnsupportedBrick(f"{brick.type}({kwargs}): {exc}") from None
    if module_params(module) != brick.params:
        raise UnsupportedBrick(f"{brick.type}: rebuilt with {module_params(module)} parameters, traced with {brick.params}")
    float_dtypes = [d for d in brick.input_dtypes if d in _TORCH_DTYPES]
    if float_dtypes and float_dtypes[0] != "float32":
        module = module.to(getattr(torch, float_dtypes[0]))
    inputs = []
    for shape, dtype in zip(brick.input_shapes, brick.input_dtypes or ("float32",) * len(brick.input_shapes)):
        if dtype in _TORCH_DTYPES:
            inputs.append(torch.randn(shape, dtype=getattr(torch, dtype)))
        elif dtype in ("int64", "int32", "int16", "int8", "uint8"):
            high = int(getattr(module, "num_embeddings", 2))
            inputs.append(torch.randint(0, high, shape, dtype=getattr(torch, dtype)))
        elif dtype == "bool":
            inputs.append(torch.zeros(shape, dtype=torch.bool))
        else:
            raise UnsupportedBrick(f"{brick.type}: input dtype {dtype} not supported")
    if not inputs:
        raise UnsupportedBrick(f"{brick.type}: no recorded tensor input")
    return module, inputs, dict(_CALL_KWARGS.get(brick.type, {}))


def module_params(module: Any) -> int:
    """Parameter count of a module."""
    return sum(int(p.numel()) for p in module.parameters())


def private_cache_bytes() -> int:
    """Size of the largest per-core CPU cache (L2 on most CPUs) from sysfs; 2 MiB if unknown (bytes)."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        import os

        for entry in os.listdir(base):
            try:
                with open(f"{base}/{entry}/level") as f:
                    level = int(f.read())
                with open(f"{base}/{entry}/size") as f:
                    text = f.read().strip().upper()
                with open(f"{base}/{entry}/shared_cpu_list") as f:
                    shared = f.read().strip()
            except (OSError, ValueError):
                continue
            if level > 2 or "," in shared or "-" in shared:
                continue  # shared caches hold the whole model's data anyway
            mult = {"K": 1024, "M": 1024 * 1024}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KM")) * mult)
    except OSError:
        pass
    return best or 2 * 1024 * 1024


def _minor_faults() -> int:
    """The calling thread's minor page faults so far (-1 where unknown)."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    except (ImportError, AttributeError, OSError):
        return -1


def _time_calls(
    fn: Callable[[], Any], warmup: int, n: int, min_time_s: float, evict: Callable[[], Any] | None = None
) -> tuple[list[int], list[int], list[int]]:
    """Wall-clock and calling-thread CPU durations (ns) and minor page faults of timed calls
    (faults empty where unknown)."""
    for _ in range(warmup):
        fn()
    wall: list[int] = []
    cpu: list[int] = []
    faults: list[int] = []
    deadline = time.perf_counter() + min_time_s
    while len(wall) < n or (time.perf_counter() < deadline and len(wall) < 50 * n):
        if evict is not None:
            evict()  # outside the timed region
        f0 = _minor_faults()
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        cpu.append(time.thread_time_ns() - c0)
        wall.append(t1 - t0)
        if f0 >= 0:
            faults.append(_minor_faults() - f0)
    return wall, cpu, faults


def fault_cost_ns(megabytes: int = 64, rounds: int = 5) -> float | None:
    """CPU time a minor page fault costs the faulting thread (ns): the median over ``rounds`` of
    (filling fresh memory − filling it again) / the faults the first fill took; None where
    faults cannot be counted.

    The memory is a fresh anonymous mapping filled by ``memset`` on the calling thread alone: a
    fill spread over a thread pool would leave part of the faults to other threads, and its
    barrier would charge the calling thread for waiting on them (on a busy machine, more than
    the faults themselves)."""
    import ctypes
    import mmap

    size = megabytes << 20
    costs = []
    for _ in range(rounds):
        with mmap.mmap(-1, size) as block:
            view = ctypes.c_char.from_buffer(block)
            try:
                address = ctypes.addressof(view)
                f0 = _minor_faults()
                c0 = time.thread_time_ns()
                ctypes.memset(address, 1, size)
                c1 = time.thread_time_ns()
                f1 = _minor_faults()
                ctypes.memset(address, 2, size)
                c2 = time.thread_time_ns()
            finally:
                del view  # the mapping cannot close while a ctypes object holds its buffer
        if f0 < 0 or f1 - f0 <= 0:
            return None
        costs.append(max(0.0, ((c1 - c0) - (c2 - c1)) / (f1 - f0)))
    return float(statistics.median(costs))


#: Default working set (bytes) that cold benchmarking spreads a brick's calls over.
COLD_WORKING_SET = 64 * 1024 * 1024

#: Most copies of one brick cold benchmarking makes.
MAX_COPIES = 32


def benchmark_bricks(
    bricks: Sequence[Brick] | Sequence[tuple[Brick, ...]],
    *,
    warmup: int = 3,
    n: int = 10,
    min_time_s: float = 0.0,
    runtime: str = "pytorch",
    cache: str = "cold",
    working_set: int = COLD_WORKING_SET,
    progress: Callable[[int, int], None] | None = None,
) -> list[BrickTiming]:
    """Benchmarks each brick (or sequence of bricks) in isolation.

    Inside a model a layer's weights and input were last touched a whole
    model ago (weights) or written by other layers in between, so they are not
    in the core's caches; a layer called back to back on the same data is
    (warm). Cold benchmarking (the default) therefore builds K independent
    copies of the brick — layer and inputs — with K x its footprint >=
    ``working_set`` (K <= 32), and cycles through them so no timed call finds
    the previous call's data. ONNX Runtime bricks use one copy and evict the
    private caches before each timed call instead.

    Args:
        bricks: unique bricks, or unique sequences (each run back to back).
        warmup: untimed calls first (at least one per copy).
        n: timed calls at least (more while ``min_time_s`` has not passed).
        min_time_s: keep timing small bricks at least this long (s).
        runtime: "pytorch", or "onnxruntime" (layer exported to ONNX).
        cache: "cold" or "warm" (back-to-back calls on the same data).
        working_set: cold benchmarking's working set (bytes).
        progress: called with (done, total) after each brick.

    Returns:
        One timing per brick, in order.
    """
    import torch

    if cache not in ("cold", "warm"):
        raise ValueError(f"cache must be 'cold' or 'warm', not {cache!r}")
    evict: Callable[[], Any] | None = None
    if cache == "cold" and runtime != "pytorch":
        scratch = torch.zeros(2 * private_cache_bytes() // 4)

        def evict() -> Any:
            return scratch.add_(1.0)

    out: list[BrickTiming] = []
    for i, item in enumerate(bricks):
        seq: tuple[Brick, ...] = item if isinstance(item, tuple) else (item,)
        t0 = time.perf_counter()
        try:
            first = [_make_call(b, runtime) for b in seq]
            copies = [[c for c, _, _ in first]]
            if cache == "cold" and runtime == "pytorch":
                footprint = max(1, sum(nbytes for _, nbytes, _ in first))
                k = max(1, min(MAX_COPIES, -(-working_set // footprint)))
                copies += [[clone() for _, _, clone in first] for _ in range(k - 1)]
            turn = [0]

            def run_next(copies: list[list[Callable[[], Any]]] = copies, turn: list[int] = turn) -> None:
                calls = copies[turn[0] % len(copies)]
                turn[0] += 1
                for c in calls:
                    c()

            with torch.inference_mode():
                samples, cpu, faults = _time_calls(run_next, max(warmup, len(copies)), n, min_time_s, evict)
            out.append(
                BrickTiming(
                    float(statistics.median(samples)),
                    len(samples),
                    runtime,
                    wall_s=time.perf_counter() - t0,
                    cpu_median_ns=float(statistics.median(cpu)),
                    mean_ns=float(statistics.fmean(samples)),
                    cpu_mean_ns=float(statistics.fmean(cpu)),
                    minor_faults=float(statistics.median(faults)) if faults else None,
                )
            )
        except UnsupportedBrick as exc:
            out.append(BrickTiming(None, 0, runtime, str(exc), time.perf_counter() - t0))
        except Exception as exc:  # a layer that fails on its recorded inputs
            out.append(BrickTiming(None, 0, runtime, f"{seq[0].type}: {type(exc).__name__}: {exc}", time.perf_counter() - t0))
        if progress is not None:
            progress(i + 1, len(bricks))
    return out


def _nbytes(value: Any) -> int:
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.element_size() * value.numel())
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


def _make_call(brick: Brick, runtime: str) -> tuple[Callable[[], Any], int, Callable[[], Callable[[], Any]]]:
    """A callable running the brick once, its footprint (weights, inputs, outputs; bytes),
    and a factory of independent copies (own weights and inputs, same values)."""
    import copy

    import torch

    module, inputs, kwargs = build_brick(brick)
    if runtime == "pytorch":
        with torch.inference_mode():
            result = module(*inputs, **kwargs)  # fails here, not in the timed loop, on unusable inputs
        footprint = _nbytes(list(module.parameters())) + _nbytes(list(module.buffers())) + _nbytes(inputs) + _nbytes(result)

        def clone() -> Callable[[], Any]:
            # Copying is much cheaper than building (no weight initialisation) and gives new memory.
            m2 = copy.deepcopy(module)
            xs = [x.clone() for x in inputs]
            return lambda: m2(*xs, **kwargs)

        return (lambda: module(*inputs, **kwargs)), footprint, clone
    if runtime == "onnxruntime":
        call = _ort_call(brick, module, inputs, kwargs)
        return call, 0, lambda: call
    raise ValueError(f"unknown runtime {runtime!r}")


def _ort_call(brick: Brick, module: Any, inputs: list[Any], kwargs: dict[str, Any]) -> Callable[[], Any]:
    import contextlib
    import io
    import os
    import tempfile
    import warnings

    import torch

    try:
        import onnxruntime as ort
    except ImportError:
        raise UnsupportedBrick("onnxruntime is not installed (pip install 'mltrace[onnxruntime]')") from None

    class _Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, *xs: Any) -> Any:
            return self.inner(*xs, **kwargs)

    with tempfile.TemporaryDirectory(prefix="mltrace-brick-") as tmp:
        path = os.path.join(tmp, "brick.onnx")
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")
                torch.onnx.export(_Wrapped().eval(), tuple(inputs), path, dynamo=False, opset_version=17)
        except Exception as exc:
            raise UnsupportedBrick(f"{brick.type}: ONNX export failed: {type(exc).__name__}: {str(exc)[:200]}") from None
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.intra_op_num_threads = torch.get_num_threads()  # the same threads PyTorch bricks get
        sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    feed = {name: x.numpy() for name, x in zip(names, inputs)}
    sess.run(None, feed)
    return lambda: sess.run(None, feed)


# -- the machine ---------------------------------------------------------------------------------


def _busy_s() -> float | None:
    """CPU time every process of the machine has used since boot (s; /proc/stat's busy
    fields, steal included: time a virtual CPU waited for the host), None without /proc."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    """CPU time this process has used, every thread (s)."""
    t = os.times()
    return t.user + t.system


class MachineWatch:
    """Measures, over a ``with`` block, the CPU time other processes used (``state``)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.state: MachineState | None = None

    def __enter__(self) -> MachineWatch:
        self._start = (_busy_s(), _own_s(), time.perf_counter(), os.getloadavg()[0])
        return self

    def __exit__(self, *exc: object) -> None:
        busy0, own0, wall0, load0 = self._start
        busy1, own1, wall1 = _busy_s(), _own_s(), time.perf_counter()
        if busy0 is None or busy1 is None or wall1 <= wall0:
            return
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall1 - wall0)
        self.state = MachineState(os.cpu_count() or 1, self.threads, round(others, 3), (load0, os.getloadavg()[0]))


def bench_threads(bset: BrickSet, threads: int | None) -> int:
    """The threads to benchmark with: ``threads`` when given, else those the runs were traced
    with (run.json), else torch's current number.

    Raises:
        ValueError: the runs used different thread counts and ``threads`` is None.
    """
    import torch

    if threads is not None:
        return threads
    used = sorted({m.threads for m in bset.models if m.threads is not None})
    if len(used) > 1:
        raise ValueError(f"the runs were traced with different thread counts ({', '.join(map(str, used))}): give --threads")
    return used[0] if used else int(torch.get_num_threads())


def basis_threads(bset: BrickSet, bench: int) -> int | None:
    """The intra-op threads that decide the comparison's basis: the most that a model was
    traced with or the bricks ran with; None when a run's count is unknown."""
    traced = [m.threads for m in bset.models]
    if any(t is None for t in traced):
        return None
    return max([bench, *(t for t in traced if t is not None)])


def run_bricks(
    runs: Sequence[Run],
    *,
    granularity: int = 1,
    warmup: int = 3,
    n: int = 10,
    min_time_s: float = 0.0,
    runtime: str = "pytorch",
    cache: str = "cold",
    trace_warmup: int = 1,
    threads: int | None = None,
    statistic: str = "median",
    basis: str = "auto",
    progress: Callable[[int, int], None] | None = None,
) -> BricksReport:
    """Extracts, deduplicates and benchmarks bricks, and constructs every model's latency.

    Bricks run with the threads the model ran with (``bench_threads``): a layer timed
    with two threads where the model had one would be constructed short.

    Args:
        runs: traced runs (layer level or deeper).
        granularity: H (1: layers only).
        warmup, n, min_time_s: the brick benchmarking protocol.
        runtime: "pytorch" or "onnxruntime".
        cache: "cold" or "warm" (see ``benchmark_bricks``).
        trace_warmup: model calls of each run skipped (see ``extract``).
        threads: torch threads while benchmarking (None: the runs').
        statistic: "median" or "mean" of the bricks' and the model's calls (``construct``).
        basis: "auto", "wall" or "cpu" (``choose_basis``).
        progress: called with (done, total) as bricks are benchmarked.

    Raises:
        ValueError: runs that cannot be compared as asked (the message says why), before
            any brick is benchmarked.
    """
    import torch

    from mltrace.analysis.bricks import choose_basis

    bset = extract(runs, granularity, trace_warmup)
    used = bench_threads(bset, threads)
    choose_basis(bset.models, basis_threads(bset, used), None, basis)  # refuses "cpu" before benchmarking
    before = torch.get_num_threads()
    torch.set_num_threads(used)
    try:
        with MachineWatch(used) as watch:
            t0 = time.perf_counter()
            kw: dict[str, Any] = {"warmup": warmup, "n": n, "min_time_s": min_time_s, "runtime": runtime, "cache": cache}
            timings = benchmark_bricks(bset.bricks, progress=progress, **kw)
            seq_timings = benchmark_bricks(bset.sequences, progress=progress, **kw) if granularity > 1 else []
            wall = time.perf_counter() - t0
            per_fault = fault_cost_ns()
    finally:
        torch.set_num_threads(before)
    extra = {"cache": cache, "threads": used, "fault_cost_ns": per_fault}
    kw = {"warmup": warmup, "n": n, "runtime": runtime, "bench_wall_s": wall, "extra": extra, "machine": watch.state}
    kw["fault_cost_ns"] = per_fault
    return assemble(bset, timings, seq_timings, statistic=statistic, threads=basis_threads(bset, used), basis=basis, **kw)
