"""FdTap: verbose lines are captured from fd 1, every other byte comes out unchanged.

Each test runs a program in a subprocess (fd 1 is process-wide) and compares
its real stdout, byte for byte, with what the program would print without
the verbose lines.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

PROGRAM = r"""
import json, os, subprocess, sys, time
from mltrace.tracer.fdtap import FdTap

expected = bytearray()  # what stdout must hold: everything but the verbose lines
verbose = []            # every verbose line written, in order


def user(data: bytes) -> None:
    os.write(1, data)
    expected.extend(data)


def lib(line: str) -> None:
    os.write(1, line.encode() + b"\n")
    verbose.append(line)


print("before the tap", flush=True)
expected.extend(b"before the tap\n")
sys.stdout.write("buffered before start, no newline")  # must be flushed before the switch
expected.extend(b"buffered before start, no newline")

tap = FdTap().start()
user(b" / os.write right after start\n")  # comes after the buffered text only if start() flushed it
print("printed", flush=True)
expected.extend(b"printed\n")
lib("onednn_verbose,v1,1795322166121.667969,primitive,exec,cpu,convolution,jit:avx512_core,x")
user(b"progress: ")                      # partial line ...
lib("MKL_VERBOSE SGEMM(N,N,2,2,2,0x1,0x2,2,0x3,2,0x4,0x5,2) 1.00us CNR:OFF Dyn:0 FastMM:1 TID:0  NThr:2")
user(b"50%")                             # ... continued after a verbose line
lib("MKL_VERBOSE SGEMM(N,N,3,3,3,0x1,0x2,3,0x3,3,0x4,0x5,3) 2.00us CNR:OFF Dyn:0 FastMM:1 TID:0  NThr:2")
user(b" done\n")
user(b"binary \x00\xff\xfe\r\n not utf-8 \x80\n")
user(b"user text mentioning onednn on a line\n")
user(b"ends in a prefix start: onedn")      # held back briefly, then forwarded
time.sleep(0.2)
user(b"n? no.\n")
os.write(1, b"onednn_verbose,v1,split,")     # one verbose line in two writes
time.sleep(0.1)
os.write(1, b"across,writes\n")
verbose.append("onednn_verbose,v1,split,across,writes")
user(b"binary data with MKL_VERBOSE inside and no newline for a while " + b"\x01" * 200_000 + b"\n")
print("print " * 3, end="", flush=True)
expected.extend(b"print print print ")
lib("dnnl_verbose,exec,cpu,reorder,simple:any,undef,src dst,,,2x2,0.01")
print(flush=True)
expected.extend(b"\n")

# several MB in one write, with verbose lines inside, and many small prints
big = bytearray()
for i in range(60_000):
    big.extend(b"row %06d %s\n" % (i, b"x" * 40))
    if i % 10_000 == 5:
        line = "MKL_VERBOSE DGEMM(N,N,%d,1,1,0x1,0x2,1,0x3,1,0x4,0x5,1) 3.00us CNR:OFF TID:0 NThr:1" % i
        big.extend(line.encode() + b"\n")
        verbose.append(line)
os.write(1, bytes(big))
expected.extend(b"".join(l + b"\n" for l in bytes(big).split(b"\n") if l and not l.startswith(b"MKL_VERBOSE")))
for i in range(20_000):
    print("printed line", i)
    expected.extend(b"printed line %d\n" % i)
sys.stdout.flush()  # as a plain run needs too, before a child writes

# a child process inherits the pipe as its stdout
child = ("import os; os.write(1, b'child says hi\\n"
         "MKL_VERBOSE SGEMM(N,N,1,1,1,0x1,0x2,1,0x3,1,0x4,0x5,1) 4.00us TID:0 NThr:1\\nchild partial')")
subprocess.run([sys.executable, "-c", child], check=True)
expected.extend(b"child says hi\nchild partial")
verbose.append("MKL_VERBOSE SGEMM(N,N,1,1,1,0x1,0x2,1,0x3,1,0x4,0x5,1) 4.00us TID:0 NThr:1")
sys.stdout.write(" / unflushed tail")  # left in Python's buffer: stop() must flush it
expected.extend(b" / unflushed tail")

t0 = time.monotonic_ns()
lines = tap.stop()
t1 = time.monotonic_ns()
assert tap.stop() == lines  # a second stop changes nothing
os.write(1, b"\nafter the tap\n")  # comes after the buffered tail only if stop() flushed it
expected.extend(b"\nafter the tap\n")
os.write(1, b"MKL_VERBOSE after stop goes to stdout\n")
expected.extend(b"MKL_VERBOSE after stop goes to stdout\n")
sys.stdout.write("exit without newline")
expected.extend(b"exit without newline")

