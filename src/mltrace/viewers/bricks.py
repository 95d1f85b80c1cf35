"""Draws a DLBricks report (``mltrace.analysis.bricks``) as plain-text tables."""

from __future__ import annotations

import math
import sys
from typing import IO

from mltrace.analysis.bricks import BrickSet, BricksReport


def brick_counts(bset: BrickSet) -> dict[str, int]:
    """Total and unique layer and sequence counts over every model."""
    return {
        "models": len(bset.models),
        "layers_total": bset.total_layers,
        "layers_unique": len(bset.bricks),
        "sequences_total": bset.total_sequences,
        "sequences_unique": len(bset.sequences),
    }


def _ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


#: Widest model column; longer labels are cut in the middle, keeping their run's name.
MAX_LABEL = 72


def fit_label(label: str, width: int) -> str:
    """The label cut to ``width`` characters, keeping a trailing ``[run]`` that names its run
    apart from another run's model of the same label."""
    if len(label) <= width:
        return label
    head, sep, tail = label.rpartition(" [")
    if not sep or len(tail) + 3 >= width:
        return label[: width - 1] + "…"
    return head[: width - len(tail) - 3] + "… [" + tail


def print_counts(bset: BrickSet, file: IO[str] | None = None) -> None:
    """Prints total and unique layer (and sequence) counts per model and overall."""
    out = file or sys.stdout
    c = brick_counts(bset)
    out.write(f"{c['models']} model(s): {c['layers_total']} leaf-layer calls, {c['layers_unique']} unique layer bricks")
    if bset.granularity > 1:
        out.write(f"; {c['sequences_total']} sequences of up to {bset.granularity} layers, {c['sequences_unique']} unique")
    out.write("\n")
    for m in bset.models:
        out.write(f"  {m.model}: {len(m.layers)} layers, {len({lc.brick for lc in m.layers})} unique")
        if m.parallel:
            out.write(" (parallel branches)")
        out.write("\n")
    inferred = sum(1 for b in bset.bricks if b.config_source == "inferred")
    none = [b.type for b in bset.bricks if b.config_source == "none"]
    out.write(f"constructor arguments: {inferred} inferred from shapes and parameters, {len(bset.bricks) - inferred - len(none)} recorded")
    out.write(f", {len(none)} unknown ({', '.join(sorted(set(none)))})\n" if none else "\n")


#: How the report names each basis.
BASIS_NAMES = {
    "cpu": "thread CPU time (one intra-op thread: the calling thread's CPU time is the work, not stretched by preemption)",
    "wall": "wall clock",
}


def print_report(report: BricksReport, file: IO[str] | None = None) -> None:
    """Prints counts, constructed (bricks + glue) vs measured per model on the chosen basis
    (the other basis's ratio beside it where it could be had), the machine's state while the
    bricks ran, one line saying why the wall clock was not used or not to be trusted, and the
    benchmarking-time speedup."""
    out = file or sys.stdout
    print_counts(report.set, out)
    threads = report.extra.get("threads")
    choice = report.choice
    out.write(
        f"\nbricks on {report.runtime}, {report.extra.get('cache', 'cold')} cache"
        + (f", {threads} thread(s)" if threads else "")
        + f", {report.statistic} of {report.n} calls after {report.warmup}\n"
    )
    out.write(f"basis: {BASIS_NAMES[choice.basis]}\n")
    other = report.other
    other_head = f" {other[0].basis + ' ratio':>10}" if other else ""
    width = min(MAX_LABEL, max([40, *(len(c.model) for c in report.constructions)]))
    columns = f"{'measured':>11} {'bricks':>11} {'glue':>10} {'faults':>10} {'constructed':>12} {'ratio':>7}"
    out.write(f"{'model':<{width}} {columns}{other_head}  method\n")
    for i, c in enumerate(report.constructions):
        ratio = "-" if math.isnan(c.ratio) else f"{c.ratio:.3f}" + ("" if choice.trusted else "?")
        other_ratio = f" {_ratio(other[i].ratio):>10}" if other else ""
        note = f" ({c.from_trace} layer(s) from the trace)" if c.from_trace else ""
        out.write(
            f"{fit_label(c.model, width):<{width}} {c.measured_ns / 1e6:>8.3f} ms {c.bricks_ns / 1e6:>8.3f} ms "
            f"{c.glue_ns / 1e6:>7.3f} ms {c.faults_ns / 1e6:>7.3f} ms "
            f"{c.constructed_ns / 1e6:>9.3f} ms {ratio:>7}{other_ratio}  {c.method}{note}\n"
        )
    out.write("glue: a model's time in no leaf layer (code between layers), from the trace\n")
    cost = report.extra.get("fault_cost_ns")
    if cost is not None:
        per_call = ", ".join(f"{c.extra_faults:.0f}" for c in report.constructions if c.extra_faults is not None)
        out.write(
            f"faults: minor page faults a model call took beyond its bricks' ({per_call or 'not recorded'}), "
            f"at {cost / 1e3:.2f} µs each (measured here)\n"
        )
    if report.machine is not None:
        out.write(f"machine: {report.machine.summary()}\n")
    if choice.why:
        out.write(f"{'note' if choice.trusted else 'warning'}: {choice.why}\n")
    sp = report.speedup
    out.write(
        f"\nbenchmarking-time speedup: {'-' if math.isnan(sp) else f'{sp:.2f}x'} "
        f"(every model end to end: {report.end_to_end_cost_ns / 1e9:.3f} s; unique bricks: {report.bricks_cost_ns / 1e9:.3f} s; "
        f"{report.warmup + report.n} calls each); wall time spent on bricks, with construction: {report.bench_wall_s:.2f} s\n"
    )
    failed = [(b, t) for b, t in zip(report.set.bricks, report.timings) if t.median_ns is None]
    if failed:
        out.write(f"{len(failed)} brick(s) could not run alone (their traced latency was used):\n")
        for b, t in failed[:8]:
            out.write(f"  {b.type}: {t.error}\n")
