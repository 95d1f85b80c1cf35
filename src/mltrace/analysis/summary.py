"""The short summary stored in run.json at the end of a run.

It is computed on the span table's columns (one numpy operation per level of nesting), since
the end of a long run summarizes millions of spans; the numbers follow the definitions of
``analysis.breakdown``, the plain reference, and a test holds the two equal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mltrace.analysis.breakdown import layers_named_by_model, window_end
from mltrace.run.levels import HIERARCHY, Level

if TYPE_CHECKING:
    from mltrace.run.store import Run
    from mltrace.run.table import SpanTable

_STRUCTURAL = (int(Level.MODEL), int(Level.LAYER), int(Level.USER))


def summarize(run: Run, top: int = 5, table: SpanTable | None = None, include_cold: bool = False) -> dict[str, Any]:
    """Counts per level, model calls and the top layers by self time (ns), ranked as the report
    ranks them (the program's garbage collections in a layer left out); where the layer level
    ended early, the model calls it recorded and their time (the base of layer shares).

    A layer path that more than one model has is named after its model too, as the report names
    it (``layers_named_by_model``: ``Generator.main.0``, ``Discriminator.main.0``).

    Like ``mltrace report``, it counts the steady calls: the models' cold calls
    (``coldstart.find_cold_start``, the report's rule) and every span under them are left out,
    and ``cold_calls``/``cold_ns`` say how many there were and their time. Cold rows are whole
    subtrees, so the rows kept are masked on the whole table rather than copied out of it.

    Args:
        run: the run.
        top: how many layers to list.
        table: ``run``'s spans as a table, where the caller has one (else built from ``run``).
        include_cold: count the cold calls too (``--include-cold``).
    """
    import numpy as np

    from mltrace.analysis.coldstart import find_cold_start
    from mltrace.analysis.tree import tree_of

    t = table if table is not None else run.table
    run = layers_named_by_model(run.replace(spans=None, table=t))
    t = run.table
    cold = find_cold_start(run, spent=False)
    keep = np.ones(len(t), dtype=bool)
    if not include_cold and cold.rows is not None:
        keep[cold.rows] = False
    n = int(keep.sum())
    level = t.level.astype(np.int64)
    dur = t.end - t.start
    parent = t.parent_row()

    # A level's time: its spans with no ancestor of the same level (a kept span's ancestors are kept).
    tree = tree_of(t)
    above = tree.ancestor_or(np.left_shift(np.int64(1), level))
    outermost = (np.right_shift(above, level) & 1) == 0
    levels: dict[str, dict[str, int]] = {}
    for lv in (*HIERARCHY, Level.USER):
        mine = (level == int(lv)) & keep
        count = int(mine.sum())
        if count:
            levels[lv.label] = {"spans": count, "time_ns": int(dur[mine & outermost].sum())}

    models = (level == int(Level.MODEL)) & keep
    model_starts = t.start[models]
    layer_end = window_end(run, "layer_window")
    with_layers = model_starts <= layer_end if layer_end is not None else None

    return {
        "spans": n,
        "flows": len(run.flows),
        "counters": len(run.counters),
        "levels": levels,
        "model_calls": int(models.sum()),
        "model_time_ns": int(dur[models].sum()),
        "wall_ns": int(t.end[keep].max() - t.start[keep].min()) if n else 0,
        "cold_calls": cold.cold_calls,
        "cold_ns": cold.cold_ns,
        "include_cold": include_cold,
        **(
            {"layer_model_calls": int(with_layers.sum()), "layer_model_time_ns": int(dur[models][with_layers].sum())}
            if with_layers is not None
            else {}
        ),
        "top_layers_by_self_time": _top_layers(t, level, dur, parent, keep, top, _gc_own(run, t, keep)),
    }


def _gc_own(run: Run, t: SpanTable, keep: Any) -> dict[str, int]:
    """Per layer name, the program's garbage collections charged to its own calls among the rows
    ``keep`` marks (ns), as the report charges them (``analysis.gcpauses``): part of its self time."""
    from mltrace.analysis.gcpauses import gc_by_row

    charged = gc_by_row(t, run.tracks, run.meta, keep=keep)
    return {name: g.ns for (name, lv), g in charged.own.items() if lv is Level.LAYER}


def _top_layers(t: SpanTable, level: Any, dur: Any, parent: Any, keep: Any, top: int, gc_own: dict[str, int]) -> list[dict[str, Any]]:
    """The layers with the most self time among the rows ``keep`` marks: a call's duration less
    its direct children's at the model, layer or user level, summed over the calls of each layer
    path. As the report's "Top layers by self time", they are ranked by it less the program's
    garbage collections charged to their calls (``gc_own``, per name: not the layer's work),
    which each entry gives as ``gc_ns`` (0 where none)."""
    import numpy as np

    structural_child = np.isin(level, _STRUCTURAL) & (parent >= 0) & keep
    children_ns = np.zeros(len(t), dtype=np.int64)
    np.add.at(children_ns, parent[structural_child], dur[structural_child])
    rows = np.nonzero((level == int(Level.LAYER)) & keep)[0]
    if not rows.size:
        return []
    self_ns = np.maximum(dur[rows] - children_ns[rows], 0)
    names, first, group = np.unique(t.name[rows], return_index=True, return_inverse=True)
    calls = np.bincount(group, minlength=len(names))
    total = np.zeros(len(names), dtype=np.int64)
    self_sum = np.zeros(len(names), dtype=np.int64)
    np.add.at(total, group, dur[rows])
    np.add.at(self_sum, group, self_ns)
    label = [t.names[int(k)] for k in names]
    gc_ns = [gc_own.get(x, 0) for x in label]
    # By self time less the collections in it; ties by total time, then name (the reference's order).
    order = sorted(range(len(names)), key=lambda g: (-(int(self_sum[g]) - gc_ns[g]), -int(total[g]), label[g]))[:top]
    out = []
    for g in order:
        attrs = t.attrs(int(rows[first[g]]))  # the layer's first call, in the run's order
        file, line = _most_frequent_site(t, rows[group == g])
        out.append(
            {
                "layer": label[g],
                "type": str(attrs.get("ml.layer.type", "")),
                "calls": int(calls[g]),
                "self_ns": int(self_sum[g]),
                "gc_ns": gc_ns[g],
                "location": f"{file}:{line}" if file else "",
            }
        )
    return out


def _most_frequent_site(t: SpanTable, rows: Any) -> tuple[object, object]:
    """The (``code.file.path``, ``code.line.number``) most of ``rows`` were called from (the
    first such row's, in the run's order, on a tie)."""
    import numpy as np

    from mltrace.analysis.span_pass import site_key

    sets, first, counts = np.unique(t.attr[rows], return_index=True, return_counts=True)
    tally: dict[str, list[Any]] = {}  # key: [calls, first row, (file, line)]
    for k, at, n in zip(sets.tolist(), first.tolist(), counts.tolist()):
        a = t.attr_set(k)
        entry = tally.setdefault(site_key(a), [0, at, (a.get("code.file.path"), a.get("code.line.number"))])
        entry[0] += n
        entry[1] = min(entry[1], at)
    best = min(tally.values(), key=lambda entry: (-entry[0], entry[1]))
    return best[2]  # type: ignore[no-any-return]
