"""The report as plain data (dicts, lists, numbers, strings): what ``--format json``
prints and what the Markdown report is drawn from.

The shape is the "Report JSON" schema of docs/CONVENTIONS.md (``REPORT_SCHEMA`` in
``analysis.report_schema``); keys are stable. Paths are as recorded (absolute where the
program ran); viewers shorten them for display.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

from mltrace.analysis.bottleneck import Analysis, Findings, Idle, LayerRow, NameRow, TypeRow, Verdict
from mltrace.analysis.breakdown import layers_named_by_model
from mltrace.analysis.codepaths import source_line, split_location
from mltrace.analysis.coldstart import KindCalls, ModelCalls, call_durations, kind_parts, percentile_ns
from mltrace.analysis.memory import MemoryReport, MemoryRow

__all__ = ["build_report", "call_durations", "exit_cause", "exit_text", "findings", "hot_lines", "percentile_ns"]
from mltrace.analysis.peaks import Peaks
from mltrace.analysis.units import fmt_ns
from mltrace.run.levels import Level
from mltrace.run.store import Run

#: Bumped when a key changes meaning or goes away (new keys do not bump it).
SCHEMA_VERSION = 1


def build_report(run: Run, a: Analysis) -> dict[str, Any]:
    """The whole report of a run as plain data (the "Report JSON" schema).

    Args:
        run: the run.
        a: its analysis (``analysis.bottleneck.analyze``).

    Returns:
        ``{"run", "models", "layers", "ops", "types", "findings", "generate", "memory",
        "requests", "ranks", "processes"}``; times in ns, memory in bytes.
    """
    rows = [r for r in a.layers if r.stat.level in (Level.MODEL, Level.LAYER)]
    layer_rows = [r for r in rows if r.stat.level is Level.LAYER]
    hot = hot_lines(a.tables_run(run), [r.stat.name for r in layer_rows])
    mem = a.memory
    mem_layers = {r.name: r for r in mem.layers if r.level is Level.LAYER} if mem is not None else {}
    mem_ops = {r.name: r for r in mem.ops} if mem is not None else {}
    return {
        "run": _run_entry(run, a),
        "models": [_model_entry(run, r, a.cold.model(r.stat.name)) for r in rows if r.stat.level is Level.MODEL],
        "layers": [_layer_entry(r, hot.get(r.stat.name, [])) | _memory_of(mem_layers.get(r.stat.name)) for r in layer_rows],
        "ops": [_op_entry(r) | _memory_of(mem_ops.get(r.name)) for r in a.ops],
        "types": [_type_entry(t) for t in a.types],
        "findings": findings(a),
        "generate": [g.as_dict() for g in a.generation],
        "memory": _memory_entry(mem),
        "requests": a.requests.as_dict() if a.requests is not None else None,
        "ranks": a.ranks.as_dict() if a.ranks is not None else None,
        "processes": [p.as_dict() for p in a.processes] if a.processes is not None else None,
    }


def _memory_of(row: MemoryRow | None) -> dict[str, int | None]:
    """A layer's or op's ``alloc_bytes`` and ``peak_alloc_bytes`` (null where not recorded)."""
    if row is None:
        return {"alloc_bytes": None, "peak_alloc_bytes": None}
    return {"alloc_bytes": row.alloc_bytes, "peak_alloc_bytes": row.peak_bytes}


def _memory_entry(mem: MemoryReport | None) -> dict[str, Any] | None:
    """The run's memory peaks per device (null for a run recorded without ``--memory``)."""
    if mem is None:
        return None
    keys = ("track", "device", "bytes", "ts_ns", "layer", "samples")
    return {"peaks": [{k: getattr(p, k) for k in keys} for p in mem.peaks]}


def hot_lines(run: Run, names: list[str]) -> dict[str, list[tuple[str, int]]]:
    """Per layer name, its ``ml.source.hot_lines`` summed over its calls, hottest first:
    ``[("path:line function", ns), …]`` (empty for layers that were not sampled)."""
    import numpy as np

    t = layers_named_by_model(run).table  # the names analyze() gives the layers
    index = {nm: i for i, nm in enumerate(t.names)}
    is_layer = t.level.astype(np.int64) == int(Level.LAYER)
    out: dict[str, list[tuple[str, int]]] = {}
    for name in names:
        ni = index.get(name)
        if ni is None:
            continue
        calls = np.nonzero(is_layer & (t.name == ni))[0]
        sets, counts = np.unique(t.attr[calls], return_counts=True)
        per: dict[str, int] = {}
        for k, times in zip(sets.tolist(), counts.tolist()):
            lines = t.attr_set(k).get("ml.source.hot_lines")
            for item in lines if isinstance(lines, list) else ():
                if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], int):
                    per[item[0]] = per.get(item[0], 0) + item[1] * times
        if per:
            out[name] = sorted(per.items(), key=lambda kv: (-kv[1], kv[0]))
    return out


