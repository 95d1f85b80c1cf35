"""mltrace's own flushes beside the program's model calls.

While the program runs, the session's flusher thread streams what was recorded to the run
directory every ``--flush-interval`` seconds, and turns the library level's verbose lines
into calls there (run.json ``flushes``: each flush's begin, end and the flusher's CPU time,
``tracer/recorder.py``'s ``Flusher``). It holds the GIL while it works, so a model call that
overlaps a flush may wait for it: the call runs longer than the program's own work. The
report keeps every call's time as measured and says how many steady calls overlapped a
flush, and how their median compares with the other steady calls' where both are enough
to compare.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mltrace.analysis.coldstart import ModelCalls
    from mltrace.run.store import Run

#: Steady calls needed on each side (overlapping a flush, and not) to compare their medians.
COMPARED_CALLS = 3


@dataclass(frozen=True)
class FlushOverlap:
    """A model's steady calls against mltrace's flushes.

    Attributes:
        model: the model span's name.
        steady: how many steady calls it made.
        overlapped: how many of them overlapped a flush.
        overlapped_median_ns: the median of those (None: fewer than ``COMPARED_CALLS``
            on either side).
        other_median_ns: the median of the steady calls that overlapped none (as above).
    """

    model: str
    steady: int
    overlapped: int
    overlapped_median_ns: int | None
    other_median_ns: int | None

    def text(self) -> str:
        """``"6 of 443 steady GPT2LMHeadModel calls (median 1.29 ms against 0.71 ms for the rest)"``."""
        from mltrace.analysis.units import fmt_ns

        text = f"{self.overlapped} of {self.steady} steady {self.model} calls"
        if self.overlapped_median_ns is not None and self.other_median_ns is not None:
            text += f" (median {fmt_ns(self.overlapped_median_ns)} against {fmt_ns(self.other_median_ns)} for the rest)"
        return text


@dataclass(frozen=True)
class Flushes:
    """The run's flushes and the model calls they overlapped.

    Attributes:
        count: flushes while the program ran.
        cpu_ns: the flusher thread's CPU time over them (ns).
        models: per model with a steady call that overlapped a flush, in the cold start's order.
    """

    count: int
    cpu_ns: int
    models: list[FlushOverlap]

    def text(self) -> str:
        """The report's finding in words."""
        from mltrace.analysis.units import fmt_ns

        calls = "; ".join(m.text() for m in self.models)
        return (
            f"mltrace's own flushes ({self.count}, {fmt_ns(self.cpu_ns)} of the flusher's CPU time) overlapped {calls}: "
            "the program's thread may have waited for the GIL inside those calls"
        )


def flush_intervals(meta: dict[str, Any]) -> list[tuple[int, int]]:
    """The flushes run.json keeps (``flushes.kept``: [begin ns, end ns, CPU ns] each), as
    sorted (begin, end) session-clock intervals; malformed rows are passed over."""
    kept = (meta.get("flushes") or {}).get("kept") or []
    rows = [r for r in kept if isinstance(r, list) and len(r) == 3 and all(isinstance(x, int) for x in r)]
    return sorted((b, e) for b, e, _ in rows if e > b)


def flushes_of(run: Run, models: list[ModelCalls]) -> Flushes | None:
    """The steady model calls (``models``, the cold start's) that overlapped a flush; None
    where none did or the run kept no flushes."""
    from mltrace.analysis.coldstart import model_call_rows

    intervals = flush_intervals(run.meta)
    if not intervals or not models:
        return None
    t = run.table
    calls_of = model_call_rows(t)
    begins = [b for b, _ in intervals]
    found = []
    for model in models:
        spans = calls_of.get(model.name, [])
        if len(spans) != len(model.durations):
            continue  # not the calls the cold start counted
        apart = {*model.cold, *model.failed}
        steady = [(int(t.start[r]), int(t.end[r])) for i, r in enumerate(spans) if i not in apart]
        hit = [_overlaps(begins, intervals, b, e) for b, e in steady]
        overlap = _overlap_of(model.name, steady, hit)
        if overlap is not None:
            found.append(overlap)
    if not found:
        return None
    summary = run.meta.get("flushes") or {}
    return Flushes(int(summary.get("count", len(intervals))), int(summary.get("cpu_ns", 0)), found)


def _overlap_of(name: str, steady: list[tuple[int, int]], hit: list[bool]) -> FlushOverlap | None:
    """One model's ``FlushOverlap``, None where no steady call overlapped a flush."""
    if not any(hit):
        return None
    with_flush = [e - b for (b, e), h in zip(steady, hit, strict=True) if h]
    without = [e - b for (b, e), h in zip(steady, hit, strict=True) if not h]
    compared = len(with_flush) >= COMPARED_CALLS and len(without) >= COMPARED_CALLS
    return FlushOverlap(
        name,
        len(steady),
        len(with_flush),
        round(statistics.median(with_flush)) if compared else None,
        round(statistics.median(without)) if compared else None,
    )


def _overlaps(begins: list[int], intervals: list[tuple[int, int]], begin: int, end: int) -> bool:
    """Whether ``[begin, end)`` overlaps one of ``intervals`` (sorted by begin; flushes never
    overlap each other, one thread runs them)."""
    i = bisect.bisect_left(begins, end)  # the flushes that began before the call ended
    return i > 0 and intervals[i - 1][1] > begin
