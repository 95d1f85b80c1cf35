"""Scenario sweeps: latency percentiles and throughput per batch × precision × threads.

Each scenario is one traced run. A model's latency samples are the durations
(ns) of its invocations (model spans with no model above them), after the
first ``warmup`` calls. Percentiles interpolate linearly between order
statistics (numpy's default), so with few calls p99 is close to the maximum.
Throughput is samples per second over the measured calls:
``batch × calls / sum of latencies``.

``build_manifest`` records what is needed to reproduce the evaluation, in the
spirit of MLModelScope's model manifests: the models (name, parameters,
inputs, where they are defined), the framework and its version, every
installed version mltrace records, the hardware, the workload (script,
arguments, its SHA-256) and the sweep's parameters.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.settings import PREFIX


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics.

    Raises:
        ValueError: for no samples or q outside [0, 100].
    """
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class ScenarioSpec:
    """One point of the grid.

    Attributes:
        batch: batch size; precision: precision name; threads: thread count
            (None: the framework's default).
    """

    batch: int
    precision: str
    threads: int | None

    @property
    def label(self) -> str:
        """``b8-bf16-t2`` (``tdefault`` without a thread count): also the scenario's directory name."""
        return f"b{self.batch}-{self.precision}-t{self.threads if self.threads is not None else 'default'}"


@dataclass
class ModelLatency:
    """Latency of one model in one scenario.

    Attributes:
        model: the model's label (name and call site).
        batch: the scenario's batch size.
        calls: measured calls.
        p50_ms, p90_ms, p99_ms, mean_ms: latency (ms).
        throughput: samples per second.
    """

    model: str
    batch: int
    calls: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    throughput: float


@dataclass
class ScenarioResult:
    """One scenario's outcome.

    Attributes:
        spec: the scenario.
        status: the script's exit status (0: ran).
        error: the tail of its output when it failed.
        wall_s: the subprocess's wall time (s).
        models: latency per model (empty when it failed).
        run_dir: its trace's run directory, relative to the sweep's output.
    """

    spec: ScenarioSpec
    status: int = 0
    error: str = ""
    wall_s: float = 0.0
    models: list[ModelLatency] = field(default_factory=list)
    run_dir: str | None = None


def model_latencies(run: Run, warmup: int, batch: int) -> list[ModelLatency]:
    """Latency and throughput of every model called in ``run`` (first call first)."""
    from mltrace.analysis.leveled import invocations, model_label

    out = []
    for key, calls in invocations(run).items():
        kept = [c.root.duration_ns for c in calls[warmup:]]
        if not kept:
            continue
        total_s = sum(kept) / 1e9
        out.append(
            ModelLatency(
                model=model_label(key),
                batch=batch,
                calls=len(kept),
                p50_ms=percentile(kept, 50) / 1e6,
                p90_ms=percentile(kept, 90) / 1e6,
                p99_ms=percentile(kept, 99) / 1e6,
                mean_ms=sum(kept) / len(kept) / 1e6,
                throughput=batch * len(kept) / total_s if total_s > 0 else 0.0,
            )
        )
    return out


def scenario_result(
    spec: ScenarioSpec, run: Run | None, warmup: int, *, status: int = 0, error: str = "", wall_s: float = 0.0
) -> ScenarioResult:
    """The result of one scenario from its run (None when the script failed)."""
    models = model_latencies(run, warmup, spec.batch) if run is not None else []
    return ScenarioResult(spec, status, error, wall_s, models)


