"""The bottleneck report as one self-contained HTML file.

Everything is inline: CSS in a ``<style>`` element, charts as SVG drawn here
(level breakdown, top layers, layer types, roofline, timeline overview). There
is no script and nothing is fetched, so the file works offline and can be
mailed around. Links open the trace in Perfetto while ``mltrace view`` serves it.

Draws only: ``render_html`` takes an ``Analysis`` and a ``Timeline`` computed
by ``mltrace.analysis.bottleneck``.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Sequence

from mltrace.analysis.bottleneck import Analysis, Bound, LayerRow, NameRow, RooflinePoint, Timeline, Verdict
from mltrace.analysis.breakdown import Breakdown, LayerStat
from mltrace.analysis.codepaths import context_lines, location, split_location
from mltrace.analysis.coldstart import KindTotals
from mltrace.analysis.memory import MemoryReport
from mltrace.analysis.peaks import Peaks, bandwidth_text
from mltrace.analysis.report_data import call_kinds_text, cold_start_text, exit_text, kind_label
from mltrace.run.levels import Level
from mltrace.run.metadata import limitations, unrecorded_levels
from mltrace.run.store import TRACE_FILE, Run
from mltrace.viewers.perfetto_ui import PERFETTO_PORT, TRACE_PATH, perfetto_url
from mltrace.viewers.terminal import fmt_ns, fmt_si

#: Verdict colours (also what the screenshot test looks for).
BOUND_COLORS = {
    Bound.COMPUTE: "#d62728",
    Bound.MEMORY: "#1f77b4",
    Bound.OVERHEAD: "#ff7f0e",
    Bound.UNKNOWN: "#8c8c8c",
}
LEVEL_COLORS = {
    Level.MODEL: "#4e79a7",
    Level.LAYER: "#59a14f",
    Level.OP: "#e8b100",
    Level.LIBRARY: "#b07aa1",
    Level.KERNEL: "#e15759",
    Level.USER: "#9c755f",
    Level.SOURCE: "#76b7b2",
}
_SELF_COLOR = "#333333"

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;max-width:1200px;color:#222;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.meta{color:#555;font-size:13px}.muted{color:#777}.warn{color:#a15c00;font-weight:600}
table{border-collapse:collapse;margin:6px 0 12px;font-size:13px}
th,td{padding:3px 8px;border-bottom:1px solid #eee;text-align:right;vertical-align:top;white-space:nowrap}
td.w{white-space:normal;min-width:220px;max-width:380px}.scroll{overflow-x:auto}
th{background:#f6f6f6;font-weight:600}td.l,th.l{text-align:left}
.v{font-weight:600}.links a{margin-right:18px}
ul.findings li{margin:3px 0}code{background:#f3f3f3;padding:1px 4px;border-radius:3px}
svg{display:block;margin:6px 0 14px;font:12px system-ui,sans-serif}
pre.src{margin:4px 0;padding:4px 6px;background:#f7f7f7;font-size:12px;white-space:pre;overflow-x:auto}
pre.src .hl{font-weight:700;background:#fff3c4}pre.src .ctx{color:#666}
details summary{cursor:pointer}
.legend span{display:inline-block;margin-right:14px}.sw{display:inline-block;width:11px;height:11px;margin-right:4px;vertical-align:-1px}
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _verdict_html(v: Verdict | None) -> str:
    if v is None:
        return ""
    return f'<span class="v" style="color:{BOUND_COLORS[v.bound]}" title="{_e(v.reason)}">{_e(v.bound.short)}</span>'


def _legend() -> str:
    items = "".join(f'<span><i class="sw" style="background:{BOUND_COLORS[b]}"></i>{_e(b.value)}</span>' for b in Bound)
    return f'<div class="legend">{items}<span><i class="sw" style="background:{_SELF_COLOR}"></i>self time</span></div>'


# -- charts -------------------------------------------------------------------


def _bar_chart(rows: Sequence[tuple[str, float, float | None, str, str]], unit_fmt: object = fmt_ns, width: int = 1100) -> str:
    """Horizontal bars: (label, value, inner value or None, colour, tooltip)."""
    if not rows:
        return ""
    label_w, row_h, pad = 320, 22, 8
    plot_w = width - label_w - 110
    top = max(r[1] for r in rows) or 1
    height = pad * 2 + row_h * len(rows)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">']
    for i, (label, value, inner, color, tip) in enumerate(rows):
        y = pad + i * row_h
        w = max(1.0, plot_w * value / top)
        text = label if len(label) <= 48 else label[:47] + "…"
        out.append(f'<text x="{label_w - 8}" y="{y + 15}" text-anchor="end">{_e(text)}</text>')
        out.append(f'<rect x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" fill="{color}"><title>{_e(tip)}</title></rect>')
        if inner is not None and inner > 0:
            wi = max(1.0, plot_w * inner / top)
            out.append(f'<rect x="{label_w}" y="{y + 8}" width="{wi:.1f}" height="{row_h - 16}" fill="{_SELF_COLOR}" opacity="0.75"/>')
        out.append(f'<text x="{label_w + w + 6:.1f}" y="{y + 15}">{_e(unit_fmt(value))}</text>')  # type: ignore[operator]
    out.append("</svg>")
    return "".join(out)


def _log_ticks(lo: float, hi: float) -> list[float]:
    return [10.0**k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)]


def roofline_svg(points: Sequence[RooflinePoint], roofs: Sequence[Peaks], width: int = 900, height: int = 440) -> str:
    """The roofline plot: log-log attainable FLOP/s against arithmetic intensity, with the points."""
    if not roofs:
        return ""
    ml, mr, mt, mb = 100, 30, 20, 50
    pw, ph = width - ml - mr, height - mt - mb
    ridges = [r.ridge for r in roofs]
    finite = [p for p in points if math.isfinite(p.intensity) and p.intensity > 0 and p.flops_per_s > 0]
    xs = [p.intensity for p in finite] + [min(ridges) / 100, max(ridges) * 100]
    peak = max(r.flops_per_s for r in roofs)
    ys = [p.flops_per_s for p in finite] + [peak / 1e4, peak * 2]
    x_lo, x_hi = 10 ** math.floor(math.log10(min(xs))), 10 ** math.ceil(math.log10(max(xs)))
    y_lo, y_hi = 10 ** math.floor(math.log10(min(ys))), 10 ** math.ceil(math.log10(max(ys)))

    def sx(x: float) -> float:
        return ml + pw * (math.log10(x) - math.log10(x_lo)) / (math.log10(x_hi) - math.log10(x_lo))

    def sy(y: float) -> float:
        return mt + ph * (1 - (math.log10(y) - math.log10(y_lo)) / (math.log10(y_hi) - math.log10(y_lo)))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" aria-label="roofline">']
    out.append(f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="#fbfbfb" stroke="#ccc"/>')
    for x in _log_ticks(x_lo, x_hi):
        out.append(f'<line x1="{sx(x):.1f}" y1="{mt}" x2="{sx(x):.1f}" y2="{mt + ph}" stroke="#e6e6e6"/>')
        out.append(f'<text x="{sx(x):.1f}" y="{mt + ph + 16}" text-anchor="middle">{x:g}</text>')
    for y in _log_ticks(y_lo, y_hi):
        out.append(f'<line x1="{ml}" y1="{sy(y):.1f}" x2="{ml + pw}" y2="{sy(y):.1f}" stroke="#e6e6e6"/>')
        out.append(f'<text x="{ml - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{_e(fmt_si(y, "FLOP/s"))}</text>')
    out.append(f'<text x="{ml + pw / 2}" y="{height - 10}" text-anchor="middle">arithmetic intensity (FLOP/byte)</text>')
    for roof, dash in zip(roofs, ("", "6 4")):
        pts = [(x_lo, min(roof.flops_per_s, x_lo * roof.bytes_per_s))]
        if x_lo < roof.ridge < x_hi:
            pts.append((roof.ridge, roof.flops_per_s))
        pts.append((x_hi, min(roof.flops_per_s, x_hi * roof.bytes_per_s)))
        path = " ".join(f"{sx(x):.1f},{sy(max(y, y_lo)):.1f}" for x, y in pts)
        style = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<polyline points="{path}" fill="none" stroke="#222" stroke-width="2"{style}/>')
        label = f"{roof.device.upper()}: {fmt_si(roof.flops_per_s, 'FLOP/s')}, {fmt_si(roof.bytes_per_s, 'B/s')}"
        out.append(f'<text x="{ml + pw - 6}" y="{sy(roof.flops_per_s) - 6:.1f}" text-anchor="end">{_e(label)}</text>')
    biggest = max((p.time_ns for p in finite), default=1) or 1
    labelled = {id(p) for p in sorted(finite, key=lambda p: -p.time_ns)[:6]}
    for p in sorted(finite, key=lambda p: -p.time_ns):
        r = 3.5 + 7 * math.sqrt(p.time_ns / biggest)
        shape = "circle" if p.kind == "layer" else "rect"
        cx, cy = sx(p.intensity), sy(p.flops_per_s)
        tip = f"{p.label} ({p.kind}): {p.intensity:.3g} FLOP/B, {fmt_si(p.flops_per_s, 'FLOP/s')}, {fmt_ns(p.time_ns)}, {p.bound.value}"
        if shape == "circle":
            out.append(
                f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="{r:.1f}" fill="{BOUND_COLORS[p.bound]}" fill-opacity="0.85" '
                f'stroke="#fff"><title>{_e(tip)}</title></circle>'
            )
        else:
            out.append(
                f'<rect x="{cx - r:.1f}" y="{cy - r:.1f}" width="{2 * r:.1f}" height="{2 * r:.1f}" fill="none" '
                f'stroke="{BOUND_COLORS[p.bound]}" stroke-width="2"><title>{_e(tip)}</title></rect>'
            )
        if id(p) in labelled:
            out.append(f'<text x="{cx + r + 3:.1f}" y="{cy + 4:.1f}" fill="#333">{_e(p.label[:40])}</text>')
    out.append("</svg>")
    return "".join(out)


def timeline_svg(tl: Timeline, width: int = 1100) -> str:
    """Lanes (track × level) shaded by how busy each time bin is, with model calls on top."""
    if not tl.lanes:
        return ""
    label_w, lane_h, axis_h, top_h = 250, 16, 22, 14
    plot_w = width - label_w - 10
    height = top_h + lane_h * len(tl.lanes) + axis_h
    scale = plot_w / tl.bins
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" aria-label="timeline">']
    span_ns = tl.end_ns - tl.start_ns
    for start, end, name in tl.models:
        x = label_w + plot_w * (start - tl.start_ns) / span_ns
        w = max(1.0, plot_w * (end - start) / span_ns)
        out.append(
            f'<rect x="{x:.1f}" y="2" width="{w:.1f}" height="{top_h - 5}" fill="{LEVEL_COLORS[Level.MODEL]}" opacity="0.5">'
            f"<title>{_e(name)}: {_e(fmt_ns(end - start))}</title></rect>"
        )
    for i, lane in enumerate(tl.lanes):
        y = top_h + i * lane_h
        color = LEVEL_COLORS.get(lane.level, "#888")
        label = f"{lane.track} · {lane.level.label}"
        out.append(f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end">{_e(label[:40])}</text>')
        out.append(f'<rect x="{label_w}" y="{y + 1}" width="{plot_w}" height="{lane_h - 2}" fill="#f4f4f4"/>')
        # Runs of bins with the same (quantised) busy fraction become one rectangle.
        run_start, run_q = 0, round(lane.busy[0] * 10) if lane.busy else 0
        for j in range(1, len(lane.busy) + 1):
            q = round(lane.busy[j] * 10) if j < len(lane.busy) else -1
            if q != run_q:
                if run_q > 0:
                    out.append(
                        f'<rect x="{label_w + run_start * scale:.1f}" y="{y + 1}" width="{(j - run_start) * scale:.1f}" '
                        f'height="{lane_h - 2}" fill="{color}" fill-opacity="{0.15 + 0.085 * run_q:.2f}"/>'
                    )
                run_start, run_q = j, q
    axis_y = top_h + lane_h * len(tl.lanes) + 14
    for k in range(6):
        x = label_w + plot_w * k / 5
        out.append(f'<text x="{x:.1f}" y="{axis_y}" text-anchor="middle">{_e(fmt_ns(span_ns * k / 5))}</text>')
    out.append("</svg>")
    return "".join(out)


# -- tables -------------------------------------------------------------------


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int] = (0,), wrap: Sequence[int] = ()) -> str:
    def cls(i: int) -> str:
        return " ".join(c for c, on in (("l", i in left), ("w", i in wrap)) if on)

    head = "".join(f'<th class="{cls(i)}">{_e(h)}</th>' for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f'<td class="{cls(i)}">{cell}</td>' for i, cell in enumerate(row)) + "</tr>" for row in rows)
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _contents(r: LayerRow) -> str:
    parts = [f"{_e(n)} {_e(fmt_ns(v[1]))}" for n, v in sorted(r.stat.ops.items(), key=lambda kv: -kv[1][1])[:3]]
    parts += [f"{_e(x.name)} {_e(fmt_ns(x.total_ns))}" for x in r.libraries[:2]]
    parts += [f"{_e(x.name[:60])} {_e(fmt_ns(x.total_ns))}" for x in r.kernels[:2]]
    return "<br>".join(parts)


def _source_html(path: object, line: object, around: int = 3) -> str:
    """The location ``path:line`` (shortened, whole) with the code line and ``around`` lines
    either side, read now; just the location when the file is not readable here."""
    where = location(path, line)
    if not where:
        return ""
    context = context_lines(path, line, around)
    if not context:
        return f"<code>{_e(where)}</code>"
    code = next((text.strip() for n, text in context if n == line), "")
    listing = "\n".join(f'<span class="{"hl" if n == line else "ctx"}">{n:>5}  {_e(text)}</span>' for n, text in context)
    return f"<details><summary><code>{_e(where)}</code> <code>{_e(code)}</code></summary><pre class=src>{listing}</pre></details>"


def _source_cell(x: LayerStat) -> str:
    """The call site with its code, and where the layer is defined (when recorded)."""
    cell = _source_html(x.file, x.line)
    if x.defined_file:
        cell += f'<div class="muted">defined at <code>{_e(location(x.defined_file, x.defined_line))}</code></div>'
    return cell


def _layer_rows(rows: Sequence[LayerRow], b: Breakdown) -> list[list[str]]:
    out = []
    for r in rows:
        x, v = r.stat, r.verdict
        out.append(
            [
                _e(x.name),
                _e(x.type),
                str(x.calls),
                _e(fmt_ns(x.total_ns)),
                _e(fmt_ns(x.self_ns) + (f" (GC {fmt_ns(r.gc.ns)})" if r.gc is not None else "")),
                _pct(x.total_ns, b.base_ns(x.level)),
                _verdict_html(v),
                _e(fmt_si(r.flops, "FLOP")),
                _e(fmt_si(r.bytes, "B")),
                f"{100 * v.efficiency:.2g}%" if v is not None and v.efficiency is not None else "",
                _e(v.reason) if v is not None else "",
                _contents(r),
                _source_cell(x),
            ]
        )
        out += [_kind_row(k, b.base_ns(x.level)) for k in r.kinds]
    return out


def _kind_row(k: KindTotals, base_ns: int) -> list[str]:
    """A row under a model's whose calls are of several kinds (``LayerRow.kinds``): the kind's
    calls, total time and share, and its calls' median and p90 under its name."""
    spread = ", ".join(f"{what} {fmt_ns(v)}" for what, v in (("median", k.median_ns), ("p90", k.p90_ns)) if v is not None)
    name = f"↳ {_e(kind_label(k.kind))}" + (f'<div class="muted">{_e(spread)}</div>' if spread else "")
    return [name, "", str(k.calls), _e(fmt_ns(k.total_ns)), "", _pct(k.total_ns, base_ns), *[""] * 7]


