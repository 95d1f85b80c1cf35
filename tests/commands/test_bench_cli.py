"""End to end, as users run them: ``mltrace bench``, ``mltrace bricks``, ``mltrace metrics tta``."""

from __future__ import annotations

import csv
import json
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import mltrace
from conftest import run_cli
from mltrace.run.levels import Level

DATA = Path(__file__).resolve().parent.parent / "data" / "metrics"

# Follows the protocol; int8 fails before importing torch, so failed scenarios cost nothing.
SWEEP_SCRIPT = textwrap.dedent(
    """
    import sys
    from mltrace.bench import scenario
    sc = scenario()
    if sc.precision == "int8":
        sys.exit("int8 is not supported by this model")
    import torch
    from torch import nn
    sc.apply_threads()
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    x = torch.randn(sc.batch, 32)
    with torch.inference_mode():
        for _ in range(sc.iters_or(3)):
            y = model(x)
    print("batch", sc.batch, "threads", torch.get_num_threads(), tuple(y.shape))
    """
)


def test_metrics_tta_prints_the_seed_table() -> None:
    res = run_cli("metrics", "tta", "--thresholds", "70:77:1", str(DATA / "seed_tta.csv"))
    assert res.returncode == 0, res.stderr.decode()
    lines = res.stdout.decode().splitlines()
    assert lines[1].split() == ["threshold", "TTA", "ATTMT"]
    assert [ln.split() for ln in lines[2:]] == [
        ["70", "364", "364"],
        ["71", "364", "364"],
        ["72", "424", "384"],
        ["73", "424", "394"],
        ["74", "504", "416"],
        ["75", "664", "457.3"],
        ["76", "704", "492.6"],
        ["77", "804", "531.5"],
    ]


def test_metrics_tta_json_and_unreached() -> None:
    res = run_cli("metrics", "tta", "--thresholds", "76:79:1", "--json", str(DATA / "seed_tta.jsonl"))
    assert res.returncode == 0, res.stderr.decode()
    rows = json.loads(res.stdout)["rows"]
    assert [(r["tta"], r["attmt"]) for r in rows] == [(704.0, 704.0), (804.0, 754.0), (None, None), (None, None)]
    text = run_cli("metrics", "tta", "--thresholds", "76:79:1", str(DATA / "seed_tta.csv")).stdout.decode()
    assert "not reached" in text and "2 threshold(s) never reached (best accuracy: 77.4)" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["metrics", "tta", "--thresholds", "77:70:1", str(DATA / "seed_tta.csv")], "below START"),
        (["metrics", "tta", "--thresholds", "70:77:1", "--metric", "top5", str(DATA / "seed_tta.csv")], "no metric column 'top5'"),
        (["metrics", "tta", "--thresholds", "70:77:1", "missing.csv"], "no such log file"),
        (["metrics", "tta", str(DATA / "seed_tta.csv")], "--thresholds"),
        (["metrics"], "needs a metric"),
        (["bench", "--leveled", "--batch", "1,2", "x.py"], "--leveled runs one scenario"),
        (["bench", "--batch", "1,zero", "x.py"], "comma list of integers"),
        (["bench", "--precision", "fp8", "x.py"], "unknown precision"),
        (["bench", "--leveled", "--levels", "model,deep", "x.py"], "unknown level"),
        (["bench", "missing.py"], "can't open file"),
        (["bench", "--rounds", "2", "x.py"], "go with --leveled"),
        (["bricks", "no-such-run"], "no such run directory"),
        (["bricks", "-H", "0", "no-such-run"], "-H >= 1"),
    ],
)
def test_usage_errors_are_one_line_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "x.py").write_text("print('ran')\n")
    res = run_cli(*args, cwd=tmp_path)
    err = res.stderr.decode()
    assert res.returncode == 2, err
    assert err.count("\n") == 1 and err.startswith("mltrace: error:"), err
    assert message in err
    assert b"ran" not in res.stdout and not (tmp_path / "mltrace-runs").exists()


