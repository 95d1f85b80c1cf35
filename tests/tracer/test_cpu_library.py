"""The cpu.library source: spans from real verbose logs, and a real torch run."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from mltrace.run.levels import Level
from mltrace.tracer.fdtap import TappedLine
from mltrace.tracer.sources.cpu_library import CpuLibrarySource, library_spans

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
OFFSET = 1_795_000_000_000_000_000  # epoch ns of session time 0 in these tests


# The parts of mltrace's Session a source uses, for programs run in a subprocess.
SESSION_STAND_IN = r"""
    import itertools
    from mltrace.tracer.clock import ClockAnchor
    from mltrace.tracer.tracks import TrackRegistry

    class Session:
        def __init__(self):
            self.anchor = ClockAnchor.take()
            self.tracks = TrackRegistry()
            self.meta, self.limitations = {}, []
            self._ids = itertools.count(1)
        def new_id(self):
            return next(self._ids)
        def note_limitation(self, text):
            self.limitations.append(text)
"""


def run_program(tmp_path: Path, program: str, env_changes: dict[str, str | None] | None = None) -> tuple[bytes, Any]:
    """Runs ``program`` (dedented) as a script with this checkout's mltrace, ``env_changes``
    set in its environment (None: removed); returns its stdout and the JSON it wrote to the
    path in ``sys.argv[1]``."""
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(program), encoding="utf-8")
    report_path = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    for key, value in (env_changes or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    proc = subprocess.run(
        [sys.executable, str(script), str(report_path)], capture_output=True, timeout=300, env=env, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return proc.stdout, json.loads(report_path.read_text(encoding="utf-8"))


def tapped(path: Path, first_receive_ns: int) -> list[TappedLine]:
    """The verbose lines of a log, received 1 µs apart."""
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if not ln.startswith("== ")]
    return [TappedLine(first_receive_ns + 1_000 * i, ln) for i, ln in enumerate(lines)]


def test_onednn_lines_become_timed_spans() -> None:
    # received after the last call of the log ended (its stamps run to ...166_132.3 ms)
    lines = tapped(DATA / "onednn" / "torch_profile_exec.log", 1_795_322_166_140_000_000 - OFFSET)
    ids = itertools.count(1)
    spans, counts = library_spans(lines, lambda ns: ns - OFFSET, 7, lambda: next(ids), "pytorch")
    lag_median, lag_max = counts.pop("receive_lag_ns_median"), counts.pop("receive_lag_ns_max")
    assert counts == {"onednn": 19, "mkl": 0, "untimed": 0, "unparsed": 0, "late": 0}
    assert 0 < lag_median <= lag_max
    assert [s.id for s in spans] == list(range(1, 20))
    stem = spans[1]
    assert stem.name == "oneDNN convolution jit:avx512_core"
    assert stem.level == Level.LIBRARY and stem.track_id == 7 and stem.parent_id is None
    assert stem.start_ns == 1_795_322_166_121_667_969 - OFFSET
    assert stem.end_ns - stem.start_ns == 2_150_150
    assert stem.attrs == {
        "mltrace.level": "library",
        "ml.framework": "pytorch",
        "ml.library.name": "oneDNN",
        "ml.library.kind": "convolution",
        "ml.library.impl": "jit:avx512_core",
        "ml.library.prop": "forward_training",
        "ml.library.desc": "mb1_ic3oc64_ih224oh112kh7sh2dh0ph3_iw224ow112kw7sw2dw0pw3",
        "ml.library.memory": (
            "src:f32:a:blocked:abcd::f0 wei:f32:a:blocked:Acdb16a::f0 bia:f32:a:blocked:a::f0 dst:f32:a:blocked:aBcd16b::f0"
        ),
        "ml.library.aux": "alg:convolution_direct",
        "ml.library.attrs": "attr-scratchpad:user",
        "ml.library.exec_ns": 2_150_150,
        "ml.library.seq": 1,
        "ml.flops": 236_027_904,
    }
    assert [s.attrs["ml.library.seq"] for s in spans] == list(range(19))


def test_mkl_lines_become_untimed_spans_ending_at_receipt() -> None:
    lines = tapped(DATA / "mkl" / "torch_mkl_verbose.log", 5_000_000)
    ids = itertools.count(100)
    spans, counts = library_spans(lines, lambda ns: ns - OFFSET, 7, lambda: next(ids))
    assert counts == {"onednn": 0, "mkl": 31, "untimed": 31, "unparsed": 0, "late": 0}
    linear = spans[2]  # nn.Linear(256, 128) on 4 rows; line 3 after the header
    assert linear.name == "MKL SGEMM"
    receive = lines[3].receive_ns
    assert (linear.start_ns, linear.end_ns) == (receive - 30_360, receive)
    assert linear.attrs["ml.library.desc"] == "T,N,128,4,256,*,*,256,*,256,*,*,128"
    assert linear.attrs["ml.library.untimed"] is True
    assert linear.attrs["ml.library.receive_ns"] == receive
    assert linear.attrs["ml.flops"] == 2 * 128 * 4 * 256
    assert (linear.attrs["ml.library.mkl_tid"], linear.attrs["ml.library.nthr"]) == (0, 2)
    assert "ml.framework" not in linear.attrs
    assert {s.name for s in spans} == {"MKL SGEMM", "MKL SGEMM_BATCH", "MKL DGEMM", "MKL SGEMV"}


def test_creation_lines_are_skipped_and_untimed_onednn_is_marked() -> None:
    lines = tapped(DATA / "onednn" / "torch_toggle_create.log", 1_000)
    ids = itertools.count(1)
    spans, counts = library_spans(lines, lambda ns: ns, 1, lambda: next(ids))
    assert counts["onednn"] == 19 and counts["untimed"] == 19 and counts["unparsed"] == 0
    assert all(s.attrs["ml.library.untimed"] for s in spans)


def test_late_timed_calls_are_counted() -> None:
    line = "onednn_verbose,v1,1000.000000,primitive,exec,cpu,reorder,jit:uni,undef,src dst,,,2x2,0.010"
    # the call ends at 1 ms + 10 µs on the epoch clock, but was received at 1 ms: clocks disagree
    _, counts = library_spans([TappedLine(1_000_000, line)], lambda ns: ns, 1, lambda: 1)
    assert counts["late"] == 1


def test_source_contract() -> None:
    source = CpuLibrarySource()
    assert source.name == "cpu.library"
    assert source.levels == (Level.LIBRARY,)
    assert source.available() is None or "torch" in str(source.available())


@pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode != 0,
    reason="torch is not installed",
)
def test_real_torch_run_through_the_source(tmp_path: Path) -> None:
    """torch imported after start(): verbosity switched on at import, off at stop, stdout clean."""
    program = (
        SESSION_STAND_IN
        + r"""
    import json, os, sys
    from mltrace.tracer.clock import now_ns
    from mltrace.tracer.sources.cpu_library import CpuLibrarySource

    session = Session()
    source = CpuLibrarySource()
    assert "torch" not in sys.modules
    source.start(session)
    t0 = now_ns()
    import torch
    conv = torch.nn.Conv2d(3, 8, 7, stride=2, padding=3).eval()
    lin = torch.nn.Linear(16, 4).eval()
    with torch.no_grad():
        print("running", end=" ", flush=True)
        conv(torch.randn(1, 3, 32, 32))
        lin(torch.randn(2, 16))
    print("done", flush=True)
    t1 = now_ns()
    events = source.stop()
    with torch.no_grad():
        conv(torch.randn(1, 3, 32, 32))  # after stop: verbose is off, nothing printed
        lin(torch.randn(2, 16))
    print("after", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump({
            "spans": [[s.name, s.start_ns, s.end_ns, s.track_id, s.attrs] for s in events],
            "t0": t0, "t1": t1, "meta": session.meta, "limitations": session.limitations,
            "env": os.environ.get("ONEDNN_VERBOSE_TIMESTAMP"),
        }, f)
    """
    )
    stdout, report = run_program(tmp_path, program, {"ONEDNN_VERBOSE_TIMESTAMP": None})
    assert stdout == b"running done\nafter\n"
    spans = report["spans"]
    names = [s[0] for s in spans]
    assert "oneDNN convolution jit:avx512_core" in names or any(n.startswith("oneDNN convolution") for n in names)
    assert names.count("MKL SGEMM") == 1
    conv = next(s for s in spans if s[0].startswith("oneDNN convolution"))
    assert conv[4]["ml.library.desc"] == "mb1_ic3oc8_ih32oh16kh7sh2dh0ph3_iw32ow16kw7sw2dw0pw3"
    assert "ml.framework" not in conv[4]  # set from the issuing op by the attach pass
    assert "ml.library.untimed" not in conv[4]  # timestamps were switched on by start()
    # converted through the session anchor: inside the window the calls ran in
    assert report["t0"] <= conv[1] <= conv[2] <= report["t1"]
    assert report["meta"]["sources_info"]["cpu.library"]["late"] == 0
    assert report["env"] is None  # the environment is restored


@pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode != 0 or not hasattr(os, "fork"),
    reason="needs torch and os.fork",
)
def test_a_forked_child_releases_verbose_output_and_stdout(tmp_path: Path) -> None:
    """What the session does in a forked child: the child's oneDNN/MKL verbose output goes off
    and its stdout is the original again; the parent's capture goes on."""
    program = (
        SESSION_STAND_IN
        + r"""
    import json, os, sys
    from mltrace.tracer.sources.cpu_library import CpuLibrarySource

    session = Session()
    source = CpuLibrarySource()
    source.start(session)
    import torch
    conv = torch.nn.Conv2d(3, 8, 7, stride=2, padding=3).eval()
    lin = torch.nn.Linear(16, 4).eval()
    pid = os.fork()
    if pid == 0:
        source.release_in_forked_child()
        with torch.no_grad():
            conv(torch.randn(1, 3, 32, 32))
            lin(torch.randn(2, 16))
        os.write(1, b"child ran conv and linear\n")
        os._exit(0)
    os.waitpid(pid, 0)
    with torch.no_grad():
        conv(torch.randn(1, 3, 32, 32))
        lin(torch.randn(2, 16))
    events = source.stop()
    with open(sys.argv[1], "w") as f:
        json.dump({"names": [s.name for s in events]}, f)
    """
    )
    stdout, report = run_program(tmp_path, program)
    assert stdout == b"child ran conv and linear\n"  # no verbose line of the child's anywhere
    # the parent's calls only, captured: one convolution and one SGEMM, none of the child's
    assert report["names"].count("MKL SGEMM") == 1
    assert sum(n.startswith("oneDNN convolution") for n in report["names"]) == 1


def _mkl_timer_redirects() -> bool:
    """Whether this build can redirect MKL's timer: the C helper built, Linux on x86-64, torch with MKL."""
    probe = "import torch; from mltrace import _mkltimer; import platform, sys; "
    probe += "sys.exit(not (torch.backends.mkl.is_available() and platform.machine() == 'x86_64' and sys.platform == 'linux'))"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, env=env).returncode == 0


