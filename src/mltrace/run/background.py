"""mltrace's helper processes (the op level's converter, the streamed finish) give the traced
program's threads the CPU first.

They work while the program runs, and where the program keeps every core busy (torch's
intra-op thread pool has as many threads as cores) a helper on one of them stalls a whole
parallel region: each of its threads waits at the region's end for the one the helper
displaced, and the stall is recorded as the program's op time. At the lowest priority a helper
runs where a core is free: between the program's model calls, while it waits, and after it ends.
"""

from __future__ import annotations

import os

#: The helpers' nice value (the lowest priority an unprivileged process can take).
HELPER_NICE = 19


def yield_to_program() -> None:
    """Lowers this process's CPU priority to ``HELPER_NICE`` (where the system allows it)."""
    try:
        os.nice(HELPER_NICE - os.nice(0))
    except OSError:
        pass