def _loc(path: object, line: object) -> str | None:
    """``path:line`` as recorded, or None when the path is missing or not text."""
    if not isinstance(path, str) or not path:
        return None
    return f"{path}:{line}" if isinstance(line, int) and not isinstance(line, bool) else path


def _verdict(v: Verdict | None) -> tuple[str | None, str | None]:
    return (v.bound.value, v.reason) if v is not None else (None, None)


def _peaks_entry(p: Peaks) -> dict[str, Any]:
    return {
        "device": p.device,
        "name": p.name,
        "flops_per_s": p.flops_per_s,
        "half_flops_per_s": p.half_flops_per_s or None,
        "bytes_per_s": p.bytes_per_s,
        "memory_bytes_per_s": p.memory_bytes_per_s or None,
        "source": p.source,
        "note": p.note or None,
    }


def _run_entry(run: Run, a: Analysis) -> dict[str, Any]:
    b, meta = a.breakdown, run.meta
    peaks = [] if a.peaks is None else [_peaks_entry(p) for p in (a.peaks.cpu, a.peaks.gpu) if p is not None]
    command = meta.get("command")
    return {
        "schema_version": SCHEMA_VERSION,
        "name": str(meta.get("name") or run.path.name),
        "path": str(run.path),
        "run_id": str(meta["run_id"]) if meta.get("run_id") else None,
        "complete": run.complete,
        "command": [str(x) for x in command] if isinstance(command, list) else None,
        "spans": b.span_count,
        "model_calls": b.model_calls,
        "model_ns": b.model_ns,
        "wall_ns": b.wall_ns,
        "levels": [{"level": lt.level.label, "spans": lt.spans, "time_ns": lt.time_ns} for lt in b.levels],
        "peaks": peaks,
        "include_cold": a.include_cold,
        "counts_note": a.counts_note(),
        "cold_calls": a.cold.cold_calls,
        "cold_ns": a.cold.cold_ns,
        "cold_spent": [{"name": x.name, "category": x.category or None, "ns": x.ns} for x in a.cold.spent],
        "unfollowed": unfollowed(meta),
        "torch_ranges": {
            "kinds": [{"kind": kind, "count": count, "ns": ns} for kind, (count, ns) in sorted(a.torch_ranges.items())],
            "text": a.torch_ranges_text(),
        },
        "unscoped_ops": {"count": a.unscoped_ops[0], "ns": a.unscoped_ops[1], "text": a.unscoped_text()},
        "compile_ops": {"count": a.compile_ops[0], "ns": a.compile_ops[1], "text": a.compile_text()},
        "exit": {
            "status": meta["exit_status"] if isinstance(meta.get("exit_status"), int) else None,
            "cause": exit_cause(meta) or None,
            "text": exit_text(meta),
        },
    }


#: The longest cause a report repeats (``SystemExit`` carries the program's whole message).
_CAUSE_MAX = 80


def _exit_status(meta: dict[str, Any]) -> int:
    """run.json's exit status, 0 where it does not say."""
    status = meta.get("exit_status")
    return status if isinstance(status, int) and not isinstance(status, bool) else 0


def exit_cause(meta: dict[str, Any]) -> str:
    """Why the program ended with a status other than 0, where run.json says ("" otherwise):
    its ``exit_cause`` (cut at ``_CAUSE_MAX`` characters), or ``os._exit``."""
    if _exit_status(meta) == 0:
        return ""
    cause = str(meta.get("exit_cause") or ("os._exit" if meta.get("exit_via") == "os._exit" else ""))
    return cause if len(cause) <= _CAUSE_MAX else cause[: _CAUSE_MAX - 1] + "…"


def exit_text(meta: dict[str, Any]) -> str:
    """How the traced program ended, where it did not end with status 0 ("" otherwise, and
    where run.json does not say): its status or the signal that ended it, and why where known
    (``exit_cause``) and not the signal's name again."""
    status = _exit_status(meta)
    if status == 0:
        return ""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        ended = f"was ended by {name}"
    else:
        name, ended = "", f"exited with status {status}"
    cause = exit_cause(meta)
    why = f" ({cause})" if cause and cause != name else ""
    return f"The program {ended}{why}: the trace holds what ran until then."