def test_bench_sweep_table_plot_manifest(tmp_path: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(SWEEP_SCRIPT)
    out = tmp_path / "sweep"
    res = run_cli(
        "bench",
        "--batch",
        "1,4",
        "--precision",
        "fp32,int8",
        "--threads",
        "1",
        "-n",
        "3",
        "--warmup",
        "1",
        "-o",
        str(out),
        str(script),
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr.decode()
    text = res.stdout.decode()
    assert "b1-fp32-t1" in text and "b4-int8-t1         failed (exit 1): int8 is not supported by this model" in text
    assert b"[4/4] b4-int8-t1: exit 1" in res.stderr
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [(r["scenario"], r["status"], r["calls"]) for r in rows] == [
        ("b1-fp32-t1", "0", "3"),
        ("b4-fp32-t1", "0", "3"),
        ("b1-int8-t1", "1", ""),
        ("b4-int8-t1", "1", ""),
    ]
    for r in rows[:2]:
        assert 0 < float(r["p50_ms"]) <= float(r["p90_ms"]) <= float(r["p99_ms"])
        assert float(r["throughput_per_s"]) > 0
    svg = ET.parse(out / "sweep.svg").getroot()
    assert len(svg.findall(".//{http://www.w3.org/2000/svg}circle")) == 2 * 4
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["parameters"]["batch"] == [1, 4] and manifest["parameters"]["threads"] == [1]
    assert manifest["framework"][0]["name"] == "pytorch" and manifest["models"][0]["name"] == "Sequential"
    assert manifest["models"][0]["parameters"] == 32 * 64 + 64 + 64 * 8 + 8
    assert manifest["hardware"]["cpu_count"] and manifest["workload"]["script"] == str(script)
    run = mltrace.load_run(out / "scenarios" / "b4-fp32-t1")
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert len(models) == 4 and models[0].attrs["ml.input.shapes"] == [[4, 32]]  # the script saw batch 4 and 1 + 3 calls
    assert run.meta["environment"]["MLTRACE_BATCH"] == "4" and run.meta["environment"]["OMP_NUM_THREADS"] == "1"
    assert "threads 1" in (out / "scenarios" / "b4-fp32-t1.log").read_text()


def test_bench_leveled_cli(tmp_path: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(SWEEP_SCRIPT)
    out = tmp_path / "lev"
    res = run_cli("bench", "--leveled", "-n", "3", "--warmup", "1", "--levels", "model,layer", "-o", str(out), str(script), cwd=tmp_path)
    assert res.returncode == 0, res.stderr.decode()
    text = res.stdout.decode()
    assert "leveled runs: model, layer" in text and "plain (uninstrumented): median" in text
    assert "every span matched across runs" in text and f"leveled trace: {out}/trace.pftrace" in text
    report = run_cli("report", str(out))
    assert report.returncode == 0 and b"Sequential" in report.stdout
    doc = json.loads((out / "leveled.json").read_text())
    assert [r["level"] for r in doc["models"][0]["levels"]] == ["model", "layer"]


def test_bricks_cli(tmp_path: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(SWEEP_SCRIPT)
    traced = run_cli("python", "-q", "--level", "layer", "-o", str(tmp_path / "run"), str(script), cwd=tmp_path)
    assert traced.returncode == 0, traced.stderr.decode()
    res = run_cli("bricks", "-n", "2", "--warmup", "1", "-H", "2", "--json", str(tmp_path / "b.json"), str(tmp_path / "run"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr.decode()
    text = res.stdout.decode()
    assert "1 model(s): 3 leaf-layer calls, 3 unique layer bricks; 2 sequences of up to 2 layers, 2 unique" in text
    assert "sequence sum (H=2)" in text and "benchmarking-time speedup" in text
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["counts"]["layers_unique"] == 3 and all(b["median_ns"] > 0 for b in doc["bricks"])
    counts = run_cli("bricks", "--no-bench", str(tmp_path / "run"))
    assert counts.returncode == 0 and b"0 inferred from shapes and parameters, 3 recorded" in counts.stdout
    model_only = run_cli("python", "-q", "--level", "model", "-o", str(tmp_path / "m"), str(script), cwd=tmp_path)
    assert model_only.returncode == 0
    res = run_cli("bricks", str(tmp_path / "m"))
    assert res.returncode == 2 and b"no layer spans (trace it with --level layer or deeper)" in res.stderr


def test_bench_leveled_reports_a_failing_script(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("raise RuntimeError('model file missing')\n")
    res = run_cli("bench", "--leveled", "--levels", "model", "-o", str(tmp_path / "out"), str(script), cwd=tmp_path)
    err = res.stderr.decode()
    assert res.returncode == 1, err
    assert "the plain run of" in err and "exited with status 1" in err
    assert "RuntimeError: model file missing" in err  # the tail of the script's own output
    assert (tmp_path / "out" / "runs" / "plain-r0.log").exists()
