"""``import_kineto`` and ``mltrace import``: a real Kineto trace becomes a finished run."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from conftest import run_cli
from mltrace.errors import UsageError
from mltrace.importers import import_kineto
from mltrace.run.levels import Level
from mltrace.run.store import EVENTS_FILE, META_FILE, RunError, load_run

DATA = Path(__file__).resolve().parents[1] / "data" / "kineto"
ALEXNET = DATA / "a100_alexnet_train.json.gz"


def raw_counts(path: Path) -> Counter[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return Counter(e["cat"] for e in json.load(f)["traceEvents"] if e.get("ph") == "X")


def test_import_writes_a_complete_correlated_run(tmp_path: Path) -> None:
    dest = tmp_path / "run"
    assert import_kineto(ALEXNET, dest) == dest
    run = load_run(dest)
    counts = raw_counts(ALEXNET)
    assert run.complete and not run.torn
    meta = run.meta
    assert meta["format"] == "mltrace-run" and meta["imported"] is True
    assert meta["source"]["format"] == "kineto" and meta["source"]["file"] == str(ALEXNET)
    assert meta["clock"]["anchor_epoch_ns"] == meta["clock"]["anchor_monotonic_ns"] == 0
    assert meta["clock"]["kineto_clock"] == "epoch_us"
    assert {k: v["recorded"] for k, v in meta["levels"].items()} == {
        "model": False,
        "layer": False,
        "op": True,
        "library": False,
        "kernel": True,
    }
    assert sum(s.level is Level.OP for s in run.spans) == counts["cpu_op"]
    gpu = [s for s in run.spans if s.attrs.get("gpu.activity")]
    assert len(gpu) == counts["kernel"] + counts["gpu_memcpy"] + counts["gpu_memset"]
    by_id = run.span_by_id()
    # After finalize_run: every GPU activity hangs under its launch call, which hangs under an op or a range.
    for s in gpu:
        launch = by_id[s.parent_id]
        assert "cuda.api.name" in launch.attrs
        assert by_id[launch.parent_id].level in (Level.OP, Level.USER, Level.KERNEL)
    assert all("ml.library.name" in s.attrs for s in gpu if s.attrs["gpu.activity"] == "kernel")
    assert (dest / "trace.pftrace").stat().st_size > 0


def test_import_refuses_a_non_empty_directory_and_changes_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "run"
    dest.mkdir()
    keep = dest / "notes.txt"
    keep.write_text("mine")
    with pytest.raises(UsageError, match="not empty"):
        import_kineto(ALEXNET, dest)
    assert [p.name for p in dest.iterdir()] == ["notes.txt"] and keep.read_text() == "mine"


def test_import_of_a_torn_trace_creates_nothing(tmp_path: Path) -> None:
    torn = tmp_path / "torn.json.gz"
    torn.write_bytes(ALEXNET.read_bytes()[:5000])
    dest = tmp_path / "run"
    with pytest.raises(RunError, match="truncated or corrupt gzip"):
        import_kineto(torn, dest)
    assert not dest.exists()


def test_cli_import(tmp_path: Path) -> None:
    dest = tmp_path / "run"
    res = run_cli("import", str(DATA / "a100_triton_kernel.json.gz"), "-o", str(dest), cwd=tmp_path)
    assert res.returncode == 0, res.stderr.decode()
    out = res.stdout.decode()
    assert "1 GPU activities, 1 linked to their launch" in out and str(dest) in out
    assert (dest / META_FILE).exists() and (dest / EVENTS_FILE).exists()
    assert json.loads((dest / META_FILE).read_text())["complete"] is True

    again = run_cli("import", str(DATA / "a100_triton_kernel.json.gz"), "-o", str(dest), cwd=tmp_path)
    assert again.returncode == 2
    err = again.stderr.decode()
    assert err.startswith("mltrace: error:") and "not empty" in err and "Traceback" not in err

    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"spans": []}')
    bad = run_cli("import", str(foreign), "-o", str(tmp_path / "other"), cwd=tmp_path)
    assert bad.returncode == 2 and "no traceEvents" in bad.stderr.decode()
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("name", ["h100_cuda_models.json.gz", "a100_sampled_rank0.json.gz", "cpu_modules_torch.json.gz"])
def test_a_trace_with_fields_of_other_types_imports_what_fits(tmp_path: Path, name: str) -> None:
    """A foreign or damaged trace: fields of events replaced by values of other types (text
    ids, huge or negative numbers, lists, dicts). The import keeps every event whose fields
    fit, counts the others as skipped, and the run reports and exports."""
    import copy
    import random

    from mltrace.cli import main

    odd: list[object] = [None, "", "x", -1, 0, 1e30, -1e30, 2**70, 1.5, True, [], {}, [1, 2], {"a": 1}, "123"]
    with gzip.open(DATA / name, "rt", encoding="utf-8") as f:
        source = json.load(f)
    for seed in range(4):
        rng = random.Random(seed)
        doc = copy.deepcopy(source)
        for e in doc["traceEvents"]:
            if rng.random() < 0.2:
                e[rng.choice([*e, "args"])] = copy.deepcopy(rng.choice(odd))
            args = e.get("args")
            if isinstance(args, dict) and args and rng.random() < 0.1:
                args[rng.choice(list(args))] = copy.deepcopy(rng.choice(odd))
        path = tmp_path / f"damaged{seed}.json"
        path.write_text(json.dumps(doc))
        dest = tmp_path / f"run{seed}"
        import_kineto(path, dest)
        run = load_run(dest)
        assert run.complete and run.spans
        assert run.meta["kineto"]["skipped"].get("malformed (a name, category, phase or args of another type)", 0) > 0
        assert all(isinstance(t.pid, int) for t in run.tracks.values())  # ids beyond 64 bits are no ids
        assert main(["report", str(dest)]) == 0
        assert main(["export", str(dest), "--format", "chrome-json", "-o", str(dest / "trace.json")]) == 0