@pytest.mark.skipif(not _mkl_timer_redirects(), reason="needs torch with MKL, Linux on x86-64 and the _mkltimer helper")
@pytest.mark.parametrize("timer", ["redirected", "mkl"])
def test_mkl_timer_redirected_while_verbose_then_restored(tmp_path: Path, timer: str) -> None:
    """MKL reads the vDSO clock while the source records, its own again after stop (or throughout, when asked)."""
    program = (
        SESSION_STAND_IN
        + r"""
    import ctypes, json, sys, time
    from mltrace import _mkltimer
    from mltrace.tracer.sources.cpu_library import CpuLibrarySource

    session = Session()
    source = CpuLibrarySource()
    source.start(session)
    import torch
    torch.set_num_threads(1)
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    slots = _mkltimer.slots()
    reads = []  # (monotonic before, what MKL's timer slot returns, monotonic after)
    for _slot, _saved, current in slots:
        timer = ctypes.CFUNCTYPE(ctypes.c_double)(current)
        reads.append((time.monotonic(), timer(), time.monotonic()))
    walls = []
    for _ in range(3):
        t0 = time.perf_counter_ns()
        torch.mm(a, b)
        walls.append(time.perf_counter_ns() - t0)
    events = source.stop()
    after_stop = [ctypes.c_void_p.from_address(slot).value for slot, _saved, _current in slots]
    with open(sys.argv[1], "w") as f:
        json.dump({"slots": slots, "reads": reads, "walls": walls, "after_stop": after_stop,
                   "exec_ns": [s.attrs["ml.library.exec_ns"] for s in events if s.name == "MKL SGEMM"],
                   "info": session.meta["sources_info"]["cpu.library"], "left": _mkltimer.slots()}, f)
    """
    )
    _, report = run_program(tmp_path, program, {"MLTRACE_MKL_TIMER": "mkl" if timer == "mkl" else None})
    # MKL's durations are in their unit either way: within the call's wall time, not far below it
    assert len(report["exec_ns"]) == 3
    assert all(0 < e <= w for e, w in zip(report["exec_ns"], report["walls"]))
    assert max(e / w for e, w in zip(report["exec_ns"], report["walls"])) > 0.1
    assert report["left"] == []
    if timer == "mkl":
        assert report["slots"] == [] and report["info"]["mkl_timer"] == "mkl (MLTRACE_MKL_TIMER=mkl)"
        return
    slots = report["slots"]
    assert slots and report["info"]["mkl_timer"] == f"clock_gettime ({len(slots)} slots redirected)"
    assert all(current != saved for _slot, saved, current in slots)
    for before, seconds, after in report["reads"]:  # the slots call CLOCK_MONOTONIC, in seconds
        assert before <= seconds <= after
    assert report["after_stop"] == [saved for _slot, saved, _current in slots]


