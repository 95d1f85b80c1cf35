"""The reference breakdown: the per-level, per-layer and per-type tables computed span by span
from the definitions in ``mltrace/analysis/breakdown.py``. The analysis computes the same tables
with numpy over the span table (``span_pass.gather``); the tests check the two agree.
"""

from __future__ import annotations

from mltrace.analysis.breakdown import Breakdown, LayerStat, LevelTime, TypeStat, op_ends, window_end
from mltrace.run.events import Span
from mltrace.run.levels import HIERARCHY, Level
from mltrace.run.store import Run

_STRUCTURAL = (Level.MODEL, Level.LAYER, Level.USER)


def _level_times(spans: list[Span], by_id: dict[int, Span]) -> list[LevelTime]:
    counts: dict[Level, int] = {}
    times: dict[Level, int] = {}
    for s in spans:
        counts[s.level] = counts.get(s.level, 0) + 1
        p = by_id.get(s.parent_id) if s.parent_id is not None else None
        nested = False
        seen = {s.id}  # a corrupt, cyclic parent chain ends the walk
        while p is not None and p.id not in seen:
            if p.level == s.level:
                nested = True
                break
            seen.add(p.id)
            p = by_id.get(p.parent_id) if p.parent_id is not None else None
        if not nested:
            times[s.level] = times.get(s.level, 0) + s.duration_ns
    order = [*HIERARCHY, Level.USER]
    return [LevelTime(lv, counts[lv], times.get(lv, 0)) for lv in order if lv in counts]


def ops_outside(spans: list[Span], by_id: dict[int, Span]) -> tuple[int, int, int, int, int, int, int]:
    """Counts op spans with no layer ancestor (inside a model that has child modules, not one
    marked ``ml.model.leaf``, which is its own only layer; and the time of the outermost of
    them), less the ops that name their layer (``ml.tf.layer``), counted apart with the time of
    the outermost of them: variable reads (``ReadVariableOp``), then the others; and op spans
    with no model ancestor."""
    enclosing: dict[int, Span | None] = {}  # span id → innermost model/layer span above or at it

    def context(span_id: int | None) -> Span | None:
        chain: list[int] = []
        found: Span | None = None
        while span_id is not None and span_id not in chain:  # a cyclic chain ends the walk
            if span_id in enclosing:
                found = enclosing[span_id]
                break
            s = by_id.get(span_id)
            if s is None:
                break
            if s.level in (Level.LAYER, Level.MODEL):
                found = s
                enclosing[span_id] = found
                break
            chain.append(span_id)
            span_id = s.parent_id
        for sid in chain:
            enclosing[sid] = found
        return found

    in_model = outside_models = in_model_ns = reads = reads_ns = layer_ops = layer_ops_ns = 0
    for s in spans:
        if s.level != Level.OP:
            continue
        ctx = context(s.parent_id)
        if ctx is None:
            outside_models += 1
        elif ctx.level == Level.MODEL and ctx.attrs.get("ml.model.leaf") is not True:
            outermost = not _inside_an_op(s, by_id)  # the time of the outermost ones
            if s.attrs.get("ml.tf.layer") and s.name == "ReadVariableOp":
                reads += 1
                reads_ns += s.duration_ns if outermost else 0
            elif s.attrs.get("ml.tf.layer"):
                layer_ops += 1
                layer_ops_ns += s.duration_ns if outermost else 0
            else:
                in_model += 1
                in_model_ns += s.duration_ns if outermost else 0
    return in_model, in_model_ns, outside_models, reads, reads_ns, layer_ops, layer_ops_ns


def _inside_an_op(span: Span, by_id: dict[int, Span]) -> bool:
    """Whether an op span is an ancestor of ``span``."""
    seen: set[int] = set()
    up = by_id.get(span.parent_id) if span.parent_id is not None else None
    while up is not None and up.id not in seen:
        if up.level == Level.OP:
            return True
        seen.add(up.id)
        up = by_id.get(up.parent_id) if up.parent_id is not None else None
    return False