with open(sys.argv[1], "w") as f:
    json.dump({
        "expected": expected.decode("latin-1"),
        "verbose": verbose,
        "captured": [text for _, text in lines],
        "receive_ns": [ns for ns, _ in lines],
        "t0": t0, "t1": t1,
        "detached": tap.detached,
        "forward_errors": tap.forward_errors,
        "native": tap._native is not None,
        "fd1_is_pipe_after": os.readlink("/proc/self/fd/1"),
    }, f)
"""


HAVE_C_READER = importlib.util.find_spec("mltrace._tapread") is not None
# The readers every behaviour is checked with: the thread reader's loop in C (where built) and
# in Python (MLTRACE_FDTAP_READER=python), and the reader process.
READERS = [
    pytest.param("thread", marks=pytest.mark.skipif(not HAVE_C_READER, reason="the C helper mltrace._tapread is not built")),
    "thread-python",
    "process",
]


def with_reader(source: str, reader: str) -> str:
    """``source`` with its first ``FdTap(`` made for ``reader`` (see READERS)."""
    kind = "process" if reader == "process" else "thread"
    out = source.replace("FdTap()", f"FdTap(reader={kind!r})", 1)
    return out if out != source else source.replace("FdTap(", f"FdTap(reader={kind!r}, ", 1)


def run_program(
    tmp_path: Path, source: str, timeout: float = 120, reader: str = "thread"
) -> tuple[subprocess.CompletedProcess[bytes], dict[str, Any]]:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(source), encoding="utf-8")
    report = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    env.pop("MLTRACE_FDTAP_READER", None)
    if reader == "thread-python":
        env["MLTRACE_FDTAP_READER"] = "python"
    env.pop("PYTHONUNBUFFERED", None)  # test the buffered case: the flushes must happen
    proc = subprocess.run(
        [sys.executable, str(script), str(report)],
        capture_output=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return proc, json.loads(report.read_text(encoding="utf-8"))


@pytest.mark.parametrize("reader", READERS)
def test_user_output_is_byte_identical_and_verbose_lines_are_captured(tmp_path: Path, reader: str) -> None:
    proc, report = run_program(tmp_path, with_reader(PROGRAM, reader), reader=reader)
    assert report["native"] is (reader == "thread")  # which loop ran
    expected = str(report["expected"]).encode("latin-1")
    assert len(proc.stdout) > 3_000_000
    assert proc.stdout == expected
    assert report["captured"] == report["verbose"]
    assert b"onednn_verbose" not in proc.stdout and b"dnnl_verbose" not in proc.stdout
    assert proc.stdout.count(b"MKL_VERBOSE") == 2  # in the over-long binary line, and written after stop()
    assert report["detached"] is False and report["forward_errors"] == 0
    receive = [int(ns) for ns in report["receive_ns"]]
    assert receive == sorted(receive) and receive[-1] <= int(report["t1"])


@pytest.mark.parametrize("reader", READERS)
def test_batched_reads_give_the_same_bytes_and_lines(tmp_path: Path, reader: str) -> None:
    # In batches (batch_s, as the library source reads), but not after an MKL line.
    program = with_reader(PROGRAM.replace("FdTap()", "FdTap(batch_s=0.01, urgent=(b'MKL_VERBOSE',))", 1), reader)
    assert program != PROGRAM
    proc, report = run_program(tmp_path, program, reader=reader)
    assert proc.stdout == str(report["expected"]).encode("latin-1")
    assert report["captured"] == report["verbose"]
    receive = [int(ns) for ns in report["receive_ns"]]
    assert receive == sorted(receive) and receive[-1] <= int(report["t1"])


LONG_BATCH_PROGRAM = r"""
import json, os, sys, time
from mltrace.tracer.fdtap import FdTap

expected, verbose = bytearray(), []
tap = FdTap(batch_s=3600).start()  # the reader may sleep up to an hour between reads
# A burst of 4 MB in one write, four times the pipe: the reader reads again at once after a
# full buffer, and sleeps only as long as a quarter of the pipe takes to fill at this rate.
burst = bytearray()
for i in range(80_000):
    row = b"row %06d %s\n" % (i, b"y" * 36)
    burst += row
    expected += row
    if i % 100 == 7:
        line = "onednn_verbose,v1,%d.5,primitive,exec,cpu,reorder,jit:uni,undef,x,,2x2,0.01" % i
        burst += line.encode() + b"\n"
        verbose.append(line)
os.write(1, bytes(burst))
# After a quiet spell, one line: at that rate the reader's next sleep is long (minutes).
time.sleep(0.3)
last = "onednn_verbose,v1,1.5,primitive,exec,cpu,reorder,jit:uni,undef,last,,2x2,0.01"
os.write(1, last.encode() + b"\n")
verbose.append(last)
deadline = time.monotonic() + 60
while last not in [text for _, text in tap.lines()] and time.monotonic() < deadline:
    time.sleep(0.01)
os.write(1, b"written while the reader sleeps\n")
expected += b"written while the reader sleeps\n"
lines = tap.stop()  # wakes the reader: nothing is left behind in the background
with open(sys.argv[1], "w") as f:
    json.dump({"expected": expected.decode("latin-1"), "verbose": verbose,
               "captured": [text for _, text in lines], "detached": tap.detached}, f)
"""


@pytest.mark.parametrize("reader", [r for r in READERS if r != "process"])  # the process reader ends its sleep first
def test_a_long_batch_sleep_neither_holds_back_a_burst_nor_outlasts_stop(tmp_path: Path, reader: str) -> None:
    proc, report = run_program(tmp_path, LONG_BATCH_PROGRAM, reader=reader)
    assert proc.stdout == str(report["expected"]).encode("latin-1")
    assert report["captured"] == report["verbose"]
    assert report["detached"] is False  # the reader woke and finished within stop()


def test_the_batch_sleep_is_cut_to_what_a_quarter_of_the_pipe_holds() -> None:
    from mltrace.tracer.fdtap import batch_sleep_s

    pipe = 1 << 20
    assert batch_sleep_s(0.1, 0, 0.5, pipe) == 0.1  # nothing read: the full batch
    assert batch_sleep_s(0.1, 30_000, 0.1, pipe) == 0.1  # 300 kB/s: a quarter (256 KiB) takes 0.87 s
    assert batch_sleep_s(0.1, 1 << 20, 0.1, pipe) == pytest.approx(0.025)  # 10 MiB/s: 25 ms
    assert batch_sleep_s(0.1, 1 << 30, 0.1, pipe) == 0.001  # never under 1 ms
    assert batch_sleep_s(0.1, 1 << 20, 0.1, 1 << 16) == pytest.approx(0.1 / 64)  # a 64 KiB pipe


@pytest.mark.parametrize("reader", READERS)
def test_stdout_restored_when_the_reader_of_stdout_is_gone(tmp_path: Path, reader: str) -> None:
    """A closed stdout pipe (``| head``) neither blocks the program nor loses verbose lines."""
    source = r"""
    import json, os, signal, sys
    from mltrace.tracer.fdtap import FdTap
    r, w = os.pipe()
    os.dup2(w, 1); os.close(w); os.close(r)  # stdout is a pipe nobody reads
    tap = FdTap().start()
    for i in range(2000):
        os.write(1, b"user output that goes nowhere %d\n" % i)
        os.write(1, b"onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,a b,,,%d,0.1\n" % i)
    lines = tap.stop()
    with open(sys.argv[1], "w") as f:
        json.dump({"n": len(lines), "errors": tap.forward_errors}, f)
    """
    source = with_reader(source, reader)
    _, report = run_program(tmp_path, source, reader=reader)
    assert report["n"] == 2000
    assert int(report["errors"]) > 0


@pytest.mark.parametrize("reader", [r for r in READERS if r != "process"])
@pytest.mark.parametrize("saved", ["kept", "closed"])
def test_a_failed_reader_hands_stdout_back(tmp_path: Path, reader: str, saved: str) -> None:
    """When the thread reader fails (a program that closes descriptors it did not open, with
    ``os.closerange``, can make it), the program's output must not go into a pipe nobody reads:
    its writes would fail with EPIPE. ``_reader_failed`` points fd 1 back at the original
    where the saved descriptor is still the one saved, else at /dev/null with one warning;
    stop() then neither restores from nor closes a descriptor that is no longer mltrace's."""
    source = r"""
    import errno, json, os, sys, time
    from mltrace.tracer.fdtap import FdTap
    tap = FdTap(batch_s=0.01).start()
    print("before", flush=True)
    time.sleep(0.2)  # forwarded by the reader
    if SAVED == "closed":
        os.close(tap._saved_fd)
        mine = os.open(os.devnull, os.O_RDONLY)  # may take its number: mltrace must leave it open
    tap._reader_failed(OSError(errno.EBADF, "closed by the program"))
    now = os.fstat(1)
    if SAVED == "kept":
        where = "original" if (now.st_dev, now.st_ino) == tuple(os.fstat(tap._saved_fd)[i] for i in (2, 1)) else "pipe"
    else:
        where = "null" if now.st_rdev == os.stat(os.devnull).st_rdev else "pipe"
    print("after", flush=True)
    tap.stop()
    if SAVED == "closed":
        os.fstat(mine)
    print(json.dumps({"errno": tap.reader_error.errno, "fd1": where}), file=sys.stderr)
    """.replace("SAVED", repr(saved))
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(source), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    env.pop("MLTRACE_FDTAP_READER", None)
    if reader == "thread-python":
        env["MLTRACE_FDTAP_READER"] = "python"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert json.loads(err.strip().splitlines()[-1]) == {"errno": errno.EBADF, "fd1": "original" if saved == "kept" else "null"}
    if saved == "kept":
        assert proc.stdout == b"before\nafter\n"
        assert "warning" not in err
    else:  # the original went with the saved descriptor: the rest is discarded, once said
        assert proc.stdout == b"before\n"
        assert err.count("mltrace: warning: the tap on descriptor 1 lost its pipe") == 1


def test_process_reader_falls_back_to_a_thread(tmp_path: Path) -> None:
    source = r"""
    import json, os, sys
    from mltrace.tracer.fdtap import FdTap
    sys.executable = "/nonexistent/python"  # the reader process cannot start
    tap = FdTap(reader="process").start()
    os.write(1, b"user\n")
    os.write(1, b"MKL_VERBOSE SGEMM(N) 1.00us TID:0 NThr:1\n")
    thread = tap._thread is not None
    lines = tap.stop()
    with open(sys.argv[1], "w") as f:
        json.dump({"thread": thread, "lines": [t for _, t in lines]}, f)
    """
    proc, report = run_program(tmp_path, source)
    assert proc.stdout == b"user\n"
    assert report == {"thread": True, "lines": ["MKL_VERBOSE SGEMM(N) 1.00us TID:0 NThr:1"]}


@pytest.mark.parametrize("reader", READERS)
def test_context_manager_restores_fd_on_exception(tmp_path: Path, reader: str) -> None:
    source = r"""
    import json, os, sys
    from mltrace.tracer.fdtap import FdTap
    before = os.fstat(1)
    try:
        with FdTap() as tap:
            os.write(1, b"MKL_VERBOSE SGEMM(N) 1.00us TID:0 NThr:1\n")
            raise KeyError("boom")
    except KeyError:
        pass
    after = os.fstat(1)
    print("visible", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump({"same": (before.st_ino, before.st_dev) == (after.st_ino, after.st_dev),
                   "lines": [t for _, t in tap.lines()], "active": tap.active}, f)
    """
    source = with_reader(source, reader)
    proc, report = run_program(tmp_path, source, reader=reader)
    assert proc.stdout == b"visible\n"
    assert report == {"same": True, "lines": ["MKL_VERBOSE SGEMM(N) 1.00us TID:0 NThr:1"], "active": False}


@pytest.mark.parametrize("reader", READERS)
def test_child_outliving_stop_does_not_block(tmp_path: Path, reader: str) -> None:
    source = r"""
    import json, os, subprocess, sys, time
    from mltrace.tracer.fdtap import FdTap
    tap = FdTap().start()
    child = subprocess.Popen([sys.executable, "-c",
        "import os, time; time.sleep(1.5); os.write(1, b'late child output\\n')"])
    t0 = time.monotonic()
    tap.stop(timeout_s=0.3)
    waited = time.monotonic() - t0
    child.wait()
    time.sleep(0.3)  # the detached reader forwards the child's line
    with open(sys.argv[1], "w") as f:
        json.dump({"detached": tap.detached, "waited_s": waited}, f)
    """
    source = with_reader(source, reader)
    proc, report = run_program(tmp_path, source, reader=reader)
    assert report["detached"] is True
    assert float(report["waited_s"]) < 1.4
    assert proc.stdout == b"late child output\n"


@pytest.mark.parametrize("reader", [r for r in READERS if r != "process"])
def test_stop_does_not_wait_for_multiprocessings_lifelong_helpers(tmp_path: Path, reader: str) -> None:
    """multiprocessing's resource tracker, started while the tap runs, holds the pipe until the
    program exits: stop() does not wait for it (``held_by_helpers``), where it waits for a child
    of the program's own (``held_by_helpers`` False), as ``test_child_outliving_stop_does_not_block``."""
    source = r"""
    import json, subprocess, sys, time
    from multiprocessing import resource_tracker
    from mltrace.tracer.fdtap import FdTap
    tap = FdTap().start()
    resource_tracker.ensure_running()
    tap.stop()
    helpers = tap.held_by_helpers
    tap = FdTap().start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    tap.stop(timeout_s=0.5)
    child.wait()
    with open(sys.argv[1], "w") as f:
        json.dump({"helpers": helpers, "child": tap.held_by_helpers}, f)
    """
    proc, report = run_program(tmp_path, with_reader(source, reader), reader=reader)
    assert report == {"helpers": True, "child": False}, proc.stderr


@pytest.mark.parametrize("reader", [r for r in READERS if r != "process"])
def test_stop_returns_while_a_child_writes_without_pause(tmp_path: Path, reader: str) -> None:
    """stop() returns while a child keeps writing to the pipe, and the child's lines come out
    whole: the reader forwards them, detached, until the child ends."""
    source = r"""
    import json, subprocess, sys, time
    from mltrace.tracer.fdtap import FdTap
    tap = FdTap().start()
    child = subprocess.Popen([sys.executable, "-c",
        "import os, time\nend = time.monotonic() + 4\nwhile time.monotonic() < end: os.write(1, b'x' * 60 + b'\\n')"],
        stdout=None)
    time.sleep(0.5)
    t0 = time.monotonic()
    tap.stop(timeout_s=0.3)
    waited = time.monotonic() - t0
    child.wait()
    time.sleep(0.3)
    with open(sys.argv[1], "w") as f:
        json.dump({"detached": tap.detached, "waited_s": waited}, f)
    """
    proc, report = run_program(tmp_path, with_reader(source, reader), reader=reader)
    assert report["detached"] is True
    assert float(report["waited_s"]) < 2.5  # the child writes for 4 s
    assert set(proc.stdout.split(b"\n")[:-1]) == {b"x" * 60}  # whole lines, nothing lost in between


@pytest.mark.parametrize("reader", [r for r in READERS if r != "process"])
def test_stop_while_a_thread_of_the_program_drains_a_full_stdout(tmp_path: Path, reader: str) -> None:
    """stdout is a pipe that a (slow) thread of the program itself reads. At stop() the reader is
    blocked forwarding into that full pipe: stop() must let the thread run to drain it, not wait
    for the reader while keeping the GIL."""
    source = r"""
    import json, os, sys, threading, time
    from mltrace.tracer.fdtap import FdTap
    r, w = os.pipe()
    os.dup2(w, 1); os.close(w)
    got = bytearray()

    def drain():  # the program's own reader of its stdout, slower than the writes
        while not got.endswith(b"END\n"):
            got.extend(os.read(r, 4096))
            time.sleep(0.002)

    t = threading.Thread(target=drain)
    t.start()
    tap = FdTap(batch_s=0.01).start()
    expected = b"".join(b"line %06d of the program's output\n" % i for i in range(60_000))
    os.write(1, expected[:1_000_000])
    os.write(1, b"MKL_VERBOSE SGEMM(N) 1.00us TID:0 NThr:1\n")
    os.write(1, expected[1_000_000:])
    lines = tap.stop()
    os.write(1, b"END\n")
    t.join()
    os.dup2(2, 1)
    with open(sys.argv[1], "w") as f:
        json.dump({"same": bytes(got) == expected + b"END\n", "lines": [t for _, t in lines]}, f)
    """
    _, report = run_program(tmp_path, with_reader(source, reader), timeout=60, reader=reader)
    assert report == {"same": True, "lines": ["MKL_VERBOSE SGEMM(N) 1.00us TID:0 NThr:1"]}


@pytest.mark.parametrize("reader", [r for r in READERS if r != "process"])
def test_a_forked_child_stops_its_copy_without_the_parents_reader(tmp_path: Path, reader: str) -> None:
    """A child forked while the tap runs has the tap's state but not its reader thread: its
    stop() restores fd 1 plainly and returns at once; the parent's tap goes on and keeps every
    line."""
    source = r"""
    import json, os, sys, time
    from mltrace.tracer.fdtap import FdTap
    tap = FdTap(batch_s=0.01).start()
    for i in range(2000):
        os.write(1, b"MKL_VERBOSE SGEMM(N) %d\n" % i)
    pid = os.fork()
    if pid == 0:
        t0 = time.monotonic()
        tap.stop()
        os.write(1, b"child took %.2f s\n" % (time.monotonic() - t0))
        os._exit(0)
    os.waitpid(pid, 0)
    lines = tap.stop()
    with open(sys.argv[1], "w") as f:
        json.dump({"lines": len(lines)}, f)
    """
    proc, report = run_program(tmp_path, with_reader(source, reader), timeout=60, reader=reader)
    assert report == {"lines": 2000}
    took = float(proc.stdout.split(b"child took ")[1].split(b" s")[0])
    assert took < 0.5  # no wait for a reader thread the child does not have


@pytest.mark.parametrize("reader", [r for r in READERS if r != "process"])
def test_a_forked_child_released_writes_past_the_parents_tap(tmp_path: Path, reader: str) -> None:
    """What the session does in a forked child (release_in_forked_child): the child's fd 1 is the
    original again, so its lines, verbose ones too, go straight out; the parent's tap keeps
    capturing the parent's."""
    source = r"""
    import json, os, sys
    from mltrace.tracer.fdtap import FdTap
    tap = FdTap(batch_s=0.01).start()
    pid = os.fork()
    if pid == 0:
        tap.release_in_forked_child()
        os.write(1, b"MKL_VERBOSE from the child\n")
        os._exit(0)
    os.waitpid(pid, 0)
    os.write(1, b"MKL_VERBOSE from the parent\n")
    lines = tap.stop()
    with open(sys.argv[1], "w") as f:
        json.dump({"lines": [t for _, t in lines], "active": tap.active}, f)
    """
    proc, report = run_program(tmp_path, with_reader(source, reader), timeout=60, reader=reader)
    assert proc.stdout == b"MKL_VERBOSE from the child\n"
    assert report == {"lines": ["MKL_VERBOSE from the parent"], "active": False}


@pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode != 0,
    reason="torch is not installed",
)
def test_real_torch_onednn_verbose_is_captured(tmp_path: Path) -> None:
    source = r"""
    import json, sys
    import torch
    from mltrace.tracer.fdtap import FdTap
    from mltrace.formats.verbose_logs import parse_mkl_line, parse_onednn_line
    conv = torch.nn.Conv2d(3, 8, 7, stride=2, padding=3).eval()
    lin = torch.nn.Linear(16, 4).eval()
    print("model ready", flush=True)
    with FdTap() as tap:
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON), torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
            with torch.no_grad():
                print("running", end=" ", flush=True)
                conv(torch.randn(1, 3, 32, 32))
                lin(torch.randn(2, 16))
                print("done", flush=True)
    onednn = [c for c in (parse_onednn_line(t) for _, t in tap.lines()) if c is not None]
    mkl = [c for c in (parse_mkl_line(t) for _, t in tap.lines()) if c is not None]
    with open(sys.argv[1], "w") as f:
        json.dump({"onednn": [(c.kind, c.desc) for c in onednn], "mkl": [list(c.args[:5]) for c in mkl],
                   "n": len(tap.lines())}, f)
    """
    proc, report = run_program(tmp_path, source, timeout=300)
    assert proc.stdout == b"model ready\nrunning done\n"
    assert ["convolution", "mb1_ic3oc8_ih32oh16kh7sh2dh0ph3_iw32ow16kw7sw2dw0pw3"] in report["onednn"]
    assert report["mkl"] == [["T", "N", "4", "2", "16"]]  # nn.Linear(16, 4) on 2 rows: SGEMM M=4 N=2 K=16


