"""What the library level costs one small MKL call, split in its parts.

A loop of ``torch.mm`` on 64×64 matrices (one torch thread: one MKL SGEMM and one MKL verbose
line a call, the kind of call a Hugging Face ``generate`` loop makes by the thousand) runs in a
fresh process per condition, in interleaved rounds (the conditions rotate through a round's
positions); each process reports the mean µs a call over its timed loop (``--seconds``, several
flush intervals):

- ``plain``: verbose output off;
- ``MKL verbose to /dev/null, MKL's timer``: ``MKL_VERBOSE=1`` alone, as a user would set it
  (MKL reads its clock through ``cpuid``, which a hypervisor traps);
- ``MKL verbose to /dev/null, timer redirected``: switched on at run time with MKL's timer
  pointed at the vDSO clock, as the library level does (``mltrace._mkltimer``);
- ``fd tap, lines dropped``: the same into the library level's fd tap (``FdTap``, the C reader,
  100 ms batches), a thread taking the lines (decoded) every 0.5 s, as the flusher does,
  and dropping them;
- ``fd tap, lines parsed``: the same, the thread also turning them into records and
  events.jsonl rows as the library level's flusher does (``LibrarySpanMaker.add_records``,
  ``LibraryRecords.encode``); ``read in Python``: with ``MLTRACE_MKL_PARSER=python``;
- ``mltrace --level op`` and ``mltrace --level library``: the whole session (``--level op``
  records the ``aten::mm`` ops without verbose output); ``mltrace --level library, lines read
  in Python``: the same with ``MLTRACE_MKL_PARSER=python`` (the MKL lines read by the Python
  code instead of the C helper ``mltrace._mklscan``).

Then, in this process, the flusher's CPU time a line (take and decode, parse, encode) on
20,000 lines as the loop prints them, with the lines read in C and in Python, in turns.

``--program-cost LINES``: instead, in this process, the loop (verbose output off) while a
thread parses and encodes LINES such lines every 0.5 s as the flusher does, its lines read in
C, in Python, or not at all (no flusher work), in rotating rounds: what the flusher's parse
costs the program's loop itself, without the tap and MKL's printing around it.

    python benchmarks/library_mkl_call.py --rounds 8 --seconds 3
    python benchmarks/library_mkl_call.py --rounds 12 --seconds 2 --program-cost 30000
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import harness

from mltrace.settings import MKL_PARSER

CONDITIONS: dict[str, str] = {
    "plain": "plain",
    "MKL verbose to /dev/null, MKL's timer": "env",
    "MKL verbose to /dev/null, timer redirected": "redirected",
    "fd tap, lines dropped": "tap",
    "fd tap, lines parsed": "parse",
    "fd tap, lines parsed, read in Python": "parse-python",
    "mltrace --level op": "op",
    "mltrace --level library": "library",
    "mltrace --level library, lines read in Python": "library-python",
}
#: How often the child's stand-in flusher takes the tap's lines (s): the session's flush interval.
FLUSH_INTERVAL_S = 0.5


def child(mode: str, seconds: float) -> None:
    """The measured loop (``seconds`` long, after a warm-up), in mode ``mode``; prints ``US_PER_CALL <µs>`` on stderr."""
    import torch

    torch.set_num_threads(1)
    stop_flusher: Callable[[], None] = lambda: None  # noqa: E731
    if mode in ("redirected", "tap", "parse", "parse-python"):
        from mltrace import _mkltimer

        _mkltimer.install()
        if mode != "redirected":
            stop_flusher = start_tap(parse=mode.startswith("parse"))
        torch._C._verbose.mkl_set_verbose(1)
    us_per_call = mm_loop(torch.randn(64, 64), torch.randn(64, 64), 500, seconds)
    stop_flusher()
    print(f"US_PER_CALL {us_per_call:.3f}", file=sys.stderr)


def mm_loop(a: Any, b: Any, warm: int, seconds: float) -> float:
    """``torch.mm(a, b)`` ``warm`` times, then in blocks of 100 for ``seconds``: µs a call."""
    import torch

    for _ in range(warm):
        torch.mm(a, b)
    start = time.perf_counter()
    end, calls = start + seconds, 0
    while time.perf_counter() < end:
        for _ in range(100):
            torch.mm(a, b)
        calls += 100
    return (time.perf_counter() - start) / calls * 1e6


def start_tap(parse: bool) -> Callable[[], None]:
    """Starts the library level's fd tap on fd 1 and a thread that takes its lines every
    ``FLUSH_INTERVAL_S`` (and with ``parse`` turns them into records and rows); returns
    what stops both."""
    from mltrace.tracer.fdtap import FdTap
    from mltrace.tracer.sources.cpu_library import _READ_BATCH_S, LibrarySpanMaker, _parse_in_chunks
    from mltrace.tracer.sources.library_records import LibraryRecords

    tap = FdTap(batch_s=_READ_BATCH_S).start()
    ids = itertools.count(1)
    maker = LibrarySpanMaker(lambda ns: ns, 1, lambda: next(ids))
    done = threading.Event()

    def drain() -> None:
        lines = tap.take_lines()
        if parse:
            records = LibraryRecords()
            _parse_in_chunks(maker, lines, records)
            records.encode()

    def flusher() -> None:
        while not done.wait(FLUSH_INTERVAL_S):
            drain()

    thread = threading.Thread(target=flusher, daemon=True)
    thread.start()

    def stop() -> None:
        done.set()
        thread.join()
        tap.stop()

    return stop


def command(mode: str, seconds: float, out_dir: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one condition's process."""
    env = dict(os.environ)
    env.pop("MKL_VERBOSE", None)
    me = [os.path.abspath(__file__), "--child", mode, "--seconds", str(seconds)]
    env.pop(MKL_PARSER.name, None)
    if mode == "env":
        env["MKL_VERBOSE"] = "1"
    if mode in ("library-python", "parse-python"):
        env[MKL_PARSER.name] = "python"
    if mode in ("op", "library", "library-python"):
        level = mode.split("-", maxsplit=1)[0]
        return [sys.executable, "-m", "mltrace", "python", "-q", "--level", level, "-o", out_dir, *me], env
    return [sys.executable, *me], env


