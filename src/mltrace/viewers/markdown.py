"""The report as Markdown (``mltrace report RUN --format md``), to paste into a pull request.

Drawn from ``analysis.report_data``'s plain data; paths are shortened
(``analysis.codepaths.short_path``) but never cut.
"""

from __future__ import annotations

from typing import Any

from mltrace.analysis.codepaths import short_path, split_location
from mltrace.analysis.units import fmt_ns, fmt_si
from mltrace.viewers.services import (
    PROCESS_COLUMNS,
    RANK_COLUMNS,
    REQUEST_COLUMNS,
    process_cells,
    processes_headline,
    rank_cells,
    ranks_headline,
    request_cells,
    requests_headline,
    straggler_line,
    unfollowed_line,
)


def _cell(text: object) -> str:
    """A table cell: pipes escaped, newlines as spaces."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _code(text: str | None) -> str:
    """Inline code (a path:line, a source line); "" for None."""
    if not text:
        return ""
    fence = "``" if "`" in text else "`"
    return f"{fence}{_cell(text)}{fence}"


def _short(loc: str | None) -> str | None:
    """``path:line`` with its path shortened, or None."""
    if not loc:
        return None
    path, line, _ = split_location(loc)
    return f"{short_path(path)}:{line}" if line is not None else short_path(path)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def render_markdown(data: dict[str, Any], top: int = 15) -> str:
    """The report data as one Markdown document: summary, findings, models, top layers by
    self time (with call site, definition and hot lines), ops."""
    run = data["run"]
    out = [f"## mltrace report — {_cell(run['name'])}", ""]
    out.append(
        f"{run['spans']} spans, {run['model_calls']} model calls, model time {fmt_ns(run['model_ns'])}, wall {fmt_ns(run['wall_ns'])}"
        f"{run.get('counts_note', '')}."
    )
    if not run["complete"]:
        out.append("The run did not finish normally: events up to the last flush.")
    if (run.get("exit") or {}).get("text"):
        out.append(_cell(run["exit"]["text"]))
    out += [_cell(unfollowed_line(note)) for note in run.get("unfollowed") or []]
    out.append("")
    if data["findings"]:
        out += ["### Findings", ""] + [f"- {_cell(f['text'])}" for f in data["findings"]] + [""]
    notes = (run.get("unscoped_ops"), run.get("compile_ops"), run.get("torch_ranges"))
    for note in ((n or {}).get("text") for n in notes):
        if note:
            out += [f"_{_cell(note)}_", ""]
    out += _requests_section(data, top) + _ranks_section(data) + _processes_section(data)
    if data["models"]:
        out += ["### Models", ""]
        out += _table(
            ["model", "calls", "cold", "steady median", "steady p90", "called from"],
            [row for m in data["models"] for row in _model_rows(m)],
        )
        out.append("")
    layers = sorted(data["layers"], key=lambda x: (-(x["self_ns"] - x.get("gc_self_ns", 0)), x["name"]))[:top]
    if layers:
        out += ["### Top layers by self time", ""]
        out += _table(
            ["layer", "type", "calls", "self", "total", "median", "verdict", "source", "defined"], [_layer_row(x) for x in layers]
        )
        out.append("")
        out += _hot_section(layers)
    out += _memory_section(data, top)
    out += _generate_section(data)
    if data["ops"]:
        out += ["### Top ops by self time", ""]
        out += _table(
            ["op", "calls", "self", "total", "FLOP", "verdict"],
            [
                [
                    _code(o["name"]),
                    str(o["calls"]),
                    fmt_ns(o["self_ns"]),
                    fmt_ns(o["total_ns"]),
                    fmt_si(o["flops"], "FLOP") if o["flops"] else "",
                    _verdict(o["verdict"]),
                ]
                for o in data["ops"][:top]
            ],
        )
        out.append("")
    return "\n".join(out)


def _requests_section(data: dict[str, Any], top: int) -> list[str]:
    """The requests' latency and the slowest requests' time: model, outside it, top layers and ops."""
    req = data.get("requests")
    if not req:
        return []
    rows = [[_cell(c) for c in request_cells(r)] for r in req["slowest"][:top]]
    return ["### Requests", "", _cell(requests_headline(req)) + ".", "", *_table(list(REQUEST_COLUMNS), rows), ""]


def _ranks_section(data: dict[str, Any]) -> list[str]:
    """Each rank's model and collective time, and the straggler."""
    ranks = data.get("ranks")
    if not ranks:
        return []
    out = ["### Ranks", "", _cell(ranks_headline(ranks)) + ".", ""]
    out += _table(list(RANK_COLUMNS), [[_cell(c) for c in rank_cells(r)] for r in ranks["ranks"]])
    line = straggler_line(ranks)
    return [*out, *(["", _cell(line) + "."] if line else []), ""]


