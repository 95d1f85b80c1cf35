"""Finished spans and model-call frames leave the cyclic garbage collector's lists (``_untrack.c``).

A span waits for the flusher after it ends; tracked, each of the program's young collections
promoted it, and the oldest generation's growth brought full collections into the program's
thread (docs/PERFORMANCE.md, "The program's garbage collections").
"""

from __future__ import annotations

import gc
from collections import Counter
from pathlib import Path

import pytest

import mltrace
from mltrace.run.events import Span
from mltrace.run.levels import Level

untrack = pytest.importorskip("mltrace._untrack", reason="the C helper was not built")
torch = pytest.importorskip("torch")


def _span(attrs: dict[str, object]) -> Span:
    return Span(1, None, Level.MODEL, "m", 0, 5, 1, attrs)


def test_a_span_of_json_values_and_shapes_is_untracked_whole() -> None:
    size = torch.Size([2, 3])
    shapes = [(size, torch.float32)]
    span = _span({"name": "x", "list": [1, [2, 3]], "_in": shapes, "_cpu0": (5, 6)})
    assert gc.is_tracked(span) and gc.is_tracked(span.attrs) and gc.is_tracked(size)
    assert untrack.untrack_span(span) is True
    assert not gc.is_tracked(span)
    for value in (span.attrs, span.attrs["list"], span.attrs["list"][1], shapes, shapes[0], size):
        assert not gc.is_tracked(value)


def test_what_could_hold_a_cycle_stays_tracked() -> None:
    class Anything:
        pass

    held = [Anything()]
    looped: list[object] = [1]
    looped.append(looped)
    deep: list[object] = [[[[[1]]]]]
    span = _span({"safe": [1, 2], "held": held, "looped": looped, "deep": deep})
    assert untrack.untrack_span(span) is False
    assert not gc.is_tracked(span) and not gc.is_tracked(span.attrs["safe"])
    assert gc.is_tracked(span.attrs), "the dict holds containers that stay tracked"
    assert gc.is_tracked(held) and gc.is_tracked(looped) and gc.is_tracked(deep)
    span.attrs.clear()
    del held, looped, deep
    assert gc.collect() >= 2, "the self-referencing list is still the collector's to free"


def test_a_record_is_untracked_with_its_tuples() -> None:
    module = torch.nn.Identity()
    record = [module, None, 3, ("", module, {}, None, None), [1]]
    untrack.untrack_record(record)
    assert not gc.is_tracked(record) and not gc.is_tracked(record[3])
    assert gc.is_tracked(module) and gc.is_tracked(record[4]), "only the list and its tuples"
    with pytest.raises(TypeError):
        untrack.untrack_record((1, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("level", ["model", "layer"])
def test_model_calls_leave_nothing_tracked_until_the_flush(tmp_path: Path, level: str) -> None:
    """Before: 9 tracked objects a model call at the model level (the span, its dict, a bound
    method, the shapes' lists, tuples and torch.Size objects), 11 at the layer level."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    x = torch.ones(2, 3)
    with torch.no_grad(), mltrace.profile(output=tmp_path / "run", summary=False, level=level, flush_interval_s=60):
        for _ in range(3):
            model(x)
        gc.collect()
        gc.disable()
        try:
            before = {id(o) for o in gc.get_objects()}
            for _ in range(50):
                model(x)
            gc.collect(0)  # young tuples of atoms are untracked at the collector's first look
            left = Counter(type(o).__name__ for o in gc.get_objects() if id(o) not in before)
        finally:
            gc.enable()
    assert sum(left.values()) < 25, f"tracked objects left by 50 model calls: {left}"
    run = mltrace.load_run(tmp_path / "run")
    calls = [s for s in run.spans if s.level is Level.MODEL]
    assert len(calls) == 53 and all(s.attrs["ml.input.shapes"] == [[2, 3]] for s in calls)
