"""Terminal rendering of the report (rich tables). Draws; computes nothing."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import IO

from mltrace.analysis.breakdown import Breakdown, LayerStat, breakdown
from mltrace.run.store import Run, load_run


def fmt_ns(ns: float) -> str:
    """Human duration: 812 ns, 12.3 µs, 4.56 ms, 1.23 s."""
    if ns < 1_000:
        return f"{ns:.0f} ns"
    if ns < 1_000_000:
        return f"{ns / 1e3:.1f} µs"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.2f} s"


def _short_path(path: str | None, line: int | None) -> str:
    if not path:
        return ""
    try:
        rel = os.path.relpath(path)
        shown = rel if not rel.startswith("..") else path
    except ValueError:
        shown = path
    if "site-packages/" in shown:
        shown = shown.split("site-packages/", 1)[1]
    return f"{shown}:{line}"


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _console(file: IO[str] | None) -> object:
    from rich.console import Console

    return Console(file=file or sys.stdout, width=None if (file or sys.stdout).isatty() else 160, highlight=False)


def render_report(run: Run, b: Breakdown, top: int = 15, file: IO[str] | None = None) -> None:
    """Prints the full report: levels, top layers (total and self), layer types."""
    from rich.table import Table

    console = _console(file)
    meta = run.meta
    title = f"mltrace report — {meta.get('name', run.path.name)}  ({run.path})"
    console.print(f"[bold]{title}[/bold]")  # type: ignore[attr-defined]
    if not run.complete:
        console.print("[yellow]run did not finish normally: events up to the last flush[/yellow]")  # type: ignore[attr-defined]
    console.print(  # type: ignore[attr-defined]
        f"{b.span_count} spans, {b.model_calls} model calls, model time {fmt_ns(b.model_ns)}, wall {fmt_ns(b.wall_ns)}"
    )
    lt = Table(title="Time per level", title_justify="left")
    for col in ("level", "spans", "time", "% of model"):
        lt.add_column(col, justify="right" if col != "level" else "left")
    for row in b.levels:
        lt.add_row(row.level.label, str(row.spans), fmt_ns(row.time_ns), _pct(row.time_ns, b.model_ns))
    console.print(lt)  # type: ignore[attr-defined]
    _layer_table(console, "Top layers by total time", b.layers[:top], b.model_ns)
    by_self = sorted((x for x in b.layers if x.level.label == "layer"), key=lambda x: -x.self_ns)[:top]
    _layer_table(console, "Top layers by self time", by_self, b.model_ns)
    if b.types:
        tt = Table(title="By layer type (self time)", title_justify="left")
        for col in ("type", "calls", "self", "% of model"):
            tt.add_column(col, justify="right" if col != "type" else "left")
        for t in b.types[:top]:
            tt.add_row(t.type, str(t.calls), fmt_ns(t.self_ns), _pct(t.self_ns, b.model_ns))
        console.print(tt)  # type: ignore[attr-defined]
    levels = meta.get("levels", {})
    missing = [f"{k}: {v.get('reason')}" for k, v in levels.items() if v.get("requested") and not v.get("recorded")]
    if missing:
        console.print("[dim]Not recorded — " + "; ".join(missing) + "[/dim]")  # type: ignore[attr-defined]
    for lim in meta.get("limitations", []):
        console.print(f"[dim]Limitation: {lim}[/dim]")  # type: ignore[attr-defined]


def _layer_table(console: object, title: str, rows: list[LayerStat], model_ns: int) -> None:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in ("layer", "type", "calls", "total", "self", "% model", "top ops", "source"):
        table.add_column(col, justify="right" if col in ("calls", "total", "self", "% model") else "left")
    for x in rows:
        ops = sorted(x.ops.items(), key=lambda kv: -kv[1][1])[:2]
        ops_text = ", ".join(f"{name} {fmt_ns(v[1])}" for name, v in ops)
        table.add_row(
            x.name if x.level.label == "layer" else f"[bold]{x.name}[/bold]",
            x.type,
            str(x.calls),
            fmt_ns(x.total_ns),
            fmt_ns(x.self_ns),
            _pct(x.total_ns, model_ns),
            ops_text,
            _short_path(x.file, x.line),
        )
    console.print(table)  # type: ignore[attr-defined]


def print_report(path: str | Path, top: int = 15, file: IO[str] | None = None) -> None:
    """Loads a run and prints its report."""
    run = load_run(path)
    render_report(run, breakdown(run), top=top, file=file)


def print_run_summary(run_dir: Path, file: IO[str] | None = None) -> None:
    """The short end-of-run summary on stderr: top layers and where the run is."""
    out = file or sys.stderr
    try:
        run = load_run(run_dir)
        b = breakdown(run)
    except Exception as exc:
        out.write(f"mltrace: run written to {run_dir} (summary unavailable: {exc})\n")
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(file=out, width=None if out.isatty() else 140, highlight=False)
    console.print(
        f"[bold]mltrace[/bold]: {b.span_count} spans, {b.model_calls} model calls, "
        f"model time {fmt_ns(b.model_ns)}"
    )
    layers = sorted((x for x in b.layers if x.level.label == "layer"), key=lambda x: -x.self_ns)[:5]
    if layers:
        table = Table(title="Top layers by self time", title_justify="left")
        for col in ("layer", "type", "calls", "self", "% model", "source"):
            table.add_column(col, justify="right" if col in ("calls", "self", "% model") else "left")
        for x in layers:
            table.add_row(x.name, x.type, str(x.calls), fmt_ns(x.self_ns), _pct(x.self_ns, b.model_ns), _short_path(x.file, x.line))
        console.print(table)
    console.print(f"trace: {run_dir / 'trace.pftrace'}  (mltrace report {run_dir})")