def test_split_takes_whole_verbose_lines_then_the_mixed_rest(tmp_path: Path) -> None:
    """One chunk: verbose lines first (the quick path), then the program's text with a verbose
    line starting mid-line, then a started verbose line that must be held back; then a chunk
    of nothing but verbose lines (kept as one block, split when read)."""
    from mltrace.tracer.fdtap import FdTap

    out = tmp_path / "forwarded"
    tap = FdTap()
    tap._saved_fd = os.open(out, os.O_WRONLY | os.O_CREAT)
    try:
        chunk = (
            b"onednn_verbose,a\r\nMKL_VERBOSE b\n"  # whole lines
            b"50% done onednn_verbose,c\n"  # the program's text, then a line mid-line
            b"user line\nMKL_VERBOSE d\nonednn_verb"  # ... a tail that may become a line
        )
        held = tap._split(chunk, 7)
        held = tap._split(held + b"ose,e\nbye\n", 8)
        assert tap._split(b"MKL_VERBOSE f\nonednn_verbose,g\r\n", 9) == b""  # all verbose: kept whole
    finally:
        os.close(tap._saved_fd)
    assert held == b""
    assert out.read_bytes() == b"50% done user line\nbye\n"
    assert tap.lines() == [
        (7, "onednn_verbose,a"),
        (7, "MKL_VERBOSE b"),
        (7, "onednn_verbose,c"),
        (7, "MKL_VERBOSE d"),
        (8, "onednn_verbose,e"),
        (9, "MKL_VERBOSE f"),
        (9, "onednn_verbose,g"),
    ]


