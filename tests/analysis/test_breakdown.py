"""Breakdown tables and cross-stack chains on real and hand-made runs."""

from __future__ import annotations

import io
from pathlib import Path

import torch
from torch import nn

import mltrace
from mltrace.analysis.breakdown import cross_stack_chains
from mltrace.run.events import Span, Track
from mltrace.run.levels import Level
from mltrace.run.store import Run
from support.reference_breakdown import breakdown


def _run(spans: list[Span]) -> Run:
    return Run(path=Path("."), meta={}, tracks={1: Track(1, "thread", "main", 1, 1)}, spans=spans)


def test_self_time_and_level_time_from_a_table() -> None:
    spans = [
        Span(1, None, Level.MODEL, "Net", 0, 100, 1, {"ml.layer.type": "Net"}),
        Span(2, 1, Level.LAYER, "a", 10, 50, 1, {"ml.layer.type": "Linear"}),
        Span(3, 2, Level.LAYER, "a.inner", 20, 30, 1, {"ml.layer.type": "ReLU"}),
        Span(4, 2, Level.OP, "aten::addmm", 31, 49, 1),
        Span(5, 1, Level.LAYER, "b", 60, 90, 1, {"ml.layer.type": "Linear"}),
    ]
    b = breakdown(_run(spans))
    by = {x.name: x for x in b.layers}
    assert by["Net"].self_ns == 100 - 40 - 30
    assert by["a"].self_ns == 40 - 10  # the op is content, not a child layer
    assert by["a"].ops == {"aten::addmm": [1, 18]}
    assert {t.level: t.time_ns for t in b.levels} == {Level.MODEL: 100, Level.LAYER: 70, Level.OP: 18}
    assert [(t.type, t.self_ns) for t in b.types] == [("Linear", 60), ("ReLU", 10)]
    assert b.model_calls == 1 and b.model_ns == 100


def test_user_spans_have_no_share_of_model_time() -> None:
    """A request span holds its model call: its time as a share of model time (over 100 %)
    would say nothing, so the level has no base (the viewers print "-")."""
    spans = [
        Span(1, None, Level.USER, "POST /predict", 0, 300, 1),
        Span(2, 1, Level.MODEL, "Net", 50, 150, 1, {"ml.layer.type": "Net"}),
        Span(3, 2, Level.LAYER, "a", 60, 140, 1, {"ml.layer.type": "Linear"}),
    ]
    b = breakdown(_run(spans))
    assert {t.level: t.time_ns for t in b.levels}[Level.USER] == 300
    assert b.base_ns(Level.USER) == 0 and b.base_ns(Level.LAYER) == b.base_ns(Level.MODEL) == 100


def test_cross_stack_chain_reaches_the_library_call(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2), nn.ReLU(), nn.Flatten(), nn.LazyLinear(10)).eval()
    x = torch.randn(1, 3, 96, 96)
    with torch.inference_mode():
        model(x)
        with mltrace.profile(output=tmp_path / "r", summary=False, level="library"):
            for _ in range(2):
                model(x)
    run = mltrace.load_run(tmp_path / "r")
    chains = cross_stack_chains(run, [x for x in breakdown(run).layers if x.level is Level.LAYER])
    conv = next(c for c in chains if c.type == "Conv2d")
    assert conv.calls == 2
    assert conv.links[0].level == Level.OP and "conv" in conv.links[0].name
    assert conv.links[1].level == Level.LIBRARY and conv.links[1].detail in ("oneDNN", "MKL")
    assert conv.links[1].total_ns <= conv.links[0].total_ns
    linear = next(c for c in chains if c.type == "Linear")
    assert linear.links[-1].detail == "MKL"


