"""Benchmark harness: leveled experimentation, scenario sweeps, and the workload protocol.

The workload side (what a benchmarked script calls)::

    from mltrace.bench import scenario, MetricLogger

    sc = scenario()                      # MLTRACE_BATCH / _PRECISION / _THREADS / _ITERS
    sc.apply_threads()                   # torch.set_num_threads(sc.threads) when set
    x = torch.randn(sc.batch, 3, 224, 224, dtype=sc.torch_dtype())
    for _ in range(sc.iters_or(20)):
        model(x)

    log = MetricLogger("train_log.jsonl")  # training loops: TTA/ATTMT input + counter track
    log.log(accuracy=71.2)

The harness side (what ``mltrace bench`` calls): ``run_leveled`` runs a script once per level
in fresh subprocesses ("plain": docs/METHODS.md) and writes the leveled trace; ``run_sweep``
runs it once per scenario of a batch × precision × threads grid and writes a table, an SVG plot
and a reproducibility manifest. Importing this module imports no framework.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from mltrace.settings import BATCH, ITERS, LEVEL, NAME, OUTPUT, PRECISION, THREADS

if TYPE_CHECKING:
    from mltrace.analysis.leveled import LeveledResult
    from mltrace.analysis.sweep import SweepResult

#: Precisions the protocol names. What each means is the script's choice (for
#: PyTorch: fp16/bf16 cast the model and inputs; int8 usually means dynamic
#: quantization of Linear layers); the harness only passes the name on.
PRECISIONS = ("fp32", "fp16", "bf16", "int8")

#: glibc settings for ``steady_malloc``: no heap trimming, and buffers up to
#: 32 MiB (glibc's largest mmap threshold) from the heap with a fixed threshold.
#: By default glibc returns freed memory at the top of the heap to the system
#: and moves its mmap threshold as blocks are freed, so whether an inference's
#: activations cost fresh page faults depends on the process's allocation
#: history: MobileNetV2 here took 20–24 ms or 16–17 ms per call depending on it,
#: enough to swamp any instrumentation overhead. Plain and traced children get
#: the same settings.
STEADY_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824"}


class BenchError(RuntimeError):
    """A benchmark that could not run (a child that failed, unusable output)."""


# ---------------------------------------------------------------------------
# Workload protocol
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One point of a sweep, as the benchmarked script sees it.

    Attributes:
        batch: batch size (samples per model call).
        precision: one of ``PRECISIONS``.
        threads: intra-op threads to use; None: the framework's default.
        iters: model calls the harness asks for (warm-up included); None when
            the script runs outside the harness.
    """

    batch: int = 1
    precision: str = "fp32"
    threads: int | None = None
    iters: int | None = None

    def iters_or(self, default: int) -> int:
        """The number of model calls to make: ``iters`` if the harness set it, else ``default``."""
        return self.iters if self.iters is not None else default

    def torch_dtype(self) -> Any:
        """The torch floating dtype for ``precision`` (float32 for fp32 and int8)."""
        import torch

        return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.precision, torch.float32)

    def apply_threads(self) -> None:
        """Sets torch's intra-op thread count when ``threads`` is given (imports torch)."""
        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)


