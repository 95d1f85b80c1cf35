"""Terminal rendering of the report and of a run diff (rich tables). Draws; computes nothing."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import IO, Any

from mltrace.analysis.bottleneck import Analysis, Bound, LayerRow, NameRow, Verdict
from mltrace.analysis.breakdown import Breakdown, LayerStat
from mltrace.analysis.codepaths import location, source_line, split_location
from mltrace.analysis.coldstart import left_out_note
from mltrace.analysis.diff import RunDiff
from mltrace.analysis.memory import MemoryReport
from mltrace.analysis.peaks import Peaks, bandwidth_text
from mltrace.analysis.report_data import PER_KIND, call_kinds_text, cold_start_text, exit_text, kind_label
from mltrace.analysis.summary import summarize
from mltrace.analysis.units import fmt_ns, fmt_si
from mltrace.run.levels import Level
from mltrace.run.metadata import limitations, unrecorded_levels
from mltrace.run.store import Run, load_run, read_meta

__all__ = ["fmt_ns", "fmt_si", "output_width", "print_run_summary", "render_diff", "render_report"]


def _stored_summary(run_dir: Path) -> dict[str, Any] | None:
    """run.json's summary of a finalized run, or None."""
    meta = read_meta(run_dir)
    summary = meta.get("summary")
    return summary if meta.get("complete") and isinstance(summary, dict) else None


def _short_path(path: object, line: object) -> str:
    """``path:line`` shortened (working directory, ``site-packages/``) but whole."""
    return location(path, line)


def _source_cell(path: object, line: object) -> str:
    """The call site ``path:line`` and, when the file is readable now, the line's code."""
    where = location(path, line)
    code = source_line(path, line) if where else ""
    return f"{_esc(where)}  [dim]{_esc(code)}[/dim]" if code else _esc(where)


def _esc(text: object) -> str:
    """Text shown as it is: rich markup in it (``[...]``) escaped."""
    from rich.markup import escape

    return escape(str(text))


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


#: Width of a report written to a pipe or file when neither ``--width`` nor ``COLUMNS``
#: says otherwise: no line is ever folded (tables are as wide as their content).
UNLIMITED_WIDTH = 100_000


def output_width(out: IO[str], width: int | None = None) -> int | None:
    """Columns to draw in: ``width`` if given, else ``COLUMNS``, else the terminal's
    (None: rich asks the terminal), else (a pipe, a file) ``UNLIMITED_WIDTH``."""
    if width:
        return width
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return None if out.isatty() else UNLIMITED_WIDTH


def _console(file: IO[str] | None, width: int | None = None) -> Any:
    from rich.console import Console

    out = file or sys.stdout
    return Console(file=out, width=output_width(out, width), highlight=False, soft_wrap=False)


def _table(title: str, columns: list[tuple[str, bool]]) -> Any:
    """A rich table whose cells wrap (folding words too long for the column), never "…".

    Args:
        title: the table's title.
        columns: (header, right-justified) per column.
    """
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for header, right in columns:
        table.add_column(header, justify="right" if right else "left", overflow="fold")
    return table


_BOUND_STYLE = {Bound.COMPUTE: "red", Bound.MEMORY: "blue", Bound.OVERHEAD: "yellow", Bound.UNKNOWN: "dim"}


def _verdict_text(v: Verdict | None) -> str:
    if v is None:
        return ""
    return f"[{_BOUND_STYLE[v.bound]}]{v.bound.short}[/]"


def _peaks_line(p: Peaks) -> str:
    extra = f"; {p.note}" if p.note else ""
    half = f", {fmt_si(p.half_flops_per_s, 'FLOP/s')} fp16/bf16" if p.half_flops_per_s else ""
    return (
        f"{p.device.upper()} {p.name}: {fmt_si(p.flops_per_s, 'FLOP/s')}{half}, {bandwidth_text(p)} "
        f"(ridge {p.ridge_for(None):.1f} FLOP/B; {p.source}{extra})"
    )