@pytest.mark.slow
@pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True).returncode != 0,
    reason="tensorflow is not installed",
)
def test_tensorflow_through_the_environment(tmp_path: Path) -> None:
    """use_env=True after ``import tensorflow``: TF's own oneDNN reads the variables at its first op."""
    program = (
        SESSION_STAND_IN
        + r"""
    import json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    from mltrace.tracer.sources.cpu_library import CpuLibrarySource

    session = Session()
    source = CpuLibrarySource(use_env=True)
    source.start(session)
    print("tf matmul", flush=True)
    tf.matmul(tf.random.normal([4, 64]), tf.random.normal([64, 32]))
    events = source.stop()
    with open(sys.argv[1], "w") as f:
        json.dump({"spans": [[s.name, s.attrs] for s in events], "limitations": session.limitations,
                   "env": [os.environ.get(k) for k in ("ONEDNN_VERBOSE", "MKL_VERBOSE", "ONEDNN_VERBOSE_TIMESTAMP")]}, f)
    """
    )
    stdout, report = run_program(tmp_path, program, dict.fromkeys(("ONEDNN_VERBOSE", "MKL_VERBOSE", "ONEDNN_VERBOSE_TIMESTAMP")))
    assert stdout == b"tf matmul\n"
    gemm = [attrs for name, attrs in report["spans"] if name.startswith("oneDNN gemm_api")]
    assert [a["ml.library.desc"] for a in gemm] == ["4x64:64x32"]
    assert gemm[0]["ml.flops"] == 2 * 4 * 32 * 64 and "ml.library.untimed" not in gemm[0]
    assert report["env"] == [None, None, None]
    assert any("stays on" in text for text in report["limitations"])


