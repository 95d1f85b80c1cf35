"""Leveled experimentation: overhead-free latency per span, from one run per level.

Tracing a level inflates the levels above it (a layer hook runs inside the model span; a
profiler's op callbacks run inside layer spans). Following XSP, the workload runs once per
level with every level down to that one enabled, and each span's latency is taken from the
run in which its level is the deepest one enabled. ``analyze`` matches the runs' spans and
summarises them (``Stats``), ``build_leveled_run`` makes the leveled trace; docs/METHODS.md,
"Leveled experimentation", describes the method.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mltrace.run.events import Span, Track
from mltrace.run.levels import HIERARCHY, Level
from mltrace.run.store import Run

#: Fraction cut from each end of the sorted samples before averaging.
TRIM = 0.2

ModelKey = tuple[str, "str | None", "int | None"]
"""A model: (span name, call file, call line)."""

PathKey = tuple[tuple[str, int], ...]
"""A span inside an invocation: ((name, k), …) from the model span down."""


# -- statistics ------------------------------------------------------------


def trimmed_mean(samples: Sequence[float], proportion: float = TRIM) -> float:
    """Mean after cutting ``floor(proportion * n)`` samples from each end.

    Raises:
        ValueError: for no samples or a proportion outside [0, 0.5).
    """
    if not samples:
        raise ValueError("trimmed mean of no samples")
    if not 0 <= proportion < 0.5:
        raise ValueError("proportion must be in [0, 0.5)")
    xs = sorted(samples)
    cut = int(proportion * len(xs))
    kept = xs[cut : len(xs) - cut]
    return sum(kept) / len(kept)


@dataclass(frozen=True)
class Stats:
    """Summary of one set of latency samples (ns).

    Attributes:
        n: number of samples.
        mean_ns: 20 % trimmed mean.
        median_ns: median.
        stdev_ns: sample standard deviation (0 for one sample).
        min_ns, max_ns: range.
    """

    n: int
    mean_ns: float
    median_ns: float
    stdev_ns: float
    min_ns: int
    max_ns: int

    @classmethod
    def of(cls, samples: Sequence[int]) -> Stats:
        """Summarizes ``samples`` (ns).

        Raises:
            ValueError: for no samples.
        """
        if not samples:
            raise ValueError("no samples")
        return cls(
            n=len(samples),
            mean_ns=trimmed_mean(samples),
            median_ns=float(statistics.median(samples)),
            stdev_ns=statistics.stdev(samples) if len(samples) > 1 else 0.0,
            min_ns=min(samples),
            max_ns=max(samples),
        )

    @property
    def spread_pct(self) -> float:
        """Standard deviation relative to the trimmed mean (%)."""
        return 100.0 * self.stdev_ns / self.mean_ns if self.mean_ns else 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (ns, rounded to 0.1 ns)."""
        return {
            "n": self.n,
            "trimmed_mean_ns": round(self.mean_ns, 1),
            "median_ns": round(self.median_ns, 1),
            "stdev_ns": round(self.stdev_ns, 1),
            "min_ns": self.min_ns,
            "max_ns": self.max_ns,
        }


# -- invocations and keys ----------------------------------------------------


def model_key(span: Span) -> ModelKey:
    """The key of a model span: its name and the call site recorded by the tracer."""
    file, line = span.attrs.get("ml.call.file.path"), span.attrs.get("ml.call.line.number")
    return (span.name, file if isinstance(file, str) else None, line if isinstance(line, int) else None)


def model_label(key: ModelKey) -> str:
    """``ResNet (infer.py:36)``, or the bare name when the call site is unknown."""
    name, file, line = key
    return f"{name} ({os.path.basename(file)}:{line})" if file else name


def path_label(path: PathKey) -> str:
    """``ResNet > layer1 > layer1.0.relu[1]``: names from the model down, ``[k]`` for k > 0."""
    return " > ".join(f"{n}[{k}]" if k else n for n, k in path)


@dataclass
class Invocation:
    """One call of a model and every span under it.

    Attributes:
        model: the model's key.
        root: the model span.
        spans: path key → span, in depth-first call order.
    """

    model: ModelKey
    root: Span
    spans: dict[PathKey, Span]