def render_report(run: Run, a: Analysis, top: int = 15, file: IO[str] | None = None, width: int | None = None) -> None:
    """Prints the bottleneck report: findings, levels, top layers with verdicts, aggregations.

    Nothing is cut: long cells wrap (``output_width`` says how wide the report is drawn).
    """
    console = _console(file, width)
    b = a.breakdown
    meta = run.meta
    title = f"mltrace report — {meta.get('name', run.path.name)}  ({run.path})"
    console.print(f"[bold]{title}[/bold]")  # type: ignore[attr-defined]
    if not run.complete:
        console.print("[yellow]run did not finish normally: events up to the last flush[/yellow]")  # type: ignore[attr-defined]
    ended = exit_text(meta)
    if ended:
        console.print(f"[yellow]{_esc(ended)}[/yellow]")  # type: ignore[attr-defined]
    console.print(  # type: ignore[attr-defined]
        f"{b.span_count} spans, {b.model_calls} model calls, model time {fmt_ns(b.model_ns)}, wall {fmt_ns(b.wall_ns)}" + a.counts_note()
    )
    if a.peaks is not None:
        console.print("[dim]Roofline peaks — " + _peaks_line(a.peaks.cpu) + "[/dim]")  # type: ignore[attr-defined]
        if a.peaks.gpu is not None:
            console.print("[dim]Roofline peaks — " + _peaks_line(a.peaks.gpu) + "[/dim]")  # type: ignore[attr-defined]
    _findings(console, a)
    _requests(console, a, top)
    _ranks(console, a)
    _processes(console, a)
    scoped = bool(a.unscoped_ops[0])  # then the % column counts only what ran in model calls and user spans
    cols = ("level", "spans", "time", *(("in model & user spans",) if scoped else ()), "% of model")
    lt = _table("Time per level", [(col, col != "level") for col in cols])
    for row in b.levels:
        in_scope = a.level_ns_in_scope.get(row.level, row.time_ns)
        cells = (fmt_ns(row.time_ns), *((fmt_ns(in_scope),) if scoped else ()), _pct(in_scope, b.base_ns(row.level)))
        lt.add_row(row.level.label, str(row.spans), *cells)
    if b.levels:
        console.print(lt)  # type: ignore[attr-defined]
    outside: list[str] = []
    if b.ops_outside_layers:
        outside.append(f"{b.ops_outside_layers} ops inside model calls but in no layer ({fmt_ns(b.ops_outside_layers_ns)})")
    if b.reads_outside_layers:
        outside.append(
            f"{b.reads_outside_layers} variable reads outside their layer's span ({fmt_ns(b.reads_outside_layers_ns)}): "
            "TensorFlow ran them ahead of the layer that reads them, which their ml.tf.layer names; not counted as the model's"
        )
    if b.layer_ops_outside_layers:
        outside.append(
            f"{b.layer_ops_outside_layers} ops of a layer outside its span ({fmt_ns(b.layer_ops_outside_layers_ns)}): "
            "TensorFlow ran them apart from the rest of their layer's call (a BatchNormalization's arithmetic on its "
            "weights alone, with the step's variable reads), which their ml.tf.layer names; not counted as the model's"
        )
    if a.unscoped_ops[0]:
        outside.append(a.unscoped_text())
    elif b.ops_outside_models:
        outside.append(f"{b.ops_outside_models} ops outside any model call")
    if a.compile_ops[0]:
        outside.append(a.compile_text())
    if a.torch_ranges:
        outside.append(a.torch_ranges_text())
    if outside:
        console.print("[dim]" + "; ".join(outside) + "[/dim]")  # type: ignore[attr-defined]
    if a.layers:
        _layer_table(console, "Top layers by total time", a.layers[:top], b)
        by_self = a.top_by_self(top)
        if by_self:
            _layer_table(console, "Top layers by self time", by_self, b)
            _why_table(console, by_self)
            _hot_lines(console, a.tables_run(run), by_self)
    if a.types:
        cols = ("type", "calls", "total", "self", "% of model", "FLOP", "bytes", "verdict")
        tt = _table("By layer type (self time)", [(col, col not in ("type", "verdict")) for col in cols])
        for t in a.types[:top]:
            tt.add_row(
                _esc(t.type),
                str(t.calls),
                fmt_ns(t.total_ns),
                fmt_ns(t.self_ns),
                _pct(t.self_ns, b.base_ns(Level.LAYER)),
                fmt_si(t.flops, "FLOP"),
                fmt_si(t.bytes, "B"),
                _verdict_text(t.verdict),
            )
        console.print(tt)  # type: ignore[attr-defined]
    _chains(console, a.tables_run(run), top, [r.stat for r in a.top_by_self(min(top, 10))])
    _name_table(console, "By op (self time)", a.ops[:top], ops=True)
    _name_table(console, "By library call", a.libraries[:top], detail="library")
    _name_table(console, "By GPU kernel", a.kernels[:top], detail="library")
    _gpu_groups(console, run, top)
    _name_table(console, "By CUDA API call (CPU side)", a.runtime[:top])
    if a.memory is not None:
        _memory(console, a.memory, top)
    missing = unrecorded_levels(meta)
    if missing:
        console.print("[dim]Not recorded — " + "; ".join(missing) + "[/dim]")  # type: ignore[attr-defined]
    for lim in limitations(meta):  # one line each: a child's command line may hold newlines
        console.print(f"[dim]Limitation: {_esc(lim.replace(chr(10), ' '))}[/dim]")  # type: ignore[attr-defined]


