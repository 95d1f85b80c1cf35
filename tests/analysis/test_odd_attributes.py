"""Attributes are the program's (``mltrace.span(..., **attrs)``) or a foreign file's (an
imported trace): any JSON value may sit where the analysis expects a shape, a name or a
number. The report, its HTML form and every file export must still work, and a value JSON
cannot hold must not cost the trace."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import mltrace
from mltrace.cli import main
from mltrace.run import store

DATA = Path(__file__).resolve().parents[1] / "data" / "kineto"

#: Values put in place of attributes: wrong types, symbolic and negative sizes, nesting.
ODD: list[Any] = [
    None, "", "s77", "tensor(1)", -1, 0, 1.5, True, [], [[]], [["batch", 3]], [None], [[-5, 2]],
    [[1.5, 2]], [1, "b"], {"a": 1}, {"x": [1, {"y": None}]}, [True, False], "é" * 3,
]  # fmt: skip


def _live_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "live"
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, 10))
    with mltrace.profile(output=run_dir, summary=False, level="op"):
        with mltrace.span("preprocess", batch=1):
            x = torch.randn(1, 3, 16, 16)
        with torch.inference_mode():
            for _ in range(2):
                model.eval()(x)
    return run_dir


def _imported_run(tmp_path: Path, name: str) -> Path:
    run_dir = tmp_path / name.split(".", maxsplit=1)[0]
    assert main(["import", str(DATA / name), "-o", str(run_dir)]) == 0
    return run_dir


def _with_odd_attributes(base: Path, dest: Path, seed: int) -> Path:
    """A copy of the run at ``base`` whose spans have random attributes replaced by ``ODD`` values."""
    run = store.load_run(base)
    keys = sorted({k for s in run.spans for k in s.attrs})
    rng = random.Random(seed)
    spans = run.spans
    for span in spans:
        if rng.random() < 0.5:
            attrs = dict(span.attrs)
            for key in rng.sample(keys, k=min(len(keys), rng.randint(1, 6))):
                attrs[key] = copy.deepcopy(rng.choice(ODD))
            span.attrs = attrs
    run.spans = spans
    dest.mkdir()
    store.write_events_atomically(dest / store.EVENTS_FILE, run)
    store.write_meta(dest, run.meta)
    return dest


@pytest.mark.parametrize("base", ["live", "h100_cuda_models.json.gz", "a100_sampled_rank0.json.gz"])
def test_reports_and_exports_take_any_attribute_values(tmp_path: Path, base: str, capsys: pytest.CaptureFixture[str]) -> None:
    source = _live_run(tmp_path) if base == "live" else _imported_run(tmp_path, base)
    assert main(["report", str(source)]) == 0  # the unchanged run first
    for seed in range(6):
        run_dir = _with_odd_attributes(source, tmp_path / f"odd{seed}", seed)
        for args in (
            ["report", str(run_dir)],
            ["report", str(run_dir), "--html", str(run_dir / "report.html")],
            ["export", str(run_dir), "--format", "chrome-json", "-o", str(run_dir / "trace.json")],
            ["export", str(run_dir), "--format", "perfetto", "-o", str(run_dir / "export.pftrace")],
            ["export", str(run_dir), "--format", "jaeger-json", "-o", str(run_dir / "jaeger.json")],
            ["diff", str(source), str(run_dir)],
            *([["bricks", "--no-bench", str(run_dir)]] if base == "live" else []),  # layer spans: the live run's
        ):
            assert main(args) == 0, (seed, args, capsys.readouterr().err[-500:])
    capsys.readouterr()


def test_values_json_cannot_hold_are_written_as_text(tmp_path: Path) -> None:
    """An integer beyond 64 bits or a dict with int keys failed the whole stream before (every
    later span was lost); they are now written as text, and the spans around them are kept."""
    run_dir = tmp_path / "run"
    with mltrace.profile(output=run_dir, summary=False):
        with mltrace.span("before"):
            pass
        with mltrace.span("odd", big=2**70, small=-(2**70), by_number={1: "a"}, items={3}, blob=b"xy") as s:  # names redaction leaves
            s.set("pair", (1, 2))
            s.set(2, "two")  # type: ignore[arg-type]  # not text: made text
        with mltrace.span("after"):
            pass
    run = mltrace.load_run(run_dir)
    assert [s.name for s in sorted(run.spans, key=lambda s: s.start_ns)] == ["before", "odd", "after"]
    odd = next(s for s in run.spans if s.name == "odd")
    assert odd.attrs["big"] == str(2**70) and odd.attrs["small"] == str(-(2**70))
    assert odd.attrs["by_number"] == {"1": "a"} and odd.attrs["items"] == [3] and odd.attrs["pair"] == [1, 2]
    assert odd.attrs["blob"] == "b'xy'" and odd.attrs["2"] == "two"


#: Values put in place of run.json entries.
ODD_META: list[Any] = [
    None, "", "x", -1, 0, 1.5, True, [], {}, [1, 2], {"a": 1}, 2**70, {"ended_ns": "x"},
    {"frameworks": {"pytorch": 5}}, {"frameworks": []}, [{"a": None}],
]  # fmt: skip


def _paths(d: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for k, v in d.items():
        out.append((*prefix, k))
        if isinstance(v, dict):
            out += _paths(v, (*prefix, k))
    return out


def test_reports_and_exports_take_a_run_json_of_other_shapes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A hand-edited or foreign run.json (sections of other types, ids beyond 64 bits): the
    report, its HTML form, the exports and a diff still work, from what the run holds."""
    import json
    import shutil

    source = _live_run(tmp_path)
    meta = json.loads((source / store.META_FILE).read_text())
    paths = _paths(meta)
    for seed in range(10):
        rng = random.Random(seed)
        odd = copy.deepcopy(meta)
        for path in rng.sample(paths, k=min(len(paths), rng.randint(1, 12))):
            section = odd
            for key in path[:-1]:
                section = section.get(key) if isinstance(section.get(key), dict) else {}
            section[path[-1]] = copy.deepcopy(rng.choice(ODD_META))
        run_dir = tmp_path / f"meta{seed}"
        shutil.copytree(source, run_dir)
        (run_dir / store.TABLE_FILE).unlink(missing_ok=True)
        (run_dir / store.META_FILE).write_text(json.dumps(odd))
        for args in (
            ["report", str(run_dir)],
            ["report", str(run_dir), "--html", str(run_dir / "report.html")],
            ["export", str(run_dir), "--format", "jaeger-json", "-o", str(run_dir / "jaeger.json")],
            ["export", str(run_dir), "--format", "chrome-json", "-o", str(run_dir / "trace.json")],
            ["diff", str(source), str(run_dir)],
        ):
            assert main(args) in (0, 2), (seed, args, capsys.readouterr().err[-500:])
    capsys.readouterr()
