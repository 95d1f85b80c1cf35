"""Generation loops: time to first token, time per output token, tokens per second.

A Hugging Face ``generate()`` call is a ``generate`` span whose model calls are
its children, tagged ``ml.generate.step`` (``tracer/sources/hf_generate.py``).
For each: the time to first token is from the span's start to the end of its
prefill model call (the generating model's first; an encoder-decoder's encoder
call, phase ``encode``, comes before it); the time per output token is the time
between the ends of consecutive model calls after it (each decode step: the model
call and the sampling around it); tokens per second is new tokens per sequence
over the whole call. mltrace's own pauses inside a call (``analysis/pauses.py``) are
left out of each of these times. The cold model calls inside a call
(``analysis/coldstart.py``: compile, recompiles for a new shape, warm-up) stay in these
times, and are counted beside them (``cold_calls``, ``cold_ns``) so that a compile is not
read as slow decoding. Each call names the user's line that called ``generate()`` (the
span's ``code.*``: the innermost frame outside the frameworks and transformers).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from mltrace.analysis.codepaths import location, source_line
from mltrace.analysis.coldstart import percentile_ns
from mltrace.analysis.pauses import PausesByTrack
from mltrace.analysis.units import fmt_ns
from mltrace.run.levels import Level
from mltrace.run.store import Run


@dataclass(frozen=True)
class GenerateCall:
    """One ``generate()`` call.

    Attributes:
        model: the model's class.
        start_ns, total_ns: when it began, and how long it took.
        model_calls: its model calls (prefill and decode steps).
        new_tokens: tokens generated per sequence, or None where not recorded.
        ttft_ns: time to first token (None without model calls).
        token_ns: the time of each decode step, in order.
        file, line: the user's line that called it (``code.*``), or None where not recorded.
        paused_ns: mltrace's own pauses inside it, left out of ``total_ns``, ``ttft_ns`` and
            ``token_ns``.
        cold_calls, cold_ns: its cold model calls (``analysis.coldstart``) and their time,
            which ``total_ns``, ``ttft_ns`` and ``token_ns`` include.
    """

    model: str
    start_ns: int
    total_ns: int
    model_calls: int
    new_tokens: int | None
    ttft_ns: int | None
    token_ns: list[int]
    file: str | None = None
    line: int | None = None
    paused_ns: int = 0
    cold_calls: int = 0
    cold_ns: int = 0

    @property
    def tpot_median_ns(self) -> int | None:
        return int(statistics.median(self.token_ns)) if self.token_ns else None

    @property
    def tpot_p90_ns(self) -> int | None:
        return percentile_ns(self.token_ns, 90) if self.token_ns else None

    @property
    def tokens_per_s(self) -> float | None:
        if not self.new_tokens or self.total_ns <= 0:
            return None
        return self.new_tokens * 1e9 / self.total_ns

    def text(self) -> str:
        """One line for the report's findings."""
        tokens = f"{self.new_tokens} new tokens" if self.new_tokens is not None else f"{self.model_calls} model calls"
        site = location(self.file, self.line)
        parts = [f"generate ({self.model}){f' at {site}' if site else ''}: {tokens} in {fmt_ns(self.total_ns)}"]
        if self.ttft_ns is not None:
            parts.append(f"time to first token {fmt_ns(self.ttft_ns)}")
        if self.token_ns:
            parts.append(f"per output token {fmt_ns(self.tpot_median_ns or 0)} median (p90 {fmt_ns(self.tpot_p90_ns or 0)})")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:.1f} tokens/s")
        if self.cold_calls:
            cold = fmt_ns(self.cold_ns)
            parts.append(f"{self.cold_calls} of its model calls cold ({cold} of these times: warm-up or compile, see Cold start)")
        if self.paused_ns:
            parts.append(f"mltrace's own pauses ({fmt_ns(self.paused_ns)}) left out")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """The report JSON's ``generate[]`` entry."""
        return {
            "model": self.model,
            "start_ns": self.start_ns,
            "total_ns": self.total_ns,
            "model_calls": self.model_calls,
            "new_tokens": self.new_tokens,
            "ttft_ns": self.ttft_ns,
            "tpot_median_ns": self.tpot_median_ns,
            "tpot_p90_ns": self.tpot_p90_ns,
            "tokens_per_s": self.tokens_per_s,
            "paused_ns": self.paused_ns,
            "cold_calls": self.cold_calls,
            "cold_ns": self.cold_ns,
            "source": self.source,
            "source_text": source_line(self.file, self.line) or None,
        }

    @property
    def source(self) -> str | None:
        """``path:line`` of the call as recorded, or None."""
        if not self.file:
            return None
        return f"{self.file}:{self.line}" if self.line is not None else self.file


def generate_calls(run: Run, cold: list[tuple[int, int, str]] | None = None) -> list[GenerateCall]:
    """Every ``generate()`` call of the run, in start order. Read from the span table's columns
    (only the few ``generate`` and model rows are looked at), so a large run's spans are never
    built as objects for it. ``cold``: the run's cold model calls as (start ns, end ns, name)
    (``ColdStart.intervals``), counted per call."""
    import numpy as np

    table = run.table
    if "generate" not in table.names:
        return []
    named = (table.level == int(Level.USER)) & (table.name == table.names.index("generate"))
    calls = [r for r in np.flatnonzero(named).tolist() if "ml.generate.model" in table.attrs(r)]
    if not calls:
        return []
    parent = table.parent_row()
    is_call = np.zeros(len(table) + 1, dtype=bool)  # the extra last entry stands for "no parent" (-1)
    is_call[calls] = True
    under_call = (table.level == int(Level.MODEL)) & is_call[parent]
    children: dict[int, list[int]] = {c: [] for c in calls}
    for r in np.flatnonzero(under_call).tolist():
        if "ml.generate.step" in table.attrs(r):
            children[int(parent[r])].append(r)
    start, end = table.start, table.end
    pauses_of = PausesByTrack(run)
    out = []
    for call in sorted(calls, key=lambda r: int(start[r])):
        steps = sorted(children[call], key=lambda r: int(start[r]))
        ends = [int(end[r]) for r in steps if table.attrs(r).get("ml.generate.phase") != "encode"]
        attrs = table.attrs(call)
        tokens = attrs.get("ml.generate.new_tokens")
        call_start, call_end = int(start[call]), int(end[call])
        pauses = pauses_of.of(int(table.track[call]))
        paused = pauses.within(call_start, call_end)
        inside = [(a, b) for a, b, _ in cold or () if call_start <= a and b <= call_end]
        out.append(
            GenerateCall(
                model=str(attrs["ml.generate.model"]),
                start_ns=call_start,
                total_ns=call_end - call_start - paused,
                model_calls=len(steps),
                new_tokens=int(tokens) if isinstance(tokens, int) else None,
                ttft_ns=ends[0] - call_start - pauses.within(call_start, ends[0]) if ends else None,
                token_ns=[b - a - pauses.within(a, b) for a, b in zip(ends, ends[1:])],
                file=_text(attrs.get("code.file.path")),
                line=_int(attrs.get("code.line.number")),
                paused_ns=paused,
                cold_calls=len(inside),
                cold_ns=sum(b - a - pauses.within(a, b) for a, b in inside),
            )
        )
    return out


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