def _requests(console: Any, a: Analysis, top: int) -> None:
    """The requests' latency and, for the slowest, where their time went (``analysis.requests``)."""
    from mltrace.viewers.services import REQUEST_COLUMNS, request_cells, requests_headline

    if a.requests is None:
        return
    data = a.requests.as_dict()
    console.print(f"[bold]Requests[/bold]: {_esc(requests_headline(data))}")
    table = _table(f"Slowest {len(data['slowest'])} requests: where the time went", [(c, 0 < i < 4) for i, c in enumerate(REQUEST_COLUMNS)])
    for r in data["slowest"][:top]:
        table.add_row(*(_esc(cell) for cell in request_cells(r)))
    console.print(table)


def _ranks(console: Any, a: Analysis) -> None:
    """Each torch.distributed rank's model and collective time, and the straggler (``analysis.ranks``)."""
    from mltrace.viewers.services import RANK_COLUMNS, rank_cells, ranks_headline, straggler_line

    if a.ranks is None:
        return
    data = a.ranks.as_dict()
    table = _table(f"Ranks: {ranks_headline(data)}", [(c, 0 < i < 5) for i, c in enumerate(RANK_COLUMNS)])
    for r in data["ranks"]:
        table.add_row(*(_esc(cell) for cell in rank_cells(r)))
    console.print(table)
    line = straggler_line(data)
    if line:
        console.print(f"  • {_esc(line)}")


def _processes(console: Any, a: Analysis) -> None:
    """Each process's model calls and spans, in a run of several processes (``analysis.processes``)."""
    from mltrace.viewers.services import PROCESS_COLUMNS, process_cells, processes_headline

    if a.processes is None:
        return
    data = [p.as_dict() for p in a.processes]
    table = _table(f"Processes: {processes_headline(data)}", [(c, 2 < i < 6) for i, c in enumerate(PROCESS_COLUMNS)])
    for p in data:
        table.add_row(*(_esc(cell) for cell in process_cells(p)))
    console.print(table)


def _chains(console: object, run: Run, top: int, layers: list[LayerStat]) -> None:
    """Top layers by self time, each with its heaviest op and library call or kernel."""
    from mltrace.analysis.breakdown import cross_stack_chains

    chains = [c for c in cross_stack_chains(run, layers) if c.links]
    if not chains:
        return
    console.print("[bold]Cross-stack: where each top layer's time goes[/bold]")  # type: ignore[attr-defined]
    for c in chains:
        steps = [f"[bold]{_esc(c.layer)}[/bold] ({_esc(c.type)}, self {fmt_ns(c.self_ns)})"]
        steps += [f"{_esc(link.name)} {fmt_ns(link.total_ns)}" for link in c.links]
        console.print("  " + " → ".join(steps))  # type: ignore[attr-defined]