def test_echoed_verbose_lines_are_forwarded_in_place_and_captured(tmp_path: Path) -> None:
    """``echo``: the lines of the libraries the user asked for (MKL's here) are forwarded where
    they were written, and captured all the same; the others are only captured."""
    from mltrace.tracer.fdtap import FdTap

    out = tmp_path / "forwarded"
    tap = FdTap(echo=(b"MKL_VERBOSE ",))
    assert tap._native_type is None  # the C reader forwards no captured line
    tap._saved_fd = os.open(out, os.O_WRONLY | os.O_CREAT)
    try:
        held = tap._split(b"onednn_verbose,a\nMKL_VERBOSE b\n50% done MKL_VERBOSE c\nuser line\nonednn_verbose,d\nMKL_VER", 1)
        held = tap._split(held + b"BOSE e\nbye\n", 2)
        tap._capture(b"MKL_VERBOSE cut short", 3)  # the pipe's end inside a line
    finally:
        os.close(tap._saved_fd)
    assert held == b""
    assert out.read_bytes() == b"MKL_VERBOSE b\n50% done MKL_VERBOSE c\nuser line\nMKL_VERBOSE e\nbye\nMKL_VERBOSE cut short"
    assert [text for _, text in tap.lines()] == [
        "onednn_verbose,a",
        "MKL_VERBOSE b",
        "MKL_VERBOSE c",
        "onednn_verbose,d",
        "MKL_VERBOSE e",
        "MKL_VERBOSE cut short",
    ]


