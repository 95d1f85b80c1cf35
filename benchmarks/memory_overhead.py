"""What ``--memory`` costs: mltrace's op level with and without memory, against torch.profiler
alone with and without ``profile_memory=True``, side by side in one process.

mltrace's op level without ``--memory`` profiles every thread (``profile_all_threads``);
with it, only the thread that starts the profiler (torch records no memory events in the
all-threads mode), so torch.profiler is measured in both modes too.

The model is the issue's conv + TransformerEncoder (a 4×4-patch conv stem, two
``TransformerEncoderLayer`` of width 64, a linear head; 64×64 images, 256 tokens). Per
round, in turn: plain calls; torch.profiler (``record_shapes``, the thread that starts
it) without and with ``profile_memory``; an mltrace session at ``--level op`` without
and with ``memory=True``. Each block runs ``--calls`` model calls after one warm-up call
(inside the block, so the profiler sees it as mltrace would) and takes the median call
latency; each condition's figure is the median over rounds. Blocks are interleaved so
that machine noise hits all alike; each block's median is also divided by the plain
block's of the same round, and the overhead printed is the median of those ratios.

    python benchmarks/memory_overhead.py                  # about a minute on 2 cores
    python benchmarks/memory_overhead.py --batch 32       # the larger batch
    python benchmarks/memory_overhead.py --quick          # smoke run

Prints a table (median ms a call, overhead against plain, the stop: torch's export or
mltrace's whole stop, and the memory events recorded); ``--json FILE`` writes the figures.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import torch
from torch import nn

from mltrace.config import ProfileOptions
from mltrace.run.levels import Level
from mltrace.run.store import read_meta
from mltrace.tracer.session import Session

CONDITIONS = ("plain", "torch.profiler", "torch.profiler all threads", "torch.profiler memory", "mltrace op", "mltrace op --memory")


class ConvEncoder(nn.Module):
    """The issue's small conv + TransformerEncoder model."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 64, 4, stride=4)
        layer = nn.TransformerEncoderLayer(64, 4, 256, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x).flatten(2).transpose(1, 2)
        return self.head(self.encoder(f).mean(1))


#: What a call is timed with: the calling thread's CPU time (``--clock cpu``, the default:
#: on a shared machine it leaves out the time other processes hold the cores, and with one
#: intra-op thread every op runs on that thread) or wall time (``--clock wall``).
CLOCKS = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}
_clock = CLOCKS["cpu"]


def _calls(model: nn.Module, x: torch.Tensor, n: int) -> list[int]:
    """Time (ns, ``_clock``) of ``n`` calls after one warm-up call."""
    with torch.no_grad():
        return harness.time_calls(lambda: model(x), n, warm=1, clock=_clock)


