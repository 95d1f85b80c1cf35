"""Layers of an exported program (torch.export) from its nodes' nn_module_stack (passes/fx_layers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import mltrace
from conftest import run_cli, run_plain
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.tracer.sources.torch_modules import exported_class_name

pytest.importorskip("torch.export")


try:  # imported here, not in a test: its import adds a finder to sys.meta_path for good
    import transformers
except ImportError:  # pragma: no cover - an optional extra
    transformers = None


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
    assert [s.name for s in models] == ["Net (exported)"] * 2  # the exported class, not torch's GraphModule
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
    assert [s.name for s in run.spans if s.level == Level.MODEL] == ["Net (exported)"] * 2
    assert not [s for s in run.spans if s.level == Level.LAYER]  # torch's input guards (_guards_fn) are none
    assert run.meta["correlation"]["fx_layers"]["calls_without_ops"] == 2
    assert any("torch.export" in note and "--level op" in note for note in run.meta["limitations"])


class Holder(nn.Module):
    """A model of the program's own that calls an exported program as one of its layers."""

    def __init__(self, exported: nn.Module) -> None:
        super().__init__()
        self.exported = exported
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.exported(x))


@pytest.mark.parametrize("strict", [False, True])
def test_an_exported_program_is_named_after_the_exported_class_and_torchs_guards_are_no_layer(
    tmp_path: Path, hot_path: str, strict: bool
) -> None:
    """``ep.module()`` is a GraphModule whose graph first calls torch's input guards (a
    ``GuardsFn`` submodule, ``_guards_fn``): its model spans are named after the class that was
    exported, as its nodes' ``nn_module_stack`` records it, and the guards' calls are no layer
    spans, as a layer of a model of the program's own or as the model's own layer."""
    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(2, 3, 8, 8)
    program = torch.export.export(net, (x,), strict=strict).module()
    holder = Holder(program)  # no .eval(): an exported program refuses train()
    assert isinstance(getattr(program, "_guards_fn", None), nn.Module)  # torch's guards: what is left out
    with mltrace.profile(output=tmp_path / "run", summary=False, level="layer"), torch.no_grad():
        for _ in range(2):
            program(x)
        holder(x)
    run = mltrace.load_run(tmp_path / "run")
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert [(s.name, s.attrs["ml.layer.type"]) for s in models] == [("Net (exported)", "Net")] * 2 + [("Holder", "Holder")]
    layers = [s for s in run.spans if s.level == Level.LAYER]
    assert {(s.name, s.attrs["ml.layer.type"]) for s in layers} == {("exported", "Net"), ("out", "Linear")}
    assert all(s.parent_id == models[2].id for s in layers)


def test_a_graph_module_names_the_exported_class_only_where_its_graph_names_one(tmp_path: Path) -> None:
    """``torch.fx.symbolic_trace`` names its GraphModule's class after the traced module already
    (a model of its own, `` (fx)``, apart from the eager module's calls); a GraphModule whose
    nodes carry no ``nn_module_stack`` keeps ``GraphModule``; a graph whose nodes' roots name two
    classes names none."""
    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(2, 3, 8, 8)
    traced = torch.fx.symbolic_trace(net)
    plain = torch.fx.GraphModule(net, traced.graph)
    program = torch.export.export(net, (x,)).module()
    assert exported_class_name(program) == "Net" and exported_class_name(plain) is None
    mixed = torch.export.export(net, (x,)).module()
    stacks = [n.meta["nn_module_stack"] for n in mixed.graph.nodes if n.meta.get("nn_module_stack")]
    root = next(iter(stacks[-1]))
    stacks[-1][root] = ("", "other.Other")
    assert exported_class_name(mixed) is None
    with mltrace.profile(output=tmp_path / "run", summary=False, level="model"), torch.no_grad():
        for module in (traced, plain, mixed):
            module(x)
    run = mltrace.load_run(tmp_path / "run")
    # the two GraphModules run graphs of different structures: two models
    assert [s.name for s in run.spans if s.level == Level.MODEL] == ["Net (fx)", "GraphModule", "GraphModule (mixed)"]


def test_an_exported_hugging_face_model_is_named_after_its_class(tmp_path: Path) -> None:
    """A BertModel built from a config (no download), exported: its calls are BertModel's."""
    if transformers is None:
        pytest.skip("transformers is not installed")
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 100, (1, 8))
    program = torch.export.export(model, (ids,)).module()
    with mltrace.profile(output=tmp_path / "run", summary=False, level="layer"), torch.no_grad():
        program(ids)
    run = mltrace.load_run(tmp_path / "run")
    assert [s.name for s in run.spans if s.level == Level.MODEL] == ["BertModel (exported)"]
    assert not [s for s in run.spans if s.level == Level.LAYER]


EXPORTED_SCRIPT = """
import torch
from torch import nn

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.act(self.fc(x)))

torch.manual_seed(0)
x = torch.randn(2, 8)
for strict in (False, True):
    program = torch.export.export(Tiny().eval(), (x,), strict=strict).module()
    with torch.no_grad():
        for _ in range(3):
            y = program(x)
    print(strict, [round(v, 4) for v in y.flatten().tolist()])
"""


def test_the_report_names_an_exported_model_after_its_class_with_no_row_for_torchs_guards(tmp_path: Path) -> None:
    """``mltrace python`` on a program that runs ``torch.export``'s programs: its output is the
    plain run's, and the report's model is the exported class, its layers the class's own."""
    script = tmp_path / "exported.py"
    script.write_text(EXPORTED_SCRIPT)
    out = tmp_path / "run"
    done = run_cli("python", "-q", "--level", "op", "-o", str(out), str(script))
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == run_plain(script).stdout
    report = run_cli("report", "--format", "json", str(out))
    assert report.returncode == 0, report.stderr.decode()
    data = json.loads(report.stdout)
    assert [(m["name"], m["type"], m["calls"]) for m in data["models"]] == [("Tiny (exported)", "Tiny", 6)]
    assert {(row["name"], row["type"]) for row in data["layers"]} == {("fc", "Linear"), ("act", "ReLU"), ("head", "Linear")}