ANOTHER_THREAD_WRITES = r"""
import os, sys, threading, time
from mltrace.tracer.fdtap import FdTap

stop = threading.Event()


def writer() -> None:  # the program's other thread: numbered lines, all the time
    i = 0
    while not stop.is_set():
        os.write(1, b"%d\n" % i)
        i += 1
        time.sleep(0.0001)


t = threading.Thread(target=writer)
t.start()
for _ in range(20):  # the library source's tap (batched reads), stopped while the thread writes
    tap = FdTap(batch_s=0.01).start()
    time.sleep(0.03)
    tap.stop()
    time.sleep(0.005)
stop.set()
t.join()
"""


@pytest.mark.parametrize("reader", [r for r in READERS if r != "process"])
def test_a_stop_while_another_thread_writes_keeps_its_lines_in_order(tmp_path: Path, reader: str) -> None:
    """Bytes still in the pipe when fd 1 is restored would reach the terminal after the
    thread's next, direct write: stop() first has the reader's bytes forwarded, then forwards
    what is left in the pipe before another Python thread can run."""
    script = tmp_path / "writer.py"
    script.write_text(ANOTHER_THREAD_WRITES)
    env = dict(os.environ, MLTRACE_FDTAP_READER="python" if reader == "thread-python" else "c")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=120, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    numbers = [int(x) for x in proc.stdout.split()]
    assert len(numbers) > 1000
    assert numbers == list(range(len(numbers)))


