"""Op-level cycles stop for good once a second thread calls models (a cycle's switch would drop
the ops other threads run meanwhile): the profiler runs on whole and every call keeps its ops."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli
from mltrace.run.levels import Level
from mltrace.run.store import load_run

SCRIPT = """
import threading, time
import torch
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
x = torch.randn(2, 8)

def calls(n):
    with torch.inference_mode():
        for _ in range(n):
            model(x)
            time.sleep(0.12)

calls(4)  # one thread: cycles of 0.1 s switch
workers = [threading.Thread(target=calls, args=(6,)) for _ in range(2)]
for w in workers:
    w.start()
calls(6)
for w in workers:
    w.join()
"""


def test_cycles_stop_when_a_second_thread_calls_models(tmp_path: Path) -> None:
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    done = run_cli("python", "-q", "--level", "op", "-o", str(tmp_path / "run"), str(script), env={"MLTRACE_OP_CYCLE_S": "0.1"})
    assert done.returncode == 0, done.stderr.decode()
    meta = json.loads((tmp_path / "run" / "run.json").read_text())["torch_profiler"]
    assert meta["cycles_stopped"].startswith("model calls on more than one thread")
    assert meta["cycles"] >= 2  # the single-threaded start had its cycles
    run = load_run(tmp_path / "run")
    models = [s for s in run.spans if s.level is Level.MODEL]
    linear = [s for s in run.spans if s.name == "aten::linear"]
    assert len(models) == 4 + 3 * 6 and len(linear) == len(models)  # no call lost its ops
