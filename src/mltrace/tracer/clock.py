"""The session clock: integer nanoseconds on the host's monotonic clock.

Every event in a run is stamped in nanoseconds of ``time.monotonic_ns()``
(CLOCK_MONOTONIC on Linux). A run keeps one anchor pair (monotonic, epoch) taken
back to back, so foreign clocks that count from the Unix epoch (Kineto,
oneDNN's verbose timestamps, ONNX Runtime) convert exactly through it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

now_ns = time.monotonic_ns
"""The session clock (ns). Bound once: calling it costs one C call."""


@dataclass(frozen=True)
class ClockAnchor:
    """A pair of readings of the monotonic and the epoch clock taken together.

    Attributes:
        monotonic_ns: ``time.monotonic_ns()`` at the anchor (ns).
        epoch_ns: ``time.time_ns()`` at the anchor (ns since the Unix epoch).
        uncertainty_ns: half the time the pair of readings took (ns); the
            bound on the error of any conversion through this anchor.
    """

    monotonic_ns: int
    epoch_ns: int
    uncertainty_ns: int

    @classmethod
    def take(cls, samples: int = 16) -> ClockAnchor:
        """Reads both clocks ``samples`` times and keeps the tightest pair."""
        best: tuple[int, int, int] | None = None
        for _ in range(samples):
            m0 = time.monotonic_ns()
            e = time.time_ns()
            m1 = time.monotonic_ns()
            width = m1 - m0
            if best is None or width < best[2]:
                best = ((m0 + m1) // 2, e, width)
        assert best is not None
        return cls(monotonic_ns=best[0], epoch_ns=best[1], uncertainty_ns=(best[2] + 1) // 2)

    def epoch_to_session(self, epoch_ns: int) -> int:
        """Converts a Unix-epoch timestamp (ns) to the session clock (ns)."""
        return epoch_ns - self.epoch_ns + self.monotonic_ns

    def session_to_epoch(self, session_ns: int) -> int:
        """Converts a session timestamp (ns) to Unix-epoch ns."""
        return session_ns - self.monotonic_ns + self.epoch_ns


def boot_id() -> str | None:
    """This boot's id (Linux ``/proc/sys/kernel/random/boot_id``): two runs with the same one read
    the same CLOCK_MONOTONIC, so their session times compare as they are (``run/merge.py``)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None
