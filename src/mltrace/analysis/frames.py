"""A run as pandas DataFrames, for one's own analyses.

::

    from mltrace.analysis.frames import load_frames

    f = load_frames("mltrace-runs/infer-20261122-101500")
    f.ops.groupby("layer_type").dur_ns.sum().sort_values()
    f.kernels[f.kernels.dur_ns < 5_000].groupby("op").size()

One row per span in ``spans``; ``layers``, ``ops`` and ``kernels`` are the
spans of those levels with the columns that matter for them; ``layer_stats``
is one row per layer (aggregated over calls, with the report's verdicts when
peaks are given); ``Frames`` lists the columns. Times are integer ns. pandas is
imported here only (``pip install 'mltrace[analysis]'``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.peaks import PeakSet
from mltrace.run.events import TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run, load_run

_STRUCTURAL = (Level.MODEL, Level.LAYER)
_SELF_CHILDREN = (Level.MODEL, Level.LAYER, Level.USER)


@dataclass
class Frames:
    """The DataFrames of one run. Columns:

    ``spans``
        id, parent_id, level ("model", "layer", "op", …), name, start_ns, end_ns,
        dur_ns, self_ns (minus direct children on the same track; layers: minus
        child layers and user spans), track_id, track, track_kind, device, stream,
        layer_id and layer (the nearest model/layer at or above), op_id and op (the
        outermost op at or above), attrs (the attribute dict).
    ``layers`` (model and layer spans)
        id, parent_id, level, path, type, start_ns, end_ns, dur_ns, self_ns,
        parent_layer, framework, file, line (the call site in model code), defined_file,
        defined_line (where its forward is defined), params, input_shapes, output_shapes,
        input_dtypes.
    ``ops``
        id, parent_id, name, start_ns, end_ns, dur_ns, self_ns, top_level, layer,
        layer_type, flops, input_shapes, input_dtypes, track.
    ``kernels`` (kernel-level spans on GPU streams)
        id, parent_id, name, start_ns, end_ns, dur_ns, device, stream, library,
        activity, op, layer.
    ``layer_stats``
        name, level, type, calls, total_ns, self_ns, flops, bytes, work_source,
        verdict, reason, intensity, efficiency, file, line.
    """

    spans: Any
    layers: Any
    ops: Any
    kernels: Any
    layer_stats: Any


def _pandas() -> Any:
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("mltrace's DataFrame API needs pandas: pip install 'mltrace[analysis]'") from None
    return pd


def load_frames(run: Run | str | os.PathLike[str], peaks: PeakSet | None = None) -> Frames:
    """Loads a run (or takes a loaded one) into DataFrames.

    Args:
        run: a run directory, or a loaded ``Run``.
        peaks: roofs for the verdicts in ``layer_stats``; None leaves them empty.

    Raises:
        ImportError: pandas is not installed.
        mltrace.run.store.RunError: the path is not a readable run.
    """
    pd = _pandas()
    if not isinstance(run, Run):
        run = load_run(run)
    spans = run.spans
    by_id = {s.id: s for s in spans}
    tracks = run.tracks
    # Nearest model/layer and outermost op at or above each span, parents first.
    layer_of: dict[int, int | None] = {}
    op_of: dict[int, int | None] = {}

    def resolve(sid: int) -> None:
        chain = []
        cur = by_id.get(sid)
        while cur is not None and cur.id not in layer_of:
            chain.append(cur)
            cur = by_id.get(cur.parent_id) if cur.parent_id is not None else None
            if len(chain) > len(by_id):  # cyclic parents: stop
                break
        up_layer = layer_of.get(cur.id) if cur is not None else None
        up_op = op_of.get(cur.id) if cur is not None else None
        for node in reversed(chain):
            if node.level in _STRUCTURAL:
                up_layer = node.id
            elif node.level is Level.OP and up_op is None:
                up_op = node.id
            layer_of[node.id] = up_layer
            op_of[node.id] = up_op

    child_ns: dict[int, int] = {}
    for s in spans:
        if s.id not in layer_of:
            resolve(s.id)
        p = by_id.get(s.parent_id) if s.parent_id is not None else None
        if p is None:
            continue
        if p.level in _STRUCTURAL:
            if s.level in _SELF_CHILDREN:
                child_ns[p.id] = child_ns.get(p.id, 0) + s.duration_ns
        elif p.track_id == s.track_id:
            child_ns[p.id] = child_ns.get(p.id, 0) + s.duration_ns

    def name_of(sid: int | None) -> str | None:
        return by_id[sid].name if sid is not None else None

    rows: dict[str, list[Any]] = {
        k: []
        for k in (
            "id parent_id level name start_ns end_ns dur_ns self_ns track_id track track_kind device stream layer_id layer op_id op attrs"
        ).split()
    }
    layer_rows: list[dict[str, Any]] = []
    op_rows: list[dict[str, Any]] = []
    kernel_rows: list[dict[str, Any]] = []
    for s in spans:
        t = tracks.get(s.track_id)
        dur = s.duration_ns
        self_ns = max(0, dur - child_ns.get(s.id, 0))
        lid, oid = layer_of.get(s.id), op_of.get(s.id)
        rows["id"].append(s.id)
        rows["parent_id"].append(s.parent_id)
        rows["level"].append(s.level.label)
        rows["name"].append(s.name)
        rows["start_ns"].append(s.start_ns)
        rows["end_ns"].append(s.end_ns)
        rows["dur_ns"].append(dur)
        rows["self_ns"].append(self_ns)
        rows["track_id"].append(s.track_id)
        rows["track"].append(t.name if t is not None else None)
        rows["track_kind"].append(t.kind if t is not None else None)
        rows["device"].append(t.device if t is not None else -1)
        rows["stream"].append(t.stream if t is not None else -1)
        rows["layer_id"].append(lid)
        rows["layer"].append(name_of(lid))
        rows["op_id"].append(oid)
        rows["op"].append(name_of(oid))
        rows["attrs"].append(s.attrs)
        a = s.attrs
        if s.level in _STRUCTURAL:
            parent_layer = layer_of.get(s.parent_id) if s.parent_id is not None else None
            layer_rows.append(
                {
                    "id": s.id,
                    "parent_id": s.parent_id,
                    "level": s.level.label,
                    "path": s.name,
                    "type": a.get("ml.layer.type"),
                    "start_ns": s.start_ns,
                    "end_ns": s.end_ns,
                    "dur_ns": dur,
                    "self_ns": self_ns,
                    "parent_layer": name_of(parent_layer),
                    "framework": a.get("ml.framework"),
                    "file": a.get("code.file.path"),
                    "line": a.get("code.line.number"),
                    "defined_file": a.get("ml.defined.file.path"),
                    "defined_line": a.get("ml.defined.line.number"),
                    "params": a.get("ml.layer.params"),
                    "input_shapes": a.get("ml.input.shapes"),
                    "output_shapes": a.get("ml.output.shapes"),
                    "input_dtypes": a.get("ml.input.dtypes"),
                }
            )
        elif s.level is Level.OP:
            op_rows.append(
                {
                    "id": s.id,
                    "parent_id": s.parent_id,
                    "name": s.name,
                    "start_ns": s.start_ns,
                    "end_ns": s.end_ns,
                    "dur_ns": dur,
                    "self_ns": self_ns,
                    "top_level": oid == s.id,
                    "layer": name_of(lid),
                    "layer_type": by_id[lid].attrs.get("ml.layer.type") if lid is not None else None,
                    "flops": a.get("ml.flops"),
                    "input_shapes": a.get("ml.input.shapes"),
                    "input_dtypes": a.get("ml.input.dtypes"),
                    "track": t.name if t is not None else None,
                }
            )
        elif s.level is Level.KERNEL and t is not None and t.kind == TrackKind.GPU_STREAM:
            kernel_rows.append(
                {
                    "id": s.id,
                    "parent_id": s.parent_id,
                    "name": a.get("gpu.kernel.name") or s.name,
                    "start_ns": s.start_ns,
                    "end_ns": s.end_ns,
                    "dur_ns": dur,
                    "device": t.device,
                    "stream": t.stream,
                    "library": a.get("ml.library.name"),
                    "activity": a.get("gpu.activity"),
                    "op": name_of(oid),
                    "layer": name_of(lid),
                }
            )
    analysis = analyze(run, peaks)
    stats = [
        {
            "name": r.stat.name,
            "level": r.stat.level.label,
            "type": r.stat.type,
            "calls": r.stat.calls,
            "total_ns": r.stat.total_ns,
            "self_ns": r.stat.self_ns,
            "flops": r.flops,
            "bytes": r.bytes,
            "work_source": r.work_source,
            "verdict": r.verdict.bound.short if r.verdict else None,
            "reason": r.verdict.reason if r.verdict else None,
            "intensity": r.verdict.intensity if r.verdict else None,
            "efficiency": r.verdict.efficiency if r.verdict else None,
            "file": r.stat.file,
            "line": r.stat.line,
        }
        for r in analysis.layers
    ]

    def frame(records: list[dict[str, Any]], columns: list[str]) -> Any:
        return pd.DataFrame.from_records(records, columns=columns)

    return Frames(
        spans=pd.DataFrame(rows),
        layers=frame(
            layer_rows,
            "id parent_id level path type start_ns end_ns dur_ns self_ns parent_layer framework file line defined_file defined_line params "
            "input_shapes output_shapes input_dtypes".split(),
        ),
        ops=frame(
            op_rows,
            "id parent_id name start_ns end_ns dur_ns self_ns top_level layer layer_type flops input_shapes input_dtypes track".split(),
        ),
        kernels=frame(kernel_rows, "id parent_id name start_ns end_ns dur_ns device stream library activity op layer".split()),
        layer_stats=frame(
            stats,
            "name level type calls total_ns self_ns flops bytes work_source verdict reason intensity efficiency file line".split(),
        ),
    )
