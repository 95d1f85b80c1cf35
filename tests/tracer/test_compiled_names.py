"""A torch.compile'd model's spans are named after the module it compiled."""

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