def _hot_lines(console: Any, run: Run, rows: list[LayerRow], per_layer: int = 3) -> None:
    """Per top layer, the model-code lines py-spy sampled most while it ran (``--py-spy``)."""
    from mltrace.analysis.report_data import hot_lines

    hot = hot_lines(run, [r.stat.name for r in rows])
    if not hot:
        return
    console.print("[bold]Hottest model-code lines per layer (py-spy samples)[/bold]")
    for r in rows:
        lines = hot.get(r.stat.name)
        if not lines:
            continue
        sampled = sum(ns for _, ns in lines)
        console.print(f"  [bold]{_esc(r.stat.name)}[/bold] ({_esc(r.stat.type)})")
        for loc, ns in lines[:per_layer]:
            path, line, function = split_location(loc)
            console.print(f"      {_source_cell(path, line)}  [dim]{_esc(function)} · {fmt_ns(ns)}, {_pct(ns, sampled)} of samples[/dim]")


def _gpu_groups(console: object, run: Run, top: int) -> None:
    """XSP's layer and op tables on the GPU: GPU time, launches and the top kernels of each."""

    from mltrace.analysis.gpu import gpu_tables

    if not any(t.kind == "gpu_stream" for t in run.tracks.values()):
        return
    tables = gpu_tables(run)
    for title, rows in (("GPU time by layer", tables.layers), ("GPU time by op", tables.ops)):
        rows = [r for r in rows if r.gpu_ns][:top]
        if not rows:
            continue
        cols = ("name", "calls", "CPU", "GPU", "launches", "top kernels")
        table = _table(title, [(col, col not in ("name", "top kernels")) for col in cols])
        for r in rows:
            kernels = "; ".join(f"{_esc(name)} ×{count} {fmt_ns(ns)}" for name, count, ns in r.top_kernels(2))
            table.add_row(_esc(r.name), str(r.calls), fmt_ns(r.cpu_ns), fmt_ns(r.gpu_ns), str(r.launches), kernels)
        console.print(table)  # type: ignore[attr-defined]
    if tables.unattributed_to_op:
        console.print(f"[dim]GPU activities not under any op: {tables.unattributed_to_op}[/dim]")  # type: ignore[attr-defined]


def _findings(console: object, a: Analysis) -> None:
    f = a.findings
    b = a.breakdown
    lines: list[str] = [_cold_line(a)] if a.cold_text() else []
    kinds = call_kinds_text(a, name=_esc, text=_esc)
    lines += [kinds] if kinds else []
    lines += [_esc(g.text()) for g in a.generation]
    total = sum(f.bound_ns.values())
    if total:
        shares = ", ".join(
            f"{_verdict_text(Verdict(bound, ''))} {100 * ns / total:.0f}%"
            for bound, ns in sorted(f.bound_ns.items(), key=lambda kv: -kv[1])
            if ns
        )
        dominant = f"[bold]{f.dominant.value}[/bold]"
        lead = f"Mostly {dominant}" if f.mostly else f"Mixed, {dominant} the largest known"
        lines.append(f"{lead} — share of {f.basis}: {shares}")
    for idle in f.idle:
        text = _esc(idle.headline())
        if idle.gaps:
            g = idle.gaps[0]
            text += f"; largest {fmt_ns(g.duration_ns)} after {_esc(g.before)} before {_esc(g.after)}"
        lines.append(text + idle.tracer_text())
    if f.device_ns and f.cpu_ns:
        lines.append(f"CPU time {fmt_ns(f.cpu_ns)} vs GPU busy {fmt_ns(f.device_ns)}: ratio {f.cpu_ns / f.device_ns:.2f}")
    if f.data_movement_base_ns:
        top = ", ".join(f"{_esc(x.name)} {fmt_ns(x.total_ns)}" for x in f.data_movement_top[:3])
        lines.append(
            f"Data movement: {fmt_ns(f.data_movement_ns)} ({_pct(f.data_movement_ns, f.data_movement_base_ns)} of op+GPU time)"
            + (f" — {top}" if top else "")
        )
    if f.framework_ns is not None:
        lines.append(
            f"Framework overhead (layer time not covered by ops): {fmt_ns(f.framework_ns)} "
            f"({_pct(f.framework_ns, f.framework_base_ns)} of model time)"
        )
    for note in f.notes:
        lines.append(f"[dim]{note}[/dim]")
    if lines:
        console.print("[bold]Findings[/bold]")  # type: ignore[attr-defined]
        for line in lines:
            console.print(f"  • {line}")  # type: ignore[attr-defined]
    del b


