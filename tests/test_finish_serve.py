"""The streamed finish end to end (issue 27): a traced program whose events.jsonl passes
``MLTRACE_FINISH_STREAM`` bytes has its run finished a part at a time by a finisher process
(``python -m mltrace.finish_serve RUN_DIR``) while it runs, with the same result as a run
finished whole; a program killed meanwhile leaves its run as streamed, and the finisher
process ends by itself."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from conftest import mltrace_cmd, run_cli
from mltrace.run import store
from mltrace.run.levels import Level
from mltrace.run.store import Run
from support.helper_processes import default_nice_below, parent_pid, placement

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL (no library level on CPU)")

#: Deterministic in its calls: model, layer, op and library calls the same run after run.
#: Prints a checksum and exits with 3.
LIVE_PROGRAM = """
import sys, time
import torch

torch.manual_seed(0)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(16, 32, batch_first=True)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])

model = Net().eval()
x = torch.randn(2, 8, 16)
total = 0.0
with torch.no_grad():
    for _ in range(80):
        total += float(model(x).sum())
        time.sleep(0.02)
print(f"calls 80 sum {total:.4f}")
print("bye", file=sys.stderr)
sys.exit(3)
"""

#: Calls a model until killed (at most a minute), saying "ready" after 100 calls.
ENDLESS_PROGRAM = """
import time
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).eval()
x = torch.randn(4, 32)
calls, deadline = 0, time.monotonic() + 60
with torch.no_grad():
    while time.monotonic() < deadline:
        model(x)
        calls += 1
        time.sleep(0.002)
        if calls == 100:
            print("ready", flush=True)
