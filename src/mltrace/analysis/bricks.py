"""DLBricks: model latency constructed from benchmarks of its deduplicated layers.

1. **Extract.** From each traced run (layer level or deeper), one invocation
   per model gives the model's *leaf layers* (layer spans with no layer below
   them) in call order. Each becomes a *brick*: layer type, input shapes and
   dtypes, parameter count, and constructor arguments — recorded by the tracer
   (``ml.layer.config``) when present, else inferred from type, shapes and
   parameter count (``infer_config``). Weights are never read or stored.
   With granularity H > 1, each model's leaf sequence is also cut into
   consecutive runs of H layers (the last may be shorter): sequence bricks.
2. **Deduplicate** bricks and sequences across all models (total vs unique).
3. **Benchmark** each unique brick in isolation (``mltrace.brickbench``, which
   imports torch; this module only holds the results, ``BrickTiming``).
4. **Construct** each model's latency: the sum of its bricks' medians; when
   the trace shows leaf layers overlapping in time (parallel branches), the
   critical path through them instead (a layer follows every layer that ended
   before it started). A brick that cannot be built in isolation (a custom
   layer type, unknown arguments) keeps its traced latency and is counted as
   such. Plus the model's *glue*: its time in no leaf layer (residual adds,
   ``flatten``, indexing between layers), the median over the traced calls,
   a term of its own taken from the trace (``ModelBricks.glue_ns``).
5. **Report** constructed / measured per model, where *measured* is the
   median model-span latency in the run given (use a leveled run for an
   overhead-free figure), on one basis (``choose_basis``): the calling
   thread's CPU time where the model and its bricks ran on one intra-op thread
   (model spans carry ``ml.thread.cpu_ns``; the glue is scaled by each call's
   CPU / wall share), else the wall clock, with one line saying why that
   figure cannot be trusted when the machine was busy; and the benchmarking-time speedup:
   ``Σ_models (warmup + n) · measured`` over ``Σ_unique bricks (warmup + n) ·
   brick median`` — the time benchmarking every model end to end would take,
   over the time benchmarking each unique brick once takes, under the same
   protocol. The wall time actually spent (with layer construction) is
   reported beside it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.run.store import Run

Shape = tuple[int, ...]

#: Layer types that take no constructor argument that changes their cost.
NO_ARG_TYPES = {
    "ReLU", "ReLU6", "GELU", "SiLU", "Sigmoid", "Tanh", "Hardswish", "Hardsigmoid", "Mish", "ELU", "LeakyReLU",
    "Identity", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "Softplus", "Hardtanh",
}  # fmt: skip

# -- bricks ------------------------------------------------------------------------


@dataclass(frozen=True)
class Brick:
    """A layer as a benchmarkable unit (hashable: equal bricks deduplicate).

    Attributes:
        type: layer class name ("Conv2d").
        input_shapes: shapes of its tensor inputs.
        input_dtypes: their dtypes ("float32").
        params: number of parameters (never the weights).
        config: constructor keyword arguments, sorted by name.
        config_source: "recorded" (from the trace), "inferred", or "none".
    """

    type: str
    input_shapes: tuple[Shape, ...]
    input_dtypes: tuple[str, ...]
    params: int
    config: tuple[tuple[str, Any], ...] = ()
    config_source: str = "none"

    def label(self) -> str:
        """``Conv2d(in_channels=3, …) [1x3x224x224]``."""
        cfg = ", ".join(f"{k}={v!r}" for k, v in self.config)
        shapes = ", ".join("x".join(str(d) for d in s) for s in self.input_shapes)
        return f"{self.type}({cfg}) [{shapes}]"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "type": self.type,
            "input_shapes": [list(s) for s in self.input_shapes],
            "input_dtypes": list(self.input_dtypes),
            "params": self.params,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in self.config},
            "config_source": self.config_source,
        }


@dataclass
class LayerCall:
    """One leaf-layer call in a model's reference invocation.

    Attributes:
        path: the layer's path ("layer1.0.conv1").
        brick: its brick.
        start_ns, end_ns: its span in the trace (ns).
        traced_ns: its median latency over the run's invocations (ns).
    """

    path: str
    brick: Brick
    start_ns: int
    end_ns: int
    traced_ns: float


@dataclass
class ModelBricks:
    """One model's decomposition.

    Attributes:
        model: the model's label.
        run: the run directory it came from.
        measured_ns: median model-span latency in the run (ns).
        invocations: model calls used for ``measured_ns``.
        layers: leaf-layer calls of the reference invocation, in call order.
        sequences: its consecutive runs of H bricks (H = granularity).
        parallel: whether leaf layers overlap in time (parallel branches).
        unattributed_ns: time of the reference invocation in no leaf layer (ns).
        glue_ns: median over the calls of the time in no leaf layer (ns): the code
            between layers, which no brick runs.
        threads: the compute threads the run used (run.json), None when unknown.
        measured_mean_ns, glue_mean_ns: the means of the same (ns).
        measured_cpu_ns, measured_cpu_mean_ns: median and mean of the model calls' thread
            CPU time (span attribute ``ml.thread.cpu_ns``; ns); None when a call lacks it.
        glue_cpu_ns, glue_cpu_mean_ns: the glue on that basis: each call's glue times its
            CPU / wall share, median and mean (ns).
        cpu_share: median over the calls of thread CPU time / wall time: below 1 where the
            calling thread was preempted or waited (or, with several intra-op threads,
            where it waited for the others).
        minor_faults: median minor page faults of the calling thread per call (span attribute
            ``ml.thread.minor_faults``); None when a call lacks it.
        trace_others_cores: cores other processes kept busy while the run was traced, on
            average: the machine's mean CPU utilization (run.json ``counters_summary``) times its
            cores, less the run's compute threads; None when not recorded.
    """

    model: str
    run: str
    measured_ns: float
    invocations: int
    layers: list[LayerCall]
    sequences: list[tuple[Brick, ...]]
    parallel: bool
    unattributed_ns: int
    glue_ns: float = 0.0
    threads: int | None = None
    measured_mean_ns: float = 0.0
    glue_mean_ns: float = 0.0
    measured_cpu_ns: float | None = None
    measured_cpu_mean_ns: float | None = None
    glue_cpu_ns: float | None = None
    glue_cpu_mean_ns: float | None = None
    cpu_share: float | None = None
    minor_faults: float | None = None
    trace_others_cores: float | None = None


@dataclass
class BrickSet:
    """Bricks of every model, deduplicated.

    Attributes:
        granularity: H, the longest sequence brick.
        models: per-model decompositions.
        bricks: unique layer bricks, in first-seen order.
        sequences: unique sequence bricks (H > 1), in first-seen order.
    """

    granularity: int
    models: list[ModelBricks]
    bricks: list[Brick]
    sequences: list[tuple[Brick, ...]]

    @property
    def total_layers(self) -> int:
        """Leaf-layer calls over all models."""
        return sum(len(m.layers) for m in self.models)

    @property
    def total_sequences(self) -> int:
        """Sequence bricks over all models (before deduplication)."""
        return sum(len(m.sequences) for m in self.models)


def _shapes(value: Any) -> tuple[Shape, ...]:
    """Recorded shapes; one with a dimension that is not a whole number (symbolic) is ()."""
    if not isinstance(value, list):
        return ()
    return tuple(tuple(s) if all(type(d) is int for d in s) else () for s in value if isinstance(s, list))


def _freeze(value: Any) -> Any:
    """A recorded value made hashable: lists as tuples, dicts as sorted (key, value) tuples."""
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    return value


def brick_of(span: Span, model_batch: int | None = None) -> Brick:
    """The brick of a layer span: recorded config if any, else inferred."""
    a = span.attrs
    ltype = str(a.get("ml.layer.type", ""))
    ins = _shapes(a.get("ml.input.shapes"))
    outs = _shapes(a.get("ml.output.shapes"))
    recorded_dtypes, recorded_params = a.get("ml.input.dtypes"), a.get("ml.layer.params")
    dtypes = tuple(str(d) for d in recorded_dtypes) if isinstance(recorded_dtypes, list) else ()
    params = recorded_params if isinstance(recorded_params, int) and not isinstance(recorded_params, bool) else 0
    recorded = a.get("ml.layer.config")
    if isinstance(recorded, dict):
        cfg = tuple(sorted((str(k), _freeze(v)) for k, v in recorded.items()))
        return Brick(ltype, ins, dtypes, params, cfg, "recorded")
    inferred = infer_config(ltype, ins, outs, params, model_batch)
    if inferred is None:
        return Brick(ltype, ins, dtypes, params, (), "none")
    return Brick(ltype, ins, dtypes, params, tuple(sorted((k, _freeze(v)) for k, v in inferred.items())), "inferred")


def _conv_geometry(in_sz: int, out_sz: int, k: int) -> tuple[int, int] | None:
    """(stride, padding) with out = floor((in + 2p - k) / s) + 1, preferring 'same'-style padding."""
    pads = list(dict.fromkeys([(k - 1) // 2, 0, k // 2, *range(k + 1)]))
    for s in range(1, 9):
        for p in pads:
            if in_sz + 2 * p >= k and (in_sz + 2 * p - k) // s + 1 == out_sz:
                return s, p
    return None


def _infer_conv(dims: int, ins: tuple[Shape, ...], outs: tuple[Shape, ...], params: int) -> dict[str, Any] | None:
    if not ins or not outs or len(ins[0]) not in (dims + 1, dims + 2) or len(outs[0]) != len(ins[0]):
        return None
    off = len(ins[0]) - dims - 1
    cin, cout = ins[0][off], outs[0][off]
    groups = [1] + ([cin] if cin > 1 and cout % cin == 0 else [])
    groups += [g for g in range(2, cin) if cin % g == 0 and cout % g == 0 and g not in groups]
    for k in (3, 1, 5, 7, 2, 4, 9, 11, 6, 8, 10, 13, 15):
        for g in groups:
            for bias in (False, True):
                if cout * (cin // g) * k**dims + (cout if bias else 0) != params:
                    continue
                stride, padding = [], []
                for d in range(dims):
                    geo = _conv_geometry(ins[0][off + 1 + d], outs[0][off + 1 + d], k)
                    if geo is None:
                        break
                    stride.append(geo[0])
                    padding.append(geo[1])
                else:
                    return {
                        "in_channels": cin,
                        "out_channels": cout,
                        "kernel_size": k,
                        "stride": stride,
                        "padding": padding,
                        "groups": g,
                        "bias": bias,
                    }
    return None


def _infer_pool(dims: int, ins: tuple[Shape, ...], outs: tuple[Shape, ...]) -> dict[str, Any] | None:
    if not ins or not outs or len(ins[0]) < dims or len(outs[0]) != len(ins[0]):
        return None
    spatial_in = ins[0][-dims:]
    spatial_out = outs[0][-dims:]
    for k in (3, 2, 1, 4, 5, 7):
        for s in (2, 1, 3, 4, k):
            for p in range(k // 2 + 1):
                if all(i + 2 * p >= k and (i + 2 * p - k) // s + 1 == o for i, o in zip(spatial_in, spatial_out)):
                    return {"kernel_size": k, "stride": s, "padding": p}
    return None


def _batch_first(ins: tuple[Shape, ...], model_batch: int | None) -> bool:
    # Which of the first two dims is the model's batch decides; modern code defaults to batch_first.
    if ins and len(ins[0]) == 3 and model_batch is not None:
        a, b = ins[0][0], ins[0][1]
        if b == model_batch and a != model_batch:
            return False
    return True


def infer_config(
    ltype: str, ins: tuple[Shape, ...], outs: tuple[Shape, ...], params: int, model_batch: int | None = None
) -> dict[str, Any] | None:
    """Constructor arguments of a ``torch.nn`` layer inferred from its trace attributes.

    Exact where type, shapes and parameter count determine them (Linear,
    BatchNorm, LayerNorm, Embedding, adaptive pooling, convolutions up to
    kernel size, stride, padding, groups and bias). Heuristic otherwise:
    pooling kernels (a matching kernel/stride/padding), attention heads
    (``embed_dim // 64``), ``batch_first`` (where the model's batch size sits),
    a transformer layer's activation (ReLU). docs/METHODS.md lists them.

    Args:
        ltype: layer class name.
        ins, outs: input and output shapes.
        params: parameter count.
        model_batch: the model call's batch size (first dim of its first input).

    Returns:
        Keyword arguments for the class, or None when they cannot be inferred.
    """
    if ltype in NO_ARG_TYPES:
        return {}
    if ltype in ("Conv1d", "Conv2d", "Conv3d"):
        return _infer_conv(int(ltype[4]), ins, outs, params)
    if ltype == "Linear" and ins and outs and ins[0] and outs[0]:
        fin, fout = ins[0][-1], outs[0][-1]
        if params == fin * fout + fout:
            return {"in_features": fin, "out_features": fout, "bias": True}
        if params == fin * fout:
            return {"in_features": fin, "out_features": fout, "bias": False}
        return None
    if ltype in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d") and ins and len(ins[0]) >= 2:
        c = ins[0][1]
        return {"num_features": c, "affine": params == 2 * c}
    if ltype == "LayerNorm" and ins and ins[0]:
        shape = ins[0]
        for n in range(1, len(shape) + 1):
            size = math.prod(shape[-n:])
            if params in (2 * size, size):
                return {"normalized_shape": list(shape[-n:]), "elementwise_affine": True, "bias": params == 2 * size}
        if params == 0:
            return {"normalized_shape": [shape[-1]], "elementwise_affine": False}
        return None
    if ltype == "Embedding" and outs and outs[0] and outs[0][-1]:
        dim = outs[0][-1]
        if params % dim == 0 and params:
            return {"num_embeddings": params // dim, "embedding_dim": dim}
        return None
    if ltype in (
        "AdaptiveAvgPool1d",
        "AdaptiveAvgPool2d",
        "AdaptiveAvgPool3d",
        "AdaptiveMaxPool1d",
        "AdaptiveMaxPool2d",
        "AdaptiveMaxPool3d",
    ):
        dims = int(ltype[-2])
        if outs and len(outs[0]) >= dims:
            return {"output_size": list(outs[0][-dims:])}
        return None
    if ltype in ("MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d"):
        return _infer_pool(int(ltype[-2]), ins, outs)
    if ltype in ("Softmax", "LogSoftmax"):
        return {"dim": -1}
    if ltype == "Flatten":
        return {}
    if ltype == "MultiheadAttention" and ins and ins[0]:
        e = ins[0][-1]
        if params not in (4 * e * e + 4 * e, 4 * e * e):
            return None
        return {
            "embed_dim": e,
            "num_heads": e // 64 if e % 64 == 0 else 1,
            "bias": params != 4 * e * e,
            "batch_first": _batch_first(ins, model_batch),
        }
    if ltype == "TransformerEncoderLayer" and ins and ins[0]:
        d = ins[0][-1]
        rest = params - 4 * d * d - 9 * d  # attention 4d²+4d, two norms 4d, linear2 bias d
        if rest <= 0 or rest % (2 * d + 1):
            return None
        return {
            "d_model": d,
            "nhead": d // 64 if d % 64 == 0 else 1,
            "dim_feedforward": rest // (2 * d + 1),
            "dropout": 0.0,
            "batch_first": _batch_first(ins, model_batch),
        }
    return None


# -- extraction ------------------------------------------------------------------------


def _leaf_layers(spans: dict[Any, Span]) -> list[Span]:
    layers = [s for s in spans.values() if s.level == Level.LAYER]
    by_id = {s.id: s for s in spans.values()}
    parents_with_layer_below: set[int] = set()
    for s in layers:
        p = by_id.get(s.parent_id) if s.parent_id is not None else None
        while p is not None:
            if p.id in parents_with_layer_below:
                break
            parents_with_layer_below.add(p.id)
            p = by_id.get(p.parent_id) if p.parent_id is not None else None
    return sorted((s for s in layers if s.id not in parents_with_layer_below), key=lambda s: (s.start_ns, s.id))


def extract(runs: Sequence[Run], granularity: int = 1, warmup: int = 1) -> BrickSet:
    """Extracts and deduplicates bricks from traced runs.

    Args:
        runs: runs with layer spans (``--level layer`` or deeper), or leveled runs.
        granularity: H, the longest sequence brick (1: single layers only).
        warmup: model calls skipped before the reference invocation and the
            measured median (fewer when the run has fewer calls).

    Raises:
        ValueError: for H < 1 or a run without layer spans.
    """
    from mltrace.analysis.leveled import invocations, model_label, path_label
    from mltrace.analysis.peaks import run_threads

    if granularity < 1:
        raise ValueError("granularity H must be at least 1")
    models: list[ModelBricks] = []
    unique: dict[Brick, None] = {}
    unique_seq: dict[tuple[Brick, ...], None] = {}
    for run in runs:
        if not any(s.level == Level.LAYER for s in run.spans):
            raise ValueError(f"{run.path}: no layer spans (trace it with --level layer or deeper)")
        for key, calls in invocations(run).items():
            skip = min(warmup, len(calls) - 1)
            ref = calls[skip]
            first = _shapes(ref.root.attrs.get("ml.input.shapes"))
            model_batch = first[0][0] if first and first[0] else None
            traced: dict[str, list[int]] = {}
            for call in calls[skip:]:
                for pk, s in call.spans.items():
                    if s.level == Level.LAYER:
                        traced.setdefault(path_label(pk), []).append(s.duration_ns)
            path_of = {id(s): path_label(pk) for pk, s in ref.spans.items()}
            leaves = _leaf_layers(ref.spans)
            layers = []
            for s in leaves:
                b = brick_of(s, model_batch)
                unique.setdefault(b, None)
                layers.append(
                    LayerCall(s.name, b, s.start_ns, s.end_ns, float(statistics.median(traced.get(path_of[id(s)], [s.duration_ns]))))
                )
            seqs: list[tuple[Brick, ...]] = []
            if granularity > 1:
                seqs = [tuple(lc.brick for lc in layers[i : i + granularity]) for i in range(0, len(layers), granularity)]
                for sq in seqs:
                    unique_seq.setdefault(sq, None)
            parallel = any(b.start_ns < a.end_ns for a, b in zip(layers, layers[1:]))
            covered = _union_ns([(lc.start_ns, lc.end_ns) for lc in layers])
            measured = [c.root.duration_ns for c in calls[skip:]]
            glue = [max(0, c.root.duration_ns - _union_ns([(x.start_ns, x.end_ns) for x in _leaf_layers(c.spans)])) for c in calls[skip:]]
            cpu = [c.root.attrs.get("ml.thread.cpu_ns") for c in calls[skip:]]
            faults = [c.root.attrs.get("ml.thread.minor_faults") for c in calls[skip:]]
            models.append(
                ModelBricks(
                    model=model_label(key),
                    run=str(run.path),
                    measured_ns=float(statistics.median(measured)),
                    invocations=len(measured),
                    layers=layers,
                    sequences=seqs,
                    parallel=parallel,
                    unattributed_ns=max(0, ref.root.duration_ns - covered),
                    glue_ns=float(statistics.median(glue)),
                    threads=run_threads(run.meta),
                    measured_mean_ns=statistics.fmean(measured),
                    glue_mean_ns=statistics.fmean(glue),
                    **_cpu_figures(measured, glue, cpu),
                    minor_faults=_median_count(faults),
                    trace_others_cores=trace_others_cores(run.meta),
                )
            )
    return BrickSet(granularity, _named_apart(models), list(unique), list(unique_seq))


def _cpu_figures(wall: list[int], glue: list[int], cpu: list[Any]) -> dict[str, float]:
    """``ModelBricks``' CPU-time fields from the calls' wall times, glue and thread CPU times
    (empty where a call has no CPU time or a zero wall time)."""
    if not cpu or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpu) or not all(wall):
        return {}
    shares = [c / w for c, w in zip(cpu, wall)]
    glue_cpu = [g * sh for g, sh in zip(glue, shares)]
    return {
        "measured_cpu_ns": float(statistics.median(cpu)),
        "measured_cpu_mean_ns": statistics.fmean(cpu),
        "glue_cpu_ns": float(statistics.median(glue_cpu)),
        "glue_cpu_mean_ns": statistics.fmean(glue_cpu),
        "cpu_share": float(statistics.median(shares)),
    }


def trace_others_cores(meta: dict[str, Any]) -> float | None:
    """Cores others kept busy while a run was traced: its machine's mean CPU utilization
    (``counters_summary["cpu.utilization"]``, sampled from /proc/stat) times the machine's
    cores, less the run's compute threads (the tracer's own threads count as others' here);
    None when the run has no such figures."""
    from mltrace.analysis.peaks import run_threads

    util = meta.get("counters_summary", {}).get("cpu.utilization") if isinstance(meta.get("counters_summary"), dict) else None
    host = meta.get("host")
    cores = host.get("cpu_count") if isinstance(host, dict) else None
    threads = run_threads(meta)
    if not isinstance(util, dict) or not isinstance(util.get("mean"), (int, float)) or not isinstance(cores, int) or threads is None:
        return None
    return max(0.0, float(util["mean"]) / 100.0 * cores - min(threads, cores))


def _median_count(values: list[Any]) -> float | None:
    """The median of recorded counts; None when one is missing."""
    counts = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return float(statistics.median(counts)) if counts and len(counts) == len(values) else None


def _named_apart(models: list[ModelBricks]) -> list[ModelBricks]:
    """The models, those whose label another run's model shares named with their run
    directory too (``ResNet (infer.py:53) [resnet-b1]``): two runs of one script are two rows.
    Where two such directories share their name (``a/run``, ``b/run``), as many trailing
    parts of their paths as tell them apart (``[a/run]``, ``[b/run]``)."""
    runs_of: dict[str, set[str]] = {}
    for m in models:
        runs_of.setdefault(m.model, set()).add(m.run)
    short = run_names(sorted({m.run for m in models}))
    return [replace(m, model=f"{m.model} [{short[m.run]}]") if len(runs_of[m.model]) > 1 else m for m in models]


def run_names(paths: Sequence[str]) -> dict[str, str]:
    """Each run directory's shortest trailing part of its (absolute) path that no other of
    ``paths`` ends with: its name where the names differ."""
    parts = {p: Path(p).resolve().parts for p in paths}
    names: dict[str, str] = {}
    for p, mine in parts.items():
        for k in range(1, len(mine) + 1):
            tail = mine[-k:]
            if all(other[-k:] != tail for q, other in parts.items() if q != p and other != mine):
                break
        names[p] = "/".join(tail) if tail[0] != "/" else str(Path(*tail))
    return names


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total = 0
    end = None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


# -- construction ------------------------------------------------------------------------


def critical_path_ns(layers: Sequence[LayerCall], weight: Callable[[LayerCall], float]) -> float:
    """Longest chain of layers where each starts after the previous one ended in the trace.

    Layers overlapping in time (parallel branches) are not chained, so the
    result is the constructed latency of a model whose branches run
    concurrently; for a sequential trace it is the plain sum.
    """
    order = sorted(range(len(layers)), key=lambda i: layers[i].start_ns)
    by_end = sorted(range(len(layers)), key=lambda i: layers[i].end_ns)
    best_done = 0.0  # longest path over layers already ended
    longest = [0.0] * len(layers)
    j = 0
    for i in order:
        while j < len(by_end) and layers[by_end[j]].end_ns <= layers[i].start_ns:
            best_done = max(best_done, longest[by_end[j]])
            j += 1
        longest[i] = best_done + weight(layers[i])
    return max(longest, default=0.0)


@dataclass
class Construction:
    """A model's constructed latency.

    Attributes:
        model: the model's label.
        measured_ns: traced model latency, median or mean as the construction, on its basis (ns).
        constructed_ns: from the bricks, glue included (ns).
        method: "sum", "sequence sum (H=…)" or "critical path".
        from_trace: leaf layers whose brick could not run alone (their traced latency was used).
        from_trace_ns: the time those contributed (ns).
        glue_ns: the model's time in no leaf layer, from the trace (ns; in ``constructed_ns``).
        basis: "wall" (wall-clock latency) or "cpu" (the calling thread's CPU time).
        faults_ns: the cost of the page faults the model took beyond its bricks' (ns; in
            ``constructed_ns``; 0 when not known).
        extra_faults: those faults per call (None: not known).
    """

    model: str
    measured_ns: float
    constructed_ns: float
    method: str
    from_trace: int = 0
    from_trace_ns: float = 0.0
    glue_ns: float = 0.0
    basis: str = "wall"
    faults_ns: float = 0.0
    extra_faults: float | None = None

    @property
    def bricks_ns(self) -> float:
        """The bricks' part of the constructed latency (ns)."""
        return self.constructed_ns - self.glue_ns - self.faults_ns

    @property
    def ratio(self) -> float:
        """constructed / measured."""
        return self.constructed_ns / self.measured_ns if self.measured_ns else math.nan


#: The statistics a construction can use: of the bricks' calls, and of the traced model calls.
STATISTICS = ("median", "mean")

#: What a construction compares: wall-clock latency, or the calling thread's CPU time.
BASES = ("wall", "cpu")


def construct(
    model: ModelBricks,
    brick_ns: dict[Brick, float],
    sequence_ns: dict[tuple[Brick, ...], float] | None = None,
    statistic: str = "median",
    basis: str = "wall",
    faults: dict[Any, float] | None = None,
    fault_cost_ns: float | None = None,
) -> Construction:
    """Constructs a model's latency from brick medians, plus the model's glue (``glue_ns``)
    and its page faults beyond its bricks' (``faults_ns``).

    Args:
        model: the model's decomposition.
        brick_ns: median latency (ns) per benchmarked brick; bricks missing
            here fall back to their traced latency.
        sequence_ns: median latency (ns) per sequence brick (H > 1); a model
            whose sequences were all benchmarked is constructed from them.
        statistic: "median" or "mean": which of the model's measured latency and glue
            go with the bricks' figures. A mean is stretched by preemption in proportion
            to a call's length, so on a busy machine a sum of bricks' means compares
            with the model's mean, where the median of a short brick is a call that was
            not preempted at all.
        basis: "wall", or "cpu": ``brick_ns`` and ``sequence_ns`` are the bricks' thread CPU
            times, compared with the model calls' thread CPU time and glue on that basis; a
            layer from the trace counts its traced latency times the calls' CPU / wall share.
        faults: minor page faults per call of each benchmarked brick (and sequence), and
        fault_cost_ns: the CPU time one costs (ns): with both, and the model's faults per
            call known (``ModelBricks.minor_faults``), the faults the model took beyond its
            bricks' (memory the allocator gave back to the OS between its layers and took
            again; bricks called alone reuse theirs) add their cost. Not for parallel
            branches (other threads' faults are not counted) or layers from the trace.

    Raises:
        ValueError: basis "cpu" for a model whose calls carry no thread CPU time.
    """
    fallback = [lc for lc in model.layers if lc.brick not in brick_ns]
    share = 1.0
    if basis == "cpu":
        if model.measured_cpu_ns is None or model.cpu_share is None:
            raise ValueError(f"{model.model}: its model calls carry no thread CPU time (ml.thread.cpu_ns)")
        share = model.cpu_share

    def weight(lc: LayerCall) -> float:
        return brick_ns.get(lc.brick, lc.traced_ns * share)

    if model.parallel:
        total = critical_path_ns(model.layers, weight)
        method = "critical path"
    elif sequence_ns is not None and model.sequences and all(sq in sequence_ns for sq in model.sequences):
        total = sum(sequence_ns[sq] for sq in model.sequences)
        method = f"sequence sum (H={max(len(sq) for sq in model.sequences)})"
        fallback = []
    else:
        total = sum(weight(lc) for lc in model.layers)
        method = "sum"
    fallback_ns = sum(lc.traced_ns * share for lc in fallback)
    measured, glue = _measured_and_glue(model, statistic, basis)
    extra_faults = None
    if faults is not None and fault_cost_ns is not None and model.minor_faults is not None and not model.parallel and not fallback:
        units: list[Any] = list(model.sequences) if method.startswith("sequence") else [lc.brick for lc in model.layers]
        if all(u in faults for u in units):
            extra_faults = model.minor_faults - sum(faults[u] for u in units)
    faults_ns = 0.0 if extra_faults is None or fault_cost_ns is None else extra_faults * fault_cost_ns
    return Construction(
        model.model, measured, total + glue + faults_ns, method, len(fallback), fallback_ns, glue, basis, faults_ns, extra_faults
    )


def _measured_and_glue(model: ModelBricks, statistic: str, basis: str) -> tuple[float, float]:
    """The model's measured latency and glue for a statistic and a basis (ns)."""
    if basis == "cpu":
        pair = (model.measured_cpu_mean_ns, model.glue_cpu_mean_ns) if statistic == "mean" else (model.measured_cpu_ns, model.glue_cpu_ns)
        return float(pair[0] or 0.0), float(pair[1] or 0.0)
    return (model.measured_mean_ns, model.glue_mean_ns) if statistic == "mean" else (model.measured_ns, model.glue_ns)


# -- benchmark results ------------------------------------------------------------------------


@dataclass
class BrickTiming:
    """One unique brick's benchmark.

    Attributes:
        median_ns: median latency (wall clock, ns); None when it could not run.
        samples: timed calls.
        runtime: "pytorch" or "onnxruntime".
        error: why it could not run ("" when it ran).
        wall_s: wall time spent on it, construction included (s).
        cpu_median_ns: median CPU time of the calling thread (ns): unlike wall
            time, not stretched when a busy machine preempts the benchmark; the
            latency itself for single-threaded work.
        mean_ns: mean latency (wall clock, ns): on a busy machine, unlike the median of
            short calls, stretched by preemption in proportion to the call's length, as a
            whole model call is.
        cpu_mean_ns: mean CPU time of the calling thread (ns).
        minor_faults: median minor page faults per timed call (None: not counted).
    """

    median_ns: float | None
    samples: int
    runtime: str
    error: str = ""
    wall_s: float = 0.0
    cpu_median_ns: float | None = None
    mean_ns: float | None = None
    cpu_mean_ns: float | None = None
    minor_faults: float | None = None

    def figure(self, statistic: str, basis: str) -> float | None:
        """The timing a construction uses: median or mean, wall clock or thread CPU time (ns)."""
        if basis == "cpu":
            return self.cpu_mean_ns if statistic == "mean" else self.cpu_median_ns
        return self.mean_ns if statistic == "mean" else self.median_ns


#: Others' CPU use (cores, on average) while bricks ran above which the machine is not idle.
BUSY_CORES = 0.25

#: Others' CPU use (cores) while bricks ran above which even thread CPU times are not
#: comparable: others' use of the shared caches and memory bandwidth stretches them too
#: (single runs on the 2-core VM, docs/METHODS.md: 0.86–1.39 with others at 0.85–1.0 cores,
#: 0.91–1.02 at 0.01 or less).
CPU_BUSY_CORES = 0.5


@dataclass(frozen=True)
class MachineState:
    """How busy the machine was while the bricks ran.

    Attributes:
        cores: the machine's cores.
        threads: the compute threads the bricks ran with.
        others_cores: CPU time that other processes used while the bricks ran, per
            second of wall time (cores kept busy by others, on average).
        loadavg: the 1-minute load average before and after.
    """

    cores: int
    threads: int
    others_cores: float
    loadavg: tuple[float, float]

    @property
    def idle(self) -> bool:
        """Whether others used less than ``BUSY_CORES`` cores."""
        return self.others_cores < BUSY_CORES

    def summary(self) -> str:
        """``idle``/``busy`` and the figures: others' cores while the bricks ran, the load average."""
        state = "idle" if self.idle else "busy"
        return (
            f"{state}: other processes kept {self.others_cores:.2f} of {self.cores} cores busy while the bricks ran "
            f"(load average {self.loadavg[0]:.1f} → {self.loadavg[1]:.1f})"
        )


#: A single-threaded model call whose thread ran on a CPU for less than this share of its
#: wall time was preempted (or waited): its wall-clock latency is not its work.
MIN_CPU_SHARE = 0.9


@dataclass(frozen=True)
class BasisChoice:
    """What constructed/measured compares, and whether to trust it.

    Attributes:
        basis: "cpu" (the calling thread's CPU time) or "wall" (wall-clock latency).
        trusted: whether the ratios on that basis can be taken as they are.
        why: one line: why the wall clock was not used, or why the ratio on it is not to
            be trusted ("" when the wall clock was used on an idle machine).
        cpu_possible: whether the CPU-time basis was available (one intra-op thread,
            thread CPU time recorded on every model call).
    """

    basis: str
    trusted: bool
    why: str
    cpu_possible: bool


@dataclass(frozen=True)
class Busy:
    """What made the machine unfit for a comparison (each "" when it did not happen).

    Attributes:
        bricks: others used cores while the bricks ran (not idle).
        bricks_over: others used more than ``CPU_BUSY_CORES`` cores: even the bricks'
            thread CPU time stretches (shared caches and memory bandwidth, caches refilled
            after a preemption).
        trace: single-threaded model calls ran on a CPU for less than ``MIN_CPU_SHARE`` of
            their wall time while traced: preempted, so their wall time is not their work and
            their CPU time is stretched too.
        traced, traced_over: others used more than ``BUSY_CORES`` (``CPU_BUSY_CORES``) cores
            while a run was traced (``ModelBricks.trace_others_cores``).
    """

    bricks: str = ""
    bricks_over: str = ""
    trace: str = ""
    traced: str = ""
    traced_over: str = ""

    def wall(self) -> str:
        """Why wall clocks are not comparable ("" when they are)."""
        return "; ".join(r for r in (self.bricks, self.traced, self.trace) if r)

    def cpu(self) -> str:
        """Why thread CPU times are not comparable either ("" when they are)."""
        return "; ".join(r for r in (self.bricks_over, self.traced_over, self.trace) if r)


def busy_machine(models: Sequence[ModelBricks], threads: int | None, machine: MachineState | None) -> Busy:
    """How busy the machine was while the bricks ran (``machine``) and while the models were
    traced (single-threaded calls' CPU / wall share, ``ModelBricks.cpu_share``)."""
    bricks = bricks_over = trace = ""
    if machine is not None and not machine.idle:
        bricks = (
            f"load average {machine.loadavg[1]:.1f} on {machine.cores} CPUs (other processes kept "
            f"{machine.others_cores:.1f} cores busy while the bricks ran)"
        )
        if machine.others_cores > CPU_BUSY_CORES:
            bricks_over = bricks
    if threads == 1:
        shares = [(m.cpu_share, m.model) for m in models if m.cpu_share is not None and m.cpu_share < MIN_CPU_SHARE]
        if shares:
            share, name = min(shares)
            trace = f"traced model calls ran on a CPU for {share:.0%} of their wall time ({name})"
    traced = traced_over = ""
    others = [(m.trace_others_cores, m.model) for m in models if m.trace_others_cores is not None]
    if others and max(others)[0] > BUSY_CORES:
        cores, name = max(others)
        traced = f"other processes kept ≈ {cores:.1f} cores busy while {name} was traced"
        traced_over = traced if cores > CPU_BUSY_CORES else ""
    return Busy(bricks, bricks_over, trace, traced, traced_over)


def choose_basis(models: Sequence[ModelBricks], threads: int | None, machine: MachineState | None, requested: str = "auto") -> BasisChoice:
    """The basis constructed/measured is compared on, and whether it can be trusted.

    With one intra-op thread (model and bricks) and thread CPU time on every model call,
    the calling thread's CPU time is the work the latency is made of, not stretched by
    preemption: "auto" compares CPU time with CPU time. It is trusted unless the machine was
    too busy for that too (``Busy.cpu``): others used more than ``CPU_BUSY_CORES`` cores, or
    the traced calls were preempted. With several intra-op threads the calling thread's CPU time misses the
    others' work and is not the latency: "auto" compares wall clocks, which are trusted
    only on an idle machine (``Busy.wall``).

    Args:
        models: the decompositions.
        threads: intra-op threads of the models and the bricks (the most of them; None
            when a run's is unknown).
        machine: how busy the machine was while the bricks ran (None: not measured).
        requested: "auto", "cpu" or "wall".

    Raises:
        ValueError: "cpu" requested where it is not available (the message says why), or
            an unknown basis.
    """
    if requested not in ("auto", *BASES):
        raise ValueError(f"basis must be auto, wall or cpu, not {requested!r}")
    if threads is None:
        no_cpu = "intra-op threads unknown: thread CPU time may not be the latency"
    elif threads > 1:
        no_cpu = f"intra-op threads = {threads}: CPU time is not the latency"
    elif not models or any(m.measured_cpu_ns is None for m in models):
        no_cpu = "the model calls carry no thread CPU time (traced by an older mltrace)"
    else:
        no_cpu = ""
    if requested == "cpu" and no_cpu:
        raise ValueError(f"no CPU-time basis: {no_cpu}")
    busy = busy_machine(models, threads, machine)
    if requested == "cpu" or (requested == "auto" and not no_cpu):
        if busy.cpu():
            why = (
                f"{busy.cpu()}: too busy for thread CPU time too (shared caches and memory bandwidth); "
                "neither basis is comparable: rerun on an idle machine"
            )
            return BasisChoice("cpu", False, why, True)
        why = f"{busy.wall()}: wall-clock bricks not comparable; CPU-time basis used" if busy.wall() else ""
        return BasisChoice("cpu", True, why, True)
    if not busy.wall():
        return BasisChoice("wall", True, "", not no_cpu)
    if no_cpu:
        why = (
            f"{no_cpu}, and {busy.wall()}: wall-clock constructed/measured not comparable; "
            "rerun with OMP_NUM_THREADS=1 or on an idle machine"
        )
    else:
        why = f"{busy.wall()}: wall-clock constructed/measured not comparable; the CPU-time basis (--basis auto) is"
    return BasisChoice("wall", False, why, not no_cpu)


# -- the whole pipeline --------------------------------------------------------------------------


@dataclass
class BricksReport:
    """Bricks, their timings and every model's construction.

    Attributes:
        set: the extracted bricks.
        timings: timing per unique brick (same order as ``set.bricks``).
        sequence_timings: timing per unique sequence (H > 1).
        constructions: per model, on the chosen basis (``choice``).
        warmup, n: the benchmarking protocol (calls).
        runtime: where bricks ran.
        bench_wall_s: wall time spent benchmarking bricks (s).
        machine: how busy the machine was while they ran (None: not measured).
        statistic: "median" or "mean" (``construct``).
        choice: the basis of ``constructions`` and whether to trust it (``choose_basis``).
        other: per model, on the other basis where it could be had (for comparison), else None.
    """

    set: BrickSet
    timings: list[BrickTiming]
    sequence_timings: list[BrickTiming]
    constructions: list[Construction]
    warmup: int
    n: int
    runtime: str
    bench_wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    machine: MachineState | None = None
    statistic: str = "median"
    choice: BasisChoice = BasisChoice("wall", True, "", False)
    other: list[Construction] | None = None

    @property
    def end_to_end_cost_ns(self) -> float:
        """Time benchmarking every model end to end would take: Σ (warmup + n) · measured (ns)."""
        return sum((self.warmup + self.n) * m.measured_ns for m in self.set.models)

    @property
    def bricks_cost_ns(self) -> float:
        """Time benchmarking each unique brick once takes, same protocol: Σ (warmup + n) · median (ns)."""
        timings = self.sequence_timings if self.set.granularity > 1 and self.sequence_timings else self.timings
        return sum((self.warmup + self.n) * t.median_ns for t in timings if t.median_ns is not None)

    @property
    def speedup(self) -> float:
        """end_to_end_cost_ns / bricks_cost_ns (benchmarking-time speedup)."""
        return self.end_to_end_cost_ns / self.bricks_cost_ns if self.bricks_cost_ns else math.nan

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (format ``mltrace-bricks``, times in ns)."""
        s = self.set
        return {
            "format": "mltrace-bricks",
            "version": 1,
            "granularity": s.granularity,
            "runtime": self.runtime,
            "protocol": {"warmup": self.warmup, "n": self.n, "statistic": self.statistic},
            "basis": {"used": self.choice.basis, "trusted": self.choice.trusted, "why": self.choice.why or None},
            "counts": {
                "models": len(s.models),
                "layers_total": s.total_layers,
                "layers_unique": len(s.bricks),
                "sequences_total": s.total_sequences,
                "sequences_unique": len(s.sequences),
            },
            "speedup": {
                "end_to_end_cost_ns": round(self.end_to_end_cost_ns),
                "bricks_cost_ns": round(self.bricks_cost_ns),
                "speedup": round(self.speedup, 3) if not math.isnan(self.speedup) else None,
                "bench_wall_s": round(self.bench_wall_s, 3),
                "definition": "sum over models of (warmup+n)*measured / sum over unique bricks of (warmup+n)*brick median",
            },
            "models": [
                {
                    "model": m.model,
                    "run": m.run,
                    "layers": len(m.layers),
                    "unique_layers": len({lc.brick for lc in m.layers}),
                    "parallel_branches": m.parallel,
                    "unattributed_ns": m.unattributed_ns,
                    "threads": m.threads,
                    "measured_ns": round(c.measured_ns),
                    "constructed_ns": round(c.constructed_ns),
                    "bricks_ns": round(c.bricks_ns),
                    "glue_ns": round(c.glue_ns),
                    "faults_ns": round(c.faults_ns),
                    "extra_minor_faults": c.extra_faults,
                    "minor_faults": m.minor_faults,
                    "ratio": round(c.ratio, 4) if not math.isnan(c.ratio) else None,
                    "method": c.method,
                    "layers_from_trace": c.from_trace,
                    "basis": c.basis,
                    **({} if o is None else {f"{o.basis}_basis": _basis_json(o)}),
                    "cpu_share": None if m.cpu_share is None else round(m.cpu_share, 4),
                    "layer_sequence": [
                        {"path": lc.path, "brick": s.bricks.index(lc.brick), "traced_ns": round(lc.traced_ns)} for lc in m.layers
                    ],
                }
                for m, c, o in zip(s.models, self.constructions, self.other or _nones(len(s.models)))
            ],
            "bricks": [
                {
                    **b.to_json(),
                    "median_ns": round(t.median_ns) if t.median_ns is not None else None,
                    "mean_ns": round(t.mean_ns) if t.mean_ns is not None else None,
                    "cpu_median_ns": round(t.cpu_median_ns) if t.cpu_median_ns is not None else None,
                    "minor_faults": t.minor_faults,
                    "samples": t.samples,
                    "error": t.error or None,
                }
                for b, t in zip(s.bricks, self.timings)
            ],
            "sequences": [
                {
                    "bricks": [s.bricks.index(b) for b in sq],
                    "median_ns": round(t.median_ns) if t.median_ns is not None else None,
                    "error": t.error or None,
                }
                for sq, t in zip(s.sequences, self.sequence_timings)
            ],
            "machine": None if self.machine is None else {**asdict(self.machine), "idle": self.machine.idle},
            **self.extra,
        }


def _nones(count: int) -> list[Construction | None]:
    return [None] * count


def _basis_json(c: Construction) -> dict[str, Any]:
    """A construction's figures on its basis, for the JSON beside the chosen one."""
    return {
        "measured_ns": round(c.measured_ns),
        "constructed_ns": round(c.constructed_ns),
        "glue_ns": round(c.glue_ns),
        "ratio": round(c.ratio, 4) if not math.isnan(c.ratio) else None,
    }


def assemble(
    bset: BrickSet,
    timings: list[BrickTiming],
    sequence_timings: list[BrickTiming],
    *,
    warmup: int,
    n: int,
    runtime: str,
    bench_wall_s: float,
    extra: dict[str, Any] | None = None,
    machine: MachineState | None = None,
    statistic: str = "median",
    threads: int | None = None,
    basis: str = "auto",
    fault_cost_ns: float | None = None,
) -> BricksReport:
    """The report of benchmarked bricks: every model constructed from their medians or means
    (sequences' where H > 1 and all of a model's were benchmarked), on the basis
    ``choose_basis`` picks for ``threads`` (the intra-op threads of models and bricks),
    ``machine`` and ``basis`` ("auto", "wall" or "cpu"); on the other one too where it can be had.
    With ``fault_cost_ns`` (the CPU time of a minor page fault), the page faults each model
    took beyond its bricks' add their cost (``construct``).

    Raises:
        ValueError: an unknown statistic or basis, or "cpu" where it is not available.
    """
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}, not {statistic!r}")
    choice = choose_basis(bset.models, threads, machine, basis)

    def on(basis: str) -> list[Construction]:
        def figures(items: Sequence[Any], got: list[BrickTiming]) -> dict[Any, float]:
            values = ((item, t.figure(statistic, basis)) for item, t in zip(items, got))
            return {item: v for item, v in values if v is not None}

        brick_ns, seq_ns = figures(bset.bricks, timings), figures(bset.sequences, sequence_timings)
        kw: dict[str, Any] = {"faults": faults, "fault_cost_ns": fault_cost_ns}
        return [construct(m, brick_ns, seq_ns if bset.granularity > 1 else None, statistic, basis, **kw) for m in bset.models]

    pairs = [*zip(bset.bricks, timings), *zip(bset.sequences, sequence_timings)]
    faults: dict[Any, float] = {item: t.minor_faults for item, t in pairs if t.minor_faults is not None}

    constructions = on(choice.basis)
    other = None
    if choice.cpu_possible:
        other = on("wall" if choice.basis == "cpu" else "cpu")
    kw: dict[str, Any] = {"extra": extra or {}, "machine": machine, "statistic": statistic, "choice": choice, "other": other}
    return BricksReport(bset, timings, sequence_timings, constructions, warmup, n, runtime, bench_wall_s, **kw)
