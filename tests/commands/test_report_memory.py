"""``mltrace python --memory`` then ``mltrace report``/``diff``, as a user runs them, on a
TransformerEncoder: the JSON report's memory keys (checked against the schema), the text
report's memory section, and a run without ``--memory``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from analysis.schema_check import errors
from conftest import run_cli
from mltrace.analysis.report_schema import REPORT_SCHEMA

D_MODEL, HEADS, TOKENS = 128, 4, 128

SCRIPT = f"""
import sys
import torch
from torch import nn

torch.manual_seed(0)
layer = nn.TransformerEncoderLayer({D_MODEL}, {HEADS}, 4 * {D_MODEL}, batch_first=True)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, {D_MODEL})
        self.encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    def forward(self, x):
        return self.encoder(self.embed(x)).mean(1)

model = Net().eval()
x = torch.randn(int(sys.argv[1]), {TOKENS}, 16)
with torch.no_grad():
    for _ in range(2):
        model(x)
"""


def trace(home: Path, name: str, batch: int, *options: str) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    (home / "encode.py").write_text(SCRIPT)
    res = run_cli("python", "-q", *options, "-o", str(home / name), str(home / "encode.py"), str(batch), cwd=home)
    assert res.returncode == 0, res.stderr.decode()
    return home / name


def report(run: Path, *args: str) -> Any:
    res = run_cli("report", str(run), *args, env={"MLTRACE_CACHE_DIR": str(run.parent / "cache")})
    assert res.returncode == 0, res.stderr.decode()
    return res.stdout.decode()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    home = tmp_path_factory.mktemp("memory")
    return trace(home, "b32", 32, "--memory"), trace(home, "plain", 4)


def test_json_report_names_the_peak_layer_at_batch_32(runs: tuple[Path, Path]) -> None:
    data = json.loads(report(runs[0], "--format", "json"))
    assert errors(data, REPORT_SCHEMA) == []
    (peak,) = data["memory"]["peaks"]
    assert peak["track"] == "cpu.memory.allocated" and peak["device"] == -1 and peak["samples"] > 100
    assert peak["layer"] is not None and peak["layer"].startswith("encoder.layers."), peak
    scores = 32 * HEADS * TOKENS * TOKENS * 4  # one layer's attention weights (bytes)
    assert peak["bytes"] >= scores
    layers = {x["name"]: x for x in data["layers"]}
    for name in ("encoder.layers.0", "encoder.layers.1", "encoder.layers.2"):
        assert layers[name]["peak_alloc_bytes"] >= 32 * TOKENS * D_MODEL * 4  # at least its output
        assert layers[name]["alloc_bytes"] >= layers[name]["peak_alloc_bytes"]
    assert any(op["alloc_bytes"] for op in data["ops"])


def test_text_report_has_a_memory_section(runs: tuple[Path, Path]) -> None:
    text = report(runs[0], "--width", "200")
    assert "Memory peak cpu.memory.allocated:" in text and " in encoder.layers." in text
    assert "Memory by layer (peak of one call)" in text and "Memory by op (allocated)" in text


def test_markdown_report_has_a_memory_section(runs: tuple[Path, Path]) -> None:
    md = report(runs[0], "--format", "md")
    section = md.split("### Memory", 1)[1].split("###", 1)[0]
    assert "| cpu.memory.allocated |" in section and "| encoder.layers." in section
    assert "Layers by peak of live memory while they ran" in section
    assert "### Memory" not in report(runs[1], "--format", "md")


def test_without_memory_the_keys_are_null(runs: tuple[Path, Path]) -> None:
    data = json.loads(report(runs[1], "--format", "json"))
    assert errors(data, REPORT_SCHEMA) == []
    assert data["memory"] is None
    assert all(x["alloc_bytes"] is None and x["peak_alloc_bytes"] is None for x in data["layers"] + data["ops"])
    assert "Memory peak" not in report(runs[1])


def test_diff_compares_the_peaks(runs: tuple[Path, Path], tmp_path: Path) -> None:
    small = trace(tmp_path, "b8", 8, "--memory")
    res = run_cli("diff", str(small), str(runs[0]), env={"MLTRACE_CACHE_DIR": str(tmp_path / "cache")})
    assert res.returncode == 0, res.stderr.decode()
    text = res.stdout.decode()
    assert "Memory peaks" in text and "peak cpu.memory.allocated" in text