def unfollowed(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """run.json's children that could not be followed: ``{"pid", "argv", "reason"}`` each."""
    out = []
    for note in meta.get("unfollowed") or []:
        if isinstance(note, dict):
            pid, argv = note.get("pid"), note.get("argv")
            out.append(
                {
                    "pid": pid if isinstance(pid, int) else None,
                    "argv": [str(x) for x in argv] if isinstance(argv, list) else [],
                    "reason": str(note.get("reason") or ""),
                }
            )
    return out


def _model_entry(run: Run, r: LayerRow, calls: ModelCalls | None) -> dict[str, Any]:
    """A model's entry: ``calls`` and ``total_ns`` over every call, cold or steady."""
    x = r.stat
    source = _loc(x.file, x.line)
    if source is None:  # runs before call sites: the model span names its caller in ml.call.*
        attrs = _first_attrs(run, x.name, Level.MODEL)
        source = _loc(attrs.get("ml.call.file.path"), attrs.get("ml.call.line.number"))
    if calls is None:  # not a model span of this run's table (cannot happen for a loaded run)
        calls = ModelCalls(x.name, [])
    return {
        "name": x.name,
        "type": x.type,
        "calls": len(calls.durations) or x.calls,
        "total_ns": sum(calls.durations) or x.total_ns,
        "cold_calls": len(calls.cold),
        "cold_ns": calls.cold_ns,
        "cold_indices": list(calls.cold),
        "failed_calls": len(calls.failed),
        "failed_indices": list(calls.failed),
        "steady_median_ns": calls.steady_median_ns,
        "steady_p90_ns": calls.steady_p90_ns,
        "kinds": [_kind_entry(k) for k in calls.by_kind()],
        "one_time": [{"category": cat, "names": names} for cat, names in calls.one_time.items()],
        "source": source,
    }


def _kind_entry(k: KindCalls) -> dict[str, Any]:
    """One kind of a model's calls: its name as the report writes it (``kind_label``) and its parts
    (``coldstart.kind_parts``: null where the kinds do not differ by it), its calls and their total
    time, cold and failed calls, and its steady calls' median and p90."""
    how, mode, batch = kind_parts(k.kind)
    return {
        "kind": kind_label(k.kind),
        "call": how or None,
        "mode": mode or None,
        "batch": batch,
        "calls": k.calls,
        "total_ns": k.total_ns,
        "cold_calls": k.cold,
        "failed_calls": k.failed,
        "steady_median_ns": k.steady_median_ns,
        "steady_p90_ns": k.steady_p90_ns,
    }


def _first_attrs(run: Run, name: str, level: Level) -> dict[str, Any]:
    import numpy as np

    t = run.table
    index = {nm: i for i, nm in enumerate(t.names)}
    if name not in index:
        return {}
    rows = np.nonzero((t.name == index[name]) & (t.level.astype(np.int64) == int(level)))[0]
    return t.attrs(int(rows[0])) if len(rows) else {}


def _layer_entry(r: LayerRow, hot: list[tuple[str, int]]) -> dict[str, Any]:
    x = r.stat
    bound, why = _verdict(r.verdict)
    text = source_line(x.file, x.line)
    return {
        "name": x.name,
        "type": x.type,
        "calls": x.calls,
        "total_ns": x.total_ns,
        "self_ns": x.self_ns,
        "median_ns": r.median_ns,
        "p90_ns": r.p90_ns,
        "source": _loc(x.file, x.line),
        "source_text": text or None,
        "defined": _loc(x.defined_file, x.defined_line),
        "flops": r.flops,
        "bytes": r.bytes,
        "achieved_flops_per_s": r.achieved_flops,
        "peak_share": r.peak_share,
        "verdict": bound,
        "why": why,
        "hot_lines": [_hot_entry(loc, ns) for loc, ns in hot],
        "gc_self_ns": r.gc.ns if r.gc is not None else 0,
        "gc_total_ns": r.gc_within.ns if r.gc_within is not None else 0,
    }


def _type_entry(t: TypeRow) -> dict[str, Any]:
    """A layer type's entry: what its calls do themselves (``TypeRow``), as the report's table."""
    bound, why = _verdict(t.verdict)
    return {
        "type": t.type,
        "calls": t.calls,
        "total_ns": t.total_ns,
        "self_ns": t.self_ns,
        "flops": t.flops,
        "bytes": t.bytes,
        "verdict": bound,
        "why": why,
    }


def _hot_entry(loc: str, ns: int) -> dict[str, Any]:
    path, line, function = split_location(loc)
    return {"line": _loc(path, line), "function": function, "ns": ns}


def _op_entry(r: NameRow) -> dict[str, Any]:
    bound, why = _verdict(r.verdict)
    return {
        "name": r.name,
        "calls": r.calls,
        "total_ns": r.total_ns,
        "self_ns": r.self_ns,
        "mean_ns": round(r.mean_ns),
        "flops": r.flops,
        "device_ns": r.device_ns,
        "achieved_flops_per_s": r.achieved_flops,
        "peak_share": r.peak_share,
        "verdict": bound,
        "why": why,
    }


def findings(a: Analysis) -> list[dict[str, Any]]:
    """The run-wide findings, each ``{"kind", "text", …numbers}`` (kinds: ``cold_start``, ``call_kinds``, ``bound``,
    ``idle``, ``generate``, ``cpu_vs_gpu``, ``data_movement``, ``framework_overhead``, ``note``)."""
    f = a.findings
    out = _cold_finding(a) + _kinds_finding(a) + _bound_finding(f) + [_idle_finding(idle) for idle in f.idle]
    out += [{"kind": "generate", "text": g.text(), "ttft_ns": g.ttft_ns, "tpot_median_ns": g.tpot_median_ns} for g in a.generation]
    if f.device_ns and f.cpu_ns:
        text = f"CPU time {fmt_ns(f.cpu_ns)} vs GPU busy {fmt_ns(f.device_ns)}: ratio {f.cpu_ns / f.device_ns:.2f}"
        out.append({"kind": "cpu_vs_gpu", "text": text, "cpu_ns": f.cpu_ns, "device_ns": f.device_ns})
    if f.data_movement_base_ns:
        top = ", ".join(f"{x.name} {fmt_ns(x.total_ns)}" for x in f.data_movement_top[:3])
        text = f"Data movement: {fmt_ns(f.data_movement_ns)} ({_share(f.data_movement_ns, f.data_movement_base_ns)} of op+GPU time)"
        text += f" — {top}" if top else ""
        out.append({"kind": "data_movement", "text": text, "ns": f.data_movement_ns, "base_ns": f.data_movement_base_ns})
    if f.framework_ns is not None:
        share = _share(f.framework_ns, f.framework_base_ns)
        text = f"Framework overhead (layer time not covered by ops): {fmt_ns(f.framework_ns)} ({share} of model time)"
        out.append({"kind": "framework_overhead", "text": text, "ns": f.framework_ns, "base_ns": f.framework_base_ns})
    return out + [{"kind": "note", "text": note} for note in f.notes]


def cold_start_text(a: Analysis, *, name: Callable[[str], str] = str, text: Callable[[str], str] = str, p90: bool = False) -> str:
    """The cold-start finding in words: the cold calls, per model against its steady calls, and
    where their extra time went. The viewers give ``name`` (how a model's or a span's name is
    written) and ``text`` (how other text is escaped); ``p90`` adds each model's steady p90."""
    per_model = [
        f"{name(m.name)} {len(m.cold)} of {len(m.durations)} ({text(fmt_ns(m.cold_ns))}; steady median {_steady_text(m, text, p90)})"
        for m in a.cold.models
        if m.cold
    ]
    spent = ", ".join(f"{name(x.name)} +{text(fmt_ns(x.ns))}" + (f" ({text(x.category)})" if x.category else "") for x in a.cold.spent[:5])
    return f"Cold start: {text(a.cold_text())} — " + "; ".join(per_model) + (f". Extra time in: {spent}" if spent else "")


#: How the report names a part of a kind of model call (``coldstart.call_kinds``) where its name
#: would not read as words (``__call__`` would also turn bold in Markdown).
_KIND_LABELS = {"": "other calls", "__call__": "eager"}


#: What a model's row in a layer table says instead of a median or p90 that would mix its kinds of
#: call (``LayerRow.kinds``): each kind's row under it gives its own.
PER_KIND = "per kind"


def kind_label(kind: str) -> str:
    """A kind of model call as the report writes it: "train at batch 64", "eval", "eager at batch
    4", "batch 250"; "other calls" for the calls with none of the others' parts ("")."""
    how, mode, batch = kind_parts(kind)
    words = " ".join(w for w in (_KIND_LABELS.get(how, how) if how else "", mode) if w)
    if batch is None:
        return words or _KIND_LABELS[""]
    return f"{words} at batch {batch}" if words else f"batch {batch}"


def _steady_text(m: ModelCalls, text: Callable[[str], str], p90: bool) -> str:
    """A model's steady median (and p90), per kind of call when its steady calls are of
    several kinds (``predict 176.02 ms, __call__ 134.10 ms``): one median over a Keras model's
    graph and eager calls, or a prefill and its decode steps, would describe neither."""
    by_kind = m.steady_by_kind()
    parts = []
    for kind, durations in by_kind:
        median = text(fmt_ns(percentile_ns(durations, 50) or 0))
        tail = text(fmt_ns(percentile_ns(durations, 90) or 0))
        if len(by_kind) == 1:
            parts.append(median + (f", p90 {tail}" if p90 else ""))
        else:
            parts.append(f"{text(kind_label(kind))} {median}" + (f" (p90 {tail})" if p90 else ""))
    return ", ".join(parts)


def call_kinds_text(a: Analysis, *, name: Callable[[str], str] = str, text: Callable[[str], str] = str) -> str:
    """The models whose calls are of several kinds (``coldstart.call_kinds``: train and eval, batch
    sizes, a generate loop's prefill and decode, Keras's ways of calling), each kind's calls and its
    steady calls' median and p90: one median over all of them would describe none. "" where every
    model's calls are of one kind. ``name`` and ``text`` as for ``cold_start_text``."""
    per_model = []
    for m in a.cold.models:
        kinds = m.by_kind()
        if kinds:
            per_model.append(f"{name(m.name)} — " + "; ".join(_kind_text(k, text) for k in kinds))
    return "Model calls of several kinds, each kind's steady median: " + ". ".join(per_model) if per_model else ""


def _kind_text(k: KindCalls, text: Callable[[str], str]) -> str:
    """ "train at batch 64, 60 calls: 25.00 ms (p90 30.00 ms)"; the cold and failed calls named."""
    calls = f"{k.calls} {'call' if k.calls == 1 else 'calls'}"
    apart = ", ".join(f"{n} {what}" for n, what in ((k.cold, "cold"), (k.failed, "failed")) if n)
    head = text(f"{kind_label(k.kind)}, {calls}" + (f" ({apart})" if apart else ""))
    median, tail = k.steady_median_ns, k.steady_p90_ns
    if median is None or tail is None:
        return f"{head}: no steady call"
    return f"{head}: {text(fmt_ns(median))} (p90 {text(fmt_ns(tail))})"


def _kinds_finding(a: Analysis) -> list[dict[str, Any]]:
    """The models whose calls are of several kinds (``call_kinds_text``)."""
    text = call_kinds_text(a)
    return [{"kind": "call_kinds", "text": text}] if text else []


def _cold_finding(a: Analysis) -> list[dict[str, Any]]:
    """The cold calls: how many, per model against its steady median, and what they spent time on."""
    if not a.cold_text():
        return []
    text = cold_start_text(a)
    return [{"kind": "cold_start", "text": text, "calls": a.cold.cold_calls, "ns": a.cold.cold_ns, "included": a.include_cold}]


def _share(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _bound_finding(f: Findings) -> list[dict[str, Any]]:
    """The verdicts' shares of the time (none when no verdict holds any): "Mostly" where the
    dominant verdict holds more than half of it, else "Mixed" and the largest known verdict."""
    total = sum(f.bound_ns.values())
    if not total:
        return []
    shares = {bound.value: ns for bound, ns in sorted(f.bound_ns.items(), key=lambda kv: -kv[1]) if ns}
    text = ", ".join(f"{bound.split('-')[0]} {100 * ns / total:.0f}%" for bound, ns in shares.items())
    dominant = f.dominant
    lead = f"Mostly {dominant.value}" if f.mostly else f"Mixed, {dominant.value} the largest known"
    text = f"{lead} — share of {f.basis}: {text}"
    return [{"kind": "bound", "text": text, "dominant": f.dominant.value, "basis": f.basis, "ns": shares}]


def _idle_finding(idle: Idle) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "kind": "idle",
        "text": idle.headline(),
        "where": idle.where,
        "idle_ns": idle.idle_ns,
        "window_ns": idle.window_ns,
    }
    if idle.loading_ns:
        entry["loading_ns"] = idle.loading_ns
    if idle.ops_ns:
        entry["ops_ns"] = idle.ops_ns
    if idle.unrecorded_ns:
        entry["unrecorded_ns"] = idle.unrecorded_ns
    if idle.gaps:
        g = idle.gaps[0]
        entry["text"] += f"; largest {fmt_ns(g.duration_ns)} after {g.before} before {g.after}"
        entry["largest_gap"] = {"ns": g.duration_ns, "before": g.before, "after": g.after}
    if idle.tracer_ns:
        entry["text"] += idle.tracer_text()
        entry["tracer_ns"] = idle.tracer_ns
    return entry
