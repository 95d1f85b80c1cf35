"""Layers of an exported program (torch.export) from its nodes' nn_module_stack (passes/fx_layers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import mltrace
from mltrace.run.levels import Level
from mltrace.run.store import Run

pytest.importorskip("torch.export")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1, enable_nested_tensor=False)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x).flatten(2).transpose(1, 2)
        return self.head(self.encoder(f)[:, 0])


def _trace_exported(tmp_path: Path, level: str, calls: int = 2) -> Run:
    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(2, 3, 8, 8)
    program = torch.export.export(net, (x,)).module()  # exported before the session: its tracing is not in the run
    with mltrace.profile(output=tmp_path / level, summary=False, level=level), torch.no_grad():
        for _ in range(calls):
            program(x)
    return mltrace.load_run(tmp_path / level)


def test_an_exported_program_has_the_eager_models_layer_paths(tmp_path: Path) -> None:
    run = _trace_exported(tmp_path, "op")
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert [s.name for s in models] == ["GraphModule", "GraphModule"]
    by_id = run.span_by_id()
    layers = [s for s in run.spans if s.level == Level.LAYER and s.attrs.get("ml.layer.from") == "fx.nn_module_stack"]
    names = {s.name for s in layers}
    assert {"stem", "stem.0", "stem.1", "encoder", "encoder.layers.0", "encoder.layers.0.self_attn", "head"} <= names
    for layer in layers:  # nested by path, each inside its model call
        parent = by_id[layer.parent_id]
        assert parent.level == Level.MODEL or layer.name.startswith(parent.name + ".")
        assert parent.start_ns <= layer.start_ns and layer.end_ns <= parent.end_ns
    types = {s.name: s.attrs["ml.layer.type"] for s in layers}
    assert types["stem.0"] == "Conv2d" and types["head"] == "Linear"
    # The ops run under the layers they came from.
    conv = [s for s in run.spans if s.level == Level.OP and s.name == "aten::conv2d"]
    assert len(conv) == 2 and {by_id[s.parent_id].name for s in conv} == {"stem.0"}
    linear_parents = {by_id[s.parent_id].name for s in run.spans if s.level == Level.OP and s.name == "aten::linear"}
    assert "head" in linear_parents
    assert run.meta["correlation"]["fx_layers"] == {"calls": 2, "calls_without_ops": 0, "layers_added": len(layers)}
    assert run.meta["correlation"]["check_containment"]["outside_parent"] == 0
    # Each layer names the line of model code that called its module, as the layer level does.
    forward = Net.forward.__code__
    sites = {s.name: (s.attrs.get("code.file.path"), s.attrs.get("code.line.number")) for s in layers}
    stem_line, head_line = forward.co_firstlineno + 1, forward.co_firstlineno + 2
    assert sites["stem"] == sites["stem.0"] == (__file__, stem_line)  # stem.0 is called by torch's Sequential
    assert sites["head"] == sites["encoder"] == (__file__, head_line)
    assert {s for name, s in sites.items() if name.startswith("encoder.")} <= {(__file__, head_line), (None, None)}


def test_without_the_op_level_an_exported_call_keeps_its_model_span_only(tmp_path: Path) -> None:
    run = _trace_exported(tmp_path, "layer")
    assert [s.name for s in run.spans if s.level == Level.MODEL] == ["GraphModule", "GraphModule"]
    assert not [s for s in run.spans if s.attrs.get("ml.layer.from") == "fx.nn_module_stack"]
    assert run.meta["correlation"]["fx_layers"]["calls_without_ops"] == 2
    assert any("torch.export" in note and "--level op" in note for note in run.meta["limitations"])