def test_variable_reads_that_name_their_layer_are_not_the_models_ops() -> None:
    """TensorFlow ran two variable reads of layer ``fc`` before fc's span began: they name it
    (``ml.tf.layer``) and are counted apart, not as ops the model ran in no layer."""
    from mltrace.analysis.bottleneck import analyze
    from mltrace.viewers.terminal import render_report

    read = {"ml.tf.node": "net_1/fc_1/MatMul/ReadVariableOp", "ml.tf.layer": "fc"}
    spans = [
        Span(1, None, Level.MODEL, "net", 0, 100, 1, {"ml.layer.type": "Functional"}),
        Span(2, 1, Level.OP, "ReadVariableOp", 1, 3, 1, read),
        Span(3, 1, Level.OP, "ReadVariableOp", 4, 7, 1, {**read, "ml.tf.node": "net_1/fc_1/BiasAdd/ReadVariableOp"}),
        Span(4, 1, Level.OP, "IteratorGetNext", 8, 18, 1),
        Span(5, 1, Level.LAYER, "fc", 20, 90, 1, {"ml.layer.type": "Dense"}),
        Span(6, 5, Level.OP, "MatMul", 21, 89, 1),
    ]
    run = _run(spans)
    a = analyze(run)
    b = a.breakdown
    assert (b.ops_outside_layers, b.ops_outside_layers_ns) == (1, 10)
    assert (b.reads_outside_layers, b.reads_outside_layers_ns) == (2, 5)
    assert b == breakdown(run)
    out = io.StringIO()
    render_report(run, a, file=out, width=400)
    text = out.getvalue()
    assert "1 ops inside model calls but in no layer (10 ns)" in text
    assert "2 variable reads outside their layer's span (5 ns)" in text


def test_ops_outside_layers_and_models_are_counted() -> None:
    spans = [
        Span(1, None, Level.MODEL, "Net", 0, 100, 1),
        Span(2, 1, Level.LAYER, "a", 10, 50, 1),
        Span(3, 2, Level.OP, "aten::addmm", 20, 40, 1),  # in a layer
        Span(4, 1, Level.OP, "aten::add", 60, 70, 1),  # in the model, between layers
        Span(5, 4, Level.OP, "aten::empty", 61, 62, 1),  # nested op: still outside any layer
        Span(6, None, Level.OP, "aten::randn", 200, 210, 1),  # program code, no model
    ]
    b = breakdown(_run(spans))
    assert (b.ops_outside_layers, b.ops_outside_layers_ns, b.ops_outside_models) == (2, 10, 1)  # the outermost op's time


def test_layer_ops_that_name_their_layer_are_counted_apart_from_reads() -> None:
    """A BatchNormalization's arithmetic on its weights (``batchnorm/Rsqrt``, ``mul``) ran with the
    step's variable reads, before the layer's span: those ops name the layer (``ml.tf.layer``) and
    are counted as its, on a line of their own, not as the model's nor as variable reads."""
    from mltrace.analysis.bottleneck import analyze
    from mltrace.viewers.terminal import render_report

    def bn(node: str) -> dict[str, str]:
        return {"ml.tf.node": f"net_1/bn_1/batchnorm/{node}", "ml.tf.layer": "bn"}

    spans = [
        Span(1, None, Level.MODEL, "net", 0, 100, 1, {"ml.layer.type": "Functional"}),
        Span(2, 1, Level.OP, "ReadVariableOp", 1, 3, 1, {**bn("ReadVariableOp"), "ml.tf.node": "net_1/bn_1/Cast/ReadVariableOp"}),
        Span(3, 1, Level.OP, "Rsqrt", 4, 8, 1, bn("Rsqrt")),
        Span(4, 1, Level.OP, "Mul", 9, 15, 1, bn("mul")),
        Span(5, 1, Level.OP, "IteratorGetNext", 16, 18, 1),
        Span(6, 1, Level.LAYER, "bn", 20, 90, 1, {"ml.layer.type": "BatchNormalization"}),
        Span(7, 6, Level.OP, "Mul", 21, 60, 1, {"ml.tf.node": "net_1/bn_1/batchnorm/mul_1"}),
    ]
    run = _run(spans)
    a = analyze(run)
    b = a.breakdown
    assert (b.ops_outside_layers, b.ops_outside_layers_ns) == (1, 2)
    assert (b.reads_outside_layers, b.reads_outside_layers_ns) == (1, 2)
    assert (b.layer_ops_outside_layers, b.layer_ops_outside_layers_ns) == (2, 10)
    assert b == breakdown(run)
    out = io.StringIO()
    render_report(run, a, file=out, width=400)
    text = out.getvalue()
    assert "1 ops inside model calls but in no layer (2 ns)" in text
    assert "2 ops of a layer outside its span (10 ns)" in text
