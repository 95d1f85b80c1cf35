"""A model with no child modules is its own only layer: its ops are not "ops inside model calls
but in no layer"; a model with layers that runs ops in its own forward keeps that note."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import mltrace
from mltrace.analysis.bottleneck import analyze
from mltrace.run.events import Span, Track
from mltrace.run.levels import Level
from mltrace.run.store import Run
from support.reference_breakdown import breakdown


class Affine(nn.Module):
    """A model of parameters only: its forward runs ops, it calls no module."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))
        self.bias = nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.weight + self.bias)


class Scaled(nn.Module):
    """A model with a layer whose forward also runs an op of its own, outside the layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 2


def _model_of(span: Span, by_id: dict[int, Span]) -> Span | None:
    """The model span an op span is directly in, with no layer between; else None."""
    up = by_id.get(span.parent_id) if span.parent_id is not None else None
    while up is not None and up.level == Level.OP:
        up = by_id.get(up.parent_id) if up.parent_id is not None else None
    return up if up is not None and up.level == Level.MODEL else None


def test_ops_of_a_model_without_child_modules_are_in_no_layer_only_where_it_has_layers(tmp_path: Path, hot_path: str) -> None:
    torch.manual_seed(0)
    linear, affine, scaled = nn.Linear(8, 8).eval(), Affine().eval(), Scaled().eval()
    x = torch.randn(2, 8)
    with mltrace.profile(output=tmp_path / "run", summary=False, level="op"), torch.no_grad():
        for _ in range(2):
            scaled(affine(linear(x)))
    run = mltrace.load_run(tmp_path / "run")
    models = {s.name: s for s in run.spans if s.level == Level.MODEL}
    assert {name: s.attrs.get("ml.model.leaf") for name, s in models.items()} == {"Linear": True, "Affine": True, "Scaled": None}
    by_id = run.span_by_id()
    direct = [(s, _model_of(s, by_id)) for s in run.spans if s.level == Level.OP]
    in_leaf_models = [s for s, model in direct if model is not None and model.name in ("Linear", "Affine")]
    in_scaled = [s for s, model in direct if model is not None and model.name == "Scaled"]
    assert in_leaf_models and in_scaled, "no ops recorded in the models: this test checks nothing"
    assert {s.name for s in in_scaled} >= {"aten::mul"}  # Scaled's own op, outside its layer fc
    b = analyze(run).breakdown
    assert b.ops_outside_layers == len(in_scaled)
    assert b == breakdown(run)


def test_the_note_counts_ops_of_models_with_layers_alone() -> None:
    spans = [
        Span(1, None, Level.MODEL, "Linear", 0, 100, 1, {"ml.model.leaf": True}),
        Span(2, 1, Level.OP, "aten::linear", 10, 90, 1),
        Span(3, 2, Level.OP, "aten::addmm", 20, 80, 1),
        Span(4, None, Level.MODEL, "Net", 200, 300, 1),
        Span(5, 4, Level.LAYER, "fc", 210, 250, 1),
        Span(6, 5, Level.OP, "aten::linear", 215, 245, 1),
        Span(7, 4, Level.OP, "aten::mul", 260, 270, 1),  # the model's own op, beside its layer
    ]
    run = Run(path=Path("."), meta={}, tracks={1: Track(1, "thread", "main", 1, 1)}, spans=spans)
    for b in (analyze(run).breakdown, breakdown(run)):
        assert (b.ops_outside_layers, b.ops_outside_layers_ns) == (1, 10)
