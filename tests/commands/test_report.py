"""``mltrace report RUN`` on a real traced run: text piped whole, ``--width``/``COLUMNS``,
``--format json`` (checked against the documented schema) and ``--format md``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import mltrace
from analysis.schema_check import errors
from conftest import run_cli
from mltrace.analysis.codepaths import location
from mltrace.analysis.report_schema import REPORT_SCHEMA

LONG = "a_layer_name_long_enough_to_have_been_cut_in_every_table_before"

SCRIPT = f"""
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
        self.blocks = nn.ModuleDict({{"{LONG}": nn.Linear(8, 8)}})
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        f = self.stem(x).mean((2, 3))
        f = self.blocks["{LONG}"](f)
        return self.head(f)

model = Net().eval()
with torch.inference_mode():
    for _ in range(3):
        model(torch.randn(2, 3, 16, 16))
"""


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of a user script that sits in a directory deep enough to be cut at 160 columns."""
    pytest.importorskip("torch")
    home = tmp_path_factory.mktemp("report") / ("project_directory_with_a_long_name_" * 3).rstrip("_")
    home.mkdir()
    (home / "infer.py").write_text(SCRIPT)
    res = run_cli("python", "-q", "-o", str(home / "run"), str(home / "infer.py"), cwd=home)
    assert res.returncode == 0, res.stderr.decode()
    return home


def report(home: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Runs ``mltrace report run ARGS`` in the project directory, its output a pipe."""
    res = run_cli("report", "run", *args, cwd=home, env={"MLTRACE_CACHE_DIR": str(home.parent / "cache"), **(env or {})})
    return res.returncode, res.stdout.decode(), res.stderr.decode()


def layer_attrs(home: Path, name: str) -> dict[str, Any]:
    return next(s.attrs for s in mltrace.load_run(home / "run").spans if s.name == name)


def test_piped_text_is_whole(traced: Path) -> None:
    rc, out, err = report(traced, env={"COLUMNS": ""})
    assert rc == 0, err
    assert "…" not in out
    stem = layer_attrs(traced, "stem.0")
    shown = location(stem["code.file.path"], stem["code.line.number"], cwd=str(traced))
    row = next(line for line in out.splitlines() if line.startswith("│ stem.0 "))
    assert shown in row and ":" in shown  # the whole path:line, on the layer's own row
    assert f"blocks.{LONG}" in out
    if "ml.defined.file.path" in stem:  # runs that record call sites: the user's line, with its code
        assert shown == "infer.py:13" and "f = self.stem(x).mean((2, 3))" in row
        assert "torch/nn/modules/conv.py:" in row


@pytest.mark.parametrize(("args", "env"), [(("--width", "72"), {}), ((), {"COLUMNS": "72"})])
def test_width_wraps_instead_of_cutting(traced: Path, args: tuple[str, ...], env: dict[str, str]) -> None:
    rc, out, err = report(traced, *args, env=env)
    assert rc == 0, err
    assert "…" not in out
    assert max(len(line.rstrip()) for line in out.splitlines()) <= 72
    joined = "".join(out.split())  # a folded name reads whole once the table's wrapping is removed
    assert LONG[:20] in joined


def test_json_report_follows_the_schema(traced: Path) -> None:
    rc, out, err = report(traced, "--format", "json")
    assert rc == 0, err
    data = json.loads(out)
    assert errors(data, REPORT_SCHEMA) == []
    assert list(data) == ["run", "models", "layers", "ops", "types", "findings", "generate", "memory", "requests", "ranks", "processes"]
    assert data["generate"] == []  # no generate() call in this run
    assert data["requests"] is None and data["ranks"] is None and data["run"]["unfollowed"] == []  # no service, no ranks
    assert data["processes"] is None  # one process
    assert data["memory"] is None  # recorded without --memory
    (model,) = data["models"]
    assert model["name"] == "Net" and model["calls"] == 3
    layers = {x["name"]: x for x in data["layers"]}
    assert {"stem.0", "stem.1", "head", f"blocks.{LONG}"} <= set(layers)
    stem = layer_attrs(traced, "stem.0")
    assert layers["stem.0"]["source"] == f"{stem['code.file.path']}:{stem['code.line.number']}"  # whole, as recorded
    defined = stem.get("ml.defined.file.path")
    assert layers["stem.0"]["defined"] == (f"{defined}:{stem['ml.defined.line.number']}" if defined else None)
    assert all(x["median_ns"] is not None and x["median_ns"] <= x["p90_ns"] for x in data["layers"])
    assert data["ops"] and all(o["verdict"] for o in data["ops"])


def test_markdown_report(traced: Path) -> None:
    rc, out, err = report(traced, "--format", "md", "--top", "3")
    assert rc == 0, err
    assert out.startswith("## mltrace report — infer\n")
    assert "### Top layers by self time" in out and "| layer | type |" in out and "…" not in out
    stem = layer_attrs(traced, "stem.0")
    table = out.split("### Top layers by self time", 1)[1].split("### ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == 3
    if "`stem.0`" in table:
        assert location(stem["code.file.path"], stem["code.line.number"], cwd=str(traced)) in table
    # The line on the ops outside every model call, as the text and HTML reports have it.
    rc, data, err = report(traced, "--format", "json")
    note = json.loads(data)["run"]["unscoped_ops"]["text"]
    assert " ops outside every model call" in note
    assert f"\n_{note}_\n" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--width", "5"), "--width must be at least"),
        (("--format", "json", "--html", "x.html"), "--html and --format json: choose one"),
    ],
)
def test_bad_options_say_one_line(traced: Path, args: tuple[str, ...], message: str) -> None:
    rc, out, err = report(traced, *args)
    assert rc == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and out == ""


def test_a_run_that_recorded_nothing_says_so(tmp_path: Path) -> None:
    """A program that runs no model: the report says nothing was recorded, prints no empty
    table and measures no peaks to judge nothing by."""
    script = tmp_path / "no_model.py"
    script.write_text('print("hello")\n')
    traced = run_cli("python", "-q", "-o", str(tmp_path / "run"), str(script))
    assert traced.returncode == 0 and traced.stdout == b"hello\n"
    cache = {"MLTRACE_CACHE_DIR": str(tmp_path / "cache")}  # empty: a report that judged would measure
    text = run_cli("report", str(tmp_path / "run"), env=cache)
    assert text.returncode == 0, text.stderr.decode()
    out = text.stdout.decode()
    assert "nothing was recorded" in out and "Time per level" not in out
    assert b"measuring" not in text.stderr and not (tmp_path / "cache").exists()
    data = json.loads(run_cli("report", str(tmp_path / "run"), "--format", "json", env=cache).stdout)
    assert errors(data, REPORT_SCHEMA) == []
    assert [f["text"] for f in data["findings"] if f["kind"] == "note"][0].startswith("nothing was recorded")
