"""Two models of one class but of different structures are two models (``ModelNames._apart``);
new instances of one structure (a model built per request) stay one."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import mltrace
from mltrace.analysis.bottleneck import analyze
from mltrace.run.levels import Level


def _models(run_dir: Path) -> list[str]:
    run = mltrace.load_run(run_dir)
    return [s.name for s in sorted(run.spans, key=lambda s: s.start_ns) if s.level == Level.MODEL]


def test_an_encoder_and_a_decoder_of_one_class_are_two_models(tmp_path: Path) -> None:
    enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    dec = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad(), mltrace.profile(output=tmp_path / "run", summary=False, level="layer"):
        for _ in range(3):
            dec(enc(torch.randn(2, 8)))
    assert _models(tmp_path / "run") == ["Sequential", "Sequential (dec)"] * 3
    run = mltrace.load_run(tmp_path / "run")
    layers = {r.name: r.calls for r in analyze(run, include_cold=True).breakdown.layers if r.level == Level.LAYER}
    assert layers == {f"{m}.{i}": 3 for m in ("Sequential", "Sequential (dec)") for i in range(3)}


def test_a_model_built_anew_for_each_call_is_one_model(tmp_path: Path) -> None:
    with torch.no_grad(), mltrace.profile(output=tmp_path / "run", summary=False, level="model"):
        for _ in range(3):
            nn.Sequential(nn.Linear(8, 4))(torch.randn(2, 8))
        other = nn.Sequential(nn.Linear(8, 2), nn.Linear(2, 2))
        other(torch.randn(2, 8))
        nn.Sequential(nn.Linear(3, 3), nn.Tanh())(torch.randn(1, 3))  # held by no variable
    assert _models(tmp_path / "run") == ["Sequential"] * 3 + ["Sequential (other)", "Sequential (12 parameters)"]
