"""What the library level's hand-over costs a verbose line, on a real run's lines.

``CpuLibrarySource.drain_events`` runs on the session's flusher thread every flush while the
program runs, holding the GIL: it takes the lines the fd tap captured since the last drain
(``FdTap.take_lines``, which decodes them) and turns them into spans (``LibrarySpanMaker``).
This starts the source with the parts of a session it uses (no mltrace session, no flusher
of its own), runs a small CNN (oneDNN convolutions and reorders, MKL SGEMM for its two
linear layers) for SECONDS, and calls ``drain_events`` from a second thread every 0.5 s,
timing each call with ``time.thread_time_ns``. Prints the CPU time a line over all drains,
the median of the drains' per-line times, and the longest drain.

    python benchmarks/library_drain.py --seconds 8
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time
from typing import Any

from mltrace.tracer.clock import ClockAnchor
from mltrace.tracer.sources.cpu_library import CpuLibrarySource
from mltrace.tracer.tracks import TrackRegistry


class StandInSession:
    """The parts of mltrace's Session that ``CpuLibrarySource`` uses."""

    def __init__(self) -> None:
        self.anchor = ClockAnchor.take()
        self.tracks = TrackRegistry()
        self.meta: dict[str, Any] = {}
        self.limitations: list[str] = []
        self._ids = itertools.count(1)

    def new_id(self) -> int:
        return next(self._ids)

    def note_limitation(self, text: str) -> None:
        self.limitations.append(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between drains (the default flush interval)")
    args = parser.parse_args()
    session = StandInSession()
    source = CpuLibrarySource()
    source.start(session)  # type: ignore[arg-type]
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, stride=2), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(64 * 16, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10),
    ).eval()  # fmt: skip
    x = torch.randn(4, 3, 64, 64)
    drains: list[tuple[int, int]] = []  # (lines, thread CPU ns)
    stop = threading.Event()

    def flusher() -> None:
        while not stop.wait(args.interval):
            before = source._taken + len(source._held)
            t0 = time.thread_time_ns()
            source.drain_events()
            drains.append((source._taken - before, time.thread_time_ns() - t0))

    thread = threading.Thread(target=flusher)
    thread.start()
    end, calls = time.monotonic() + args.seconds, 0
    with torch.no_grad():
        while time.monotonic() < end:
            model(x)
            calls += 1
    stop.set()
    thread.join()
    at_stop = len(source.stop())
    lines = sum(n for n, _ in drains)
    print(
        json.dumps(
            {
                "calls": calls,
                "drains": len(drains),
                "lines_drained": lines,
                "spans_at_stop": at_stop,
                "ns_per_line": round(sum(ns for _, ns in drains) / max(lines, 1)),
                "ns_per_line_median_drain": round(statistics.median([ns / n for n, ns in drains if n >= 100] or [0])),
                "longest_drain_ms": round(max((ns for _, ns in drains), default=0) / 1e6, 1),
                "sources_info": session.meta["sources_info"]["cpu.library"],
            }
        )  # fmt: skip
    )


if __name__ == "__main__":
    main()