def _torch_block(
    model: nn.Module, x: torch.Tensor, n: int, memory: bool, tmp: Path, all_threads: bool = False
) -> tuple[list[int], int, int]:
    """torch.profiler alone: (latencies, export ns, memory events)."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    kwargs: dict[str, Any] = {"experimental_config": _ExperimentalConfig(profile_all_threads=True)} if all_threads else {}
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=memory, **kwargs)
    prof.start()
    try:
        lat = _calls(model, x, n)
    finally:
        prof.stop()
    t0 = time.perf_counter_ns()
    path = tmp / "torch.json"
    prof.export_chrome_trace(str(path))
    stop_ns = time.perf_counter_ns() - t0
    events = json.loads(path.read_text())["traceEvents"]
    path.unlink()
    return lat, stop_ns, sum(1 for e in events if e.get("name") == "[memory]")


def _mltrace_block(model: nn.Module, x: torch.Tensor, n: int, memory: bool, out: Path) -> tuple[list[int], int, int]:
    """An mltrace session at the op level: (latencies, stop ns, memory events)."""
    session = Session(ProfileOptions(output=out, summary=False, level=Level.OP, memory=memory)).start()
    try:
        lat = _calls(model, x, n)
    finally:
        t0 = time.perf_counter_ns()
        session.stop()
        stop_ns = time.perf_counter_ns() - t0
    meta = read_meta(out)
    events = int(meta.get("correlation", {}).get("attribute_memory", {}).get("memory_events", 0))
    return lat, stop_ns, events


def _alloc_loop(n: int) -> int:
    """Time (ns, ``_clock``) of ``n`` allocations and frees of a 1 KiB tensor."""
    t0 = _clock()
    for _ in range(n):
        torch.empty(256)
    return _clock() - t0


def per_event_cost(n: int, rounds: int) -> dict[str, float]:
    """What one memory event costs torch.profiler (ns): ``n`` allocate-and-free pairs (two
    events each) under the one-thread profiler with and without ``profile_memory``, in
    interleaved rounds; the median difference per event."""
    from torch.profiler import ProfilerActivity, profile

    times: dict[bool, list[int]] = {False: [], True: []}
    for r in range(rounds):
        for memory in (False, True) if r % 2 == 0 else (True, False):
            prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=memory)
            prof.start()
            try:
                _alloc_loop(100)  # warm-up
                times[memory].append(_alloc_loop(n))
            finally:
                prof.stop()
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return {"pairs": n, "ns_per_pair_off": off / n, "ns_per_pair_on": on / n, "ns_per_event": (on - off) / (2 * n)}


def run(batch: int, calls: int, rounds: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = ConvEncoder().eval()
    x = torch.randn(batch, 3, 64, 64)
    keys = ("median_ms", "vs_plain", "stop_ms", "memory_events")
    figures: dict[str, dict[str, list[float]]] = {c: {k: [] for k in keys} for c in CONDITIONS}
    blocks: dict[str, Callable[[Path], tuple[list[int], int, int]]] = {
        "plain": lambda tmp: (_calls(model, x, calls), 0, 0),
        "torch.profiler": lambda tmp: _torch_block(model, x, calls, False, tmp),
        "torch.profiler all threads": lambda tmp: _torch_block(model, x, calls, False, tmp, all_threads=True),
        "torch.profiler memory": lambda tmp: _torch_block(model, x, calls, True, tmp),
        "mltrace op": lambda tmp: _mltrace_block(model, x, calls, False, tmp / "run"),
        "mltrace op --memory": lambda tmp: _mltrace_block(model, x, calls, True, tmp / "run"),
    }
    for r in range(rounds):
        order = CONDITIONS if r % 2 == 0 else tuple(reversed(CONDITIONS))
        for cond in order:
            with tempfile.TemporaryDirectory(prefix="mltrace-membench-") as tmp:
                lat, stop_ns, events = blocks[cond](Path(tmp))
            figures[cond]["median_ms"].append(statistics.median(lat) / 1e6)
            figures[cond]["stop_ms"].append(stop_ns / 1e6)
            figures[cond]["memory_events"].append(events)
        plain = figures["plain"]["median_ms"][-1]
        for cond in CONDITIONS:
            figures[cond]["vs_plain"].append(figures[cond]["median_ms"][-1] / plain)
    summary = {c: {k: statistics.median(v) for k, v in f.items()} for c, f in figures.items()}
    return {"batch": batch, "calls": calls, "rounds": rounds, "torch": torch.__version__, "summary": summary, "rounds_raw": figures}


def _print(result: dict[str, Any]) -> None:
    s, raw = result["summary"], result["rounds_raw"]
    head = f"batch {result['batch']}, {result['calls']} calls a block, {result['rounds']} rounds"
    print(f"{head}, torch {result['torch']}, {torch.get_num_threads()} intra-op threads, {result['clock']} time")
    print(f"{'condition':<28} {'ms/call':>9} {'vs plain':>9} {'stop ms':>9} {'mem events':>11}")
    for c in CONDITIONS:
        f = s[c]
        print(f"{c:<28} {f['median_ms']:9.2f} {100 * (f['vs_plain'] - 1):+8.1f}% {f['stop_ms']:9.0f} {f['memory_events']:11.0f}")
    ev = result.get("per_event")
    if ev:
        events_per_call = s["mltrace op --memory"]["memory_events"] / (result["calls"] + 1)
        share = events_per_call * ev["ns_per_event"] / (s["plain"]["median_ms"] * 1e6)
        print(
            f"one memory event: {ev['ns_per_event']:.0f} ns ({ev['pairs']} allocate-and-free pairs: {ev['ns_per_pair_off']:.0f} ns a pair "
            f"without, {ev['ns_per_pair_on']:.0f} ns with); {events_per_call:.0f} events a call → {100 * share:.2f}% of a plain call"
        )
    for base, mem in (("torch.profiler", "torch.profiler memory"), ("mltrace op", "mltrace op --memory")):
        per_round = [m / b for m, b in zip(raw[mem]["median_ms"], raw[base]["median_ms"])]
        print(f"memory's own cost in {base}: {100 * (statistics.median(per_round) - 1):+.1f}% a call (median of rounds)")


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch's intra-op threads (default 1, so CPU time sees every op; 0: torch's own)"
    )
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="time calls by thread CPU time or wall time")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 5 calls")
    harness.add_json(parser)
    args = parser.parse_args()
    if args.quick:
        args.calls, args.rounds = 5, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    global _clock
    _clock = CLOCKS[args.clock]
    result = run(args.batch, args.calls, args.rounds)
    result["per_event"] = per_event_cost(5_000 if args.quick else 50_000, 2 if args.quick else 7)
    result["clock"] = args.clock
    result["threads"] = torch.get_num_threads()
    _print(result)
    harness.write_json(args.json, result)


if __name__ == "__main__":
    main()
