"""Chrome trace-event JSON export (chrome://tracing, Perfetto's legacy importer).

Spans become complete ("X") events with µs timestamps relative to the run's
first event; GPU streams get a process per GPU; flows become "s"/"f" pairs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mltrace.run.events import TrackKind
from mltrace.run.store import Run


def chrome_events(run: Run) -> list[dict[str, Any]]:
    """The trace events of ``run`` as Chrome JSON dicts."""
    t0 = min((s.start_ns for s in run.spans), default=0)
    out: list[dict[str, Any]] = []
    where: dict[int, tuple[Any, Any]] = {}
    for t in run.tracks.values():
        if t.kind == TrackKind.GPU_STREAM:
            pid: Any = f"GPU {t.device}"
            tid: Any = f"stream {t.stream}"
        elif t.kind == TrackKind.COUNTER:
            pid, tid = t.pid, 0
        elif t.kind == TrackKind.ASYNC:
            pid, tid = t.pid, t.name
        else:
            pid, tid = t.pid, t.tid
        where[t.id] = (pid, tid)
        if t.kind in (TrackKind.THREAD, TrackKind.ASYNC, TrackKind.GPU_STREAM):
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": t.name}})
    for s in run.spans:
        pid, tid = where.get(s.track_id, (0, s.track_id))
        out.append(
            {
                "ph": "X",
                "name": s.name,
                "cat": s.level.label,
                "ts": (s.start_ns - t0) / 1e3,
                "dur": s.duration_ns / 1e3,
                "pid": pid,
                "tid": tid,
                "args": {"mltrace.span.id": s.id, "mltrace.parent.id": s.parent_id, **s.attrs},
            }
        )
    by_id = {s.id: s for s in run.spans}
    for f in run.flows:
        a, b = by_id.get(f.from_span), by_id.get(f.to_span)
        if a is None or b is None:
            continue
        pa, ta = where.get(a.track_id, (0, a.track_id))
        pb, tb = where.get(b.track_id, (0, b.track_id))
        out.append({"ph": "s", "id": f.id, "name": f.kind, "cat": f.kind, "ts": (a.start_ns - t0) / 1e3, "pid": pa, "tid": ta})
        out.append({"ph": "f", "bp": "e", "id": f.id, "name": f.kind, "cat": f.kind, "ts": (b.start_ns - t0) / 1e3, "pid": pb, "tid": tb})
    for c in run.counters:
        counter_track = run.tracks.get(c.track_id)
        name = counter_track.name if counter_track else str(c.track_id)
        pid = where.get(c.track_id, (0, 0))[0]
        out.append({"ph": "C", "name": name, "ts": (c.ts_ns - t0) / 1e3, "pid": pid, "args": {"value": c.value}})
    for i in run.instants:
        pid, tid = where.get(i.track_id, (0, i.track_id))
        ts = (i.ts_ns - t0) / 1e3
        out.append({"ph": "i", "s": "t", "name": i.name, "cat": i.level.label, "ts": ts, "pid": pid, "tid": tid, "args": i.attrs})
    return out


def export_chrome_json(run: Run, dest: Path) -> Path:
    """Writes ``dest`` (atomically) as ``{"traceEvents": [...], "metadata": {...}}``."""
    doc = {"traceEvents": chrome_events(run), "displayTimeUnit": "ns", "metadata": {"mltrace": run.meta.get("name", "")}}
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, default=str)
    os.replace(tmp, dest)
    return dest