"""

TEMPORARY = ("events.jsonl.streamed.tmp", "trace.pftrace.streamed.tmp")


def _env(stream: str) -> dict[str, str]:
    env = {**os.environ, "MLTRACE_FINISH_STREAM": stream, "MLTRACE_OP_CYCLE_S": "0.3"}
    env.pop("MLTRACE_OUTPUT", None)
    return env


def _temporary_files(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name.endswith(".tmp"))


def _calls(run: Run) -> dict[str, Counter[str]]:
    """Span counts by name, per level (the run's calls)."""
    counts: dict[str, Counter[str]] = {}
    for s in run.spans:
        counts.setdefault(s.level.name, Counter())[s.name] += 1
    return counts


def test_a_program_whose_run_streams_has_it_finished_as_a_run_finished_whole(tmp_path: Path) -> None:
    """The same program traced with ``MLTRACE_FINISH_STREAM=65536`` (its run finished a part at
    a time) and ``0`` (finished whole), beside it run plainly: the same output and exit status;
    the streamed run is complete, says how many segments were streamed, leaves no temporary
    file, reports, and has the calls of the other run at every level, each name as often."""
    script = tmp_path / "live.py"
    script.write_text(textwrap.dedent(LIVE_PROGRAM), encoding="utf-8")
    runs = {stream: tmp_path / f"run-{stream}" for stream in ("65536", "0")}
    procs = {
        stream: subprocess.Popen(
            mltrace_cmd("python", "-q", "-o", str(run_dir), str(script)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_env(stream),
            stdin=subprocess.DEVNULL,
        )
        for stream, run_dir in runs.items()
    }
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    outputs = {stream: proc.communicate(timeout=120) for stream, proc in procs.items()}
    assert plain.returncode == 3 and plain.stdout.startswith(b"calls 80 sum ")
    for stream, (out, err) in outputs.items():
        assert procs[stream].returncode == 3, err.decode(errors="replace")
        assert out == plain.stdout and err.endswith(b"bye\n")
    streamed, whole = store.load_run(runs["65536"]), store.load_run(runs["0"])
    assert streamed.meta["complete"] is True and whole.meta["complete"] is True
    assert streamed.meta["finish"]["streamed_segments"] >= 1 and "finish" not in whole.meta
    assert _temporary_files(runs["65536"]) == []
    calls, expected = _calls(streamed), _calls(whole)
    assert calls["MODEL"] == expected["MODEL"] == Counter({"Net": 80})
    assert calls["LAYER"] == expected["LAYER"] and sum(calls["LAYER"].values()) == 160
    assert calls["OP"] == expected["OP"] and calls["OP"]["aten::lstm"] == 80
    assert calls["LIBRARY"] == expected["LIBRARY"] and calls["LIBRARY"]["MKL SGEMM"] == 80  # one per head call
    check = streamed.meta["correlation"]["check_containment"]
    assert check["outside_parent"] == check["missing_parent"] == 0
    # Which op a library call goes under depends on when its verbose line was read (a line read
    # late on a loaded machine leaves its call unattached): compared on one raw run in
    # test_finish_stream.py, here only counted.
    attach = streamed.meta["correlation"]["attach_library_calls"]
    assert attach["timed"] + attach["untimed"] + attach["unattached"] == sum(calls["LIBRARY"].values())
    report = run_cli("report", "--include-cold", str(runs["65536"]), timeout=120)
    assert report.returncode == 0, report.stderr.decode(errors="replace")
    assert f"{len(streamed.spans)} spans, 80 model calls".encode() in report.stdout


def _finisher_pid(run_dir: Path) -> int | None:
    """The pid of the finisher process of ``run_dir`` (``python -m mltrace.finish_serve RUN_DIR``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mltrace.finish_serve" in args and str(run_dir).encode() in args:
            return int(entry.name)
    return None


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no longer does: nobody may reap an orphan here)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for(condition: object, what: str, timeout_s: float = 60) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the finisher process in /proc")
def test_a_program_killed_while_its_run_streams_leaves_it_as_streamed(tmp_path: Path) -> None:
    """SIGKILL to a traced program whose finisher process runs: the process's input ends, it
    removes its temporary files and exits by itself; the run loads, as streamed (not complete),
    and a finisher process started over it by hand still finishes it."""
    script = tmp_path / "endless.py"
    script.write_text(textwrap.dedent(ENDLESS_PROGRAM), encoding="utf-8")
    run_dir = tmp_path / "run"
    cmd = mltrace_cmd("python", "-q", "--flush-interval", "0.1", "-o", str(run_dir), str(script))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=_env("65536"), stdin=subprocess.DEVNULL)
    finisher: int | None = None
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        _wait_for(lambda: _finisher_pid(run_dir) is not None, "the finisher process")
        finisher = _finisher_pid(run_dir)
        assert finisher is not None and parent_pid(finisher) == proc.pid  # the traced process's
        # below the program's CPU priority, where that priority weighs against the program
        assert placement(finisher) == {
            "same_session": True,
            "same_autogroup": True,
            "own_group": True,
            "nice_below_parent": default_nice_below(finisher),
        }
        _wait_for(lambda: all((run_dir / name).exists() for name in TEMPORARY), "the finisher's temporary files")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL and finisher is not None
    try:
        _wait_for(lambda: not _running(finisher), "the finisher process to exit", timeout_s=30)
    finally:
        if _running(finisher):
            os.kill(finisher, signal.SIGKILL)
    # the finisher's own (the program, killed while it exported an op cycle, may leave its export's)
    assert not any((run_dir / name).exists() for name in TEMPORARY)
    assert list(run_dir.glob("*.streamed.tmp")) == []  # the span table's spilled arrays too
    run = store.load_run(run_dir)
    assert run.meta.get("complete") is not True and "finish" not in run.meta
    # "ready" came at the 100th call; what the last flushes wrote before the kill is kept
    assert sum(s.level is Level.MODEL for s in run.spans) >= 50
    _finish_by_hand(run_dir, tmp_path / "copy", run)


def _finish_by_hand(run_dir: Path, copy: Path, raw: Run) -> None:
    """``python -m mltrace.finish_serve`` over a copy of the raw run: seals (a line that is not a
    request in between), then a finish: phases, then the metadata it wrote; the run complete,
    with the raw run's spans."""
    shutil.copytree(run_dir, copy)
    first, last = min(s.start_ns for s in raw.spans), max(s.end_ns for s in raw.spans)
    seals = [{"seal": t} for t in range(first + 200_000_000, last + 1_200_000_000, 200_000_000)]
    lines = [json.dumps(r) for r in seals[:2]] + ["not json", "[1]"] + [json.dumps(r) for r in seals[2:]]
    lines.append(json.dumps({"finish": raw.meta}))
    done = subprocess.run(
        [sys.executable, "-m", "mltrace.finish_serve", str(copy)],
        input="\n".join(lines).encode() + b"\n", capture_output=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert answers and all("phase" in a for a in answers[:-1]) and "done" in answers[-1]
    meta = answers[-1]["done"]
    assert meta["complete"] is True and meta["finish"]["streamed_segments"] >= 1  # seals that queued up count as one
    assert store.read_meta(copy) == meta
    finished = store.load_run(copy)
    assert sorted(s.id for s in finished.spans) == sorted(s.id for s in raw.spans)
    # the finisher's own; a program killed while it exported an op cycle leaves that export's
    # partial file (torch-profiler-N.json.tmp), which is not the finisher's to remove
    assert [name for name in _temporary_files(copy) if not name.startswith("torch-profiler-")] == []


def test_the_finisher_process_without_a_run_directory_says_how_to_call_it() -> None:
    done = subprocess.run([sys.executable, "-m", "mltrace.finish_serve"], capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    assert done.stderr.decode().splitlines() == ["usage: python -m mltrace.finish_serve RUN_DIR"]