def _name_rows(rows: Sequence[NameRow], verdicts: bool) -> list[list[str]]:
    out = []
    for r in rows:
        cells = [_e(r.name[:120])]
        if not verdicts:
            cells.append(_e(r.detail))
        cells += [str(r.calls), _e(fmt_ns(r.total_ns)), _e(fmt_ns(r.self_ns)), _e(fmt_ns(r.mean_ns))]
        if verdicts:
            cells += [
                _e(fmt_si(r.flops, "FLOP")) if r.flops else "",
                _e(fmt_ns(r.device_ns)) if r.device_ns else "",
                _verdict_html(r.verdict),
                _e(r.verdict.reason) if r.verdict else "",
            ]
        out.append(cells)
    return out


# -- the page -----------------------------------------------------------------


def render_html(run: Run, a: Analysis, tl: Timeline, top: int = 15, port: int = PERFETTO_PORT) -> str:
    """The whole report as one HTML document (a string): charts first, then the tables.

    Args:
        run: the run (for its metadata and paths).
        a: its analysis.
        tl: its timeline overview.
        top: rows per chart and table.
        port: the port ``mltrace view`` serves on, for the Perfetto links.
    """
    b = a.breakdown
    meta = run.meta
    name = str(meta.get("name") or run.path.name)
    parts: list[str] = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>mltrace report — {_e(name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>mltrace report — {_e(name)}</h1>",
        f'<div class="meta">{_e(run.path.resolve())} · {b.span_count} spans · {b.model_calls} model calls{_e(a.counts_note())} · '
        f"model time {_e(fmt_ns(b.model_ns))} · wall {_e(fmt_ns(b.wall_ns))} · written {_e(time.strftime('%Y-%m-%d %H:%M:%S'))}</div>",
    ]
    if not run.complete:
        parts.append('<p class="warn">The run did not finish normally: events up to the last flush.</p>')
    ended = exit_text(meta)
    if ended:
        parts.append(f'<p class="warn">{_e(ended)}</p>')
    parts += [_meta_block(meta), _links(run, port), _findings(a), _services(a, top), _charts(a, tl, top), _tables(run, a, top)]
    if a.memory is not None:
        parts.append(_memory(a.memory, top))
    notes = [*(f"Not recorded — {m}" for m in unrecorded_levels(meta)), *(f"Limitation: {x}" for x in limitations(meta))]
    if notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li class=muted>{_e(n)}</li>" for n in notes) + "</ul>")
    parts.append(f'<p class="muted">Generated by mltrace {_e(meta.get("mltrace_version", ""))}. Verdict rules: docs/ANALYSIS.md.</p>')
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _services(a: Analysis, top: int) -> str:
    """The requests' latency and the slowest requests' time, the ranks' time with the straggler,
    and the processes' model calls ("" for a run with none of them)."""
    from mltrace.viewers import services as sv

    parts = []
    if a.requests is not None:
        req = a.requests.as_dict()
        rows = [[_e(c) for c in sv.request_cells(r)] for r in req["slowest"][:top]]
        parts += ["<h2>Requests</h2>", f"<p>{_e(sv.requests_headline(req))}</p>", _table(sv.REQUEST_COLUMNS, rows, left=(0, 4, 5, 6))]
    if a.ranks is not None:
        ranks = a.ranks.as_dict()
        rows = [[_e(c) for c in sv.rank_cells(r)] for r in ranks["ranks"]]
        parts += [f"<h2>Ranks: {_e(sv.ranks_headline(ranks))}</h2>", _table(sv.RANK_COLUMNS, rows, left=(0, 5))]
        line = sv.straggler_line(ranks)
        parts += [f"<p>{_e(line)}</p>"] if line else []
    if a.processes is not None:
        processes = [p.as_dict() for p in a.processes]
        rows = [[_e(c) for c in sv.process_cells(p)] for p in processes]
        parts += [f"<h2>Processes: {_e(sv.processes_headline(processes))}</h2>", _table(sv.PROCESS_COLUMNS, rows, left=(0, 2, 6))]
    return "\n".join(parts)


def _memory(mem: MemoryReport, top: int) -> str:
    """The memory section: each device's peak and the layer holding it, the layers by peak
    and the ops by allocated bytes."""
    parts = ["<h2>Memory</h2>"]
    for p in mem.peaks:
        where = f" in <b>{_e(p.layer)}</b>" if p.layer else ""
        parts.append(f"<p>Peak {_e(p.track)}: <b>{_e(fmt_si(p.bytes, 'B'))}</b>{where} <span class=muted>({p.samples} samples)</span></p>")
    headers = ["name", "calls", "peak", "allocated", "freed", "device"]
    for title, rows in (("Layers by peak of one call", mem.layers), ("Ops by allocated bytes", mem.ops)):
        if rows:
            cells = [
                [_e(r.name), str(r.calls), *(_e(fmt_si(v, "B")) for v in (r.peak_bytes, r.alloc_bytes, r.freed_bytes)), _e(r.device)]
                for r in rows[:top]
            ]
            parts.append(f"<h3>{_e(title)}</h3>" + _table(headers, cells, left=(0, 5)))
    return "\n".join(parts)


def _verdict_color(v: Verdict | None) -> str:
    return BOUND_COLORS[v.bound] if v is not None else BOUND_COLORS[Bound.UNKNOWN]


def _charts(a: Analysis, tl: Timeline, top: int) -> str:
    b = a.breakdown
    parts = ["<h2>Time per level</h2>"]
    parts.append(
        _bar_chart(
            [
                (
                    lt.level.label,
                    lt.time_ns,
                    None,
                    LEVEL_COLORS.get(lt.level, "#888"),
                    f"{lt.spans} spans, {_pct(a.level_ns_in_scope.get(lt.level, lt.time_ns), b.base_ns(lt.level))} of model time",
                )
                for lt in b.levels
            ]
        )
    )
    if a.layers:
        parts.append("<h2>Top layers by total time</h2>" + _legend())
        parts.append(
            _bar_chart(
                [
                    (
                        r.stat.name,
                        r.stat.total_ns,
                        r.stat.self_ns,
                        _verdict_color(r.verdict),
                        f"{r.stat.type}: total {fmt_ns(r.stat.total_ns)}, self {fmt_ns(r.stat.self_ns)}"
                        + (f"; {r.verdict.bound.value}: {r.verdict.reason}" if r.verdict else ""),
                    )
                    for r in a.layers[:top]
                ]
            )
        )
    if a.types:
        parts.append("<h2>Layer types by self time</h2>")
        parts.append(
            _bar_chart(
                [
                    (
                        t.type or "(no type)",
                        t.self_ns,
                        None,
                        _verdict_color(t.verdict),
                        f"{t.calls} calls, self {fmt_ns(t.self_ns)}" + (f"; {t.verdict.reason}" if t.verdict else ""),
                    )
                    for t in a.types[:top]
                ]
            )
        )
    if a.peaks is not None:
        roofs = [a.peaks.cpu] + ([a.peaks.gpu] if a.peaks.gpu is not None else [])
        parts.append("<h2>Roofline</h2>")
        parts.append(
            '<p class="muted">Circles: layers (area ∝ time); squares: layer types. '
            + " · ".join(_e(f"{p.device.upper()} roof: {p.name}, {p.source}") for p in roofs)
            + "</p>"
            + _legend()
        )
        parts.append(roofline_svg(a.roofline, roofs))
    if tl.lanes:
        parts.append("<h2>Timeline overview</h2>")
        parts.append(f'<p class="muted">{tl.bins} bins of {_e(fmt_ns(tl.bin_ns))}; darker = busier. Top strip: model calls.</p>')
        parts.append(timeline_svg(tl))
    return "\n".join(parts)


def _hot_lines(run: Run, rows: Sequence[LayerRow], per_layer: int = 3) -> str:
    """Per top layer, the model-code lines py-spy sampled most while it ran (``--py-spy``)."""
    from mltrace.analysis.report_data import hot_lines

    hot = hot_lines(run, [r.stat.name for r in rows])
    if not hot:
        return ""
    items = []
    for r in rows:
        lines = hot.get(r.stat.name)
        if not lines:
            continue
        sampled = sum(ns for _, ns in lines)
        entries = []
        for loc, ns in lines[:per_layer]:
            path, line, function = split_location(loc)
            share = f"{_e(function)} · {_e(fmt_ns(ns))}, {_pct(ns, sampled)} of samples"
            entries.append(f"<li>{_source_html(path, line, around=2)} <span class=muted>{share}</span></li>")
        items.append(f"<li><b>{_e(r.stat.name)}</b> ({_e(r.stat.type)})<ul>{''.join(entries)}</ul></li>")
    return "<h2>Hottest model-code lines per layer (py-spy samples)</h2><ul>" + "".join(items) + "</ul>"


def _tables(run: Run, a: Analysis, top: int) -> str:
    b = a.breakdown
    parts = ["<h2>Time per level (table)</h2>"]
    scoped = bool(a.unscoped_ops[0])  # then the % column counts only what ran in model calls and user spans
    level_rows: list[list[str]] = []
    for lt in b.levels:
        in_scope = a.level_ns_in_scope.get(lt.level, lt.time_ns)
        scoped_cell = [_e(fmt_ns(in_scope))] if scoped else []
        level_rows.append([_e(lt.level.label), str(lt.spans), _e(fmt_ns(lt.time_ns)), *scoped_cell, _pct(in_scope, b.base_ns(lt.level))])
    parts.append(_table(["level", "spans", "time", *(["in model & user spans"] if scoped else []), "% of model"], level_rows))
    if a.layers:
        headers = [
            "layer",
            "type",
            "calls",
            "total",
            "self",
            "% model",
            "verdict",
            "FLOP",
            "bytes",
            "% roofline",
            "why",
            "ops / libraries / kernels",
            "source",
        ]
        left, wrap = (0, 1, 6, 10, 11, 12), (10, 11)
        parts.append("<h2>Top layers by self time</h2>")
        parts.append(_table(headers, _layer_rows(a.top_by_self(top), b), left=left, wrap=wrap))
        parts.append("<details><summary>Top layers by total time (table)</summary>")
        parts.append(_table(headers, _layer_rows(a.layers[:top], b), left=left, wrap=wrap) + "</details>")
        parts.append(_hot_lines(a.tables_run(run), a.top_by_self(top)))
    if a.types:
        parts.append("<h2>By layer type (self time)</h2>")
        parts.append(
            _table(
                ["type", "calls", "total", "self", "% model", "FLOP", "bytes", "verdict", "why"],
                [
                    [
                        _e(t.type),
                        str(t.calls),
                        _e(fmt_ns(t.total_ns)),
                        _e(fmt_ns(t.self_ns)),
                        _pct(t.self_ns, b.base_ns(Level.LAYER)),
                        _e(fmt_si(t.flops, "FLOP")),
                        _e(fmt_si(t.bytes, "B")),
                        _verdict_html(t.verdict),
                        _e(t.verdict.reason) if t.verdict else "",
                    ]
                    for t in a.types[:top]
                ],
                left=(0, 7, 8),
                wrap=(8,),
            )
        )
    if a.ops:
        parts.append("<h2>By op (self time)</h2>")
        parts.append(
            _table(
                ["op", "calls", "total", "self", "mean", "FLOP", "GPU time", "verdict", "why"],
                _name_rows(a.ops[:top], True),
                left=(0, 7, 8),
                wrap=(8,),
            )
        )
    for title, rows, headers in (
        ("By library call", a.libraries, ["library call", "library", "calls", "total", "self", "mean"]),
        ("By GPU kernel", a.kernels, ["kernel", "library", "calls", "total", "self", "mean"]),
        ("By CUDA API call (CPU side)", a.runtime, ["call", "", "calls", "total", "self", "mean"]),
    ):
        if rows:
            parts.append(f"<h2>{_e(title)}</h2>")
            parts.append(_table(headers, _name_rows(rows[:top], False), left=(0, 1)))
    return "\n".join(parts)


def _meta_block(meta: dict[str, object]) -> str:
    host = meta.get("host") if isinstance(meta.get("host"), dict) else {}
    assert isinstance(host, dict)
    rows = []
    command = meta.get("command")
    if isinstance(command, list):
        rows.append(("command", " ".join(str(c) for c in command)))
    for key in ("hostname", "cpu", "cpu_count", "os"):
        if host.get(key):
            rows.append((key, str(host[key])))
    versions = meta.get("versions")
    if isinstance(versions, dict) and versions:
        rows.append(("versions", ", ".join(f"{k} {v}" for k, v in versions.items() if isinstance(v, str))))
    if not rows:
        return ""
    body = "".join(f'<tr><th class="l">{_e(k)}</th><td class="l">{_e(v)}</td></tr>' for k, v in rows)
    return f"<details><summary>Run details</summary><table>{body}</table></details>"


def _links(run: Run, port: int) -> str:
    trace_url = f"http://127.0.0.1:{port}{TRACE_PATH}"
    online = perfetto_url(trace_url)
    offline = f"http://127.0.0.1:{port}/#!/?url={trace_url}"
    trace_file = (run.path / TRACE_FILE).resolve()
    run_arg = _e(run.path)
    return (
        "<h2>Open the trace in Perfetto</h2><ul class=links>"
        f'<li><a href="{_e(online)}">ui.perfetto.dev</a> — first run <code>mltrace view {run_arg}</code></li>'
        f'<li><a href="{_e(offline)}">offline Perfetto UI</a> — first run <code>mltrace view {run_arg} --offline</code></li>'
        f'<li><a href="{_e(trace_file.as_uri())}">{_e(TRACE_FILE)}</a> — or drag the file into any Perfetto UI</li></ul>'
    )


def _cold_item(a: Analysis) -> str:
    """The cold-start finding (``report_data.cold_start_text``), in HTML."""
    return cold_start_text(a, name=lambda s: f"<code>{_e(s)}</code>", text=_e)


def _findings(a: Analysis) -> str:
    f = a.findings
    items: list[str] = [_cold_item(a)] if a.cold_text() else []
    kinds = call_kinds_text(a, name=lambda s: f"<code>{_e(s)}</code>", text=_e)
    items += [kinds] if kinds else []
    items += [_e(g.text()) for g in a.generation]
    total = sum(f.bound_ns.values())
    if total:
        shares = ", ".join(
            f'<span style="color:{BOUND_COLORS[bound]}" class="v">{_e(bound.short)}</span> {100 * ns / total:.0f}%'
            for bound, ns in sorted(f.bound_ns.items(), key=lambda kv: -kv[1])
            if ns
        )
        dominant = f'<span class="v" style="color:{BOUND_COLORS[f.dominant]}">{_e(f.dominant.value)}</span>'
        lead = f"Mostly {dominant}" if f.mostly else f"Mixed, {dominant} the largest known"
        items.append(f"{lead} — share of {_e(f.basis)}: {shares}")
    for idle in f.idle:
        text = _e(idle.headline())
        if idle.gaps:
            g = idle.gaps[0]
            text += f"; largest {_e(fmt_ns(g.duration_ns))} after <code>{_e(g.before[:60])}</code> before <code>{_e(g.after[:60])}</code>"
        items.append(text + _e(idle.tracer_text()))
    if f.device_ns and f.cpu_ns:
        items.append(f"CPU time {_e(fmt_ns(f.cpu_ns))} vs GPU busy {_e(fmt_ns(f.device_ns))}: ratio {f.cpu_ns / f.device_ns:.2f}")
    if f.data_movement_base_ns:
        top = ", ".join(f"<code>{_e(x.name)}</code> {_e(fmt_ns(x.total_ns))}" for x in f.data_movement_top[:3])
        items.append(
            f"Data movement: {_e(fmt_ns(f.data_movement_ns))} ({_pct(f.data_movement_ns, f.data_movement_base_ns)} of op+GPU time)"
            + (f" — {top}" if top else "")
        )
    if f.framework_ns is not None:
        items.append(
            f"Framework overhead (layer time not covered by ops): {_e(fmt_ns(f.framework_ns))} "
            f"({_pct(f.framework_ns, f.framework_base_ns)} of model time)"
        )
    items += [f'<span class="muted">{_e(n)}</span>' for n in f.notes]
    if a.unscoped_ops[0]:
        items.append(f'<span class="muted">{_e(a.unscoped_text())}</span>')
    if a.compile_ops[0]:
        items.append(f'<span class="muted">{_e(a.compile_text())}</span>')
    if a.torch_ranges:
        items.append(f'<span class="muted">{_e(a.torch_ranges_text())}</span>')
    if a.peaks is not None:
        for p in (a.peaks.cpu, a.peaks.gpu):
            if p is not None:
                items.append(
                    f'<span class="muted">Roofline peaks — {_e(p.device.upper())} {_e(p.name)}: {_e(fmt_si(p.flops_per_s, "FLOP/s"))}, '
                    f"{_e(bandwidth_text(p))} (ridge {p.ridge_for(None):.1f} FLOP/B; {_e(p.source)})</span>"
                )
    if not items:
        return ""
    return "<h2>Findings</h2><ul class=findings>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>"