def run_condition(mode: str, seconds: float, out_dir: str) -> float:
    """One process of ``mode``: its µs a call (stdout to /dev/null)."""
    cmd, env = command(mode, seconds, out_dir)
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    for line in proc.stderr.splitlines():
        if line.startswith("US_PER_CALL "):
            return float(line.split()[1])
    raise RuntimeError(f"{mode}: no timing (exit {proc.returncode}): {proc.stderr[-400:]}")


def mkl_line(rng: random.Random) -> bytes:
    """An MKL verbose line as the loop prints it (fresh pointers, a duration)."""
    pointers = [f"0x{rng.randrange(1 << 40, 1 << 47):x}" for _ in range(5)]
    a, b, c, d, e = pointers
    return (
        f"MKL_VERBOSE SGEMM(N,N,64,64,64,{a},{b},64,{c},64,{d},{e},64) {rng.uniform(5, 20):.2f}us CNR:OFF Dyn:0 FastMM:1 TID:0  NThr:1\n"
    ).encode()


def flusher_cost(lines: int = 20_000, repeats: int = 5) -> dict[str, dict[str, float]]:
    """The flusher's CPU µs a line (best of ``repeats``): taking and decoding the tap's
    captured block, parsing, encoding the rows; with the MKL lines read by the C helper
    (``c``, where it is built; also the helper's reading alone, which parsing includes) and by
    the Python code (``python``), in turns."""
    from mltrace.tracer.fdtap import FdTap
    from mltrace.tracer.sources.cpu_library import LibrarySpanMaker, _parse_in_chunks
    from mltrace.tracer.sources.library_records import LibraryRecords

    rng = random.Random(0)
    block = b"".join(mkl_line(rng) for _ in range(lines))
    best: dict[str, dict[str, float]] = {"c": {}, "python": {}}
    ids = itertools.count(1)
    for _ in range(repeats):
        for parser, cost in best.items():
            os.environ[MKL_PARSER.name] = parser  # read when the maker is made
            tap = FdTap()
            tap._raw.append((1, [block]))
            maker = LibrarySpanMaker(lambda ns: ns, 1, lambda: next(ids))
            records = LibraryRecords()
            t0 = time.thread_time_ns()
            taken = tap.take_lines()
            t1 = time.thread_time_ns()
            _parse_in_chunks(maker, taken, records)
            t2 = time.thread_time_ns()
            records.encode()
            t3 = time.thread_time_ns()
            parts = [("take", t1 - t0), ("parse", t2 - t1), ("encode", t3 - t2), ("all", t3 - t0)]
            if maker._scan is not None:  # the C reading alone, within parse
                t4 = time.thread_time_ns()
                maker._scan(taken)
                parts.append(("of which the C reading", time.thread_time_ns() - t4))
            for part, ns in parts:
                cost[part] = min(cost.get(part, float("inf")), ns / lines / 1e3)
    del os.environ[MKL_PARSER.name]
    return best


