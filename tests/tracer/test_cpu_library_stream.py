"""The library level on CPU hands its spans to the session while the program runs
(``CpuLibrarySource.drain_events``, before every flush), not only at ``stop()``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import mltrace
from conftest import mltrace_cmd
from mltrace.formats.verbose_logs import parse_mkl_line
from mltrace.run import store
from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.tracer.clock import now_ns
from mltrace.tracer.fdtap import TappedLine
from mltrace.tracer.session import active_session
from mltrace.tracer.sources.cpu_library import CpuLibrarySource, LibrarySpanMaker, library_spans

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
pytestmark = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL")


def _streamed_library(run_dir: Path) -> list[Span]:
    """The library spans events.jsonl holds now (the run still going, or killed)."""
    return [s for s in store.load_run(run_dir).spans if s.level == Level.LIBRARY]


def _wait_for(condition: Any, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _seqs(spans: list[Span]) -> list[int]:
    return sorted(s.attrs["ml.library.seq"] for s in spans)


def _logged_lines() -> list[TappedLine]:
    """oneDNN (creation and execution, with and without timestamps) and MKL lines from real
    logs, twice over (repeated calls), received 1 µs apart."""
    texts = []
    for log in ("onednn/torch_profile_exec.log", "onednn/torch_toggle_create.log", "mkl/torch_mkl_verbose.log"):
        texts += [ln for ln in (DATA / log).read_text(encoding="utf-8").splitlines() if not ln.startswith("== ")]
    return [TappedLine(1_795_322_166_140_000_000 + 1_000 * i, text) for i, text in enumerate(texts * 2)]


def test_spans_made_batch_by_batch_are_those_of_one_call_over_all_lines() -> None:
    """``LibrarySpanMaker`` fed in batches of any size gives what ``library_spans`` gives over
    all the lines: the same spans, seq over the whole run, the same counts; every span has
    its own attributes (the templates of repeated calls are copied)."""
    lines = _logged_lines()
    whole, counts = library_spans(lines, lambda ns: ns - 1_795_000_000_000_000_000, 7, iter(range(10**6)).__next__)
    assert counts["onednn"] > 10 and counts["mkl"] > 10 and counts["untimed"] > counts["mkl"]
    for size in (1, 5, 17, len(lines)):
        maker = LibrarySpanMaker(lambda ns: ns - 1_795_000_000_000_000_000, 7, iter(range(10**6)).__next__)
        spans = [s for i in range(0, len(lines), size) for s in maker.add(lines[i : i + size])]
        assert spans == whole
        assert [list(s.attrs) for s in spans] == [list(s.attrs) for s in whole]  # attribute order too
        assert maker.summary() == counts and maker.lines == len(lines)
    assert len({id(s.attrs) for s in whole}) == len(whole)


def test_mkl_calls_that_differ_in_their_pointers_alone_share_one_template() -> None:
    """A loop's GEMMs repeat their sizes with new buffers: the maker keeps one template per
    call with its pointers masked (it kept one per pointer set, so nearly every MKL line paid
    for its attributes and FLOPs again, on the program's time). An argument that only looks
    like a pointer in part stays as it is."""
    gemm = "MKL_VERBOSE SGEMM(N,N,64,1,34,{},{},64,{},34,{},{},64) 4.78us CNR:OFF Dyn:1 FastMM:1 TID:0  NThr:1"
    lines = [TappedLine(1_000 * (i + 1), gemm.format(*(hex(0x7F00 + 16 * i + k) for k in range(5)))) for i in range(50)]
    lines.append(TappedLine(60_000, "MKL_VERBOSE SGEMV(N,0x10z,a0x10,0x,0x7f) 1us TID:0  NThr:1"))
    maker = LibrarySpanMaker(lambda ns: ns, 7, iter(range(1, 10**6)).__next__)
    spans = maker.add(lines)
    assert len(maker._templates) == 2  # type: ignore[attr-defined]
    assert {s.attrs["ml.library.desc"] for s in spans[:50]} == {"N,N,64,1,34,*,*,64,*,34,*,*,64"}
    assert {s.attrs["ml.flops"] for s in spans[:50]} == {2 * 64 * 1 * 34}
    assert spans[50].attrs["ml.library.desc"] == "N,0x10z,a0x10,0x,*"


def test_a_repeated_mkl_call_is_read_as_a_whole_parse_reads_its_line() -> None:
    """A line like one seen before is split, not parsed whole: each call still gets its own
    line's duration (exactly, every unit, exponent forms too), thread fields and template."""
    gemm = "MKL_VERBOSE SGEMM(N,N,64,1,34,{},{},64,{},34,{},{},64) {} CNR:OFF Dyn:1 FastMM:1 TID:{}  NThr:{}"
    times = ["4.78us", "4.7849us", "0.0005us", "12ns", "1.5ms", "2e-06s", "3.25us", "0.0015us"]
    lines = [
        TappedLine(10**9 + 1_000 * i, gemm.format(*(hex(0x7F00 + 16 * i + k) for k in range(5)), times[i % 8], i % 2, 1 + i % 3))
        for i in range(48)
    ]
    lines.insert(20, TappedLine(10**9 + 20_500, "MKL_VERBOSE SGEMV(N,64,34,0x7f,0x7e,64,0x7d,1,0x7c,0x7b,1) 2.5us TID:0"))
    spans = LibrarySpanMaker(lambda ns: ns, 7, iter(range(1, 10**6)).__next__).add(lines)
    calls = [parse_mkl_line(line.text) for line in lines]
    assert len(spans) == len(calls) == 49
    for span, call in zip(spans, calls, strict=True):
        assert call is not None
        assert span.end_ns - span.start_ns == call.duration_ns
        assert span.attrs["ml.library.kind"] == call.function
        assert span.attrs.get("ml.library.mkl_tid") == call.tid and span.attrs.get("ml.library.nthr") == call.nthr
    assert spans[20].attrs["ml.library.kind"] == "SGEMV" and "ml.library.nthr" not in spans[20].attrs
    assert {spans[i].end_ns - spans[i].start_ns for i in (3, 11)} == {12} and spans[4].end_ns - spans[4].start_ns == 1_500_000


def test_a_drain_parses_in_chunks_handing_the_gil_over_between_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flusher parses a drain's lines ``PARSE_CHUNK`` at a time and gives the GIL up between
    two chunks (``time.sleep(0)``): a program thread waiting for it after a torch op waited up to
    the switch interval for every op while a whole flush's lines were parsed in one piece (a
    GPT-2 decode step overlapping a flush read 55-66 ms against 31 ms). The spans are those of
    one pass."""
    from mltrace.tracer.sources import cpu_library

    gemm = "MKL_VERBOSE SGEMM(N,N,64,1,34,0x7f00,0x7f10,64,0x7f20,34,0x7f30,0x7f40,64) 4.78us CNR:OFF Dyn:1 FastMM:1 TID:0  NThr:1"
    lines = [TappedLine(1_000 * (i + 1), gemm) for i in range(2 * cpu_library.PARSE_CHUNK + 5)]
    whole = LibrarySpanMaker(lambda ns: ns, 7, iter(range(1, 10**6)).__next__).add(lines)
    sleeps: list[float] = []
    monkeypatch.setattr(cpu_library.time, "sleep", sleeps.append)
    chunked = cpu_library._parse_in_chunks(LibrarySpanMaker(lambda ns: ns, 7, iter(range(1, 10**6)).__next__), lines)
    assert chunked == whole and len(whole) == len(lines)
    assert sleeps == [0, 0]  # between the three chunks


def _model() -> Any:
    """oneDNN (the convolution, timed) and MKL (the linear layer's SGEMM, untimed) per call."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 14 * 14, 10)).eval()


def test_library_spans_reach_events_jsonl_while_the_program_runs(tmp_path: Path) -> None:
    """Library spans are in events.jsonl before the session stops, as a prefix of the run's
    seq numbers; once the program is idle the source's sealed time passes its last call and
    nothing is pending; after stop the run holds each call once, seq 0..n-1."""
    model, x = _model(), torch.randn(2, 3, 16, 16)
    run_dir = tmp_path / "run"
    with torch.no_grad(), mltrace.profile(level="library", output=run_dir, summary=False, flush_interval_s=0.05):
        session = active_session()
        assert session is not None
        source = next(s for s in session.started if isinstance(s, CpuLibrarySource))
        for _ in range(20):
            model(x)
        _wait_for(lambda: len(_streamed_library(run_dir)) > 0, "library spans in events.jsonl")
        early = _streamed_library(run_dir)
        assert _seqs(early) == list(range(len(early)))  # handed over in order, from the first
        mark = now_ns()  # every call so far ended before it; the program is idle from here
        _wait_for(lambda: (source.sealed_until_ns() or 0) >= mark, "the sealed time to pass the last call")
        assert source.pending_spans() == 0
        sealed = source.sealed_until_ns()
        assert sealed is not None and sealed <= now_ns()
        for _ in range(20):
            model(x)
    assert source.sealed_until_ns() is None  # stopped, holds nothing
    run = store.load_run(run_dir)
    lib = [s for s in run.spans if s.level == Level.LIBRARY]
    assert _seqs(lib) == list(range(len(lib)))
    assert len({s.id for s in lib}) == len(lib)
    info = run.meta["sources_info"]["cpu.library"]
    assert info["onednn"] + info["mkl"] == len(lib)
    assert info["mkl"] == sum(s.name == "MKL SGEMM" for s in lib) == 40  # one SGEMM a call
    assert len(lib) > len(early)
    assert info["receive_lag_ns_median"] <= info["receive_lag_ns_max"]


TWO_RUNS = """
import json, sys, time
import torch, mltrace
from mltrace.run import store
from mltrace.run.levels import Level

run_dir, flush_s = sys.argv[1], float(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 14 * 14, 10)
).eval()
x = torch.randn(2, 3, 16, 16)

def streamed():
    return sum(s.level == Level.LIBRARY for s in store.load_run(run_dir).spans)

with torch.no_grad(), mltrace.profile(level="library", output=run_dir, summary=False, flush_interval_s=flush_s):
    for _ in range(30):
        model(x)
    deadline = time.monotonic() + 30
    while flush_s < 1 and streamed() == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    before_stop = streamed()
    for _ in range(30):
        model(x)
run = store.load_run(run_dir)
lib = [s for s in run.spans if s.level == Level.LIBRARY]
print(json.dumps({
    "before_stop": before_stop,
    "seqs": sorted(s.attrs["ml.library.seq"] for s in lib),
    "names": sorted(s.name for s in lib),
    "info": run.meta["sources_info"]["cpu.library"],
}))
"""


def test_a_run_has_the_same_library_spans_whether_handed_over_or_held_to_stop(tmp_path: Path) -> None:
    """The same program with flushes every 20 ms (spans handed over while it runs) and every
    60 s (none before the session stops: every line turned into spans at stop, as one
    ``library_spans`` call): the same spans by name, the same counts in run.json, and the spans
    handed over plus those returned by stop are the calls parsed."""
    script = tmp_path / "prog.py"
    script.write_text(TWO_RUNS, encoding="utf-8")
    # torch.profiler held whole: a converted op cycle would wake the flusher (flush_soon) at once
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), MLTRACE_OP_CYCLE_S="0")
    env.pop("MLTRACE_OUTPUT", None)
    reports = {}
    for flush_s in ("0.02", "60"):
        proc = subprocess.run(
            [sys.executable, str(script), str(tmp_path / f"run-{flush_s}"), flush_s],
            capture_output=True, timeout=300, env=env, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
        reports[flush_s] = json.loads(proc.stdout.decode().splitlines()[-1])
    streamed, held = reports["0.02"], reports["60"]
    assert streamed["before_stop"] > 0 and held["before_stop"] == 0
    for report in (streamed, held):
        info = report["info"]
        assert report["seqs"] == list(range(len(report["seqs"])))
        assert info["onednn"] + info["mkl"] == len(report["seqs"])
        assert info["mkl"] == 60 and info["unparsed"] == 0 and info["late"] == 0
    assert streamed["names"] == held["names"]
    keys = ("lines", "onednn", "mkl", "untimed", "unparsed", "late")
    assert {k: streamed["info"][k] for k in keys} == {k: held["info"][k] for k in keys}
    assert streamed["before_stop"] < len(streamed["seqs"])  # the last calls came at stop (or a later drain)


KILLED = """
import time
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 14 * 14, 10)
).eval()
x = torch.randn(2, 3, 16, 16)
calls = 0
with torch.no_grad():
    while True:
        model(x)
        calls += 1
        time.sleep(0.005)
        if calls == 40:
            print("ready", flush=True)
"""


def test_a_killed_run_keeps_its_library_calls_up_to_the_last_flush(tmp_path: Path) -> None:
    """SIGKILL while the library level records: the library spans flushed before the kill stay
    in the run, each once, seq 0..n-1 (a prefix of the run's calls)."""
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED), encoding="utf-8")
    run_dir = tmp_path / "run"
    env = dict(os.environ)
    env.pop("MLTRACE_OUTPUT", None)
    cmd = mltrace_cmd("python", "--level", "library", "--flush-interval", "0.05", "-q", "-o", str(run_dir), str(script))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        _wait_for(lambda: sum(s.name == "MKL SGEMM" for s in _streamed_library(run_dir)) >= 40, "40 calls' SGEMMs streamed", 60)
        seen = {s.attrs["ml.library.seq"] for s in _streamed_library(run_dir)}
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    run = store.load_run(run_dir)
    assert run.meta.get("complete") is not True
    lib = [s for s in run.spans if s.level == Level.LIBRARY]
    assert _seqs(lib) == list(range(len(lib)))  # each once, none missing before the last
    assert seen <= set(_seqs(lib))
    assert sum(s.name == "MKL SGEMM" for s in lib) >= 40
    assert sum(s.attrs.get("ml.library.kind") == "convolution" for s in lib) >= 40


