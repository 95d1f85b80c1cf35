"""The end-of-run summary counts what ``mltrace report`` counts: the steady model calls, with
the cold ones and their spans left out and said so, on a real traced program."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import SCRIPTS, run_cli

_COUNTS = re.compile(r"(\d+) spans, (\d+) model calls, model time ([\d.]+ [^\s,]+)")


def test_the_summary_and_the_report_count_the_same_steady_calls(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    env = {"MLTRACE_OP_CYCLE_S": "0", "MLTRACE_CACHE_DIR": str(tmp_path / "cache")}
    res = run_cli("python", "--level", "op", "-o", "run", str(SCRIPTS / "calibrated_model.py"), "10", cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr.decode()
    (summary_line,) = [ln for ln in res.stderr.decode().splitlines() if ln.startswith("mltrace: ") and " model calls" in ln]
    report = run_cli("report", "run", "--width", "200", cwd=tmp_path, env=env)
    assert report.returncode == 0, report.stderr.decode()
    header = report.stdout.decode().splitlines()[1]

    stored = json.loads((tmp_path / "run" / "run.json").read_text())["summary"]
    cold = stored["cold_calls"]
    assert cold >= 1 and stored["cold_ns"] > 0  # the calibrating first call, at least
    assert stored["model_calls"] == 10 - cold
    many = "calls and their" if cold > 1 else "call and its"
    note = f" (the {cold} cold {many} spans left out)"
    summary_counts, report_counts = _COUNTS.search(summary_line), _COUNTS.search(header)
    assert summary_counts is not None and report_counts is not None, (summary_line, header)
    assert summary_counts.groups() == report_counts.groups()  # spans, model calls and model time
    assert summary_line.endswith(note) and header.endswith(note)
    # The calibration's ops ran only in the cold call: the summary's layers leave them out too.
    assert all(x["calls"] == 10 - cold for x in stored["top_layers_by_self_time"])