def _env_int(name: str, value: str, minimum: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, not {value!r}") from None
    if n < minimum:
        raise ValueError(f"{name} must be at least {minimum}, not {n}")
    return n


def scenario(*, batch: int = 1, precision: str = "fp32", threads: int | None = None, iters: int | None = None) -> Scenario:
    """The scenario the harness asked for, from the environment, with the script's defaults.

    Reads ``MLTRACE_BATCH``, ``MLTRACE_PRECISION``, ``MLTRACE_THREADS`` and
    ``MLTRACE_ITERS``; each one unset falls back to the argument.

    Raises:
        ValueError: for a malformed variable or an unknown precision.
    """
    if (text := BATCH.get()) is not None:
        batch = _env_int(BATCH.name, text, 1)
    if (text := PRECISION.get()) is not None:
        precision = text.strip().lower()
    if (text := THREADS.get()) is not None:
        threads = _env_int(THREADS.name, text, 1)
    if (text := ITERS.get()) is not None:
        iters = _env_int(ITERS.name, text, 1)
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")
    return Scenario(batch=batch, precision=precision, threads=threads, iters=iters)


class MetricLogger:
    """Logs training metrics against elapsed time, for TTA/ATTMT and the trace.

    Each ``log`` call appends one JSON line ``{"time": s, "step": n, name: value…}``
    to ``path`` (time in seconds since the logger was created) and, while an
    mltrace session runs, adds one sample per metric to a counter track named
    ``metric.<name>`` in the trace. Without ``path``, a running session's run
    directory gets ``metrics.jsonl``, which ``mltrace metrics tta RUN`` reads.

    Args:
        path: the JSON Lines file to append to; None: the session's run
            directory, or no file outside a session.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        from mltrace.tracer import session as session_mod

        self._t0_ns = time.monotonic_ns()
        self._lock = threading.Lock()
        self._step = 0
        active = session_mod.active_session()
        if path is None and active is not None and active.run_dir is not None:
            from mltrace.analysis.metrics import RUN_METRICS_FILE

            path = active.run_dir / RUN_METRICS_FILE
        self.path: Path | None = Path(path) if path is not None else None

    def log(self, step: int | None = None, **metrics: float) -> None:
        """Records metric values (e.g. ``accuracy=71.2``) at the current time.

        Args:
            step: the step or epoch number; default: a running count of calls.
            **metrics: metric name → value.
        """
        from mltrace.tracer import session as session_mod

        now = time.monotonic_ns()
        with self._lock:
            self._step += 1
            record: dict[str, Any] = {"time": round((now - self._t0_ns) / 1e9, 6), "step": self._step if step is None else step}
            record.update({k: float(v) for k, v in metrics.items()})
            if self.path is not None:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")
        active = session_mod.active_session()
        if active is not None:
            for name, value in metrics.items():
                active.recorder.counter(active.tracks.counter(f"metric.{name}"), float(value), now)


# ---------------------------------------------------------------------------
# Plain (uninstrumented) timing child: python -m mltrace.bench plain OUT SCRIPT ARGS…
# ---------------------------------------------------------------------------


class OutermostCallTimer:
    """Times the outermost ``nn.Module`` call on each thread, without hooks.

    ``install(torch)`` replaces ``torch.nn.Module.__call__`` with a wrapper that
    timestamps the call only when no module call is running on the thread;
    nested calls go straight through. ``remove()`` restores the original.

    Attributes:
        samples: (model class name, call file, call line) → durations (ns), in call order.
    """

    def __init__(self) -> None:
        self._tls = threading.local()
        self._module_cls: Any = None
        self._original: Any = None
        self.samples: dict[tuple[str, str | None, int | None], list[int]] = {}
        self._names: Any = None  # torch_modules.ModelNames once torch is imported
        #: ``callsite.model_call_site``, the tracer's call site of a model call, once installed.
        self._call_site: Callable[[Any], dict[str, Any]] = lambda frame: {}
        #: id(module) → (weak reference, its model name), named once as the tracer names it.
        self._named: dict[int, tuple[Any, str]] = {}

    def install(self, torch: Any) -> None:
        """Wraps ``torch.nn.Module.__call__`` (idempotent)."""
        from mltrace.tracer.callsite import model_call_site
        from mltrace.tracer.sources.torch_modules import ModelNames, calls_impl_directly

        if self._original is not None:
            return
        module_cls = torch.nn.Module
        self._names = ModelNames(module_cls)
        self._call_site = model_call_site
        original = module_cls.__call__
        tls = self._tls
        clock = time.monotonic_ns  # the tracer's clock, so plain and traced figures compare
        record = self._record

        # Nested calls take the same short path as mltrace's model-level wrapper (thread-local
        # attribute, then ``_call_impl`` directly when ``__call__`` is torch's own): a slower
        # pass-through here would make "plain" slower than the model level it is compared with.
        direct = calls_impl_directly(module_cls, original)

        def __call__(module: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 - replaces Module.__call__
            try:
                busy = tls.busy
            except AttributeError:
                busy = tls.busy = False
            if busy:
                if direct and module._compiled_call_impl is None:
                    return module._call_impl(*args, **kwargs)
                return original(module, *args, **kwargs)
            tls.busy = True
            t0 = clock()
            try:
                return original(module, *args, **kwargs)
            finally:
                t1 = clock()
                tls.busy = False
                record(module, t1 - t0)

        self._module_cls = module_cls
        self._original = original
        module_cls.__call__ = __call__

    def remove(self) -> None:
        """Restores ``nn.Module.__call__``."""
        if self._original is not None:
            self._module_cls.__call__ = self._original
            self._original = None

    def _record(self, module: Any, duration_ns: int) -> None:
        # Same call-site and naming rules as the tracer's model spans, so keys match across runs.
        caller = sys._getframe(2)
        site = self._call_site(caller)
        key = (self._model_name(module, caller), site.get("code.file.path"), site.get("code.line.number"))
        self.samples.setdefault(key, []).append(duration_ns)

    def _model_name(self, module: Any, caller: Any) -> str:
        """The module's model name as the tracer gives it at its first call (``ModelNames``)."""
        named = self._named.get(id(module))
        if named is None or named[0]() is not module:
            try:
                ref = weakref.ref(module)
            except TypeError:
                return str(self._names.name(module, caller))
            named = self._named[id(module)] = (ref, self._names.name(module, caller))
        return named[1]

    def to_json(self) -> dict[str, Any]:
        """The samples as the plain-timings document read by ``analysis.leveled``."""
        return {
            "format": "mltrace-plain-timings",
            "method": "nn.Module.__call__ wrapper timing the outermost module call per thread (no hooks, no session)",
            "models": [{"name": k[0], "call_file": k[1], "call_line": k[2], "durations_ns": v} for k, v in self.samples.items()],
        }


def _plain_child(out: str, script_argv: list[str]) -> int:
    from mltrace.runner import Target, check_target, run_target
    from mltrace.tracer.sources._imports import PostImportHook

    if not script_argv:
        sys.stderr.write("usage: python -m mltrace.bench plain OUT.json SCRIPT [ARGS...]\n")
        return 2
    target = Target(script_argv[0], None, script_argv[1:])
    check_target(target)
    timer = OutermostCallTimer()
    hook = PostImportHook("torch", timer.install)
    status = 1
    try:
        status = run_target(target)
    finally:
        hook.remove()
        timer.remove()
        doc = timer.to_json()
        doc["exit_status"] = status
        Path(out).write_text(json.dumps(doc) + "\n", encoding="utf-8")
    return status


# ---------------------------------------------------------------------------
# Subprocess plumbing shared by the harnesses
# ---------------------------------------------------------------------------


@dataclass
class ChildRun:
    """One subprocess the harness ran.

    Attributes:
        label: what it was ("plain r0", "layer r1", "b8-bf16-t2").
        command: its argv.
        status: exit status.
        wall_s: wall time (s).
        log: file holding its stdout and stderr.
        output: the run directory or timings file it wrote.
    """

    label: str
    command: list[str]
    status: int
    wall_s: float
    log: Path
    output: Path


def _child_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    for k in (OUTPUT, LEVEL, NAME, BATCH, PRECISION, THREADS, ITERS):
        env.pop(k.name, None)
    env.update(extra)
    return env


def _tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _run_child(label: str, cmd: list[str], env: Mapping[str, str], log: Path, output: Path, timeout_s: float | None) -> ChildRun:
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        try:
            status = subprocess.run(
                cmd, env=dict(env), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            status = 124
    return ChildRun(label, cmd, status, time.perf_counter() - t0, log, output)


def _trace_cmd(python: str, level: str, out: Path, name: str, script: str, args: Sequence[str]) -> list[str]:
    return [python, "-m", "mltrace", "python", "-q", "--level", level, "-o", str(out), "--name", name, script, *args]


def _say(progress: IO[str] | None, text: str) -> None:
    if progress is not None:
        progress.write(f"mltrace bench: {text}\n")
        progress.flush()


def _prepare_output(output: str | os.PathLike[str] | None, name: str, kind: str) -> Path:
    from mltrace.tracer.session import default_run_dir, prepare_run_dir

    return prepare_run_dir(Path(output) if output is not None else default_run_dir(f"{name}-{kind}"))


def available_levels() -> list[Any]:
    """Hierarchy levels that some installed source can record here (model first).

    A level listed here may still record nothing at run time (no GPU for
    kernels); ``run_leveled`` checks each run's metadata and says so.
    """
    from mltrace.run.levels import HIERARCHY
    from mltrace.tracer.sources import default_sources

    found: set[Any] = set()
    for source in default_sources():
        try:
            if source.available() is None:
                found.update(source.levels)
        except Exception:  # an availability check that fails means "not available"
            continue
    return [lv for lv in HIERARCHY if lv in found]


# ---------------------------------------------------------------------------
# Leveled experimentation
# ---------------------------------------------------------------------------


@dataclass
class LeveledReport:
    """What ``run_leveled`` produced.

    Attributes:
        result: the analysis (estimates, inflation, mismatches).
        path: the output directory: a run directory holding the leveled trace
            (run.json, events.jsonl, trace.pftrace), leveled.json, and the raw
            runs under ``runs/``.
        children: every subprocess run.
    """

    result: LeveledResult
    path: Path
    children: list[ChildRun] = field(default_factory=list)


def run_leveled(
    script: str,
    args: Sequence[str] = (),
    *,
    n: int = 10,
    warmup: int = 2,
    rounds: int = 1,
    levels: Sequence[Any] | None = None,
    output: str | os.PathLike[str] | None = None,
    name: str | None = None,
    python: str | None = None,
    progress: IO[str] | None = sys.stderr,
    timeout_s: float | None = None,
    steady_malloc: bool = False,
) -> LeveledReport:
    """Runs ``script`` once plain and once per level, and builds the leveled trace.

    Each run is a fresh subprocess: ``python -m mltrace.bench plain …`` for the
    plain run and ``python -m mltrace python --level L …`` for level L. The
    script is asked (``MLTRACE_ITERS``) for ``warmup + ceil(n / rounds)`` model
    calls; the first ``warmup`` calls of each model in each process are
    dropped. With ``rounds > 1`` the set of runs repeats, in reverse order on
    odd rounds, so drift on a busy machine hits every level alike.

    Args:
        script: the script to run.
        args: its arguments.
        n: model calls measured per model and level (after warm-up), in total.
        warmup: calls dropped per model and process.
        rounds: how many times each run is repeated.
        levels: levels to run (``Level`` or names); default: every level with
            an available source, model first.
        output: output directory (absent or empty); default
            ``mltrace-runs/<name>-leveled-<stamp>``.
        name: run name (default: the script's stem).
        python: interpreter for the children (default: this one).
        progress: where progress lines go (None: nowhere).
        timeout_s: limit per child (s).
        steady_malloc: run every child with ``STEADY_MALLOC_ENV`` (glibc).

    Raises:
        BenchError: when a child fails or records nothing usable.
        mltrace.errors.UsageError: for bad arguments.
    """
    from mltrace.analysis.leveled import analyze, build_leveled_run, load_plain_timings
    from mltrace.errors import UsageError
    from mltrace.run import store
    from mltrace.run.levels import HIERARCHY, Level

    if n < 1 or warmup < 0 or rounds < 1:
        raise UsageError("need -n >= 1, --warmup >= 0 and --rounds >= 1")
    if not os.path.exists(script):
        raise UsageError(f"can't open file {script!r}: no such file")
    wanted: list[Level] = []
    for lv in levels if levels is not None else available_levels():
        try:
            parsed = Level.parse(lv) if isinstance(lv, str) else Level(lv)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if parsed not in HIERARCHY:
            raise UsageError(f"{parsed.label} is not a hierarchy level")
        if parsed not in wanted:
            wanted.append(parsed)
    wanted.sort()
    if not wanted:
        raise UsageError("no level to run (no source is available: is torch installed?)")
    python = python or sys.executable
    name = name or Path(script).stem
    out = _prepare_output(output, name, "leveled")
    raw = out / "runs"
    raw.mkdir()
    per_round = warmup + math.ceil(n / rounds)
    env = _child_env({ITERS.name: str(per_round), **(STEADY_MALLOC_ENV if steady_malloc else {})})
    plan: list[tuple[str, Level | None]] = [("plain", None), *((lv.label, lv) for lv in wanted)]
    children: list[ChildRun] = []
    plain_files: list[Path] = []
    level_dirs: dict[Level, list[Path]] = {lv: [] for lv in wanted}
    for r in range(rounds):
        order = plan if r % 2 == 0 else list(reversed(plan))
        for label, level in order:
            tag = f"{label}-r{r}"
            t0 = time.perf_counter()
            if level is None:
                dest = raw / f"{tag}.json"
                cmd = [python, "-m", "mltrace.bench", "plain", str(dest), script, *args]
            else:
                dest = raw / tag
                cmd = _trace_cmd(python, level.label, dest, f"{name}-{label}", script, args)
            child = _run_child(tag, cmd, env, raw / f"{tag}.log", dest, timeout_s)
            children.append(child)
            _say(progress, f"round {r + 1}/{rounds}: {label:<8} exit {child.status}, {time.perf_counter() - t0:.1f} s")
            if child.status != 0:
                raise BenchError(f"the {label} run of {script} exited with status {child.status}:\n{_tail(child.log)}")
            if level is None:
                plain_files.append(dest)
            else:
                level_dirs[level].append(dest)
    plain = load_plain_timings(plain_files)
    runs = {lv: [store.load_run(d) for d in dirs] for lv, dirs in level_dirs.items()}
    result = analyze(plain, runs, warmup=warmup)
    if not result.models:
        raise BenchError(f"{script} made no nn.Module call that was traced: nothing to measure")
    leveled = build_leveled_run(result, runs, out)
    leveled.meta["name"] = f"{name}-leveled"
    leveled.meta["command"] = list(sys.argv)
    leveled.meta["leveled"] = {
        "workload": [os.path.abspath(script), *args],
        "n": n,
        "warmup": warmup,
        "rounds": rounds,
        "levels": [lv.label for lv in result.levels],
        "steady_malloc": STEADY_MALLOC_ENV if steady_malloc else None,
        "raw_runs": "runs/",
        "result": "leveled.json",
    }
    _write_run(out, leveled)
    doc = result.to_json()
    doc.update(
        script=os.path.abspath(script),
        args=list(args),
        n=n,
        warmup=warmup,
        rounds=rounds,
        steady_malloc=STEADY_MALLOC_ENV if steady_malloc else None,
        children=[
            {"label": c.label, "status": c.status, "wall_s": round(c.wall_s, 3), "output": os.path.relpath(c.output, out)} for c in children
        ],
    )
    (out / "leveled.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return LeveledReport(result, out, children)


def _write_run(out: Path, run: Any) -> None:
    from mltrace.analysis.summary import summarize
    from mltrace.run import store
    from mltrace.run.perfetto import export_perfetto

    store.write_events_atomically(out / store.EVENTS_FILE, run)
    export_perfetto(run, out / store.TRACE_FILE)
    run.meta["summary"] = summarize(run)
    run.meta["complete"] = True
    store.write_meta(out, run.meta)


# ---------------------------------------------------------------------------
# Scenario sweeps
# ---------------------------------------------------------------------------


@dataclass
class SweepReport:
    """What ``run_sweep`` produced.

    Attributes:
        result: per-scenario latency and throughput.
        path: the output directory (sweep.json, sweep.csv, sweep.svg,
            manifest.json, and one run directory per scenario under scenarios/).
        manifest: the evaluation manifest written to manifest.json.
    """

    result: SweepResult
    path: Path
    manifest: dict[str, Any]


def run_sweep(
    script: str,
    args: Sequence[str] = (),
    *,
    batch: Sequence[int] = (1,),
    precision: Sequence[str] = ("fp32",),
    threads: Sequence[int | None] = (None,),
    n: int = 10,
    warmup: int = 2,
    level: str = "model",
    output: str | os.PathLike[str] | None = None,
    name: str | None = None,
    python: str | None = None,
    progress: IO[str] | None = sys.stderr,
    timeout_s: float | None = None,
    steady_malloc: bool = False,
) -> SweepReport:
    """Runs ``script`` once per scenario of the batch × precision × threads grid.

    Each scenario is a fresh ``mltrace python --level LEVEL`` subprocess with
    ``MLTRACE_BATCH``, ``MLTRACE_PRECISION``, ``MLTRACE_THREADS`` and
    ``MLTRACE_ITERS`` (= warmup + n) set; a thread count also sets
    ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS``, which PyTorch and ONNX Runtime
    honour even when the script ignores the protocol. A scenario whose script
    fails is reported, not fatal.

    Args:
        script: the script to run; args: its arguments.
        batch, precision, threads: the grid (threads None: framework default).
        n: measured model calls per scenario; warmup: calls dropped first.
        level: trace level of each scenario's run (default model: least overhead).
        output: output directory; name: run name; python: child interpreter.
        progress: where progress lines go; timeout_s: limit per scenario (s).
        steady_malloc: run every scenario with ``STEADY_MALLOC_ENV`` (glibc).

    Raises:
        mltrace.errors.UsageError: for bad arguments.
    """
    from mltrace.analysis.sweep import ScenarioSpec, build_manifest, scenario_result, sweep_csv
    from mltrace.errors import UsageError
    from mltrace.run import store
    from mltrace.run.levels import Level
    from mltrace.run.store import RunError

    if n < 1 or warmup < 0:
        raise UsageError("need -n >= 1 and --warmup >= 0")
    if not os.path.exists(script):
        raise UsageError(f"can't open file {script!r}: no such file")
    try:
        Level.parse(level)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for p in precision:
        if p not in PRECISIONS:
            raise UsageError(f"unknown precision {p!r} (choose from {', '.join(PRECISIONS)})")
    if any(b < 1 for b in batch) or any(t is not None and t < 1 for t in threads):
        raise UsageError("batch sizes and thread counts must be at least 1")
    python = python or sys.executable
    name = name or Path(script).stem
    out = _prepare_output(output, name, "sweep")
    scen_dir = out / "scenarios"
    scen_dir.mkdir()
    specs = [ScenarioSpec(b, p, t) for p in precision for t in threads for b in batch]
    results = []
    for i, spec in enumerate(specs, 1):
        extra = {BATCH.name: str(spec.batch), PRECISION.name: spec.precision, ITERS.name: str(warmup + n)}
        if steady_malloc:
            extra.update(STEADY_MALLOC_ENV)
        if spec.threads is not None:
            extra.update({THREADS.name: str(spec.threads), "OMP_NUM_THREADS": str(spec.threads), "MKL_NUM_THREADS": str(spec.threads)})
        dest = scen_dir / spec.label
        cmd = _trace_cmd(python, level, dest, f"{name}-{spec.label}", script, args)
        child = _run_child(spec.label, cmd, _child_env(extra), scen_dir / f"{spec.label}.log", dest, timeout_s)
        run = None
        if child.status == 0:
            try:
                run = store.load_run(dest)
            except RunError as exc:
                child.status = -1
                with open(scen_dir / f"{spec.label}.log", "a", encoding="utf-8") as log:
                    log.write(f"\n{exc}\n")
        res = scenario_result(
            spec, run, warmup, status=child.status, error=_tail(child.log, 3) if child.status else "", wall_s=child.wall_s
        )
        res.run_dir = os.path.relpath(dest, out) if run is not None else None
        results.append(res)
        _say(progress, f"[{i}/{len(specs)}] {spec.label}: exit {child.status}, {child.wall_s:.1f} s")
    from mltrace.analysis.sweep import SweepResult

    sweep = SweepResult(scenarios=results, n=n, warmup=warmup, level=level)
    first_run = next((store.load_run(out / r.run_dir) for r in results if r.run_dir), None)
    manifest = build_manifest(
        sweep,
        script=script,
        args=list(args),
        run_meta=first_run.meta if first_run is not None else None,
        command=list(sys.argv),
        model_spans=first_run.spans if first_run is not None else [],
    )
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    (out / "sweep.json").write_text(json.dumps(sweep.to_json(), indent=2) + "\n", encoding="utf-8")
    (out / "sweep.csv").write_text(sweep_csv(sweep), encoding="utf-8")
    from mltrace.viewers.bench import render_sweep_svg

    (out / "sweep.svg").write_text(render_sweep_svg(sweep, title=f"{name}: latency and throughput"), encoding="utf-8")
    return SweepReport(sweep, out, manifest)


def _main(argv: Sequence[str]) -> int:
    if len(argv) >= 2 and argv[0] == "plain":
        return _plain_child(argv[1], list(argv[2:]))
    sys.stderr.write("usage: python -m mltrace.bench plain OUT.json SCRIPT [ARGS...]  (internal: the harness's plain run)\n")
    return 2


if __name__ == "__main__":
    from mltrace.runner import leave

    leave(_main(sys.argv[1:]))