TAKE_LINES = """
import json, os, sys, time
from mltrace.tracer.fdtap import FdTap

tap = FdTap(reader=sys.argv[2], batch_s=0.01).start()
taken = []
for round_ in range(3):
    for i in range(50):
        os.write(1, b"MKL_VERBOSE SGEMM(N,N,%d) 1.00us TID:0 NThr:1\\n" % (round_ * 50 + i))
        os.write(1, b"user line %d\\n" % i)
    deadline = time.monotonic() + 10
    while sum(len(t) for t in taken) < 50 * (round_ + 1) and time.monotonic() < deadline:
        taken.append(tap.take_lines())
        time.sleep(0.01)
time.sleep(0.1)
empty_idle = tap.pipe_empty()
os.write(1, b"MKL_VERBOSE SGEMM(N,N,last) 1.00us TID:0 NThr:1\\n")
rest = tap.stop()
with open(sys.argv[1], "w") as f:
    json.dump({"taken": [ln.text for t in taken for ln in t], "rest": [ln.text for ln in rest], "lines": [ln.text for ln in tap.lines()],
               "empty_idle": empty_idle, "empty_stopped": tap.pipe_empty()}, f)
"""


@pytest.mark.parametrize("reader", ["thread", "thread-python", "process"])
def test_the_tap_hands_over_each_line_once(tmp_path: Path, reader: str) -> None:
    """``FdTap.take_lines`` returns the lines captured since the last take, which ``stop()``
    and ``lines()`` then leave out; the user's output passes unchanged. ``pipe_empty`` says
    True while a thread reader waits with nothing to read, False for a reader process and once
    stopped."""
    script = tmp_path / "prog.py"
    script.write_text(TAKE_LINES, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    env.pop("MLTRACE_FDTAP_READER", None)
    if reader == "thread-python":
        env["MLTRACE_FDTAP_READER"] = "python"
    kind = "process" if reader == "process" else "thread"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "report.json"), kind],
        capture_output=True, timeout=120, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    expected = [f"MKL_VERBOSE SGEMM(N,N,{i}) 1.00us TID:0 NThr:1" for i in range(150)]
    assert report["taken"] == expected
    assert report["rest"] == report["lines"] == ["MKL_VERBOSE SGEMM(N,N,last) 1.00us TID:0 NThr:1"]
    assert proc.stdout == b"".join(b"user line %d\n" % i for i in range(50)) * 3
    assert report["empty_idle"] is (reader != "process")
    assert report["empty_stopped"] is False
