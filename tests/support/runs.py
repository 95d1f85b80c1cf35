"""Run directories kept in tests/data/runs (recorded on a GPU), unpacked for a test."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import mltrace
from mltrace.run.store import Run

RUNS = Path(__file__).resolve().parent.parent / "data" / "runs"


def unpack_run(name: str, dest: Path) -> Run:
    """The stored run ``name`` (``run.json`` and gzipped ``events.jsonl``) written to ``dest`` and loaded."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(RUNS / name / "run.json", dest / "run.json")
    with gzip.open(RUNS / name / "events.jsonl.gz", "rb") as src, open(dest / "events.jsonl", "wb") as out:
        shutil.copyfileobj(src, out)
    return mltrace.load_run(dest)