def test_lines_waiting_for_stop_are_counted_for_the_span_limit(tmp_path: Path) -> None:
    """``pending_spans()``: the calls whose verbose lines were read and wait for ``stop()`` (the
    session's --max-spans counts them); what ``stop()`` made of them is no longer pending."""
    program = (
        SESSION_STAND_IN
        + r"""
    import json, sys, time
    from mltrace.tracer.sources.cpu_library import CpuLibrarySource

    session = Session()
    source = CpuLibrarySource()
    source.start(session)
    import torch
    counts = [source.pending_spans()]
    lin = torch.nn.Linear(16, 4).eval()
    with torch.no_grad():
        for _ in range(50):
            lin(torch.randn(2, 16))
    deadline = time.monotonic() + 10
    while source.pending_spans() < 50 and time.monotonic() < deadline:
        time.sleep(0.05)  # the reader reads in batches
    counts.append(source.pending_spans())
    events = source.stop()
    counts.append(source.pending_spans())
    with open(sys.argv[1], "w") as f:
        json.dump({"counts": counts, "spans": len(events)}, f)
    """
    )
    _, report = run_program(tmp_path, program, {"ONEDNN_VERBOSE_TIMESTAMP": None})
    before, waiting, after = report["counts"]
    assert before == 0  # the warm-up's lines are left out
    assert waiting == report["spans"] == 50  # one MKL SGEMM a call
    assert after == 0


def _masked(text: str) -> list[str]:
    """Lines with what changes from run to run masked: pointers, durations, timestamps."""
    import re

    text = re.sub(r"0x[0-9a-fA-F]+", "PTR", text)
    text = re.sub(r"\b\d+(?:\.\d+)?(?:us|ms|s)\b", "TIME", text)
    text = re.sub(r"(onednn_verbose,.*,)[0-9.]+$", r"\1TIME", text, flags=re.M)
    return text.splitlines()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
@pytest.mark.parametrize("user_env", [{"MKL_VERBOSE": "1"}, {"ONEDNN_VERBOSE": "1"}, {"DNNL_VERBOSE": "2", "MKL_VERBOSE": "2"}])
def test_verbose_lines_the_user_asked_for_are_printed_as_plainly(tmp_path: Path, user_env: dict[str, str]) -> None:
    """With the libraries' verbose output turned on in the user's environment, stdout under
    ``mltrace python`` (the library level) holds the same lines in the same order as plainly
    (pointers, durations and oneDNN's per-line times masked), and mltrace still records them."""
    program = REPO / "tests" / "scripts" / "users_verbose_lines.py"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), **user_env)
    for name in ("ONEDNN_VERBOSE", "DNNL_VERBOSE", "MKL_VERBOSE", "ONEDNN_VERBOSE_TIMESTAMP"):
        if name not in user_env:
            env.pop(name, None)
    plain = subprocess.run([sys.executable, str(program)], capture_output=True, timeout=300, env=env, cwd=tmp_path)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "mltrace", "python", "-q", "-o", str(run_dir), str(program)]
    traced = subprocess.run(cmd, capture_output=True, timeout=300, env=env, cwd=tmp_path)
    assert plain.returncode == traced.returncode == 0, traced.stderr.decode()
    lines = _masked(plain.stdout.decode())
    assert any(line.startswith(("MKL_VERBOSE", "onednn_verbose")) for line in lines), lines
    assert _masked(traced.stdout.decode()) == lines
    info = json.loads((run_dir / "run.json").read_text())["sources_info"]["cpu.library"]
    assert info["onednn"] + info["mkl"] > 0