def _cold_line(a: Analysis) -> str:
    """The cold-start finding (``report_data.cold_start_text``), names escaped for rich."""
    return cold_start_text(a, name=_esc, p90=True)


def _layer_table(console: object, title: str, rows: list[LayerRow], b: Breakdown) -> None:
    defined = any(r.stat.defined_file for r in rows)  # runs that record call sites also name the definition
    cols = [
        "layer",
        "type",
        "calls",
        "total",
        "self",
        "median",
        "p90",
        "% model",
        "verdict",
        "top ops / libraries / kernels",
        "source",
        *(["defined"] if defined else []),
    ]
    table = _table(title, [(col, col in ("calls", "total", "self", "median", "p90", "% model")) for col in cols])
    for r in rows:
        x = r.stat
        spread = [PER_KIND, PER_KIND] if r.kinds else [fmt_ns(v) if v is not None else "" for v in (r.median_ns, r.p90_ns)]
        table.add_row(
            _esc(x.name) if x.level.label == "layer" else f"[bold]{_esc(x.name)}[/bold]",
            _esc(x.type),
            str(x.calls),
            fmt_ns(x.total_ns),
            fmt_ns(x.self_ns) + (f" (GC {fmt_ns(r.gc.ns)})" if r.gc is not None else ""),
            *spread,
            _pct(x.total_ns, b.base_ns(x.level)),
            _verdict_text(r.verdict),
            _contents(r),
            _source_cell(x.file, x.line),
            *([_esc(location(x.defined_file, x.defined_line))] if defined else []),
        )
        for k in r.kinds:  # the model's calls of several kinds: each kind's own figures
            median, p90 = (fmt_ns(v) if v is not None else "" for v in (k.median_ns, k.p90_ns))
            kind_cells = [f"  ↳ {_esc(kind_label(k.kind))}", "", str(k.calls), fmt_ns(k.total_ns), "", median, p90]
            table.add_row(*kind_cells, _pct(k.total_ns, b.base_ns(x.level)), *[""] * (len(cols) - len(kind_cells) - 1))
    console.print(table)  # type: ignore[attr-defined]


def _contents(r: LayerRow) -> str:
    parts = []
    ops = sorted(r.stat.ops.items(), key=lambda kv: -kv[1][1])[:2]
    parts += [f"{_esc(name)} {fmt_ns(v[1])}" for name, v in ops]
    parts += [f"{_esc(x.name)} {fmt_ns(x.total_ns)}" for x in r.libraries[:1]]
    parts += [f"{_esc(x.name)} {fmt_ns(x.total_ns)}" for x in r.kernels[:1]]
    return ", ".join(parts)


def _why_table(console: object, rows: list[LayerRow]) -> None:
    cols = ("layer", "verdict", "FLOP", "bytes", "FLOP/B", "achieved", "% peak", "% roofline", "basis", "reason")
    table = _table(
        "Why: the roofline numbers of the top layers (by self time)",
        [(col, col not in ("layer", "verdict", "basis", "reason")) for col in cols],
    )
    for r in rows:
        v = r.verdict
        table.add_row(
            _esc(r.stat.name),
            _verdict_text(v),
            fmt_si(r.flops, "FLOP"),
            fmt_si(r.bytes, "B"),
            f"{v.intensity:.3g}" if v is not None and v.intensity is not None else "",
            fmt_si(r.achieved_flops, "FLOP/s") if r.achieved_flops else "",
            f"{100 * r.peak_share:.2g}%" if r.peak_share is not None else "",
            f"{100 * v.efficiency:.2g}%" if v is not None and v.efficiency is not None else "",
            _esc(v.basis) if v is not None else r.work_source,
            _esc(v.reason) if v is not None else "",
        )
    console.print(table)  # type: ignore[attr-defined]


