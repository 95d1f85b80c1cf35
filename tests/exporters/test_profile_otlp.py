"""``mltrace.profile()`` exports over OTLP as ``mltrace python --otlp`` does: with the OTEL_*
endpoint set, or with ``otlp=``, its model and layer spans reach a real in-process gRPC OTLP
receiver while the profiled region still runs, and the rest (the ops) once it stops."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("grpc")
pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("torch")

from support.otlp_receiver import GrpcReceiver, attrs_of, spans_of  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_otlp.py"


def _levels(r: GrpcReceiver) -> list[str]:
    return [attrs_of(sp.attributes)["mltrace.level"] for _s, _r, sp in spans_of(r.snapshot())]


@pytest.mark.parametrize("how", ["environment", "argument"])
def test_profile_sends_while_it_runs(tmp_path: Path, how: str) -> None:
    r = GrpcReceiver()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MLTRACE_"))}
        env["OTEL_BSP_SCHEDULE_DELAY"] = "200"
        args = [str(tmp_path / "run")]
        if how == "environment":
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = r.url
        else:
            args.append(r.url)
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ran"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _levels(r).count("model") < 3:
            time.sleep(0.1)
        live = _levels(r)  # sent while the profiled region runs: it waits for stdin
        _out, err = proc.communicate("\n", timeout=120)
        spans: list[Any] = [sp for _s, _r, sp in spans_of(r.snapshot())]
    finally:
        r.close()
    assert proc.returncode == 0, err
    assert live.count("model") == 3 and "layer" in live
    levels = [attrs_of(sp.attributes)["mltrace.level"] for sp in spans]
    assert levels.count("model") == 3 and "op" in levels  # the rest arrived once it stopped
    assert len({attrs_of(sp.attributes)["mltrace.span.id"] for sp in spans}) == len(spans)  # nothing twice
    line = next(ln for ln in err.splitlines() if ln.startswith("mltrace: OTLP:"))
    assert f"{len(spans)} spans sent to {r.url}" in line
    if how == "environment":
        assert "OTLP export on (OTEL_EXPORTER_OTLP_ENDPOINT is set)" in err
