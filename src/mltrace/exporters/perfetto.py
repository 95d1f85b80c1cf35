"""Perfetto export: native TrackEvent protobuf, streamed.

Tracks map to Perfetto tracks (process → thread tracks; one track per GPU
stream under a "GPU n" group; counter tracks), spans to SLICE_BEGIN/SLICE_END
pairs with the level as category and attributes as debug annotations, flows to
``flow_ids``/``terminating_flow_ids``. Event names, categories and annotation
names are interned per sequence.

A ``Trace`` proto is a repeated ``packet`` field, so appending serialized
packets to a file keeps it a valid trace after every flush; the trace processor
sorts packets by timestamp on load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from mltrace.tracer.levels import Level
from mltrace.tracer.model import CounterSample, Flow, Instant, Span, Track, TrackKind

_SEQ_ID = 1
_PROCESS_BASE = 1 << 48
_GPU_GROUP_BASE = 2 << 48
_TRACK_BASE = 3 << 48


def _pb() -> Any:
    # Generated protos from the `perfetto` package; imported on first use only.
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2

    return perfetto_trace_pb2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _frame(packet_bytes: bytes) -> bytes:
    # Trace.packet is field 1, wire type 2 (length-delimited).
    return b"\x0a" + _varint(len(packet_bytes)) + packet_bytes


class PerfettoEncoder:
    """Encodes mltrace events as framed TracePackets on one sequence.

    Keeps the interning tables and the set of tracks already described, so it
    can encode a run in several batches (streaming) or at once.
    """

    def __init__(self, meta: dict[str, Any] | None = None) -> None:
        self.pb = _pb()
        self.meta = meta or {}
        self._names: dict[str, int] = {}
        self._cats: dict[str, int] = {}
        self._ann: dict[str, int] = {}
        self._described: set[int] = set()
        self._processes: set[int] = set()
        self._gpu_groups: set[tuple[int, int]] = set()
        self._tracks: dict[int, Track] = {}
        self._first = True
        self.packets = 0

    # -- descriptors -----------------------------------------------------

    def _packet(self) -> Any:
        p = self.pb.TracePacket()
        p.trusted_packet_sequence_id = _SEQ_ID
        if self._first:
            p.sequence_flags = self.pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
            self._first = False
        return p

    def _process_name(self, pid: int) -> str:
        if pid == self.meta.get("pid"):
            name = self.meta.get("name") or "mltrace"
            return f"{name} (pid {pid})"
        return f"pid {pid}"

    def _describe(self, track: Track, out: list[bytes]) -> None:
        if track.id in self._described:
            return
        pb = self.pb
        if track.pid not in self._processes:
            self._processes.add(track.pid)
            p = self._packet()
            td = p.track_descriptor
            td.uuid = _PROCESS_BASE + track.pid
            td.process.pid = track.pid
            td.process.process_name = self._process_name(track.pid)
            out.append(_frame(p.SerializeToString()))
        p = self._packet()
        td = p.track_descriptor
        td.uuid = _TRACK_BASE + track.id
        if track.kind == TrackKind.THREAD:
            td.parent_uuid = _PROCESS_BASE + track.pid
            td.thread.pid = track.pid
            td.thread.tid = track.tid
            td.thread.thread_name = track.name
        elif track.kind == TrackKind.GPU_STREAM:
            key = (track.pid, track.device)
            group_uuid = _GPU_GROUP_BASE + (track.pid << 8) + max(track.device, 0)
            if key not in self._gpu_groups:
                self._gpu_groups.add(key)
                g = self._packet()
                g.track_descriptor.uuid = group_uuid
                g.track_descriptor.name = f"GPU {track.device}"
                out.append(_frame(g.SerializeToString()))
            td.parent_uuid = group_uuid
            td.name = f"stream {track.stream}"
        elif track.kind == TrackKind.COUNTER:
            td.parent_uuid = _PROCESS_BASE + track.pid
            td.name = track.name + (f" ({track.unit})" if track.unit else "")
            td.counter.SetInParent()
        else:
            td.parent_uuid = _PROCESS_BASE + track.pid
            td.name = track.name
        del pb
        self._described.add(track.id)
        out.append(_frame(p.SerializeToString()))

    # -- interning -------------------------------------------------------

    def _iid(self, table: dict[str, int], value: str, interned: Any, field: str) -> int:
        iid = table.get(value)
        if iid is None:
            iid = len(table) + 1
            table[value] = iid
            entry = getattr(interned, field).add()
            entry.iid = iid
            entry.name = value
        return iid

    # -- events ----------------------------------------------------------

    def _annotate(self, te: Any, attrs: dict[str, Any], interned: Any) -> None:
        for key, value in attrs.items():
            if value is None:
                continue
            da = te.debug_annotations.add()
            da.name_iid = self._iid(self._ann, key, interned, "debug_annotation_names")
            if isinstance(value, bool):
                da.bool_value = value
            elif isinstance(value, int):
                if -(1 << 63) <= value < (1 << 63):
                    da.int_value = value
                else:
                    da.string_value = str(value)
            elif isinstance(value, float):
                da.double_value = value
            elif isinstance(value, str):
                da.string_value = value
            else:
                da.string_value = json.dumps(value, separators=(",", ":"), default=str)

    def _slice_begin(self, span: Span, flows_out: list[int], flows_in: list[int]) -> bytes:
        pb = self.pb
        p = self._packet()
        p.timestamp = span.start_ns
        te = p.track_event
        te.type = pb.TrackEvent.TYPE_SLICE_BEGIN
        te.track_uuid = _TRACK_BASE + span.track_id
        interned = p.interned_data
        te.name_iid = self._iid(self._names, span.name, interned, "event_names")
        te.category_iids.append(self._iid(self._cats, span.level.label, interned, "event_categories"))
        if flows_out:
            te.flow_ids.extend(flows_out)
        if flows_in:
            te.terminating_flow_ids.extend(flows_in)
        self._annotate(te, span.attrs, interned)
        if not p.interned_data.ListFields():
            p.ClearField("interned_data")
        p.sequence_flags |= pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
        return _frame(p.SerializeToString())

    def _slice_end(self, span: Span) -> bytes:
        p = self._packet()
        p.timestamp = span.end_ns
        te = p.track_event
        te.type = self.pb.TrackEvent.TYPE_SLICE_END
        te.track_uuid = _TRACK_BASE + span.track_id
        return _frame(p.SerializeToString())

    def _instant(self, ev: Instant) -> bytes:
        pb = self.pb
        p = self._packet()
        p.timestamp = ev.ts_ns
        te = p.track_event
        te.type = pb.TrackEvent.TYPE_INSTANT
        te.track_uuid = _TRACK_BASE + ev.track_id
        interned = p.interned_data
        te.name_iid = self._iid(self._names, ev.name, interned, "event_names")
        te.category_iids.append(self._iid(self._cats, ev.level.label, interned, "event_categories"))
        self._annotate(te, ev.attrs, interned)
        if not p.interned_data.ListFields():
            p.ClearField("interned_data")
        p.sequence_flags |= pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
        return _frame(p.SerializeToString())

    def _counter(self, c: CounterSample) -> bytes:
        p = self._packet()
        p.timestamp = c.ts_ns
        te = p.track_event
        te.type = self.pb.TrackEvent.TYPE_COUNTER
        te.track_uuid = _TRACK_BASE + c.track_id
        te.double_counter_value = float(c.value)
        return _frame(p.SerializeToString())

    def encode(
        self,
        *,
        tracks: Iterable[Track] = (),
        spans: Iterable[Span] = (),
        instants: Iterable[Instant] = (),
        counters: Iterable[CounterSample] = (),
        flows: Iterable[Flow] = (),
    ) -> bytes:
        """Encodes one batch; returns framed packets ready to append to a trace file.

        Spans are written begin and end in an order that nests correctly for
        equal timestamps (outer begins first, inner ends first).
        """
        out: list[bytes] = []
        for t in tracks:
            self._tracks[t.id] = t
        for t in list(self._tracks.values()):
            self._describe(t, out)
        span_list = list(spans)
        flow_out: dict[int, list[int]] = {}
        flow_in: dict[int, list[int]] = {}
        for f in flows:
            flow_out.setdefault(f.from_span, []).append(f.id)
            flow_in.setdefault(f.to_span, []).append(f.id)
        depth = _depths(span_list)
        # (timestamp, phase, tiebreak, kind, object); phase 0 = end, 1 = begin/instant/counter.
        records: list[tuple[int, int, int, int, Any]] = []
        for s in span_list:
            d = depth.get(s.id, 0)
            records.append((s.start_ns, 1, d, 0, s))
            # A zero-length span's end must follow its own begin.
            records.append((s.end_ns, 0 if s.end_ns > s.start_ns else 2, -d, 1, s))
        for i in instants:
            records.append((i.ts_ns, 1, 1 << 20, 2, i))
        for c in counters:
            records.append((c.ts_ns, 1, 0, 3, c))
        records.sort(key=lambda r: (r[0], r[1], r[2]))
        for _, _, _, kind, obj in records:
            if kind == 0:
                out.append(self._slice_begin(obj, flow_out.get(obj.id, []), flow_in.get(obj.id, [])))
            elif kind == 1:
                out.append(self._slice_end(obj))
            elif kind == 2:
                out.append(self._instant(obj))
            else:
                out.append(self._counter(obj))
        self.packets += len(out)
        return b"".join(out)


def _depths(spans: list[Span]) -> dict[int, int]:
    """Depth of each span in its parent chain (within ``spans``)."""
    parent = {s.id: s.parent_id for s in spans}
    depth: dict[int, int] = {}
    for sid in parent:
        chain = []
        cur: int | None = sid
        while cur is not None and cur not in depth and cur in parent:
            chain.append(cur)
            cur = parent[cur]
        base = depth.get(cur, -1) if cur is not None else -1
        for node in reversed(chain):
            base += 1
            depth[node] = base
    return depth


class PerfettoStreamWriter:
    """Appends encoded batches to a .pftrace file while the program runs."""

    def __init__(self, file: IO[bytes], meta: dict[str, Any]) -> None:
        self._file = file
        self._encoder = PerfettoEncoder(meta)

    @classmethod
    def open(cls, path: Path, meta: dict[str, Any]) -> PerfettoStreamWriter:
        return cls(open(path, "ab"), meta)  # noqa: SIM115 - closed in close()

    def write(self, **batch: Any) -> None:
        # Flows need both ends; they are written with the final trace.
        batch.pop("flows", None)
        data = self._encoder.encode(**batch)
        if data:
            self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def export_perfetto(run: Any, dest: Path) -> Path:
    """Writes the whole run as one Perfetto trace (atomically: temp file, then rename).

    Args:
        run: a loaded ``mltrace.run.Run``.
        dest: the .pftrace file to write.

    Returns:
        ``dest``.
    """
    enc = PerfettoEncoder(run.meta)
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(
            enc.encode(
                tracks=run.tracks.values(),
                spans=run.spans,
                instants=run.instants,
                counters=run.counters,
                flows=run.flows,
            )
        )
    os.replace(tmp, dest)
    return dest


__all__ = ["PerfettoEncoder", "PerfettoStreamWriter", "export_perfetto", "Level"]