def _memory(console: object, mem: MemoryReport, top: int) -> None:
    """The memory section: each device's peak and the layer holding it, then the layers by
    peak and the ops by allocated bytes."""
    for p in mem.peaks:
        where = f" in {_esc(p.layer)}" if p.layer else ""
        console.print(f"Memory peak {_esc(p.track)}: {fmt_si(p.bytes, 'B')}{where} [dim]({p.samples} samples)[/dim]")  # type: ignore[attr-defined]
    for title, rows in (("Memory by layer (peak of one call)", mem.layers), ("Memory by op (allocated)", mem.ops)):
        if not rows:
            continue
        cols = ("name", "calls", "peak", "allocated", "freed", "device")
        table = _table(title, [(col, col not in ("name", "device")) for col in cols])
        for r in rows[:top]:
            cells = (fmt_si(r.peak_bytes, "B"), fmt_si(r.alloc_bytes, "B"), fmt_si(r.freed_bytes, "B"), r.device)
            table.add_row(_esc(r.name), str(r.calls), *cells)
        console.print(table)  # type: ignore[attr-defined]


def _name_table(console: object, title: str, rows: list[NameRow], ops: bool = False, detail: str = "") -> None:
    if not rows:
        return
    cols = ["name", *([detail] if detail else []), "calls", "total", "self", "mean"]
    if ops:
        cols += ["FLOP", "GPU time", "verdict"]
    table = _table(title, [(col, col not in ("name", detail, "verdict")) for col in cols])
    for r in rows:
        cells = [
            _esc(r.name),
            *([_esc(r.detail)] if detail else []),
            str(r.calls),
            fmt_ns(r.total_ns),
            fmt_ns(r.self_ns),
            fmt_ns(r.mean_ns),
        ]
        if ops:
            cells += [fmt_si(r.flops, "FLOP") if r.flops else "", fmt_ns(r.device_ns) if r.device_ns else "", _verdict_text(r.verdict)]
        table.add_row(*cells)
    console.print(table)  # type: ignore[attr-defined]


