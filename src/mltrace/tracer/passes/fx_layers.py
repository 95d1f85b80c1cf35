"""Correlator pass: layer spans for calls of an FX ``GraphModule`` (``torch.export``'s programs).

An exported program runs its graph's ops directly: no submodule is called, so the
layer level sees only the model span. Its nodes still say which module of the
original model each op came from (``nn_module_stack``); the torch source records
that once per graph (``ml.fx.nodes``, ``torch_modules.fx_node_modules``) and each
call's graph (``ml.fx.graph``). This pass matches the call's top-level ops (the op
level's, on the model span's thread, in time order) to the graph's op nodes in
order, by name, and makes a layer span for each run of consecutive ops of a module,
nested by the module paths (``stem`` → ``stem.0``), from the first op's start to the
last op's end, with the line of model code that called the module where the graph
recorded it (``code.*``). ``nest_by_containment`` then puts the ops under them. Ops no node
matches stay under the model span. Layers need the op level: without ops a call
keeps only its model span, ``run.json``'s ``correlation.fx_layers`` counts it and a
limitation line says so.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.run.store import Run

#: Op nodes looked ahead for an op's name before the op is left unmatched (the profiler
#: records a few ops that are no node, and a node may run no op of its own name).
_LOOKAHEAD = 8


def layers_from_fx(run: Run) -> Run:
    """Adds layer spans to the calls of GraphModules whose nodes name their modules."""
    graphs = _graphs(run.spans)
    if not graphs:
        return run
    ops_by_track = _top_level_ops(run.spans)
    next_id = max((s.id for s in run.spans), default=0) + 1
    added: list[Span] = []
    calls = without_ops = 0
    for model in run.spans:
        graph = graphs.get(model.attrs.get("ml.fx.graph")) if model.level == Level.MODEL else None
        if graph is None:
            continue
        calls += 1
        ops = [o for o in ops_by_track.get(model.track_id, []) if model.start_ns <= o.start_ns and o.end_ns <= model.end_ns]
        if not ops:
            without_ops += 1
            continue
        layers = _layers(model, _match(ops, graph["nodes"]), graph["modules"], next_id)
        next_id += len(layers)
        added.extend(layers)
    meta = dict(run.meta)
    correlation = dict(meta.get("correlation") or {})
    correlation["fx_layers"] = {"calls": calls, "calls_without_ops": without_ops, "layers_added": len(added)}
    meta["correlation"] = correlation
    if without_ops:
        note = (
            f"exported programs (torch.export): {without_ops} of {calls} calls have no layer spans, "
            "which come from their ops (record them with --level op or deeper)"
        )
        meta["limitations"] = [*(meta.get("limitations") or []), note]
    return Run(run.path, meta, run.tracks, [*run.spans, *added], run.instants, run.counters, run.flows, run.torn)


def _graphs(spans: Iterable[Span]) -> dict[Any, dict[str, Any]]:
    """Graph id → its recorded nodes, from the model spans that carry them."""
    from mltrace.tracer.passes.nesting import spans_at_level

    graphs: dict[Any, dict[str, Any]] = {}
    model = Level.MODEL  # a local: an enum member's lookup would run once a span
    for s in spans_at_level(spans, model) if isinstance(spans, list) else spans:
        text = s.attrs.get("ml.fx.nodes") if s.level == model else None
        if not isinstance(text, str):
            continue
        try:
            nodes = json.loads(text)
        except ValueError:
            continue
        if isinstance(nodes, dict) and isinstance(nodes.get("nodes"), list) and isinstance(nodes.get("modules"), list):
            graphs[s.attrs.get("ml.fx.graph")] = nodes
    return graphs


def _top_level_ops(spans: Iterable[Span]) -> dict[int, list[Span]]:
    """Per track, the op spans inside no other op span, by start."""
    by_track: dict[int, list[Span]] = {}
    for s in spans:
        if s.level == Level.OP:
            by_track.setdefault(s.track_id, []).append(s)
    out: dict[int, list[Span]] = {}
    for track, ops in by_track.items():
        ops.sort(key=lambda s: (s.start_ns, -s.end_ns))
        top: list[Span] = []
        end = -1
        for op in ops:
            if op.start_ns >= end:
                top.append(op)
                end = op.end_ns
        out[track] = top
    return out


def _match(ops: list[Span], nodes: list[list[Any]]) -> list[tuple[Span, list[int]]]:
    """Each op with the module chain of the node it matched (in order, by name), or ``[]``."""
    out = []
    i = 0
    for op in ops:
        chain: list[int] = []
        for j in range(i, min(i + _LOOKAHEAD, len(nodes))):
            if nodes[j][0] == op.name:
                chain, i = list(nodes[j][1]), j + 1
                break
        out.append((op, chain))
    return out


def _layers(model: Span, matched: list[tuple[Span, list[int]]], modules: list[list[str]], first_id: int) -> list[Span]:
    """Layer spans over runs of consecutive ops of one module, nested by the module chains."""
    layers: list[Span] = []
    open_chain: list[int] = []
    open_spans: list[Span] = []
    for op, chain in matched:
        if not chain:  # no node matched: it stays where time puts it
            continue
        keep = 0
        while keep < min(len(chain), len(open_chain)) and chain[keep] == open_chain[keep]:
            keep += 1
        del open_chain[keep:], open_spans[keep:]
        for index in chain[keep:]:
            path, cls, *site = modules[index]
            parent = open_spans[-1].id if open_spans else model.id
            attrs = {"ml.framework": "pytorch", "ml.layer.path": path, "ml.layer.type": cls, "ml.layer.from": "fx.nn_module_stack"}
            if len(site) == 2 and isinstance(site[0], str) and isinstance(site[1], int):  # older runs: no site
                attrs["code.file.path"], attrs["code.line.number"] = site
            span = Span(first_id + len(layers), parent, Level.LAYER, path, op.start_ns, op.end_ns, model.track_id, attrs)
            layers.append(span)
            open_chain.append(index)
            open_spans.append(span)
        for span in open_spans:
            span.end_ns = max(span.end_ns, op.end_ns)
    return layers