@dataclass
class SweepResult:
    """Every scenario of a sweep.

    Attributes:
        scenarios: in run order.
        n: measured calls asked per scenario; warmup: calls dropped first.
        level: the trace level of each scenario's run.
    """

    scenarios: list[ScenarioResult]
    n: int
    warmup: int
    level: str = Level.MODEL.label

    def series(self) -> dict[str, list[ModelLatency | None]]:
        """Plot series: "model · precision · threads" → one point per batch size (None: failed)."""
        batches = sorted({s.spec.batch for s in self.scenarios})
        out: dict[str, dict[int, ModelLatency | None]] = {}
        for s in self.scenarios:
            t = s.spec.threads if s.spec.threads is not None else "default"
            for m in s.models:
                out.setdefault(f"{m.model} · {s.spec.precision} · {t} threads", {})[s.spec.batch] = m
        return {k: [v.get(b) for b in batches] for k, v in out.items()}

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (format ``mltrace-sweep``; latencies in ms)."""
        return {
            "format": "mltrace-sweep",
            "version": 1,
            "n": self.n,
            "warmup": self.warmup,
            "trace_level": self.level,
            "throughput_definition": "batch * calls / sum of measured latencies (samples/s)",
            "scenarios": [
                {
                    "label": s.spec.label,
                    "batch": s.spec.batch,
                    "precision": s.spec.precision,
                    "threads": s.spec.threads,
                    "status": s.status,
                    "error": s.error or None,
                    "wall_s": round(s.wall_s, 3),
                    "run": s.run_dir,
                    "models": [vars(m) for m in s.models],
                }
                for s in self.scenarios
            ],
        }


def sweep_csv(result: SweepResult) -> str:
    """The table as CSV: one row per scenario and model (failed scenarios: status and no figures)."""
    import csv

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(
        [
            "scenario",
            "batch",
            "precision",
            "threads",
            "status",
            "model",
            "calls",
            "p50_ms",
            "p90_ms",
            "p99_ms",
            "mean_ms",
            "throughput_per_s",
        ]
    )
    for s in result.scenarios:
        base = [s.spec.label, s.spec.batch, s.spec.precision, s.spec.threads if s.spec.threads is not None else "", s.status]
        if not s.models:
            w.writerow([*base, "", "", "", "", "", "", ""])
        for m in s.models:
            w.writerow(
                [
                    *base,
                    m.model,
                    m.calls,
                    f"{m.p50_ms:.4f}",
                    f"{m.p90_ms:.4f}",
                    f"{m.p99_ms:.4f}",
                    f"{m.mean_ms:.4f}",
                    f"{m.throughput:.2f}",
                ]
            )
    return buf.getvalue()


def _sha256(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _models_of(spans: list[Span]) -> list[dict[str, Any]]:
    from mltrace.analysis.leveled import model_key, model_label

    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for s in spans:
        if s.level != Level.MODEL:
            continue
        key = model_key(s)
        if key in seen:
            continue
        a = s.attrs
        seen[key] = {
            "name": s.name,
            "label": model_label(key),
            "framework": a.get("ml.framework"),
            "parameters": a.get("ml.layer.params"),
            "input_shapes": a.get("ml.input.shapes"),
            "input_dtypes": a.get("ml.input.dtypes"),
            "defined_at": _defined_at(a),
            "called_at": f"{key[1]}:{key[2]}" if key[1] else None,
        }
    return list(seen.values())


def _defined_at(attrs: dict[str, Any]) -> str | None:
    """Where the model's forward is defined: ``ml.defined.*``; runs recorded before it existed
    kept the definition in ``code.*``."""
    for prefix in ("ml.defined", "code"):
        if attrs.get(f"{prefix}.file.path"):
            return f"{attrs[f'{prefix}.file.path']}:{attrs.get(f'{prefix}.line.number')}"
    return None


_FRAMEWORK_DISTS = {
    "pytorch": ("torch",),
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu"),
    "tensorflow": ("tensorflow", "tensorflow-cpu"),
}


def build_manifest(
    sweep: SweepResult,
    *,
    script: str,
    args: list[str],
    run_meta: dict[str, Any] | None,
    command: list[str],
    model_spans: list[Span],
) -> dict[str, Any]:
    """The evaluation manifest of a sweep (a JSON-ready dict).

    Args:
        sweep: the sweep's result.
        script, args: the workload and its arguments.
        run_meta: run.json of one scenario's run (versions, host); None when
            every scenario failed.
        command: the command line that ran the sweep.
        model_spans: spans of one scenario's run (models, inputs, parameters).
    """
    meta = run_meta or {}
    versions = dict(meta.get("versions", {}))
    models = _models_of(model_spans)
    frameworks = sorted({str(m["framework"]) for m in models if m.get("framework")})
    framework = []
    for fw in frameworks:
        dist = next((d for d in _FRAMEWORK_DISTS.get(fw, (fw,)) if d in versions), None)
        framework.append({"name": fw, "version": versions.get(dist) if dist else None})
    env = {k: v for k, v in dict(meta.get("environment", {})).items() if not k.startswith((PREFIX, "OMP_NUM_THREADS", "MKL_NUM_THREADS"))}
    batches = sorted({s.spec.batch for s in sweep.scenarios})
    precisions = list(dict.fromkeys(s.spec.precision for s in sweep.scenarios))
    threads = list(dict.fromkeys(s.spec.threads for s in sweep.scenarios))
    return {
        "manifest": "mltrace-evaluation",
        "version": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mltrace_version": meta.get("mltrace_version"),
        "models": models,
        "framework": framework,
        "versions": versions,
        "hardware": meta.get("host", {}),
        "gpus": meta.get("gpus"),
        "workload": {
            "script": os.path.abspath(script),
            "sha256": _sha256(script),
            "args": args,
            "command": command,
            "protocol": "MLTRACE_BATCH, MLTRACE_PRECISION, MLTRACE_THREADS, MLTRACE_ITERS (mltrace.bench.scenario())",
        },
        "parameters": {
            "batch": batches,
            "precision": precisions,
            "threads": threads,
            "measured_calls": sweep.n,
            "warmup_calls": sweep.warmup,
            "trace_level": sweep.level,
        },
        "environment": env,
        "scenarios": [
            {
                "label": s.spec.label,
                "batch": s.spec.batch,
                "precision": s.spec.precision,
                "threads": s.spec.threads,
                "status": s.status,
                "run": s.run_dir,
            }
            for s in sweep.scenarios
        ],
    }
