"""Noticing, once, that a traced program's held events are growing too large.

A profiler of the op level that holds every event until it stops (TensorFlow's, ONNX Runtime's,
torch.profiler held whole) grows with the run: about 1.5 MB a CNN inference on the example
model, so a long run at those levels can exhaust the machine. The session's flusher calls
``MemoryWatch.check`` every flush. It fires once, when what stopping the profilers would take,
plus the process's growth since the watch was armed (when torch.profiler started) where a
profiler holds every event until it stops, passes its budget, or, there, when available memory
is low *and* the process has grown by a good amount. torch.profiler in cycles holds only its
running cycle: the growth is then the program's own and does not count. The session then ends
the op level between two inferences where it can (``tracer/windows.py``), and otherwise says
what to do instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

LOW_FRACTION = 0.10  # of MemTotal
GROWTH_BYTES = 1 << 30  # since the session started
#: The default budget's share of the memory available when tracing starts. Converting the
#: op level's events at the session's end needs several times what it held (600 CNN
#: inferences: 350 MB held, a 2.6 GB higher peak at the end; PERFORMANCE.md).
BUDGET_FRACTION = 0.05
_GIB = float(1 << 30)


def process_rss() -> int:
    """This process's resident set size (bytes), or 0 where /proc cannot say."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_free_memory() -> None:
    """Gives memory freed by the C heap back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). torch.profiler's stop frees what it held, but glibc keeps the pages: a process
    that ended its op level after 300 CNN inferences stayed at 1.1 GB instead of 0.44 GB."""
    try:
        import ctypes

        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def read_meminfo(path: Path = Path("/proc/meminfo")) -> tuple[int, int] | None:
    """(MemAvailable, MemTotal) in bytes, or None where the file does not have them."""
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemAvailable", "MemTotal"):
            parts = rest.split()
            if parts and parts[0].isdigit():
                found[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    if "MemAvailable" not in found or not found.get("MemTotal"):
        return None
    return found["MemAvailable"], found["MemTotal"]


#: What the session's end needs a streamed span, at its peak (a 2.4-million-span layer-level
#: run peaked 1.9 GB while it stopped, with torch loaded; PERFORMANCE.md), rounded up.
FINALIZE_BYTES_PER_SPAN = 1000
#: The share of the memory available at the start that the end of a run may take by default.
SPAN_MEMORY_FRACTION = 0.10
#: The default span limit's bounds: the end of a run takes about 11 µs a span here, so 2 million
#: spans stop in about 25 s.
SPAN_LIMIT_MAX = 2_000_000
SPAN_LIMIT_MIN = 100_000


def default_span_limit(available: int | None) -> int:
    """Spans to stream before the layer level ends (``--max-spans``' default): what the end of
    the run can load in 10 % of the memory available now, between 100,000 and 2 million
    (2 million where /proc cannot say)."""
    if not available:
        return SPAN_LIMIT_MAX
    fits = int(SPAN_MEMORY_FRACTION * available) // FINALIZE_BYTES_PER_SPAN
    return max(SPAN_LIMIT_MIN, min(SPAN_LIMIT_MAX, fits))


def default_budget(available: int | None, gib: float | None = None) -> int:
    """The growth (bytes) at which the op level ends: ``gib`` GiB if given, else 5 % of the
    memory available now, at least 1 GiB (1 GiB where /proc cannot say)."""
    if gib is not None:
        return int(gib * (1 << 30))
    return max(GROWTH_BYTES, int(BUDGET_FRACTION * available)) if available else GROWTH_BYTES


class MemoryWatch:
    """Fires once when this process grows past its budget, or grows while memory runs low.

    Args:
        holding: what keeps events in memory, for the message ("the op level (torch.profiler)").
        rss: reads the process's resident size (bytes).
        meminfo: reads (available, total) bytes, or None.
    """

    def __init__(
        self,
        holding: str,
        rss: Callable[[], int] = process_rss,
        meminfo: Callable[[], tuple[int, int] | None] = read_meminfo,
    ) -> None:
        self.holding = holding
        self.budget: int | None = None  # growth (bytes) that fires the watch whatever memory is left (``arm``)
        self._rss = rss
        self._meminfo = meminfo
        self._start_rss = rss()
        self.warned = False

    def arm(self, budget: int) -> None:
        """Counts growth from now on and fires past ``budget`` bytes of it. The op level starts
        after the program's ``import torch``, whose own few hundred MB are not the profiler's."""
        self._start_rss = self._rss()
        self.budget = budget

    def check(self, stop_bytes: int = 0, growth: bool = True) -> str | None:
        """What happened, as a clause for a warning, or None; a watch fires at most once.
        ``stop_bytes``: what stopping the profilers would add still (the events they hold,
        materialised), counted against the budget with the growth so far where ``growth``
        (a profiler holds every event until it stops; one that hands them over in cycles
        holds only its running cycle, and the growth is then the program's own)."""
        if self.warned:
            return None
        grown = self._rss() - self._start_rss
        if self.budget is not None and (grown if growth else 0) + stop_bytes >= self.budget:
            self.warned = True
            return self._past_budget(self.budget, grown, stop_bytes, growth)
        info = self._meminfo() if growth else None  # a cycle's stop frees little of the program's memory
        if info is None:
            return None
        available, total = info
        if available >= LOW_FRACTION * total or grown < GROWTH_BYTES:
            return None
        self.warned = True
        return (
            f"memory is running low ({available / _GIB:.1f} of {total / _GIB:.1f} GiB available; this process grew by "
            f"{grown / _GIB:.1f} GiB while traced): {self.holding} keeps every event in memory until it stops"
        )

    def _past_budget(self, budget: int, grown: int, stop_bytes: int, growth: bool) -> str:
        """The warning's clause for a watch past ``budget``."""
        limit = f"the op level's memory budget of {budget / _GIB:.1f} GiB (MLTRACE_OP_MEMORY_GIB)"
        if not growth:
            return f"stopping torch.profiler's running cycle would take about {stop_bytes / _GIB:.1f} GiB, past {limit}"
        stop = f" (its stop would add about {stop_bytes / _GIB:.1f} GiB more)" if stop_bytes else ""
        return (
            f"this process grew by {grown / _GIB:.1f} GiB while traced{stop}, past {limit}: "
            f"{self.holding} keeps every event in memory until it stops"
        )