def _children(spans: Iterable[Span]) -> dict[int, list[Span]]:
    kids: dict[int, list[Span]] = {}
    for s in spans:
        if s.parent_id is not None:
            kids.setdefault(s.parent_id, []).append(s)
    for lst in kids.values():
        lst.sort(key=lambda s: (s.start_ns, -s.end_ns, s.id))
    return kids


def invocations(run: Run) -> dict[ModelKey, list[Invocation]]:
    """The model invocations of a run, per model, in call order.

    An invocation is a model span with no model span above it, and its
    subtree (by parent ids).
    """
    by_id = run.span_by_id()
    kids = _children(run.spans)
    roots: list[Span] = []
    for s in run.spans:
        if s.level != Level.MODEL:
            continue
        p = by_id.get(s.parent_id) if s.parent_id is not None else None
        while p is not None and p.level != Level.MODEL:
            p = by_id.get(p.parent_id) if p.parent_id is not None else None
        if p is None:
            roots.append(s)
    roots.sort(key=lambda s: (s.start_ns, s.id))
    out: dict[ModelKey, list[Invocation]] = {}
    for root in roots:
        spans: dict[PathKey, Span] = {}
        stack: list[tuple[Span, PathKey]] = [(root, ((root.name, 0),))]
        while stack:
            span, key = stack.pop()
            spans[key] = span
            seen: dict[str, int] = {}
            pairs = []
            for c in kids.get(span.id, ()):
                k = seen.get(c.name, 0)
                seen[c.name] = k + 1
                pairs.append((c, (*key, (c.name, k))))
            stack.extend(reversed(pairs))  # depth-first, in call order
        mk = model_key(root)
        out.setdefault(mk, []).append(Invocation(mk, root, spans))
    return out


def load_plain_timings(files: Iterable[str | os.PathLike[str]]) -> dict[ModelKey, list[list[int]]]:
    """Reads the plain runs' timings: model key → one list of durations (ns) per process."""
    out: dict[ModelKey, list[list[int]]] = {}
    for f in files:
        doc = json.loads(Path(f).read_text(encoding="utf-8"))
        if doc.get("format") != "mltrace-plain-timings":
            raise ValueError(f"{f}: not a plain-timings file")
        for m in doc.get("models", ()):
            key: ModelKey = (m["name"], m.get("call_file"), m.get("call_line"))
            out.setdefault(key, []).append([int(d) for d in m["durations_ns"]])
    return out


# -- the result ----------------------------------------------------------------


@dataclass
class SpanEstimate:
    """The leveled estimate of one span of the reference invocation.

    Attributes:
        path: the span's path key.
        name, level: the span's name and level.
        source: the run level the estimate comes from (None: unmatched).
        stats: latency in the source run (or in the reference run when unmatched).
        full: latency in the reference (deepest, naive full-trace) run.
        matched: whether the span was found in its source run.
    """

    path: PathKey
    name: str
    level: Level
    source: Level | None
    stats: Stats
    full: Stats
    matched: bool = True

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "path": [[n, k] for n, k in self.path],
            "name": self.name,
            "level": self.level.label,
            "source_run": self.source.label if self.source is not None else None,
            "matched": self.matched,
            "estimate": self.stats.to_json(),
            "full_trace": self.full.to_json(),
        }


