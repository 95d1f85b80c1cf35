"""Draws ``mltrace bench``'s results: the leveled figures and the sweep as text tables
(``print_leveled``, ``print_sweep``) and the sweep as an SVG plot (``render_sweep_svg``)."""

from __future__ import annotations

import math
import sys
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mltrace.analysis.leveled import LeveledResult
    from mltrace.analysis.sweep import SweepResult


# -- text --------------------------------------------------------------------------------


def _ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.3f} ms"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def print_leveled(result: LeveledResult, file: IO[str] | None = None) -> None:
    """Prints the leveled figures: per model, per level, with inflations and mismatches."""
    from mltrace.run.levels import Level

    out = file or sys.stdout
    levels = result.levels
    out.write(f"leveled runs: {', '.join(lv.label for lv in levels)}; 20% trimmed means after {result.warmup} warm-up call(s)\n")
    out.write("a level's time sums its leaf layers (layer level) or its outermost spans (other levels)\n")
    for label, why in result.skipped.items():
        out.write(f"  level {label} skipped: {why}\n")
    for m in result.models:
        out.write(f"\n{m.label}\n")
        if m.plain is not None:
            out.write(
                f"  plain (uninstrumented): median {_ms(m.plain.median_ns)}, trimmed mean {_ms(m.plain.mean_ns)}, "
                f"spread ±{m.plain.spread_pct:.1f}% (n={m.plain.n})\n"
            )
        head = f"  {'level':<8} {'leveled':>12}  " + "  ".join(f"{'in ' + lv.label + ' run':>14}" for lv in levels)
        out.write(head + "\n")
        for lt in m.levels:
            cells = []
            for lv in levels:
                if lv not in lt.by_run_ns:
                    cells.append(f"{'':>14}")
                elif lv == lt.source:
                    cells.append(f"{'(estimate)':>14}")
                else:
                    cells.append(f"{_pct(lt.inflation_pct(lv)):>14}")
            out.write(f"  {lt.level.label:<8} {_ms(lt.estimate_ns):>12}  " + "  ".join(cells) + "\n")
        model_row = m.level(Level.MODEL)
        if m.plain is not None and model_row is not None:
            full = model_row.by_run_ns.get(result.deepest)
            full_pct = 100.0 * (full / m.plain.median_ns - 1) if full is not None and m.plain.median_ns else None
            out.write(
                f"  vs plain median: leveled model {_pct(m.vs_plain_pct(Level.MODEL))}, "
                f"sum of leaf layers {_pct(m.vs_plain_pct(Level.LAYER))}, naive full trace ({result.deepest.label}) {_pct(full_pct)}\n"
            )
            if m.round_ratios:
                out.write(
                    f"  round by round (model-level run / plain run of the same round, median of {len(m.round_ratios)}): "
                    f"leveled model {_pct(m.paired_vs_plain_pct)}\n"
                )
    if result.overflows:
        out.write(f"\n{len(result.overflows)} parent(s) shorter than their children's estimates (children scaled to fit):\n")
        for o in result.overflows[:5]:
            out.write(f"  {o.model}: {o.path}: children {_ms(o.children_ns)} > parent {_ms(o.parent_ns)} (scale {o.scale:.3f})\n")
    if result.mismatches:
        out.write(f"\n{len(result.mismatches)} mismatch(es) across runs:\n")
        for x in result.mismatches[:10]:
            where = f" {x.path}" if x.path else ""
            out.write(f"  [{x.kind}] {x.model}:{where} {x.detail}\n")
        if len(result.mismatches) > 10:
            out.write(f"  … {len(result.mismatches) - 10} more in leveled.json\n")
    else:
        out.write("\nevery span matched across runs\n")


def print_sweep(result: SweepResult, file: IO[str] | None = None) -> None:
    """Prints one row per scenario and model: p50/p90/p99 latency and throughput."""
    out = file or sys.stdout
    out.write(f"{result.n} measured calls per scenario after {result.warmup} warm-up; trace level {result.level}\n")
    out.write(f"{'scenario':<18} {'model':<36} {'calls':>5} {'p50 ms':>10} {'p90 ms':>10} {'p99 ms':>10} {'samples/s':>11}\n")
    for s in result.scenarios:
        if s.status != 0 or not s.models:
            why = f"failed (exit {s.status})" if s.status != 0 else "no model calls traced"
            detail = s.error.splitlines()[-1] if s.error else ""
            out.write(f"{s.spec.label:<18} {why}: {detail}\n")
            continue
        for m in s.models:
            out.write(
                f"{s.spec.label:<18} {m.model[:36]:<36} {m.calls:>5} {m.p50_ms:>10.3f} {m.p90_ms:>10.3f} {m.p99_ms:>10.3f} "
                f"{m.throughput:>11.1f}\n"
            )


# -- the sweep's SVG plot (no plotting library) ----------------------------------------

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22")
_DASHES = {"p50": "", "p90": "6,3", "p99": "2,3"}


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _nice_max(v: float) -> float:
    if v <= 0:
        return 1.0
    exp = math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * 10**exp:
            return float(m * 10**exp)
    return float(10 ** (exp + 1))