def render_diff(d: RunDiff, top: int = 15, file: IO[str] | None = None, width: int | None = None) -> None:
    """Prints a run comparison: totals, then layers, layer types, ops and kernels that changed."""
    console = _console(file, width)
    a = f"{d.a_name} ({d.a_path})" if d.a_path else d.a_name
    b = f"{d.b_name} ({d.b_path})" if d.b_path else d.b_name
    console.print(f"[bold]mltrace diff[/bold] — A: {a}  B: {b}")  # type: ignore[attr-defined]
    console.print(f"[dim]model calls: {d.model_calls[0]} in A, {d.model_calls[1]} in B[/dim]")  # type: ignore[attr-defined]
    console.print(f"[dim]times are {d.basis}; a change counts when it is over {100 * d.threshold:.0f}% and {fmt_ns(d.min_delta_ns)}[/dim]")  # type: ignore[attr-defined]
    tt = _table("Totals", [(col, bool(col)) for col in ("", "A", "B", "change")])
    for name, va, vb in d.totals:
        tt.add_row(name, fmt_ns(va), fmt_ns(vb), _change(va, vb))
    console.print(tt)  # type: ignore[attr-defined]
    for title, section in (("Layers", d.layers), ("Layer types", d.types), ("Ops", d.ops), ("GPU kernels", d.kernels)):
        if not section:
            continue
        counts: dict[str, int] = {}
        for row in section:
            counts[row.status] = counts.get(row.status, 0) + 1
        summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
        cols = ("name", "status", "calls A", "calls B", "time A", "time B", "Δ", "change")
        table = _table(f"{title}: {summary}", [(col, col not in ("name", "status")) for col in cols])
        shown = [r for r in section if r.status != "same"][:top]
        for r in shown:
            table.add_row(
                _esc(r.name),
                f"[{_STATUS_STYLE.get(r.status, '')}]{r.status}[/]" if r.status in _STATUS_STYLE else r.status,
                str(r.calls_a),
                str(r.calls_b),
                fmt_ns(r.time_a) if r.calls_a else "",
                fmt_ns(r.time_b) if r.calls_b else "",
                _signed_ns(r.delta_ns),
                _change(r.time_a, r.time_b) if r.calls_a and r.calls_b else "",
            )
        if shown:
            console.print(table)  # type: ignore[attr-defined]
        else:
            console.print(f"[dim]{title}: no changes over the threshold[/dim]")  # type: ignore[attr-defined]
    if d.memory:
        mt = _table("Memory peaks (a layer's: of one call)", [(col, col != "name") for col in ("name", "A", "B", "change")])
        for m in d.memory[:top]:
            a_cell, b_cell = (fmt_si(v, "B") if v is not None else "" for v in (m.a_bytes, m.b_bytes))
            change = _change(m.a_bytes, m.b_bytes) if m.a_bytes is not None and m.b_bytes is not None else ""
            mt.add_row(_esc(m.name), a_cell, b_cell, change)
        console.print(mt)  # type: ignore[attr-defined]


_STATUS_STYLE = {"slower": "red", "faster": "green", "added": "yellow", "removed": "yellow"}


def _signed_ns(ns: float) -> str:
    return ("+" if ns > 0 else "-" if ns < 0 else "") + fmt_ns(abs(ns))


def _change(a: float, b: float) -> str:
    if a <= 0:
        return ""
    return f"{b / a:.2f}×"


def print_run_summary(run_dir: Path, file: IO[str] | None = None) -> None:
    """The short end-of-run summary on stderr: top layers and where the run is. The layers are
    ranked as the report ranks them, the program's garbage collections in a layer left out
    and shown beside its self time ("824.7 ms (GC 824.3 ms)").

    Read from run.json's ``summary`` (written when the run was finalized), so a
    large run is not loaded again; computed from the events where it is missing.
    """
    out = file or sys.stderr
    try:
        summary = _stored_summary(run_dir)
        if summary is None:
            summary = summarize(load_run(run_dir))
        spans, calls, model_ns = int(summary["spans"]), int(summary["model_calls"]), int(summary["model_time_ns"])
        layers = summary["top_layers_by_self_time"]
        layer_base_ns = int(summary.get("layer_model_time_ns", model_ns))
        note = "" if summary.get("include_cold") else left_out_note(int(summary.get("cold_calls", 0)))
    except Exception as exc:
        out.write(f"mltrace: run written to {run_dir} (summary unavailable: {exc})\n")
        return
    console = _console(out)
    console.print(f"[bold]mltrace[/bold]: {spans} spans, {calls} model calls, model time {fmt_ns(model_ns)}{_esc(note)}")
    if layers:
        cols = ("layer", "type", "calls", "self", "% model", "source")
        table = _table("Top layers by self time", [(col, col in ("calls", "self", "% model")) for col in cols])
        for x in layers:
            path, _, line = str(x["location"]).rpartition(":")
            source = _short_path(path, int(line)) if path and line.isdigit() else ""
            gc_ns = int(x.get("gc_ns", 0))  # a run summarized before it has none
            self_cell = fmt_ns(x["self_ns"]) + (f" (GC {fmt_ns(gc_ns)})" if gc_ns else "")
            table.add_row(_esc(x["layer"]), _esc(x["type"]), str(x["calls"]), self_cell, _pct(x["self_ns"], layer_base_ns), _esc(source))
        console.print(table)
    console.print(f"trace: {run_dir / 'trace.pftrace'}  (mltrace report {run_dir})")