def _processes_section(data: dict[str, Any]) -> list[str]:
    """Each process's model calls and spans (a run of several processes)."""
    processes = data.get("processes")
    if not processes:
        return []
    out = ["### Processes", "", _cell(processes_headline(processes)) + ".", ""]
    return [*out, *_table(list(PROCESS_COLUMNS), [[_cell(c) for c in process_cells(p)] for p in processes]), ""]


def _memory_section(data: dict[str, Any], top: int) -> list[str]:
    """Each device's peak and the layer holding it, and the layers by peak (runs recorded with ``--memory``)."""
    memory = data.get("memory")
    if not memory:
        return []
    out = ["### Memory", ""]
    out += _table(
        ["device", "peak", "held by layer", "samples"],
        [[_cell(p["track"]), fmt_si(p["bytes"], "B"), _cell(p["layer"] or ""), str(p["samples"])] for p in memory["peaks"]],
    )
    layers = sorted((x for x in data["layers"] if x.get("peak_alloc_bytes")), key=lambda x: (-x["peak_alloc_bytes"], x["name"]))[:top]
    if layers:
        out += ["", "Layers by peak of live memory while they ran:", ""]
        out += _table(
            ["layer", "peak", "allocated"],
            [[_cell(x["name"]), fmt_si(x["peak_alloc_bytes"], "B"), fmt_si(x["alloc_bytes"] or 0, "B")] for x in layers],
        )
    return [*out, ""]


def _generate_section(data: dict[str, Any]) -> list[str]:
    """One row per Hugging Face ``generate()`` call: tokens, time to first token, per output token."""
    calls = data.get("generate") or []
    if not calls:
        return []
    rows = [
        [
            _cell(g["model"]),
            str(g["new_tokens"]) if g["new_tokens"] is not None else "",
            fmt_ns(g["total_ns"]),
            _opt_ns(g["ttft_ns"]),
            _opt_ns(g["tpot_median_ns"]),
            _opt_ns(g["tpot_p90_ns"]),
            f"{g['tokens_per_s']:.1f}" if g["tokens_per_s"] is not None else "",
            _source_cell(g),
        ]
        for g in calls
    ]
    headers = ["generate", "new tokens", "total", "first token", "per token (median)", "per token (p90)", "tokens/s", "called from"]
    return ["### Generation", "", *_table(headers, rows), ""]


def _model_rows(m: dict[str, Any]) -> list[list[str]]:
    """A model's row in the Models table and, where its calls are of several kinds (``kinds``),
    a row per kind under it: the model's own steady figures would mix them, so its row leaves
    them to the kinds' rows."""
    kinds = m.get("kinds") or []
    cold = f"{m['cold_calls']} ({fmt_ns(m['cold_ns'])})" if m["cold_calls"] else "0"
    steady = [_opt_ns(m["steady_median_ns"]), _opt_ns(m["steady_p90_ns"])] if not kinds else ["per kind", "per kind"]
    rows = [[_cell(m["name"]), str(m["calls"]), cold, *steady, _code(_short(m["source"]))]]
    for k in kinds:
        median, p90 = _opt_ns(k["steady_median_ns"]), _opt_ns(k["steady_p90_ns"])
        rows.append([f"↳ {_cell(k['kind'])}", str(k["calls"]), str(k["cold_calls"]), median, p90, ""])
    return rows


def _opt_ns(ns: int | None) -> str:
    return fmt_ns(ns) if ns is not None else ""


def _verdict(v: str | None) -> str:
    return v.split("-")[0] if v else ""


def _source_cell(x: dict[str, Any]) -> str:
    """``path:line`` shortened and the line's code, of a layers[] or generate[] entry."""
    source = _code(_short(x["source"]))
    if x["source_text"]:
        source += " " + _code(x["source_text"])
    return source


def _layer_row(x: dict[str, Any]) -> list[str]:
    return [
        _code(x["name"]),
        _cell(x["type"]),
        str(x["calls"]),
        fmt_ns(x["self_ns"]) + (f" (GC {fmt_ns(x['gc_self_ns'])})" if x.get("gc_self_ns") else ""),
        fmt_ns(x["total_ns"]),
        _opt_ns(x["median_ns"]),
        _verdict(x["verdict"]),
        _source_cell(x),
        _code(_short(x["defined"])),
    ]


def _hot_section(layers: list[dict[str, Any]]) -> list[str]:
    """Per sampled layer, its hottest model-code lines (py-spy)."""
    sampled = [x for x in layers if x["hot_lines"]]
    if not sampled:
        return []
    out = ["### Hottest model-code lines per layer (py-spy)", ""]
    for x in sampled:
        lines = ", ".join(f"{_code(_short(h['line']))} {_cell(h['function'])} {fmt_ns(h['ns'])}" for h in x["hot_lines"][:3])
        out.append(f"- {_code(x['name'])}: {lines}")
    return [*out, ""]