def render_sweep_svg(sweep: SweepResult, title: str = "sweep") -> str:
    """Two panels: latency (p50 solid, p90 dashed, p99 dotted) and throughput, against batch size.

    One line per (model, precision, threads) series; failed scenarios leave a
    gap. A panel whose values span more than a factor 30 uses a log scale.
    Hovering a point shows its figures (SVG ``<title>``).

    Returns:
        The SVG document (str).
    """
    series = sweep.series()
    batches = sorted({s.spec.batch for s in sweep.scenarios})
    width, height = 1000, 460
    panel_w, panel_h = 400, 300
    left = (70, 570)
    top = 60
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'font-family="sans-serif" font-size="12">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{width / 2}" y="24" text-anchor="middle" font-size="16">{_esc(title)}</text>',
    ]
    panels = (("latency (ms)", ("p50", "p90", "p99")), ("throughput (samples/s)", ("throughput",)))
    for (label, stats), x0 in zip(panels, left):
        values = [
            getattr(pt, "throughput" if st == "throughput" else f"{st}_ms")
            for pts in series.values()
            for pt in pts
            for st in stats
            if pt is not None
        ]
        positive = [v for v in values if v > 0]
        # Spread over more than ~1.5 decades (a contended scenario next to calm ones): log scale.
        log = len(positive) > 1 and max(positive) / min(positive) > 30
        lo, hi, ymax = 0, 1, 1.0
        if log:
            lo, hi = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
            hi = max(hi, lo + 1)
            ticks = [(float(10**e), (e - lo) / (hi - lo)) for e in range(lo, hi + 1)]
        else:
            ymax = _nice_max(max(values, default=1.0))
            ticks = [(ymax * k / 5, k / 5) for k in range(6)]

        def ypos(v: float, log: bool = log, lo: int = lo, hi: int = hi, ymax: float = ymax) -> float:
            if log:
                frac = (math.log10(max(v, 10.0**lo)) - lo) / (hi - lo)
            else:
                frac = v / ymax
            return top + panel_h - panel_h * frac

        title = f"{label}, log scale" if log else label
        parts.append(f'<text x="{x0 + panel_w / 2}" y="{top - 12}" text-anchor="middle" font-size="13">{_esc(title)}</text>')
        parts.append(f'<rect x="{x0}" y="{top}" width="{panel_w}" height="{panel_h}" fill="none" stroke="#444"/>')
        for value, frac in ticks:
            y = top + panel_h - panel_h * frac
            parts.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + panel_w}" y2="{y:.1f}" stroke="#ddd"/>')
            parts.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{value:g}</text>')

        def xpos(b: int, x0: int = x0) -> float:
            i = batches.index(b)
            return x0 + panel_w * (i + 0.5) / len(batches)

        for b in batches:
            parts.append(f'<text x="{xpos(b):.1f}" y="{top + panel_h + 16}" text-anchor="middle">{b}</text>')
        parts.append(f'<text x="{x0 + panel_w / 2}" y="{top + panel_h + 34}" text-anchor="middle">batch size</text>')
        for si, (key, pts) in enumerate(series.items()):
            color = _COLORS[si % len(_COLORS)]
            for st in stats:
                dash = _DASHES.get(st, "")
                coords: list[tuple[float, float, Any]] = []
                for pt in pts:
                    if pt is None:
                        continue
                    v = pt.throughput if st == "throughput" else getattr(pt, f"{st}_ms")
                    coords.append((xpos(pt.batch), ypos(v), pt))
                if len(coords) > 1:
                    d = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in coords)
                    dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
                    parts.append(f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="2"{dash_attr}/>')
                for x, y, pt in coords:
                    tip = (
                        f"{key} batch {pt.batch}: p50 {pt.p50_ms:.3f} ms, p90 {pt.p90_ms:.3f} ms, p99 {pt.p99_ms:.3f} ms, "
                        f"{pt.throughput:.1f} samples/s"
                    )
                    parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"><title>{_esc(tip)}</title></circle>')
    ly = top + panel_h + 56
    for si, key in enumerate(series):
        color = _COLORS[si % len(_COLORS)]
        x = 70
        y = ly + si * 16
        parts.append(f'<line x1="{x}" y1="{y - 4}" x2="{x + 20}" y2="{y - 4}" stroke="{color}" stroke-width="2"/>')
        parts.append(f'<text x="{x + 26}" y="{y}">{_esc(key)}</text>')
    ky = ly + len(series) * 16 + 4
    for i, (st, dash) in enumerate(_DASHES.items()):
        x = 70 + i * 120
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(f'<line x1="{x}" y1="{ky - 4}" x2="{x + 30}" y2="{ky - 4}" stroke="#444" stroke-width="2"{dash_attr}/>')
        parts.append(f'<text x="{x + 36}" y="{ky}">{st}</text>')
    needed = ky + 16
    if needed > height:
        parts[0] = parts[0].replace(f'height="{height}"', f'height="{needed}"').replace(f"0 0 {width} {height}", f"0 0 {width} {needed}")
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
