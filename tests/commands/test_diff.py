"""``mltrace diff`` end to end, on two real runs."""

from __future__ import annotations

from pathlib import Path

import pytest

import mltrace
from conftest import run_cli


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    torch = pytest.importorskip("torch")
    nn = torch.nn
    base = tmp_path_factory.mktemp("diff")
    torch.manual_seed(0)
    small = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    other = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).eval()
    with torch.inference_mode():
        with mltrace.profile(output=base / "a", level="layer", summary=False):
            for _ in range(3):
                small(torch.randn(1, 64))
        with mltrace.profile(output=base / "b", level="layer", summary=False):
            for _ in range(5):
                other(torch.randn(8, 64))
    return base / "a", base / "b"


def test_diff_prints_the_comparison(runs: tuple[Path, Path]) -> None:
    a, b = runs
    res = run_cli("diff", str(a), str(b), "--top", "50")
    out = res.stdout.decode()
    assert res.returncode == 0, res.stderr.decode()
    assert "mltrace diff" in out and f"A: profile ({a})" in out and f"B: profile ({b})" in out
    assert "model calls: 3 in A, 5 in B" in out
    assert "times are per model call" in out  # 3 against 5 model calls
    assert "Totals" in out and "model time" in out
    assert "Layer types:" in out and "GELU" in out and "ReLU" in out
    gelu = next(line for line in out.splitlines() if "GELU" in line and "│" in line)
    relu = next(line for line in out.splitlines() if "ReLU" in line and "│" in line)
    assert "added" in gelu and "removed" in relu


def test_diff_totals_and_threshold_options(runs: tuple[Path, Path]) -> None:
    a, b = runs
    res = run_cli("diff", str(a), str(b), "--totals", "--threshold", "0.5", "--min-delta-us", "0")
    assert res.returncode == 0, res.stderr.decode()
    assert "times are totals" in res.stdout.decode() and "over 50%" in res.stdout.decode()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--top", "0"], "--top must be at least 1"),
        (["--threshold", "-1"], "--threshold must be 0 or more"),
        (["--per-call", "--totals"], "not allowed"),
    ],
)
def test_usage_errors(runs: tuple[Path, Path], extra: list[str], message: str) -> None:
    a, b = runs
    res = run_cli("diff", str(a), str(b), *extra)
    assert res.returncode == 2 and res.stderr.decode().count("\n") == 1 and message in res.stderr.decode()


def test_missing_run(runs: tuple[Path, Path], tmp_path: Path) -> None:
    res = run_cli("diff", str(runs[0]), str(tmp_path / "nope"))
    assert res.returncode == 2 and b"no such run directory" in res.stderr
