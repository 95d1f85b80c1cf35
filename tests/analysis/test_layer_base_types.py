"""A model library's subclass of a torch.nn layer (transformers' ``WhisperPositionalEmbedding``
is an ``nn.Embedding``) records the torch.nn class it derives from (``ml.layer.base_type``), and
its work comes from that class's formula where its own type has none, so it gets a verdict."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import mltrace
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.peaks import Peaks, PeakSet
from mltrace.analysis.report_data import build_report
from mltrace.run.levels import Level
from mltrace.tracer.sources.torch_modules import torch_nn_base

#: Roofs to judge by (without them no row has a verdict).
PEAKS = PeakSet(Peaks("cpu", "test CPU", 100e9, 10e9, "assumed"))
KNOWN = ("compute-bound", "memory-bound", "overhead-bound")


class PositionalEmbedding(nn.Embedding):
    """As Whisper's: the rows of the positions asked for, sliced from the table."""

    def forward(self, input_ids: torch.Tensor, past: int = 0) -> torch.Tensor:
        return self.weight[past : past + input_ids.shape[-1]]


class ScaledNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = PositionalEmbedding(64, 16)
        self.norm = ScaledNorm(16)
        self.out = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.pos(ids)))


def test_the_base_type_is_the_nearest_torch_nn_class() -> None:
    assert torch_nn_base(PositionalEmbedding) == "Embedding"
    assert torch_nn_base(ScaledNorm) == "LayerNorm"
    assert torch_nn_base(nn.Linear) is None  # torch.nn's own
    assert torch_nn_base(Block) is None  # a Module and nothing more


def test_a_subclass_of_a_torch_nn_layer_is_judged_by_its_base_types_formula(tmp_path: Path) -> None:
    model, calls = Block().eval(), 5
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad(), mltrace.profile(output=tmp_path / "run", summary=False, level="layer"):
        for _ in range(calls):
            model(ids)
    run = mltrace.load_run(tmp_path / "run")
    layers = {s.name: s for s in run.spans if s.level == Level.LAYER}
    assert layers["pos"].attrs["ml.layer.base_type"] == "Embedding"
    assert "ml.layer.base_type" not in layers["out"].attrs
    rows = {r["name"]: r for r in build_report(run, analyze(run, PEAKS))["layers"]}
    assert rows["pos"]["verdict"] in KNOWN, rows["pos"]["why"]
    assert rows["pos"]["flops"] == 0 and rows["pos"]["bytes"] > 0  # a lookup: rows moved, no arithmetic
    assert rows["norm"]["flops"] == calls * 5 * 12 * 16  # the norms' 5 per output element
    assert rows["norm"]["verdict"] in KNOWN, rows["norm"]["why"]