@dataclass
class LevelTime:
    """Time of one level per invocation, as measured in each run that records it.

    A level's time is a sum of trimmed-mean span latencies (ns). For layers it
    sums the *innermost* layers (leaf modules): a container such as
    ``nn.Sequential`` carries the instrumentation of the layers nested in it,
    which no shallower run removes, so leaf layers are the level's overhead-free
    work (the containers' own code, e.g. a residual add, is not in it). For the
    other levels it sums the *outermost* spans (no span of the same level
    above them): the ops a layer called, not the aten ops nested inside them.
    Both sums are kept.

    Attributes:
        level: the level.
        source: the run level its estimate comes from.
        spans: spans summed per invocation.
        by_run_ns: run level → the level's time (ns) in that run.
        outer_by_run_ns: run level → sum over outermost spans (ns).
        inner_by_run_ns: run level → sum over innermost spans (ns).
        missing: run level → summed spans not found in that run.
    """

    level: Level
    source: Level
    spans: int
    by_run_ns: dict[Level, float] = field(default_factory=dict)
    outer_by_run_ns: dict[Level, float] = field(default_factory=dict)
    inner_by_run_ns: dict[Level, float] = field(default_factory=dict)
    missing: dict[Level, int] = field(default_factory=dict)

    @property
    def estimate_ns(self) -> float:
        """The overhead-free time (ns): as measured in the source run."""
        return self.by_run_ns.get(self.source, 0.0)

    def inflation_pct(self, run: Level) -> float | None:
        """How much running with ``run``'s levels inflates this level (%), or None."""
        if run not in self.by_run_ns or not self.estimate_ns:
            return None
        return 100.0 * (self.by_run_ns[run] / self.estimate_ns - 1.0)

    def to_json(self, next_level: Level | None, deepest: Level) -> dict[str, Any]:
        """A JSON-ready dict with inflations by the next level and by the full trace."""
        return {
            "level": self.level.label,
            "source_run": self.source.label,
            "summed": "innermost" if self.level == Level.LAYER else "outermost",
            "spans_per_invocation": self.spans,
            "estimate_ns": round(self.estimate_ns, 1),
            "by_run_ns": {lv.label: round(v, 1) for lv, v in self.by_run_ns.items()},
            "outermost_by_run_ns": {lv.label: round(v, 1) for lv, v in self.outer_by_run_ns.items()},
            "innermost_by_run_ns": {lv.label: round(v, 1) for lv, v in self.inner_by_run_ns.items()},
            "missing_by_run": {lv.label: c for lv, c in self.missing.items() if c},
            "inflation_by_next_level_pct": _r(self.inflation_pct(next_level)) if next_level is not None else None,
            "inflation_by_full_trace_pct": _r(self.inflation_pct(deepest)),
        }


def _r(v: float | None, nd: int = 2) -> float | None:
    return None if v is None else round(v, nd)


@dataclass
class Mismatch:
    """Something that did not match across runs (reported, never hidden).

    Attributes:
        kind: "missing" (reference span absent from its level's run), "extra"
            (span of a level's run absent from the reference), "invocations"
            (runs made different numbers of calls), "plain" (model absent from
            or only in the plain run), "model" (model absent from some run).
        model: the model's label.
        detail: a human sentence.
        level: the span's level, when about a span.
        run: the run level concerned ("plain" for the plain run).
        path: the span's path label, when about a span.
    """

    kind: str
    model: str
    detail: str
    level: str | None = None
    run: str | None = None
    path: str | None = None


@dataclass
class Overflow:
    """A parent whose children's estimates exceed its own: children were scaled to fit.

    Attributes:
        model: the model's label.
        path: the parent's path label.
        parent_ns: the parent's estimate (ns).
        children_ns: sum of its same-track children's estimates (ns).
    """

    model: str
    path: str
    parent_ns: float
    children_ns: float

    @property
    def scale(self) -> float:
        """The factor children were scaled by (< 1)."""
        return self.parent_ns / self.children_ns if self.children_ns else 1.0


@dataclass
class ModelResult:
    """Leveled figures for one model.

    Attributes:
        key, label: the model's key and label.
        plain: latency of the uninstrumented run (None when it had no such model).
        levels: time per level, model first.
        spans: estimates for every span of the reference invocation (depth-first).
        invocations: run label ("plain r0", "layer r1", …) → calls made.
        reference: the reference invocation (from the deepest run).
        round_ratios: per round, the median model latency of that round's
            model-level run over the median of that round's plain run. The
            two run back to back, so slow drift of a shared machine cancels
            out of each ratio (see ``paired_vs_plain_pct``).
    """

    key: ModelKey
    label: str
    plain: Stats | None
    levels: list[LevelTime]
    spans: list[SpanEstimate]
    invocations: dict[str, int]
    reference: Invocation
    round_ratios: list[float] = field(default_factory=list)

    @property
    def paired_vs_plain_pct(self) -> float | None:
        """The leveled model latency against plain, round by round: median of ``round_ratios`` (%), or None."""
        if not self.round_ratios:
            return None
        return 100.0 * (statistics.median(self.round_ratios) - 1.0)

    def level(self, level: Level) -> LevelTime | None:
        """The row of ``level``, if the model has spans at that level."""
        return next((lt for lt in self.levels if lt.level == level), None)

    def vs_plain_pct(self, level: Level) -> float | None:
        """The level's overhead-free time relative to the plain median (%), or None."""
        lt = self.level(level)
        if lt is None or self.plain is None or not self.plain.median_ns:
            return None
        return 100.0 * (lt.estimate_ns / self.plain.median_ns - 1.0)


