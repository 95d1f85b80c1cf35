"""The short summary stored in run.json at the end of a run."""

from __future__ import annotations

from typing import Any

from mltrace.analysis.breakdown import breakdown
from mltrace.run.store import Run


def summarize(run: Run, top: int = 5) -> dict[str, Any]:
    """Counts per level, model calls and the top layers by self time (ns); where the layer level
    ended early, the model calls it recorded and their time (the base of layer shares)."""
    b = breakdown(run)
    layers = sorted((x for x in b.layers if x.level.label == "layer"), key=lambda x: -x.self_ns)[:top]
    return {
        "spans": b.span_count,
        "flows": len(run.flows),
        "counters": len(run.counters),
        "levels": {lt.level.label: {"spans": lt.spans, "time_ns": lt.time_ns} for lt in b.levels},
        "model_calls": b.model_calls,
        "model_time_ns": b.model_ns,
        "wall_ns": b.wall_ns,
        **({"layer_model_calls": b.layer_model_calls, "layer_model_time_ns": b.layer_model_ns} if b.layer_model_ns is not None else {}),
        "top_layers_by_self_time": [
            {"layer": x.name, "type": x.type, "calls": x.calls, "self_ns": x.self_ns, "location": x.location}
            for x in layers
        ],
    }
