"""torch.compile'd models: their spans are named after the module compiled, and the graphs that
torch's compiler calls as modules are no layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import mltrace
from conftest import run_cli
from mltrace.run.levels import Level

PROGRAM = """
import torch
from torch import nn

class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).relu()

class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(x)

torch.manual_seed(0)
encoder, head = Encoder().eval(), Head().eval()
encoder_c, head_c = torch.compile(encoder, backend="eager"), torch.compile(head, backend="eager")
with torch.no_grad():
    for _ in range(3):
        x = torch.randn(4, 8)
        print(head_c(encoder_c(x)).argmax(-1).tolist())
    print(encoder(x).sum().item() == encoder_c(x).sum().item())
"""


def test_two_compiled_models_are_two_models_and_apart_from_eager_calls(tmp_path: Path) -> None:
    pytest.importorskip("torch._dynamo")
    (tmp_path / "prog.py").write_text(PROGRAM)
    res = run_cli("python", "-q", "--level", "model", "-o", str(tmp_path / "run"), "prog.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout.decode().splitlines()[-1] == "True"
    run = mltrace.load_run(tmp_path / "run")
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert [s.name for s in models] == ["Encoder (compiled)", "Head (compiled)"] * 3 + ["Encoder", "Encoder (compiled)"]
    assert {s.attrs["ml.layer.type"] for s in models if "compiled" in s.name} == {"OptimizedModule"}
    report = run_cli("report", str(tmp_path / "run"), "--format", "json", "--include-cold", cwd=tmp_path)
    calls = {m["name"]: m["calls"] for m in json.loads(report.stdout)["models"]}
    assert calls == {"Encoder (compiled)": 4, "Head (compiled)": 3, "Encoder": 1}


def test_a_compiled_model_held_by_another_is_named_by_its_path(tmp_path: Path) -> None:
    """A compiled submodule called from its holder's method keeps the holder's path name."""
    pytest.importorskip("torch._dynamo")

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.compile(nn.Linear(4, 4), backend="eager")

        def run(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    holder = Holder()
    with mltrace.profile(output=tmp_path / "run", summary=False, level="model"), torch.no_grad():
        holder.run(torch.randn(2, 4))
    run = mltrace.load_run(tmp_path / "run")
    assert [s.name for s in run.spans if s.level == Level.MODEL] == ["Holder.body"]


AOT_FORWARD = """
import torch
from torch import fx, nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).relu()

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.traced = fx.symbolic_trace(Block())  # the user's own GraphModule: a layer

    def forward(self, x):
        return self.traced(self.block(x))

net = Net().eval()
with torch.no_grad():
    eager = net(torch.ones(2, 8))
    net.forward = torch.compile(net.forward, backend="aot_eager")
    for _ in range(2):
        print(torch.equal(net(torch.ones(2, 8)), eager))
    del net.forward
    print(torch.equal(net(torch.ones(2, 8)), eager))
"""


def test_the_graph_a_compiled_forward_calls_is_no_layer(tmp_path: Path) -> None:
    """aot_eager runs a compiled forward's graph as an fx GraphModule that the model does not
    hold: its call is no layer (it was '<<lambda>>', at transformers' or the program's line),
    while a GraphModule the model holds stays one."""
    pytest.importorskip("torch._dynamo")
    (tmp_path / "prog.py").write_text(AOT_FORWARD)
    res = run_cli("python", "-q", "--level", "layer", "-o", str(tmp_path / "run"), "prog.py", cwd=tmp_path)
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout.decode().split() == ["True"] * 3
    run = mltrace.load_run(tmp_path / "run")
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    layers = [s for s in run.spans if s.level == Level.LAYER]
    inside = [sorted(s.attrs["ml.layer.path"] for s in layers if m.start_ns <= s.start_ns <= m.end_ns) for m in models]
    eager = ["block", "block.fc", "traced", "traced.fc"]
    assert inside == [eager, [], [], eager]
    assert not [s for s in run.spans if s.level == Level.LAYER and "<" in s.name]