@dataclass
class LeveledResult:
    """Everything leveled experimentation found.

    Attributes:
        levels: the levels that ran and recorded, outermost first.
        skipped: level label → why it was dropped (requested but not recorded).
        models: per-model figures, in call order of the reference run.
        mismatches: what did not match across runs.
        overflows: parents whose children were scaled to fit (set by build_leveled_run).
        warmup: invocations dropped per model and run.
        trim: the trimmed mean's cut per end.
    """

    levels: list[Level]
    skipped: dict[str, str]
    models: list[ModelResult]
    mismatches: list[Mismatch]
    overflows: list[Overflow] = field(default_factory=list)
    warmup: int = 0
    trim: float = TRIM

    @property
    def deepest(self) -> Level:
        """The deepest level run: the reference (naive full-trace) run."""
        return self.levels[-1]

    def source_of(self, level: Level) -> Level:
        """The run a level's estimate comes from: the shallowest run recording it."""
        if level not in HIERARCHY:
            return self.levels[0]  # user spans: least instrumented run
        return next((lv for lv in self.levels if lv >= level), self.levels[-1])

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON-ready dict (format ``mltrace-leveled``, times in ns)."""
        models = []
        for m in self.models:
            rows = []
            for lt in m.levels:
                deeper = [lv for lv in self.levels if lv > lt.source]
                rows.append(lt.to_json(deeper[0] if deeper else None, self.deepest))
            models.append(
                {
                    "model": m.label,
                    "name": m.key[0],
                    "call_site": {"file": m.key[1], "line": m.key[2]},
                    "plain": m.plain.to_json() if m.plain is not None else None,
                    "levels": rows,
                    "leveled_model_vs_plain_pct": _r(m.vs_plain_pct(Level.MODEL)),
                    "leveled_model_vs_plain_paired_pct": _r(m.paired_vs_plain_pct),
                    "round_ratios": [round(x, 5) for x in m.round_ratios],
                    "leveled_layers_vs_plain_pct": _r(m.vs_plain_pct(Level.LAYER)),
                    "full_trace_model_vs_plain_pct": _r(
                        100.0 * (m.level(Level.MODEL).by_run_ns.get(self.deepest, 0.0) / m.plain.median_ns - 1.0)  # type: ignore[union-attr]
                        if m.plain is not None and m.level(Level.MODEL) is not None and m.plain.median_ns
                        else None
                    ),
                    "invocations": m.invocations,
                    "spans": [s.to_json() for s in m.spans],
                }
            )
        return {
            "format": "mltrace-leveled",
            "version": 1,
            "levels": [lv.label for lv in self.levels],
            "skipped_levels": self.skipped,
            "warmup": self.warmup,
            "trim_per_end": self.trim,
            "plain_method": "no session, no hooks; nn.Module.__call__ wrapped to time the outermost module call per thread",
            "models": models,
            "mismatches": [vars(x) for x in self.mismatches],
            "overflows": [
                {
                    "model": o.model,
                    "path": o.path,
                    "parent_ns": round(o.parent_ns, 1),
                    "children_ns": round(o.children_ns, 1),
                    "scale": round(o.scale, 4),
                }
                for o in self.overflows
            ],
        }


# -- the analysis --------------------------------------------------------------


def _recorded(run: Run, level: Level) -> tuple[bool, str]:
    info = run.meta.get("levels", {}).get(level.label)
    if not isinstance(info, dict):
        return True, ""  # hand-made runs carry no level table: trust the spans
    return bool(info.get("recorded")), str(info.get("reason") or "not recorded")


@dataclass
class _RunSamples:
    """Post-warm-up latencies of every span path in the runs of one level, per model."""

    samples: dict[ModelKey, dict[PathKey, list[int]]] = field(default_factory=dict)
    counts: dict[ModelKey, list[int]] = field(default_factory=dict)


def _collect(runs: Sequence[Run], warmup: int) -> tuple[_RunSamples, list[dict[ModelKey, list[Invocation]]]]:
    rs = _RunSamples()
    all_inv = []
    for run in runs:
        inv = invocations(run)
        all_inv.append(inv)
        for mk, calls in inv.items():
            rs.counts.setdefault(mk, []).append(len(calls))
            per_path = rs.samples.setdefault(mk, {})
            for call in calls[warmup:]:
                for pk, span in call.spans.items():
                    per_path.setdefault(pk, []).append(span.duration_ns)
    return rs, all_inv


def analyze(plain: dict[ModelKey, list[list[int]]] | None, runs: dict[Level, list[Run]], warmup: int = 0) -> LeveledResult:
    """Matches the runs and computes every span's overhead-free estimate.

    Model invocations are keyed by ``model_key`` and counted in call order, after dropping
    the first ``warmup`` of each model in each run; inside one, a span is keyed by its path
    from the model span (``invocations``). A span of the reference (deepest) run with no
    match in its level's run, a span of a level's run missing from the reference, and
    differing invocation counts are reported as mismatches; an unmatched reference span
    keeps its own (inflated) latency and says so.

    Args:
        plain: uninstrumented timings, model key → durations (ns) per process
            (``load_plain_timings``); None when there was no plain run.
        runs: level → the runs made with that level as the deepest one
            (one per round).
        warmup: invocations dropped per model and run (and per plain process).

    Returns:
        The result; ``models`` is empty when no run has a model invocation.
    """
    skipped: dict[str, str] = {}
    levels: list[Level] = []
    for lv in sorted(runs):
        if not runs[lv]:
            continue
        ok, reason = _recorded(runs[lv][0], lv)
        if ok:
            levels.append(lv)
        else:
            skipped[lv.label] = reason
    result = LeveledResult(levels=levels, skipped=skipped, models=[], mismatches=[], warmup=warmup)
    if not levels:
        return result
    deepest = levels[-1]
    collected = {lv: _collect(runs[lv], warmup) for lv in levels}
    ref_inv = collected[deepest][1][0]
    all_models: list[ModelKey] = []
    for lv in levels:
        for mk in collected[lv][0].counts:
            if mk not in all_models:
                all_models.append(mk)
    for mk in plain or {}:
        if mk not in all_models:
            result.mismatches.append(Mismatch("plain", model_label(mk), "called in the plain run but in no traced run", run="plain"))
    ordered = sorted(
        (mk for mk in all_models if mk in ref_inv),
        key=lambda mk: ref_inv[mk][min(warmup, len(ref_inv[mk]) - 1)].root.start_ns,
    )
    for mk in all_models:
        if mk not in ref_inv:
            result.mismatches.append(
                Mismatch("model", model_label(mk), f"not called in the reference ({deepest.label}) run", run=deepest.label)
            )
    for mk in ordered:
        result.models.append(_analyze_model(result, mk, collected, ref_inv[mk], plain, warmup))
    return result


def _analyze_model(
    result: LeveledResult,
    mk: ModelKey,
    collected: dict[Level, tuple[_RunSamples, list[dict[ModelKey, list[Invocation]]]]],
    ref_calls: list[Invocation],
    plain: dict[ModelKey, list[list[int]]] | None,
    warmup: int,
) -> ModelResult:
    label = model_label(mk)
    deepest = result.deepest
    counts: dict[str, int] = {}
    for lv in result.levels:
        for r, c in enumerate(collected[lv][0].counts.get(mk, [])):
            counts[f"{lv.label} r{r}"] = c
        if mk not in collected[lv][0].counts:
            result.mismatches.append(Mismatch("model", label, f"not called in the {lv.label} run", run=lv.label))
    plain_stats: Stats | None = None
    if plain is not None:
        per_proc = plain.get(mk)
        if per_proc is None:
            result.mismatches.append(Mismatch("plain", label, "not called in the plain run", run="plain"))
        else:
            for r, lst in enumerate(per_proc):
                counts[f"plain r{r}"] = len(lst)
            kept = [d for lst in per_proc for d in lst[warmup:]]
            if kept:
                plain_stats = Stats.of(kept)
            else:
                result.mismatches.append(Mismatch("plain", label, f"no plain call left after {warmup} warm-up call(s)", run="plain"))
    if len(set(counts.values())) > 1:
        detail = ", ".join(f"{k}: {v}" for k, v in counts.items())
        result.mismatches.append(Mismatch("invocations", label, f"runs made different numbers of calls ({detail})"))
    reference = ref_calls[min(warmup, len(ref_calls) - 1)]
    ref_samples = collected[deepest][0].samples.get(mk, {})
    estimates: list[SpanEstimate] = []
    for pk, span in reference.spans.items():
        source = result.source_of(span.level)
        full_samples = ref_samples.get(pk) or [span.duration_ns]
        src_samples = collected[source][0].samples.get(mk, {}).get(pk)
        if src_samples:
            estimates.append(SpanEstimate(pk, span.name, span.level, source, Stats.of(src_samples), Stats.of(full_samples)))
        else:
            estimates.append(SpanEstimate(pk, span.name, span.level, None, Stats.of(full_samples), Stats.of(full_samples), matched=False))
            result.mismatches.append(
                Mismatch(
                    "missing",
                    label,
                    f"not found in the {source.label} run; keeps its {deepest.label}-run latency",
                    span.level.label,
                    source.label,
                    path_label(pk),
                )
            )
    ref_keys = set(reference.spans)
    for lv in result.levels[:-1]:
        own = collected[lv][0].samples.get(mk, {})
        call = _first_kept(collected[lv][1], mk, warmup)
        if call is None:
            continue
        for pk, span in call.spans.items():
            if pk in ref_keys or result.source_of(span.level) != lv:
                continue
            if pk in own:
                result.mismatches.append(
                    Mismatch(
                        "extra",
                        label,
                        f"in the {lv.label} run but not in the reference ({deepest.label}) run",
                        span.level.label,
                        lv.label,
                        path_label(pk),
                    )
                )
    levels = _level_times(result, mk, reference, collected)
    ratios = _round_ratios(plain.get(mk) if plain is not None else None, collected[result.source_of(Level.MODEL)][1], mk, warmup)
    return ModelResult(mk, label, plain_stats, levels, estimates, counts, reference, ratios)


def _round_ratios(
    plain_runs: list[list[int]] | None, model_runs: list[dict[ModelKey, list[Invocation]]], mk: ModelKey, warmup: int
) -> list[float]:
    """Per round: median model latency in the model-level run / median plain latency.

    Plain processes and level runs are listed in round order (one of each per
    round), so the i-th of each ran back to back.
    """
    ratios = []
    for plain_calls, inv in zip(plain_runs or [], model_runs):
        kept_plain = plain_calls[warmup:]
        traced = [c.root.duration_ns for c in inv.get(mk, [])[warmup:]]
        if kept_plain and traced and statistics.median(kept_plain) > 0:
            ratios.append(statistics.median(traced) / statistics.median(kept_plain))
    return ratios


def _first_kept(invs: list[dict[ModelKey, list[Invocation]]], mk: ModelKey, warmup: int) -> Invocation | None:
    for inv in invs:
        calls = inv.get(mk)
        if calls:
            return calls[min(warmup, len(calls) - 1)]
    return None


def _level_spans(reference: Invocation) -> tuple[dict[Level, list[PathKey]], dict[Level, list[PathKey]]]:
    """Per level, the reference's outermost and innermost spans of that level."""
    outer: dict[Level, list[PathKey]] = {}
    inner: dict[Level, list[PathKey]] = {}
    has_same_level_below: set[PathKey] = set()
    for pk, span in reference.spans.items():
        for i in range(1, len(pk)):
            anc = reference.spans.get(pk[:i])
            if anc is not None and anc.level == span.level:
                has_same_level_below.add(pk[:i])
    for pk, span in reference.spans.items():
        if span.level not in HIERARCHY:
            continue
        if not any(reference.spans[pk[:i]].level == span.level for i in range(1, len(pk)) if pk[:i] in reference.spans):
            outer.setdefault(span.level, []).append(pk)
        if pk not in has_same_level_below:
            inner.setdefault(span.level, []).append(pk)
    return outer, inner