def program_cost(lines: int, rounds: int, seconds: float) -> dict[str, list[float]]:
    """The loop's µs a call per round while a stand-in flusher parses and encodes ``lines``
    lines every ``FLUSH_INTERVAL_S``, read in C (``c``), in Python (``python``), or idle (``none``)."""
    import torch

    from mltrace.tracer.fdtap import FdTap
    from mltrace.tracer.sources.cpu_library import LibrarySpanMaker, _parse_in_chunks
    from mltrace.tracer.sources.library_records import LibraryRecords

    torch.set_num_threads(1)
    rng = random.Random(0)
    tap = FdTap()
    tap._raw.append((1, [b"".join(mkl_line(rng) for _ in range(lines))]))
    taken = tap.take_lines()
    ids = itertools.count(1)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    per_call: dict[str, list[float]] = {"none": [], "python": [], "c": []}
    for r in range(rounds):
        for parser in harness.rotation(list(per_call), r):
            os.environ[MKL_PARSER.name] = parser  # read when the maker is made
            maker = LibrarySpanMaker(lambda ns: ns, 1, lambda: next(ids))
            done = threading.Event()

            def flusher(maker: LibrarySpanMaker = maker, parser: str = parser, done: threading.Event = done) -> None:
                while not done.wait(FLUSH_INTERVAL_S):
                    if parser != "none":
                        records = LibraryRecords()
                        _parse_in_chunks(maker, taken, records)
                        records.encode()

            thread = threading.Thread(target=flusher)
            thread.start()
            per_call[parser].append(mm_loop(a, b, 300, seconds))
            done.set()
            thread.join()
    del os.environ[MKL_PARSER.name]
    return per_call


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0, help="timed loop a process (s)")
    parser.add_argument("--child", choices=sorted(set(CONDITIONS.values())), help=argparse.SUPPRESS)
    parser.add_argument(
        "--only", metavar="MODES", help=f"comma-separated conditions to run, plain always among them ({', '.join(CONDITIONS.values())})"
    )
    parser.add_argument("--program-cost", type=int, metavar="LINES", help="the flusher's parse against the loop, in this process")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.seconds)
        return 0
    if args.program_cost:
        print(f"load {harness.loadavg()}; {args.rounds} rounds, a {args.seconds} s loop a variant, {args.program_cost} lines a flush")
        for variant, values in program_cost(args.program_cost, args.rounds, args.seconds).items():
            print(f"flusher parse {variant:7} {statistics.median(values):6.2f} µs a call (median; {min(values):.2f}–{max(values):.2f})")
        print("load", harness.loadavg())
        return 0
    import tempfile

    only = {"plain", *args.only.split(",")} if args.only else set(CONDITIONS.values())
    if not only <= set(CONDITIONS.values()):
        parser.error(f"--only: unknown condition(s) {', '.join(sorted(only - set(CONDITIONS.values())))}")
    kinds = [k for k, mode in CONDITIONS.items() if mode in only]
    per_call: dict[str, list[float]] = {k: [] for k in kinds}
    print(f"load {harness.loadavg()}; {args.rounds} rounds, a {args.seconds} s loop a process", flush=True)
    with tempfile.TemporaryDirectory(prefix="mkl-call-") as tmp:
        for r in range(args.rounds):
            for kind in harness.rotation(kinds, r):
                per_call[kind].append(run_condition(CONDITIONS[kind], args.seconds, os.path.join(tmp, f"{r}-{CONDITIONS[kind]}")))
    plain = statistics.median(per_call["plain"])
    print(f"{'condition':46} {'µs a call':>10} {'over plain':>11}   (median of {args.rounds} processes)")
    for kind in kinds:
        med = statistics.median(per_call[kind])
        print(f"{kind:46} {med:10.2f} {med - plain:+11.2f}")
    print("load", harness.loadavg())
    for parser, cost in flusher_cost().items():
        parts = ", ".join(f"{k} {v:.2f} µs" for k, v in cost.items())
        print(f"flusher CPU a line, lines read in {parser} (best of 5, 20,000 lines): {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
