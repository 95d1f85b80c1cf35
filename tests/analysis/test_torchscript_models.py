"""TorchScript models (``torch.jit.script``, ``torch.jit.trace``, ``torch.jit.freeze``) are named
after the class that was scripted or traced, not torch's wrapper class, so two scripted models
are two models in the report; and with `` (TorchScript)`` (`` (TorchScript, traced)``,
`` (TorchScript, frozen)``), so a TorchScript model is apart from its class's eager calls and
from its other TorchScript forms, as an exported program's module is with `` (exported)``."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

import mltrace
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.report_data import build_report
from mltrace.run.levels import Level


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Other(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Traced(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 2


def test_scripted_and_traced_models_keep_their_class_names(tmp_path: Path) -> None:
    x = torch.randn(2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script's and trace's own
        a, b = torch.jit.script(MLP().eval()), torch.jit.script(Other().eval())
        c = torch.jit.trace(Traced().eval(), x)
    assert type(a).__name__ == "RecursiveScriptModule" and type(c).__name__ == "TopLevelTracedModule"
    with torch.no_grad(), mltrace.profile(output=tmp_path / "run", summary=False, level="layer"):
        for _ in range(4):
            a(x)
            b(x)
            c(x)
    run = mltrace.load_run(tmp_path / "run")
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert [s.name for s in models] == ["MLP (TorchScript)", "Other (TorchScript)", "Traced (TorchScript, traced)"] * 4
    assert [s.attrs["ml.layer.type"] for s in models[:3]] == ["MLP", "Other", "Traced"]
    assert [s.attrs["ml.model.invocation"] for s in models[::3]] == [1, 2, 3, 4]
    data = build_report(run, analyze(run))
    assert sorted((m["name"], m["calls"]) for m in data["models"]) == [
        ("MLP (TorchScript)", 4),
        ("Other (TorchScript)", 4),
        ("Traced (TorchScript, traced)", 4),
    ]


def test_scripted_traced_frozen_and_exported_models_are_apart_from_the_eager_models_calls(tmp_path: Path) -> None:
    x = torch.randn(2, 16)
    eager = MLP().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit's own
        scripted, traced = torch.jit.script(eager), torch.jit.trace(eager, x)
        frozen = torch.jit.freeze(torch.jit.script(eager))
    exported = torch.export.export(eager, (x,)).module()
    with torch.no_grad(), mltrace.profile(output=tmp_path / "run", summary=False, level="layer"):
        for model in (eager, scripted, traced, frozen, exported):
            for _ in range(3):
                model(x)
    run = mltrace.load_run(tmp_path / "run")
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    forms = ["MLP (TorchScript)"] * 3 + ["MLP (TorchScript, traced)"] * 3 + ["MLP (TorchScript, frozen)"] * 3
    assert [s.name for s in models] == ["MLP"] * 3 + forms + ["MLP (exported)"] * 3
    assert {s.attrs["ml.layer.type"] for s in models} == {"MLP"}
    data = build_report(run, analyze(run))
    assert sorted((m["name"], m["type"], m["calls"]) for m in data["models"]) == [
        ("MLP", "MLP", 3),
        ("MLP (TorchScript)", "MLP", 3),
        ("MLP (TorchScript, frozen)", "MLP", 3),
        ("MLP (TorchScript, traced)", "MLP", 3),
        ("MLP (exported)", "MLP", 3),
    ]