def breakdown(run: Run) -> Breakdown:
    """Computes the per-level, per-layer and per-type tables of a run."""
    spans = run.spans
    by_id = {s.id: s for s in spans}
    child_structural: dict[int, int] = {}
    ops_in: dict[int, list[Span]] = {}
    for s in spans:
        if s.parent_id is None:
            continue
        if s.level in _STRUCTURAL:
            child_structural[s.parent_id] = child_structural.get(s.parent_id, 0) + s.duration_ns
        elif s.level == Level.OP:
            ops_in.setdefault(s.parent_id, []).append(s)
    layers: dict[tuple[str, Level], LayerStat] = {}
    types: dict[str, TypeStat] = {}
    model_calls = 0
    model_ns = 0
    # A model call has layer spans if it started before the layer level's end (calls in flight
    # then finish theirs), and ops if it also ended before its framework's op level ended.
    layer_end, op_end = window_end(run, "layer_window"), op_ends(run)
    layer_calls = layer_ns = op_calls = op_ns = 0
    for s in spans:
        if s.level not in (Level.MODEL, Level.LAYER):
            continue
        a = s.attrs
        ltype = str(a.get("ml.layer.type", ""))
        key = (s.name, s.level)
        st = layers.get(key)
        if st is None:
            st = LayerStat(
                s.name,
                s.level,
                ltype,
                file=a.get("code.file.path"),
                line=a.get("code.line.number"),
                framework=str(a.get("ml.framework", "")),
                defined_file=a.get("ml.defined.file.path"),
                defined_line=a.get("ml.defined.line.number"),
            )
            layers[key] = st
        self_ns = max(0, s.duration_ns - child_structural.get(s.id, 0))
        st.calls += 1
        st.total_ns += s.duration_ns
        if s.level != Level.MODEL or layer_end is None or s.start_ns <= layer_end:
            st.self_ns += self_ns  # a model call without layer spans has no known self time
        for op in ops_in.get(s.id, ()):
            agg = st.ops.setdefault(op.name, [0, 0])
            agg[0] += 1
            agg[1] += op.duration_ns
        if s.level == Level.MODEL:
            model_calls += 1
            model_ns += s.duration_ns
            with_layers = layer_end is None or s.start_ns <= layer_end
            if with_layers:
                layer_calls += 1
                layer_ns += s.duration_ns
                end = op_end.of(a.get("ml.framework"))
                if end is None or s.end_ns <= end:
                    op_calls += 1
                    op_ns += s.duration_ns
        else:
            ts = types.setdefault(ltype, TypeStat(ltype))
            ts.calls += 1
            ts.self_ns += self_ns
    wall = (max(s.end_ns for s in spans) - min(s.start_ns for s in spans)) if spans else 0
    outside_layers, outside_layers_ns, outside_models, reads, reads_ns, layer_ops, layer_ops_ns = ops_outside(spans, by_id)
    return Breakdown(
        ops_outside_layers=outside_layers,
        ops_outside_layers_ns=outside_layers_ns,
        ops_outside_models=outside_models,
        reads_outside_layers=reads,
        reads_outside_layers_ns=reads_ns,
        layer_ops_outside_layers=layer_ops,
        layer_ops_outside_layers_ns=layer_ops_ns,
        levels=_level_times(spans, by_id),
        layers=sorted(layers.values(), key=lambda x: (-x.total_ns, x.name)),
        types=sorted(types.values(), key=lambda x: (-x.self_ns, x.type)),
        model_calls=model_calls,
        model_ns=model_ns,
        wall_ns=wall,
        span_count=len(spans),
        layer_model_calls=layer_calls if layer_end is not None else None,
        layer_model_ns=layer_ns if layer_end is not None else None,
        op_model_ns=op_ns if op_end.ended or layer_end is not None else None,
        op_model_calls=op_calls if op_end.ended or layer_end is not None else None,
    )
