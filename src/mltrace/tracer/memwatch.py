"""One warning when a traced program grows while the machine runs out of memory.

torch.profiler (the op level, and the library level placed under it) keeps every event
in memory until the session stops: about 1.5 MB a CNN inference on the example model, so a
long run at those levels can exhaust the machine. The session's flusher calls
``MemoryWatch.check`` every flush; once available memory is low *and* the process has
grown by a good amount since tracing started, it says so, once, with what to do instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

LOW_FRACTION = 0.10  # of MemTotal
GROWTH_BYTES = 1 << 30  # since the session started
_GIB = float(1 << 30)


def process_rss() -> int:
    """This process's resident set size (bytes), or 0 where /proc cannot say."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


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


class MemoryWatch:
    """Says once when memory runs low while this process grows.

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
        self._rss = rss
        self._meminfo = meminfo
        self._start_rss = rss()
        self.warned = False

    def check(self) -> str | None:
        """The warning to give now, or None; a watch warns at most once."""
        if self.warned:
            return None
        info = self._meminfo()
        if info is None:
            return None
        available, total = info
        grown = self._rss() - self._start_rss
        if available >= LOW_FRACTION * total or grown < GROWTH_BYTES:
            return None
        self.warned = True
        return (
            f"memory is running low ({available / _GIB:.1f} of {total / _GIB:.1f} GiB available; this process grew by "
            f"{grown / _GIB:.1f} GiB while traced): {self.holding} keeps every event in memory until the run ends — "
            "for a long run use --level layer, or trace a window with mltrace.profile()"
        )
