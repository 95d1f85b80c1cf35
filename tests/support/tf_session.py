"""A session with the TensorFlow source alone, around a test's body."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mltrace
from mltrace.config import ProfileOptions
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.tracer.session import Session
from mltrace.tracer.sources.tensorflow import TensorFlowSource


def traced(tmp_path: Path, body: Callable[[], Any], level: Level | None = None) -> Run:
    """Runs ``body`` in a session of the TensorFlow source (under ``tmp_path/run``) and loads the run."""
    session = Session(ProfileOptions(output=tmp_path / "run", summary=False, level=level), sources=[TensorFlowSource()]).start()
    try:
        body()
    finally:
        path = session.stop()
    return mltrace.load_run(path)
