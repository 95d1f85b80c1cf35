"""The words and table cells of the report's requests, ranks and processes sections, and of its
line on a child that could not be followed, shared by the terminal, Markdown and HTML reports.

Drawn from the report JSON's ``requests``, ``ranks`` and ``processes`` sections and
``run.unfollowed`` entries (``Requests.as_dict``, ``RankTimes.as_dict``,
``ProcessRow.as_dict``, ``report_data.unfollowed``); plain text, no markup: each viewer escapes
it its own way.
"""

from __future__ import annotations

from typing import Any

from mltrace.analysis.codepaths import short_path, split_location
from mltrace.analysis.units import fmt_ns

#: Columns of the slowest-requests table (the first is left-justified, times right).
REQUEST_COLUMNS = ("request", "total", "model", "outside the model", "of which", "top layers (self)", "top ops (self)")
#: Columns of the ranks table.
RANK_COLUMNS = ("rank", "pid", "model calls", "model time", "in collectives", "collectives")
#: Columns of the processes table.
PROCESS_COLUMNS = ("process", "pid", "started by", "model calls", "model time", "spans", "note")
_SOURCES = {"otel-server": "OpenTelemetry server spans", "user": "user spans around model calls"}


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "-"


def _short(loc: str) -> str:
    """``path:line`` with its path shortened (``codepaths.short_path``)."""
    path, line, _ = split_location(loc)
    return f"{short_path(path)}:{line}" if line is not None else short_path(path)


def requests_headline(req: dict[str, Any]) -> str:
    """``12 requests (OpenTelemetry server spans: POST /predict): p50 …, p90 …, p99 …; model 46% of their time``."""
    names = ", ".join(req["names"][:3]) + (", …" if len(req["names"]) > 3 else "")
    count = f"{req['count']} request" + ("" if req["count"] == 1 else "s")
    latency = f"p50 {fmt_ns(req['p50_ns'])}, p90 {fmt_ns(req['p90_ns'])}, p99 {fmt_ns(req['p99_ns'])}"
    share = _pct(req["model_ns"], req["total_ns"])
    paused = f"; mltrace's own pauses ({fmt_ns(req['paused_ns'])}) left out" if req["paused_ns"] else ""
    return f"{count} ({_SOURCES.get(req['source'], req['source'])}: {names}): {latency}; model {share} of their time{paused}"


def request_cells(r: dict[str, Any]) -> list[str]:
    """One slowest request's row, in ``REQUEST_COLUMNS`` order."""
    name = r["name"] + (f" {r['label']}" if r["label"] else "") + (f" at {_short(r['source'])}" if r["source"] else "")
    calls = f" ({r['model_calls']} call{'' if r['model_calls'] == 1 else 's'})"
    parts = [
        f"{what} {fmt_ns(r[key])}"
        for what, key in (("before", "before_model_ns"), ("between", "between_models_ns"), ("after", "after_model_ns"))
        if r[key]
    ]
    if r["outside_ops_ns"]:
        parts.append(f"ops {fmt_ns(r['outside_ops_ns'])}")
    if r["paused_ns"]:
        parts.append(f"mltrace's own pauses {fmt_ns(r['paused_ns'])} left out")
    layers = ", ".join(f"{x['name']}" + (f" ({x['type']})" if x["type"] else "") + f" {fmt_ns(x['ns'])}" for x in r["layers"])
    ops = ", ".join(f"{x['name']} {fmt_ns(x['ns'])}" for x in r["ops"])
    return [
        name,
        fmt_ns(r["total_ns"]),
        fmt_ns(r["model_ns"]) + calls,
        f"{fmt_ns(r['outside_ns'])} ({_pct(r['outside_ns'], r['total_ns'])})",
        ", ".join(parts),
        layers,
        ops,
    ]


def ranks_headline(ranks: dict[str, Any]) -> str:
    """``2 ranks (world size 2, gloo)``."""
    n = len(ranks["ranks"])
    facts = [f"world size {ranks['world_size']}" if ranks["world_size"] is not None else "", ranks["backend"] or ""]
    facts = [f for f in facts if f]
    return f"{n} rank{'' if n == 1 else 's'}" + (f" ({', '.join(facts)})" if facts else "")


def rank_cells(r: dict[str, Any]) -> list[str]:
    """One rank's row, in ``RANK_COLUMNS`` order."""
    colls = ", ".join(f"{c['name']} ×{c['spans']} {fmt_ns(c['ns'])}" for c in r["collectives"][:3])
    return [str(r["rank"]), str(r["pid"]), str(r["model_calls"]), fmt_ns(r["model_ns"]), fmt_ns(r["collective_ns"]), colls]


def straggler_line(ranks: dict[str, Any]) -> str | None:
    """The straggler and its numbers, or None when there is none."""
    slow = ranks["straggler"]
    if slow is None:
        return None
    setup = {r["rank"]: r.get("setup_ns", 0) for r in ranks["ranks"]}
    times = {r["rank"]: r["collective_ns"] - setup[r["rank"]] for r in ranks["ranks"]}
    most = max(times, key=lambda k: (times[k], -k))
    longest = max(setup, key=lambda k: (setup[k], -k))
    after = " from their first model call on" if setup[longest] else ""
    line = (
        f"Straggler: rank {slow} waits least in collectives{after} ({fmt_ns(times[slow])}, against {fmt_ns(times[most])} on rank {most}): "
        "the other ranks wait for it"
    )
    if setup[longest]:
        line += f"; before it (set-up), rank {longest} waited {fmt_ns(setup[longest])} in collectives for the others' start-up"
    return line


def unfollowed_line(note: dict[str, Any]) -> str:
    """``Limitation: process 123 (python -c …) was not followed: why``, on one line (the terminal
    report prints run.json's limitation, which says the same)."""
    text = f"Limitation: process {note['pid']} ({' '.join(note['argv'])}) was not followed: {note['reason']}"
    return text.replace("\n", " ")


def processes_headline(processes: list[dict[str, Any]]) -> str:
    """``4 processes, 2 with model calls``."""
    calling = sum(1 for p in processes if p["model_calls"])
    return f"{len(processes)} processes, {calling} with model calls"


def process_cells(p: dict[str, Any]) -> list[str]:
    """One process's row, in ``PROCESS_COLUMNS`` order."""
    started = f"{p['parent']} ({p['start']})" if p["parent"] and p["start"] else p["parent"] or p["start"] or ""
    return [p["role"], str(p["pid"]), started, str(p["model_calls"]), fmt_ns(p["model_ns"]), str(p["spans"]), p["note"]]
