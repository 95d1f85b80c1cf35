"""Reads a .pftrace back with the perfetto protos into slices (for tests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Slice:
    name: str
    category: str
    track_uuid: int
    start: int
    end: int = -1
    depth: int = 0
    args: dict[str, Any] = field(default_factory=dict)
    flow_ids: list[int] = field(default_factory=list)
    terminating_flow_ids: list[int] = field(default_factory=list)


@dataclass
class ParsedTrace:
    slices: list[Slice]
    tracks: dict[int, Any]
    counters: dict[int, list[tuple[int, float]]]
    packets: int


def parse_pftrace(path: Path) -> ParsedTrace:
    """Parses the file; slices are rebuilt from BEGIN/END pairs per track in timestamp order."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    trace = pb.Trace.FromString(Path(path).read_bytes())
    names: dict[int, str] = {}
    cats: dict[int, str] = {}
    ann: dict[int, str] = {}
    strings: dict[int, str] = {}  # interned annotation string values
    tracks: dict[int, Any] = {}
    events: list[tuple[int, int, Any]] = []
    for order, p in enumerate(trace.packet):
        if p.sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED:
            names.clear()
            cats.clear()
            ann.clear()
            strings.clear()
        if p.HasField("interned_data"):
            for e in p.interned_data.event_names:
                names[e.iid] = e.name
            for e in p.interned_data.event_categories:
                cats[e.iid] = e.name
            for e in p.interned_data.debug_annotation_names:
                ann[e.iid] = e.name
            for e in p.interned_data.debug_annotation_string_values:
                strings[e.iid] = e.str.decode()
        if p.HasField("track_descriptor"):
            tracks[p.track_descriptor.uuid] = p.track_descriptor
        if p.HasField("track_event"):
            te = p.track_event
            resolved = {
                "type": te.type,
                "name": names.get(te.name_iid, te.name),
                "cat": cats.get(te.category_iids[0], "") if te.category_iids else "",
                "track": te.track_uuid,
                "args": {},
                "counter": te.double_counter_value,
                "flow_ids": list(te.flow_ids),
                "terminating_flow_ids": list(te.terminating_flow_ids),
            }
            for da in te.debug_annotations:
                key = ann.get(da.name_iid, da.name)
                kind = da.WhichOneof("value")
                if kind == "string_value_iid":
                    assert da.string_value_iid in strings, f"string value {da.string_value_iid} used before it was interned"
                    resolved["args"][key] = strings[da.string_value_iid]
                else:
                    resolved["args"][key] = getattr(da, kind) if kind else None
            events.append((p.timestamp, order, resolved))
    events.sort(key=lambda e: (e[0], e[1]))
    stacks: dict[int, list[Slice]] = {}
    slices: list[Slice] = []
    counters: dict[int, list[tuple[int, float]]] = {}
    for ts, _, e in events:
        if e["type"] == pb.TrackEvent.TYPE_SLICE_BEGIN:
            st = stacks.setdefault(e["track"], [])
            s = Slice(
                e["name"],
                e["cat"],
                e["track"],
                ts,
                depth=len(st),
                args=e["args"],
                flow_ids=e["flow_ids"],
                terminating_flow_ids=e["terminating_flow_ids"],
            )
            st.append(s)
            slices.append(s)
        elif e["type"] == pb.TrackEvent.TYPE_SLICE_END:
            st = stacks.get(e["track"])
            assert st, f"SLICE_END without BEGIN on track {e['track']} at {ts}"
            st.pop().end = ts
        elif e["type"] == pb.TrackEvent.TYPE_COUNTER:
            counters.setdefault(e["track"], []).append((ts, e["counter"]))
    return ParsedTrace(slices, tracks, counters, len(trace.packet))
