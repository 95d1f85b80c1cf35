"""The report as plain data, its schema, and the source-path rules it relies on."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from analysis.schema_check import errors
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.codepaths import context_lines, is_model_code, location, package_path, short_path, source_line, split_location
from mltrace.analysis.peaks import Peaks, PeakSet
from mltrace.analysis.report_data import build_report, exit_cause, exit_text, percentile_ns
from mltrace.analysis.report_schema import REPORT_SCHEMA
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run

PEAKS = PeakSet(Peaks("cpu", "test CPU", 100e9, 10e9, "assumed"))
SITE = "/opt/venv/lib/python3.11/site-packages"


def test_package_path_and_short_path() -> None:
    assert package_path(f"{SITE}/torch/nn/modules/conv.py") == "torch/nn/modules/conv.py"
    assert package_path("/usr/lib/python3/dist-packages/numpy/core.py") == "numpy/core.py"
    assert package_path("/home/u/proj/infer.py") is None
    assert short_path(f"{SITE}/torch/nn/modules/conv.py") == "torch/nn/modules/conv.py"
    assert short_path("/home/u/proj/models/net.py", cwd="/home/u/proj") == "models/net.py"
    assert short_path("/srv/elsewhere/net.py", cwd="/home/u/proj") == "/srv/elsewhere/net.py"  # outside: whole
    assert short_path("relative/net.py", cwd="/home/u/proj") == "relative/net.py"
    assert location("/home/u/proj/infer.py", 25, cwd="/home/u/proj") == "infer.py:25"
    assert location(None, 3) == "" and location(12, 3) == ""


def test_split_location() -> None:
    assert split_location("/a b/model.py:20 Net.forward") == ("/a b/model.py", 20, "Net.forward")
    assert split_location("C:/x/model.py:7") == ("C:/x/model.py", 7, "")
    assert split_location("nowhere") == ("nowhere", None, "")


@pytest.mark.parametrize(
    ("path", "model_code"),
    [
        (f"{SITE}/torch/nn/modules/conv.py", False),
        (f"{SITE}/keras/src/layers/core/dense.py", False),
        (f"{SITE}/onnxruntime/capi/onnxruntime_inference_collection.py", False),
        (f"{SITE}/mltrace/tracer/api.py", False),
        (f"{SITE}/transformers/models/gpt2/modeling_gpt2.py", True),  # model libraries are model code
        (f"{SITE}/torchvision/models/resnet.py", True),
        ("/home/u/proj/infer.py", True),
        ("<frozen importlib._bootstrap>", False),
        ("", False),
        (os.__file__, False),  # the standard library
    ],
)
def test_model_code(path: str, model_code: bool) -> None:
    assert is_model_code(path) is model_code


def test_mltrace_checkout_is_not_model_code() -> None:
    import mltrace.analysis.codepaths as here

    assert is_model_code(here.__file__) is False  # mltrace run from a source checkout, not site-packages
    assert is_model_code(__file__) is True


def test_source_lines_are_read_now_and_never_fail(tmp_path: Path) -> None:
    src = tmp_path / "net.py"
    src.write_text("a = 1\nb = 2\n    c = self.head(x)\nd = 4\n")
    assert source_line(str(src), 3) == "c = self.head(x)"
    assert context_lines(str(src), 3, 1) == [(2, "b = 2"), (3, "    c = self.head(x)"), (4, "d = 4")]
    assert context_lines(str(tmp_path / "gone.py"), 3) == [] and source_line(str(tmp_path / "gone.py"), 3) == ""
    assert context_lines(str(src), 99) == [] and context_lines(str(src), 0) == [] and context_lines(None, 3) == []


def test_percentiles() -> None:
    assert percentile_ns([], 50) is None
    assert percentile_ns([7], 90) == 7
    assert percentile_ns([40, 10, 30, 20], 50) == 25
    assert percentile_ns(list(range(1, 11)), 90) == 9  # 9.1 rounded, as numpy.percentile gives 9.1


def hand_run(defined: bool) -> Run:
    """A model called twice; each call runs layer fc (with or without ``ml.defined.*``)."""
    fc: dict[str, object] = {"ml.layer.type": "Linear", "code.file.path": "/srv/infer.py", "code.line.number": 25}
    if defined:
        fc |= {"ml.defined.file.path": f"{SITE}/torch/nn/modules/linear.py", "ml.defined.line.number": 124}
    model = {"ml.layer.type": "Net", "ml.call.file.path": "/srv/infer.py", "ml.call.line.number": 40}
    spans = [
        Span(1, None, Level.MODEL, "Net", 0, 1_000, 1, model),
        Span(2, 1, Level.LAYER, "fc", 100, 900, 1, fc),
        Span(3, None, Level.MODEL, "Net", 2_000, 5_000, 1, model),
        Span(4, 3, Level.LAYER, "fc", 2_100, 4_900, 1, fc),
        Span(5, 4, Level.OP, "aten::linear", 2_200, 4_800, 1, {}),
    ]
    return Run(Path("hand"), {"name": "hand", "complete": True}, {1: Track(1, TrackKind.THREAD, "MainThread", 1, 1)}, spans)


@pytest.mark.parametrize("defined", [True, False])
def test_report_data_matches_the_schema_and_the_run(defined: bool) -> None:
    run = hand_run(defined)
    data = build_report(run, analyze(run, PEAKS))
    assert errors(data, REPORT_SCHEMA) == []
    (model,) = data["models"]
    assert model["calls"] == 2 and model["source"] == "/srv/infer.py:40"  # from ml.call.* where code.* is absent
    assert (model["steady_median_ns"], model["cold_calls"]) == (2_000, 0)
    (fc,) = data["layers"]
    assert fc["source"] == "/srv/infer.py:25" and fc["calls"] == 2 and fc["median_ns"] == 1_800
    assert fc["defined"] == (f"{SITE}/torch/nn/modules/linear.py:124" if defined else None)
    assert [o["name"] for o in data["ops"]] == ["aten::linear"]


def test_the_validator_finds_what_is_wrong() -> None:
    run = hand_run(True)
    data = build_report(run, analyze(run, PEAKS))
    del data["layers"][0]["defined"]
    data["layers"][0]["surprise"] = 1
    data["models"][0]["calls"] = "2"
    found = errors(data, REPORT_SCHEMA)
    assert "$.layers[0]: missing 'defined'" in found and "$.layers[0]: unexpected 'surprise'" in found
    assert any(e.startswith("$.models[0].calls: str") for e in found)


def test_importing_the_report_data_imports_no_framework() -> None:
    import subprocess

    code = "import sys, mltrace.analysis.report_data, mltrace.viewers.markdown; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@pytest.mark.parametrize(
    ("meta", "said"),
    [
        ({}, ""),
        ({"exit_status": 0, "exit_cause": "SystemExit(0)"}, ""),
        ({"exit_status": 7, "exit_via": "os._exit"}, "The program exited with status 7 (os._exit): "),
        ({"exit_status": 2}, "The program exited with status 2: "),
        ({"exit_status": -9}, "The program was ended by SIGKILL: "),
        ({"exit_status": -200}, "The program was ended by signal 200: "),
        ({"exit_status": -15, "exit_cause": "SIGTERM"}, "The program was ended by SIGTERM: "),
        ({"exit_status": 1, "exit_cause": "SystemExit(" + "x" * 200 + ")"}, "The program exited with status 1 (SystemExit(xxx"),
        ({"exit_status": True}, ""),  # not a status run.json writes
    ],
)
def test_exit_text_says_how_the_program_ended(meta: dict[str, object], said: str) -> None:
    text = exit_text(meta)
    assert text.startswith(said) and bool(text) is bool(said)
    assert len(exit_cause(meta)) <= 80
    if not said:
        assert exit_cause(meta) == ""  # no cause after status 0


def test_the_bound_finding_says_mostly_only_for_more_than_half() -> None:
    from mltrace.analysis.bottleneck import Bound, Findings
    from mltrace.analysis.report_data import _bound_finding

    most = Findings(basis="ops (self time)", bound_ns={Bound.COMPUTE: 60, Bound.MEMORY: 30, Bound.UNKNOWN: 10})
    (finding,) = _bound_finding(most)
    assert finding["text"] == "Mostly compute-bound — share of ops (self time): compute 60%, memory 30%, unknown 10%"
    spread = Findings(basis="ops (self time)", bound_ns={Bound.COMPUTE: 27, Bound.UNKNOWN: 29, Bound.MEMORY: 24, Bound.OVERHEAD: 20})
    (finding,) = _bound_finding(spread)
    assert finding["text"].startswith("Mixed, compute-bound the largest known — ") and finding["dominant"] == "compute-bound"
    assert "unknown 29%, compute 27%, memory 24%, overhead 20%" in finding["text"]
