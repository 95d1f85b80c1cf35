"""What the library level's verbose capture costs, split in its parts, in one process.

Interleaved blocks of inferences on one model: plain; oneDNN + MKL verbose
output switched on and written to /dev/null (the libraries' own cost), with MKL's
own timer and with it redirected to the vDSO clock as the library level does
(``mltrace._mkltimer``); and the same output read by mltrace's fd tap (``FdTap``):
by a thread whose loop runs in Python (with and without batched reads) or in C
without the GIL (``_tapread``, what the library level runs), and by a reader process.
No mltrace session: only the capture path is measured.

    python benchmarks/library_tap.py                  # CNN (oneDNN-heavy)
    python benchmarks/library_tap.py --model encoder  # 4-layer encoder (MKL-heavy)

Conditions rotate through the positions of a round, round by round. Prints
the median latency of each condition and its ratio to plain.

``--paired BATCH_S`` measures the tap alone, tighter: one tap (C loop, reading in
batches of BATCH_S as the library level does) for the whole run, and blocks of
three kinds alternating a few hundred milliseconds apart (rotating order): verbose
output off, verbose output into the tap's pipe, and verbose output to /dev/null
(fd 1 switched between the pipe and /dev/null between blocks). Prints the median
of per-round ratios with a bootstrap 95 % interval; tap / /dev/null is what the
tap costs beyond the libraries' own printing.

    python benchmarks/library_tap.py --paired 0.1 --rounds 60
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import harness
import torch
from harness import bootstrap_median, rotation, time_calls

from mltrace.settings import FDTAP_READER
from mltrace.tracer.fdtap import FdTap

try:
    from mltrace import _mkltimer
except ImportError:  # not built: the redirected conditions are left out
    _mkltimer = None  # type: ignore[assignment]

REDIRECT = "MKL timer redirected"
# name → (batch_s, reader, loop of the thread reader: "c" or "python"); a str or None: verbose
# to /dev/null, no tap (only "onednn"'s or "mkl"'s; None: both). A name with REDIRECT in it runs
# with MKL's verbose timer redirected (as the library level does).
CONDITIONS: dict[str, tuple[float, str, str] | str | None] = {
    "verbose to /dev/null": None,
    f"verbose to /dev/null, {REDIRECT}": None,
    "oneDNN verbose alone to /dev/null": "onednn",
    f"MKL verbose alone to /dev/null, {REDIRECT}": "mkl",
    "tap thread, Python loop, one read per line": (0.0, "thread", "python"),
    f"tap thread, Python loop, 10 ms batches, {REDIRECT}": (0.01, "thread", "python"),
    f"tap thread, C loop, 10 ms batches, {REDIRECT} (shipped)": (0.01, "thread", "c"),
    f"tap process, 10 ms batches, {REDIRECT}": (0.01, "process", "python"),
}


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--model", choices=("cnn", "encoder"), default="cnn")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--paired", type=float, metavar="BATCH_S", help="the tap alone, paired blocks (see above)")
    args = parser.parse_args()
    if args.paired is not None and args.paired < 0:
        parser.error("--paired takes a batch length in seconds (0 or more)")
    work = harness.example_model(args.model, layers=4)  # the 4-layer encoder: MKL-heavy
    model, x = work.model, work.x
    mkldnn, mkl = torch.backends.mkldnn, torch.backends.mkl
    os.environ["ONEDNN_VERBOSE_TIMESTAMP"] = "1"
    if args.paired is not None:
        with torch.inference_mode():
            paired(lambda: model(x), args.rounds, args.iters, args.paired)
        return 0

    def block() -> list[float]:
        # Every block starts after the same pause: a reader process needs ≈ 0.2 s to
        # start (once per session, not measured), and a pause only before some blocks
        # would bias them (caches and clocks cool down while the program sleeps).
        time.sleep(0.3)
        out = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            model(x)
            out.append(time.perf_counter() - t0)
        return out

    conditions = {k: v for k, v in CONDITIONS.items() if _mkltimer is not None or REDIRECT not in k}
    times: dict[str, list[float]] = {"plain": [], **{k: [] for k in conditions}}
    lines = 0
    null = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(1)
    with torch.inference_mode():
        block()  # warm-up
        names = ["plain", *conditions]
        for r in range(args.rounds):
            # Every condition takes every position in turn: a block's place in the round
            # (what ran just before it) must not decide its figure.
            for name in rotation(names, r):
                if name == "plain":
                    times["plain"] += block()
                    continue
                tap_args = conditions[name]
                redirect = REDIRECT in name and _mkltimer is not None and _mkltimer.install() > 0
                try:
                    if tap_args is None or isinstance(tap_args, str):
                        onednn_on = tap_args in (None, "onednn")
                        mkl_on = tap_args in (None, "mkl")
                        sys.stdout.flush()
                        os.dup2(null, 1)
                        try:
                            with (
                                mkldnn.verbose(mkldnn.VERBOSE_ON if onednn_on else mkldnn.VERBOSE_OFF),
                                mkl.verbose(mkl.VERBOSE_ON if mkl_on else mkl.VERBOSE_OFF),
                            ):
                                times[name] += block()
                        finally:
                            os.dup2(saved, 1)
                        continue
                    batch_s, reader, loop = tap_args
                    os.environ[FDTAP_READER.name] = loop  # read when the tap is made
                    tap = FdTap(batch_s=batch_s, reader=reader).start()
                    try:
                        with mkldnn.verbose(mkldnn.VERBOSE_ON), mkl.verbose(mkl.VERBOSE_ON):
                            times[name] += block()
                    finally:
                        lines = len(tap.stop())
                finally:
                    if redirect and _mkltimer is not None:
                        _mkltimer.remove()
    base = statistics.median(times["plain"])
    print(f"{args.model}: {lines / args.iters:.0f} verbose lines an inference, load {os.getloadavg()[0]:.2f}")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"  {name:70s} {1e3 * med:8.2f} ms  {med / base:.3f}x")
    split_cost()
    return 0


def paired(fn: Any, rounds: int, iters: int, batch_s: float) -> None:
    """Verbose output off / into one tap's pipe / to /dev/null, in alternating blocks (``--paired``)."""
    verbose = torch._C._verbose
    redirected = _mkltimer is not None and _mkltimer.install() > 0
    kinds = ("off", "tap", "/dev/null")
    medians: dict[str, list[float]] = {k: [] for k in kinds}
    os.environ[FDTAP_READER.name] = "c"
    tap = FdTap(batch_s=batch_s).start()
    pipe = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for _ in range(3):
            fn()
        for r in range(rounds):
            for kind in rotation(kinds, r, mirror=True):
                os.dup2(null if kind == "/dev/null" else pipe, 1)
                verbose.mkldnn_set_verbose(0 if kind == "off" else 1)
                verbose.mkl_set_verbose(0 if kind == "off" else 1)
                try:
                    medians[kind].append(statistics.median(time_calls(fn, iters, warm=1)))
                finally:
                    verbose.mkldnn_set_verbose(0)
                    verbose.mkl_set_verbose(0)
                    os.dup2(pipe, 1)
            if (r + 1) % 10 == 0:
                print(f"round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    finally:
        os.dup2(pipe, 1)
        os.close(pipe)
        os.close(null)
        lines = len(tap.stop())
        if redirected and _mkltimer is not None:
            _mkltimer.remove()
    print(f"one tap reading in {1e3 * batch_s:g} ms batches, {rounds} rounds of 3 blocks of {iters}; {lines} lines captured")
    print(f"plain: median {statistics.median(medians['off']) / 1e6:.2f} ms, load {os.getloadavg()[0]:.2f}")
    for kind, base in (("tap", "off"), ("/dev/null", "off"), ("tap", "/dev/null")):
        pct = [100 * (a / b - 1) for a, b in zip(medians[kind], medians[base])]
        lo, hi = bootstrap_median(pct)
        against = "verbose off" if base == "off" else "to /dev/null"
        print(f"  verbose to {kind:9} / {against:12} {statistics.median(pct):+6.2f} %  95% CI [{lo:+.2f}, {hi:+.2f}]")


def split_cost(repeats: int = 2000) -> None:
    """The reader's work on one read: ``FdTap._split`` of a chunk of real verbose lines (the
    oneDNN and MKL logs in tests/data), nothing forwarded."""
    data = harness.ROOT / "tests" / "data"
    lines = [
        line
        for log in sorted([*data.glob("onednn/*.log"), *data.glob("mkl/*.log")])
        for line in log.read_bytes().split(b"\n")
        if line.startswith((b"onednn_verbose,", b"MKL_VERBOSE "))
    ]
    chunk = b"\n".join(lines) + b"\n"
    tap = FdTap()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(repeats):
            tap._split(chunk, 0)
        best = min(best, (time.perf_counter_ns() - t0) / repeats)
        tap._raw.clear()
    print(f"reader split of a {len(lines)}-line chunk ({len(chunk)} bytes): {best / 1e3:.1f} µs, {best / len(lines):.0f} ns a line")


if __name__ == "__main__":
    sys.exit(main())