INTERLEAVED = r"""
import os, sys
from mltrace.tracer.fdtap import FdTap

tap = FdTap().start()
for i in range(300):
    print(f"out {i}", flush=True)
    os.write(1, b"MKL_VERBOSE SGEMM(N,N,1,1,1,0x1,0x2,1,0x3,1,0x4,0x5,1) 1.00us TID:0 NThr:1\n")
    sys.stderr.write(f"err {i}\n")
    sys.stderr.flush()
lines = tap.stop()
print("out after", flush=True)
sys.stderr.write(f"err after {len(lines)} {tap.captured_count}\n")
"""


def _interleaved_lines(count: int) -> list[str]:
    return [line for i in range(count) for line in (f"out {i}", f"err {i}")]


@pytest.mark.parametrize("reader", READERS)
def test_stdout_and_stderr_on_one_file_keep_their_order(tmp_path: Path, reader: str) -> None:
    """With ``> f 2>&1`` fd 2 goes through the tap's pipe too: the lines come out in the order
    they were written, not stderr's first; verbose lines written between them are captured
    and counted; after stop() both descriptors write straight to the file again."""
    script = tmp_path / "interleaved.py"
    script.write_text(with_reader(INTERLEAVED, reader))
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), MLTRACE_FDTAP_READER="python" if reader == "thread-python" else "c")
    out = tmp_path / "out.txt"
    with out.open("wb") as f:
        proc = subprocess.run([sys.executable, str(script)], stdout=f, stderr=subprocess.STDOUT, timeout=120, env=env)
    assert proc.returncode == 0, out.read_text()
    counted = 0 if reader == "process" else 300  # the reader process's lines are not counted
    assert out.read_text().splitlines() == [*_interleaved_lines(300), "out after", f"err after 300 {counted}"]


