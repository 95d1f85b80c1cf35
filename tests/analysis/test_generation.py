"""generate() calls from a run built by hand: time to first token, per output token and the
whole call, with mltrace's own pauses (run.json ``torch_profiler.pauses``) left out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mltrace.analysis.generation import generate_calls
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run


def _run(meta: dict[str, Any]) -> Run:
    """One generate() call (0..10,000) of four model calls ending at 2,000, 4,000, 7,000 and 9,000."""
    call = {"ml.generate.model": "GPT2LMHeadModel", "ml.generate.new_tokens": 4, "code.file.path": "/app/gen.py", "code.line.number": 7}
    spans = [Span(1, None, Level.USER, "generate", 0, 10_000, 1, call)]
    for step, (begin, end) in enumerate([(500, 2_000), (3_000, 4_000), (5_000, 7_000), (8_000, 9_000)]):
        spans.append(Span(2 + step, 1, Level.MODEL, "GPT2LMHeadModel", begin, end, 1, {"ml.generate.step": step}))
    return Run(Path("hand"), {"name": "hand", "complete": True, **meta}, {1: Track(1, TrackKind.THREAD, "MainThread", 7, 7)}, spans)


def test_times_per_token_without_pauses() -> None:
    (call,) = generate_calls(_run({}))
    assert (call.total_ns, call.ttft_ns, call.token_ns, call.paused_ns) == (10_000, 2_000, [2_000, 3_000, 2_000], 0)
    assert call.tokens_per_s == 4 * 1e9 / 10_000
    assert call.text().startswith("generate (GPT2LMHeadModel) at /app/gen.py:7: 4 new tokens in 10.0 µs")
    assert "pauses" not in call.text()


def test_mltrace_pauses_are_left_out_of_each_time() -> None:
    """A pause after the prefill (2,000..2,800), one after the third call (7,000..7,500) and one
    outside the call: each time loses what it held, tokens/s counts the rest. Another thread's
    pause inside the call is not the call's."""
    pauses = [[7, 2_000, 2_800], [7, 7_000, 7_500], [7, 11_000, 12_000], [8, 4_500, 4_900]]  # the last: another thread's
    (call,) = generate_calls(_run({"torch_profiler": {"pauses": pauses}}))
    assert (call.total_ns, call.ttft_ns, call.token_ns, call.paused_ns) == (8_700, 2_000, [1_200, 3_000, 1_500], 1_300)
    assert call.tokens_per_s == 4 * 1e9 / 8_700
    assert call.text().endswith("mltrace's own pauses (1.3 µs) left out")
    assert call.as_dict()["paused_ns"] == 1_300