def _sum_in(samples: dict[PathKey, list[int]], keys: list[PathKey]) -> tuple[float, int]:
    total = 0.0
    missing = 0
    for pk in keys:
        s = samples.get(pk)
        if s:
            total += trimmed_mean(s)
        else:
            missing += 1
    return total, missing


def _level_times(
    result: LeveledResult,
    mk: ModelKey,
    reference: Invocation,
    collected: dict[Level, tuple[_RunSamples, list[dict[ModelKey, list[Invocation]]]]],
) -> list[LevelTime]:
    outer, inner = _level_spans(reference)
    rows = []
    for level in sorted(inner):
        keys = inner[level] if level == Level.LAYER else outer[level]
        lt = LevelTime(level, result.source_of(level), len(keys))
        for run_level in result.levels:
            if run_level < level:
                continue
            samples = collected[run_level][0].samples.get(mk, {})
            for chosen, into in ((outer[level], lt.outer_by_run_ns), (inner[level], lt.inner_by_run_ns)):
                total, missing = _sum_in(samples, chosen)
                if missing < len(chosen):
                    into[run_level] = total
            total, missing = _sum_in(samples, keys)
            if missing < len(keys):
                lt.by_run_ns[run_level] = total
            lt.missing[run_level] = missing
        rows.append(lt)
    return rows