def test_stdout_and_stderr_on_different_files_stay_apart(tmp_path: Path) -> None:
    """Where fd 2 goes elsewhere it is left alone: its lines never reach stdout."""
    script = tmp_path / "interleaved.py"
    script.write_text(INTERLEAVED)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().splitlines() == [*(f"out {i}" for i in range(300)), "out after"]
    assert proc.stderr.decode().splitlines() == [*(f"err {i}" for i in range(300)), "err after 300 300"]


TRACED_INTERLEAVED = r"""
import sys
import torch

model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
with torch.no_grad():
    for i in range(40):
        model(torch.randn(2, 8))
        print(f"out {i}", flush=True)
        sys.stderr.write(f"err {i}\n")
        sys.stderr.flush()
"""


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_traced_at_the_library_level_stdout_and_stderr_keep_their_order(tmp_path: Path) -> None:
    """``mltrace python --level library prog.py > f 2>&1``: the program's lines in its own
    order, as without mltrace, while the library level records oneDNN's calls."""
    script = tmp_path / "prog.py"
    script.write_text(TRACED_INTERLEAVED)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    env.pop("PYTHONUNBUFFERED", None)
    out = tmp_path / "out.txt"
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "mltrace", "python", "-q", "--level", "library", "-o", str(run_dir), str(script)]
    with out.open("wb") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=300, env=env, cwd=tmp_path)
    lines = [line for line in out.read_text().splitlines() if not line.startswith("mltrace")]
    assert proc.returncode == 0, out.read_text()
    assert lines == _interleaved_lines(40)
    from mltrace.run.levels import Level
    from mltrace.run.store import load_run

    assert any(s.level == Level.LIBRARY for s in load_run(run_dir).spans)


def test_a_terminal_on_both_descriptors_stays_a_terminal(tmp_path: Path) -> None:
    """On a terminal both descriptors are tapped through a pseudo-terminal: the program still
    sees a terminal on each (colours, progress bars, line buffering)."""
    import pty

    script = tmp_path / "tty.py"
    script.write_text(
        "import os, sys\n"
        "from mltrace.tracer.fdtap import FdTap\n"
        "tap = FdTap().start()\n"
        "seen = (os.isatty(1), os.isatty(2))\n"
        "tap.stop()\n"
        "sys.stderr.write(f'under the tap: stdout {seen[0]}, stderr {seen[1]}\\n')\n"
    )
    main, sub = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    try:
        proc = subprocess.run([sys.executable, str(script)], stdout=sub, stderr=sub, timeout=120, env=env)
    finally:
        os.close(sub)
    out = b""
    with contextlib.suppress(OSError):  # EIO once the terminal's other side is closed
        while chunk := os.read(main, 4096):
            out += chunk
    os.close(main)
    assert proc.returncode == 0, out.decode(errors="replace")
    assert "under the tap: stdout True, stderr True" in out.decode(errors="replace")


def _run_on_a_terminal(command: list[str], env: dict[str, str], cwd: Path) -> bytes:
    """What ``command`` writes to a terminal (util-linux ``script``), given one typed line on
    its terminal's input, which the terminal does not echo."""
    line = " ".join(map(shlex.quote, command))
    proc = subprocess.run(
        ["script", "-q", "-e", "-c", f"stty -echo; {line}", "/dev/null"],
        input=b"typed text\n",
        capture_output=True,
        timeout=300,
        env=env,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    return proc.stdout


@pytest.mark.skipif(shutil.which("script") is None, reason="util-linux script is not installed")
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_on_a_terminal_the_traced_program_writes_what_it_writes_plainly(tmp_path: Path) -> None:
    """``mltrace python prog.py`` on a terminal (the default level taps fd 1 for the library's
    verbose lines): the program sees a terminal on fds 0-2 with its size and settings, Python
    line-buffers stdout (stdout and stderr lines interleave as plainly), ``input()`` reads the
    terminal and prompts on stderr, and the terminal receives the same bytes."""
    program = REPO / "tests" / "scripts" / "terminal_report.py"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    env.pop("PYTHONUNBUFFERED", None)
    plain = _run_on_a_terminal([sys.executable, str(program)], env, tmp_path)
    run_dir = tmp_path / "run"
    traced = _run_on_a_terminal([sys.executable, "-m", "mltrace", "python", "-q", "-o", str(run_dir), str(program)], env, tmp_path)
    assert b"isatty [True, True, True] True True" in plain, plain
    assert b"prompt> typed 'typed text'" in plain, plain
    assert traced == plain
    from mltrace.run.levels import Level
    from mltrace.run.store import load_run

    assert any(s.level == Level.LIBRARY for s in load_run(run_dir).spans)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_output_that_os_exit_discards_plainly_is_not_printed_under_mltrace(tmp_path: Path) -> None:
    """``os._exit`` discards Python's and C's stdio buffers: mltrace's wrapper, which finishes
    the trace (and stops the fd tap), must not flush them. Same files, same exit status."""
    program = REPO / "tests" / "scripts" / "exit_with_buffered_output.py"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    env.pop("PYTHONUNBUFFERED", None)

    def outputs(command: list[str], name: str) -> tuple[int, bytes, bytes]:
        out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        with out.open("wb") as fo, err.open("wb") as fe:
            proc = subprocess.run(command, stdout=fo, stderr=fe, timeout=300, env=env, cwd=tmp_path)
        return proc.returncode, out.read_bytes(), err.read_bytes()

    plain = outputs([sys.executable, str(program)], "plain")
    run_dir = tmp_path / "run"
    traced = outputs([sys.executable, "-m", "mltrace", "python", "-q", "-o", str(run_dir), str(program)], "traced")
    assert plain == (5, b"flushed line\n", b"stderr line\n")
    assert traced[:2] == plain[:2]
    assert traced[2].startswith(plain[2]), traced[2]  # then mltrace's own lines, if any
    assert json.loads((run_dir / "run.json").read_text())["exit_status"] == 5


@pytest.mark.parametrize(
    "block",
    [
        b"MKL_VERBOSE SGEMM(N,N,4,4,4) 1.00us\nMKL_VERBOSE SGEMM(N,N,8,8,8) 2.00us\n",
        b"onednn_verbose,v1,exec\r\r\nonednn_verbose,v1,exec\r",
        b"MKL_VERBOSE caf\xc3\xa9 \xe2\x82\nMKL_VERBOSE \xff\xfe end",
        b"MKL_VERBOSE \xe2\r\nMKL_VERBOSE x\n",
    ],
)
def test_captured_blocks_decode_as_their_lines_one_by_one(block: bytes) -> None:
    """A captured block, decoded in one piece, gives the lines a decode line by line gives:
    the same texts (invalid bytes replaced, trailing carriage returns dropped), the receive
    time of the block, as TappedLines."""
    from mltrace.tracer.fdtap import TappedLine, _lines_of, _tapped_lines

    want = [TappedLine(7, line.rstrip(b"\r").decode("utf-8", "replace")) for line in _lines_of(block)]
    got = list(_tapped_lines(7, block))
    assert got == want
    assert all(type(line) is TappedLine for line in got)