# -- the leveled trace -----------------------------------------------------------


def build_leveled_run(result: LeveledResult, runs: dict[Level, list[Run]], path: Path) -> Run:
    """One invocation per model, every span lasting its overhead-free estimate.

    Spans keep the reference run's ids, names, levels, tracks and attributes,
    plus ``mltrace.leveled.*`` attributes: ``estimate_ns``, ``median_ns``,
    ``stdev_ns``, ``samples``, ``source_level``, ``full_trace_ns`` (latency in
    the naive full trace), ``matched`` and, when children had to be scaled,
    ``fit_scale``. Also fills ``result.overflows``.

    Children on their parent's track are laid out in call order inside it, the parent's
    remaining time spread over the gaps in proportion to the reference run's gaps; children
    whose estimates add up to more than the parent's are scaled down to fit. A span with
    spans of its own level nested in it (a container layer such as ``nn.Sequential``) is
    drawn as long as its children (``sized_by_children``): its measured latency carries
    their instrumentation, which no shallower run removes.

    Args:
        result: from ``analyze``.
        runs: the runs passed to ``analyze``.
        path: the directory the run will be written to (``Run.path``).
    """
    ref_run = runs[result.deepest][0]
    meta = json.loads(json.dumps(ref_run.meta, default=str))
    for k in ("summary", "correlation", "truncated_spans", "exit_status"):
        meta.pop(k, None)
    meta["kind"] = "leveled"
    spans: list[Span] = []
    result.overflows.clear()
    cursor: int | None = None
    for m in result.models:
        ests = {e.path: e for e in m.spans}
        ref = m.reference
        kids = _children(ref.spans.values())
        start = ref.root.start_ns if cursor is None else cursor
        lengths = _lengths(ref, ests)
        root_pk = ((ref.root.name, 0),)
        placed: list[Span] = []
        _place(m.label, ref.root, root_pk, float(start), lengths[root_pk], None, None, kids, ests, lengths, placed, result.overflows, 1.0)
        spans.extend(placed)
        end = max(s.end_ns for s in placed)
        cursor = end + max(1000, (end - start) // 20)  # a visible gap between models
    ids = {s.id for s in spans}
    track_ids = {s.track_id for s in spans}
    tracks: dict[int, Track] = {t: ref_run.tracks[t] for t in track_ids if t in ref_run.tracks}
    flows = [f for f in ref_run.flows if f.from_span in ids and f.to_span in ids]
    spans.sort(key=lambda s: (s.start_ns, -s.end_ns, s.id))
    return Run(path=path, meta=meta, tracks=tracks, spans=spans, flows=flows)


def _place(
    model: str,
    span: Span,
    pk: PathKey,
    start: float,
    duration: float,
    parent_id: int | None,
    bounds: tuple[int, int] | None,
    kids: dict[int, list[Span]],
    ests: dict[PathKey, SpanEstimate],
    lengths: dict[PathKey, float],
    out: list[Span],
    overflows: list[Overflow],
    fit_scale: float,
) -> None:
    s_ns = round(start)
    e_ns = round(start + duration)
    if bounds is not None:  # rounding must not push a child outside its parent
        s_ns = min(max(s_ns, bounds[0]), bounds[1])
        e_ns = min(max(e_ns, s_ns), bounds[1])
    est = ests[pk]
    attrs = dict(span.attrs)
    attrs.update(
        {
            "mltrace.leveled.estimate_ns": round(est.stats.mean_ns),
            "mltrace.leveled.median_ns": round(est.stats.median_ns),
            "mltrace.leveled.stdev_ns": round(est.stats.stdev_ns),
            "mltrace.leveled.samples": est.stats.n,
            "mltrace.leveled.source_level": est.source.label if est.source is not None else None,
            "mltrace.leveled.full_trace_ns": round(est.full.mean_ns),
            "mltrace.leveled.matched": est.matched,
        }
    )
    if fit_scale < 1.0:
        attrs["mltrace.leveled.fit_scale"] = round(fit_scale, 4)
    if lengths[pk] != est.stats.mean_ns:
        attrs["mltrace.leveled.sized_by_children"] = True
    out.append(Span(span.id, parent_id, span.level, span.name, s_ns, e_ns, span.track_id, attrs))
    children = kids.get(span.id, [])
    if not children:
        return
    seen: dict[str, int] = {}
    keyed: list[tuple[Span, PathKey]] = []
    for c in children:
        k = seen.get(c.name, 0)
        seen[c.name] = k + 1
        keyed.append((c, (*pk, (c.name, k))))
    same = [(c, ck) for c, ck in keyed if c.track_id == span.track_id]
    other = [(c, ck) for c, ck in keyed if c.track_id != span.track_id]
    if same:
        laid = e_ns - s_ns
        child_est = [lengths[ck] for _, ck in same]
        total = sum(child_est)
        gaps = [max(0, same[0][0].start_ns - span.start_ns)]
        for (a, _), (b, _) in zip(same, same[1:]):
            gaps.append(max(0, b.start_ns - a.end_ns))
        gaps.append(max(0, span.end_ns - same[-1][0].end_ns))
        slack = laid - total
        scale = 1.0
        if slack >= -1.0:  # within rounding (1 ns): it fits
            slack = max(0.0, slack)
            g_total = sum(gaps)
            new_gaps = [slack * g / g_total for g in gaps] if g_total else [slack / len(gaps)] * len(gaps)
        else:
            scale = laid / total if total else 1.0
            new_gaps = [0.0] * len(gaps)
            if lengths[pk] < total - 1.0:  # not merely the scale an ancestor passed down
                overflows.append(Overflow(model, path_label(pk), lengths[pk], total))
        t = float(s_ns)
        for i, ((c, ck), d) in enumerate(zip(same, child_est)):
            t += new_gaps[i]
            child_scale = scale if scale < 1 else 1.0  # laid / estimate of each child
            _place(model, c, ck, t, d * scale, span.id, (s_ns, e_ns), kids, ests, lengths, out, overflows, child_scale)
            t += d * scale
    ratio = (e_ns - s_ns) / span.duration_ns if span.duration_ns else 1.0
    for c, ck in other:
        # Another track (a GPU stream, a worker thread): keep its relative offset, scaled.
        cs = s_ns + (c.start_ns - span.start_ns) * ratio
        _place(model, c, ck, cs, lengths[ck], span.id, None, kids, ests, lengths, out, overflows, 1.0)


def _lengths(ref: Invocation, ests: dict[PathKey, SpanEstimate]) -> dict[PathKey, float]:
    """How long each span is drawn (ns): its estimate, or, for a span with spans of its own
    level inside it on its track (a container layer), the sum of its children's lengths —
    its own measurement carries the instrumentation of those nested spans."""
    children: dict[PathKey, list[PathKey]] = {}
    for pk in ref.spans:
        if len(pk) > 1:
            children.setdefault(pk[:-1], []).append(pk)
    lengths: dict[PathKey, float] = {}
    for pk in reversed(list(ref.spans)):  # depth-first order reversed: children before parents
        span = ref.spans[pk]
        same_track = [c for c in children.get(pk, ()) if ref.spans[c].track_id == span.track_id]
        if any(ref.spans[c].level == span.level for c in same_track):
            lengths[pk] = sum(lengths[c] for c in same_track)
        else:
            lengths[pk] = ests[pk].stats.mean_ns
    return lengths


__all__ = [
    "TRIM",
    "Invocation",
    "LeveledResult",
    "LevelTime",
    "Mismatch",
    "ModelResult",
    "Overflow",
    "SpanEstimate",
    "Stats",
    "analyze",
    "build_leveled_run",
    "invocations",
    "load_plain_timings",
    "model_key",
    "model_label",
    "path_label",
    "trimmed_mean",
]
