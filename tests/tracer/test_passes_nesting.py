"""nest_by_containment and attach_gpu_to_launch, from small tables of spans."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mltrace.run.events import Flow, Span
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.tracer.passes.nesting import attach_gpu_to_launch, innermost_containers, nest_by_containment

M, LY, OP, LIB, K, U = Level.MODEL, Level.LAYER, Level.OP, Level.LIBRARY, Level.KERNEL, Level.USER

# (id, explicit parent, level, start ns, end ns, track)
Row = tuple[int, int | None, Level, int, int, int]


def make_run(rows: list[Row], flows: list[Flow] | None = None) -> Run:
    spans = [Span(i, p, lv, f"s{i}", a, b, t) for i, p, lv, a, b, t in rows]
    return Run(path=Path("."), meta={}, spans=spans, flows=flows or [])


def parents(run: Run) -> dict[int, int | None]:
    return {s.id: s.parent_id for s in run.spans}


CASES: list[tuple[str, list[Row], dict[int, int | None]]] = [
    (
        "layer > op > op > launch call; a sibling op",
        [(1, None, LY, 0, 100, 1), (2, None, OP, 10, 50, 1), (3, None, OP, 20, 40, 1), (4, None, K, 25, 30, 1), (5, None, OP, 60, 90, 1)],
        {1: None, 2: 1, 3: 2, 4: 3, 5: 1},
    ),
    (
        "input order does not matter",
        [(5, None, OP, 60, 90, 1), (4, None, K, 25, 30, 1), (3, None, OP, 20, 40, 1), (2, None, OP, 10, 50, 1), (1, None, LY, 0, 100, 1)],
        {1: None, 2: 1, 3: 2, 4: 3, 5: 1},
    ),
    (
        "an op never contains a layer, even when its interval does",
        [(1, None, OP, 0, 100, 1), (2, None, LY, 10, 20, 1), (3, None, OP, 12, 18, 1)],
        {1: None, 2: None, 3: 2},
    ),
    (
        "identical intervals nest by level, coarser outside, whatever the ids",
        [(9, None, OP, 0, 10, 1), (8, None, LY, 0, 10, 1), (7, None, U, 0, 10, 1), (6, None, K, 0, 10, 1)],
        {7: None, 8: 7, 9: 8, 6: 9},
    ),
    (
        "identical intervals at one level: the earlier id is the container",
        [(1, None, OP, 0, 10, 1), (2, None, OP, 0, 10, 1)],
        {1: None, 2: 1},
    ),
    (
        "user spans nest anywhere and hold anything",
        [(1, None, OP, 0, 100, 1), (2, None, U, 10, 90, 1), (3, None, OP, 20, 30, 1), (4, None, U, 40, 50, 1), (5, None, M, 41, 49, 1)],
        {1: None, 2: 1, 3: 2, 4: 2, 5: 4},
    ),
    (
        "a library call or a kernel never holds a user span, even when its interval does",
        [(1, None, OP, 0, 100, 1), (2, None, LIB, 10, 60, 1), (3, None, U, 20, 30, 1), (4, None, K, 70, 90, 1), (5, None, U, 75, 80, 1)],
        {1: None, 2: 1, 3: 1, 4: 1, 5: 1},
    ),
    (
        "touching siblings do not nest; a zero-length span at the end does",
        [(1, None, OP, 0, 10, 1), (2, None, OP, 10, 20, 1), (3, None, K, 20, 20, 1), (4, None, K, 0, 0, 1)],
        {1: None, 2: None, 3: 2, 4: 1},
    ),
    (
        "tracks are separate",
        [(1, None, LY, 0, 100, 1), (2, None, OP, 10, 20, 2)],
        {1: None, 2: None},
    ),
    (
        "partial overlap: the latest-started container wins; no container, no parent",
        [(1, None, OP, 0, 10, 1), (2, None, OP, 5, 15, 1), (3, None, K, 6, 9, 1), (4, None, K, 11, 14, 1), (5, None, K, 8, 12, 1)],
        {1: None, 2: None, 3: 2, 4: 2, 5: 2},
    ),
    (
        "an explicit parent on another track is kept (a kernel's launch call)",
        [(1, None, K, 0, 10, 1), (2, 1, K, 20, 30, 2), (3, None, U, 15, 40, 2)],
        {1: None, 2: 1, 3: None},
    ),
    (
        "an explicit parent is refined to a closer container inside it",
        [(1, None, M, 0, 100, 1), (2, 1, LY, 10, 90, 1), (3, 1, OP, 20, 30, 1)],
        {1: None, 2: 1, 3: 2},
    ),
    (
        "an explicit parent is not replaced by a coarser container",
        [(1, None, M, 0, 100, 1), (2, 1, LY, 10, 90, 1), (3, 2, OP, 5, 95, 1)],
        {1: None, 2: 1, 3: 2},
    ),
    (
        "a missing explicit parent is replaced by the container",
        [(1, None, LY, 0, 100, 1), (2, 77, OP, 10, 20, 1)],
        {1: None, 2: 1},
    ),
]


@pytest.mark.parametrize(("rows", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_nest_by_containment(rows: list[Row], expected: dict[int, int | None]) -> None:
    assert parents(nest_by_containment(make_run(rows))) == expected


def _region(i: int, parent: int | None, start: int, end: int, name: str = "request") -> Span:
    """A region of the program's (``mltrace.span``): a user span with its call site."""
    return Span(i, parent, U, name, start, end, 1, {"code.file.path": "/srv/app.py", "code.line.number": 7})


@pytest.mark.parametrize("sweep", ["python", "c"])
def test_asyncio_tasks_keep_their_recorded_parents(sweep: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two asyncio tasks on one thread: request 3 (task B) runs while request 2 (task A) awaits,
    inside its interval. B's request, and the model call it makes, keep the parents the
    recorder gave them (the batch span, B's request); a layer inside a region of its own
    module's forward still nests under that region, and a torch range still refines."""
    if sweep == "c":
        pytest.importorskip("mltrace._sweep", reason="the C sweeps were not built")
    monkeypatch.setenv("MLTRACE_SWEEP", sweep)
    spans = [
        _region(1, None, 0, 1000, "batch"),
        _region(2, 1, 10, 900),  # task A's request
        _region(3, 1, 20, 500),  # task B's request, inside A's interval
        Span(4, 3, M, "model", 30, 400, 1),  # B's model call
        Span(5, 4, LY, "encoder", 40, 390, 1),
        _region(6, 5, 50, 380, "inside forward"),  # opened in encoder's forward
        Span(7, 5, LY, "encoder.0", 60, 370, 1),  # its module stack knows only encoder
        Span(8, 7, U, "range", 70, 360, 1, {}),  # a record_function range (from the profiler)
        _region(9, 7, 80, 350, "step"),  # recorded inside encoder.0, under the range
    ]
    out = nest_by_containment(Run(path=Path("."), meta={}, spans=spans))
    assert parents(out) == {1: None, 2: 1, 3: 1, 4: 3, 5: 4, 6: 5, 7: 6, 8: 7, 9: 8}
    assert out.meta["correlation"]["nest_by_containment"] == {"parents_set": 0, "parents_refined": 2}


def test_nest_is_pure_and_reports() -> None:
    run = make_run([(1, None, LY, 0, 100, 1), (2, None, OP, 10, 50, 1), (3, 1, OP, 20, 40, 1)])
    before = [(s.id, s.parent_id) for s in run.spans]
    originals = list(run.spans)
    out = nest_by_containment(run)
    assert [(s.id, s.parent_id) for s in run.spans] == before
    assert all(a is b for a, b in zip(run.spans, originals))
    assert "correlation" not in run.meta
    assert out.meta["correlation"]["nest_by_containment"] == {"parents_set": 1, "parents_refined": 1}
    assert parents(out) == {1: None, 2: 1, 3: 2}
    assert out.spans[0] is run.spans[0]  # unchanged spans are shared, changed ones copied


def test_nest_deep_random_tree_matches_brute_force() -> None:
    """A random properly nested tree (with ties) on two tracks against an O(n²) oracle."""
    rng = random.Random(7)
    rows: list[Row] = []
    next_id = 1

    def grow(start: int, end: int, depth: int, track: int, limit: int) -> None:
        nonlocal next_id
        t = start
        while t < end and len(rows) < limit:
            a = t + rng.randint(0, 3)
            b = min(end, a + rng.randint(0, (end - start) // 2 + 1))
            if a > b:
                break
            level = [M, LY, LY, OP, OP, K][min(depth, 5)]
            rows.append((next_id, None, level, a, b, track))
            next_id += 1
            if depth < 8 and b - a > 2:
                grow(a, b, depth + 1, track, limit)
            t = b + rng.randint(0, 2)

    grow(0, 100_000, 0, 1, 700)
    grow(0, 100_000, 0, 2, 1400)
    assert len(rows) == 1400
    out = parents(nest_by_containment(make_run(rows)))
    assert sum(p is not None for p in out.values()) > 1000  # mostly nested: the oracle is exercised
    rank = {U: 0, M: 1, LY: 2, OP: 3, K: 5}
    for i, _, lv, a, b, tr in rows:
        best: Row | None = None
        for row in rows:
            j, _, lv2, a2, b2, tr2 = row
            if j == i or tr2 != tr or not (a2 <= a and b <= b2) or lv2 > lv:
                continue
            if (a2, -b2, rank[lv2], j) >= (a, -b, rank[lv], i):
                continue  # sorts after the span: inside it, not around it
            if best is None or (a2, -b2, rank[lv2], j) > (best[3], -best[4], rank[best[2]], best[0]):
                best = row
        assert out[i] == (best[0] if best else None), i


def test_innermost_containers_handles_many_spans() -> None:
    # 50 000 sequential ops inside one layer, each with a launch call: one sweep.
    spans = [Span(1, None, LY, "layer", 0, 10**9, 1)]
    for n in range(50_000):
        start = 10 + n * 100
        spans.append(Span(2 + 2 * n, None, OP, "op", start, start + 50, 1))
        spans.append(Span(3 + 2 * n, None, K, "launch", start + 10, start + 20, 1))
    container, order = innermost_containers(spans)
    assert len(order) == len(spans)
    assert all(container[2 + 2 * n] == 1 and container[3 + 2 * n] == 2 + 2 * n for n in range(50_000))


def test_attach_gpu_to_launch() -> None:
    rows: list[Row] = [
        (1, None, OP, 0, 100, 1),
        (2, None, K, 10, 20, 1),  # cudaGraphLaunch
        (3, None, K, 30, 40, 1),  # cudaLaunchKernel
        (10, None, K, 50, 60, 2),  # three kernels of the graph
        (11, None, K, 60, 70, 2),
        (12, None, K, 70, 80, 2),
        (13, 99, K, 80, 90, 2),  # launched by 3; its old parent is replaced
        (14, None, K, 90, 95, 2),  # no launch flow
    ]
    flows = [
        Flow(100, 2, 10),
        Flow(101, 2, 11),
        Flow(102, 2, 12),
        Flow(103, 3, 13),
        Flow(104, 3, 14, kind="async"),  # not a launch
        Flow(105, 3, 555),  # endpoint missing
    ]
    run = make_run(rows, flows)
    out = attach_gpu_to_launch(nest_by_containment(run))
    assert parents(out) == {1: None, 2: 1, 3: 1, 10: 2, 11: 2, 12: 2, 13: 3, 14: None}
    assert out.meta["correlation"]["attach_gpu_to_launch"] == {"attached": 4, "missing_endpoint": 1}
    assert [s.parent_id for s in run.spans] == [None, None, None, None, None, None, 99, None]
    # The other order gives the same parents: nesting keeps cross-track parents.
    assert parents(nest_by_containment(attach_gpu_to_launch(run))) == parents(out)


def _random_rows(rng: random.Random, n: int) -> list[Row]:
    """Spans on three tracks: nested, partly overlapping, equal, zero-length; parents none,
    right, wrong, missing from the run, or on another track."""
    rows: list[Row] = []
    levels = [M, LY, OP, Level.LIBRARY, K, U]
    for i in range(1, n + 1):
        a = rng.randrange(0, 200)
        b = a + rng.choice([0, 0, 1, 5, 20, 60, 150])
        if rows and rng.random() < 0.2:  # an interval equal to an earlier one
            _, _, _, a, b, _ = rows[rng.randrange(len(rows))]
        parent = rng.choice([None, None, rng.randrange(1, i + 1) if i > 1 else None, 10_000 + i])
        rows.append((i, parent, rng.choice(levels), a, b, rng.choice([1, 1, 2, 3])))
    rng.shuffle(rows)
    return rows


@pytest.mark.parametrize("seed", range(12))
def test_the_c_sweeps_give_what_the_python_ones_give(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """nest_by_containment and separate_overlaps on columns with their sweeps in C
    (``_sweep.c``): the same spans in the same order, the same tracks, the same notes."""
    pytest.importorskip("mltrace._sweep", reason="the C sweeps were not built")
    from mltrace.tracer.passes import default_pipeline
    from mltrace.tracer.passes.checks import separate_overlaps, sort_spans

    rows = _random_rows(random.Random(seed), 60 if seed < 6 else 600)

    def passes(which: str) -> tuple[list[tuple[object, ...]], dict[int, object], dict[str, object]]:
        monkeypatch.setenv("MLTRACE_SWEEP", which)
        run = make_run(rows)
        for p in (sort_spans, nest_by_containment, separate_overlaps):
            run = p(run)
        return [(s.id, s.parent_id, s.track_id) for s in run.spans], dict(run.tracks), run.meta["correlation"]

    python, c = passes("python"), passes("c")
    assert c == python
    assert python[2]["separate_overlaps"]["moved"] > 0 or seed < 6  # the large cases overlap
    assert python[2]["nest_by_containment"]["parents_set"] > 0
    # The sweeps need sorted spans: only the pass that adds spans (layers of exported
    # programs) runs before the sort.
    pipeline = default_pipeline()
    assert pipeline.index(sort_spans) == 1 < pipeline.index(nest_by_containment) and pipeline[0].__name__ == "layers_from_fx"


def test_sort_spans_is_a_stable_sort_by_start_then_outer_first_then_id() -> None:
    from mltrace.tracer.passes.checks import sort_spans

    rows = _random_rows(random.Random(7), 500)
    run = make_run(rows)
    got = [s.id for s in sort_spans(run).spans]
    assert got == [s.id for s in sorted(run.spans, key=lambda s: (s.start_ns, -s.end_ns, s.id))]


def test_the_c_column_reader_reads_what_numpy_fromiter_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """span_columns in C (``_sweep.columns``): the Python columns, None parents as -1; a span
    whose values numpy reads differently (a float time) makes it read them as numpy does."""
    pytest.importorskip("mltrace._sweep", reason="the C sweeps were not built")
    import numpy as np

    from mltrace.tracer.passes.nesting import span_columns

    spans = make_run(_random_rows(random.Random(3), 300)).spans

    def both(spans: list[Span], keys: tuple[str, ...]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        monkeypatch.setenv("MLTRACE_SWEEP", "python")
        python = span_columns(spans, keys)
        monkeypatch.setenv("MLTRACE_SWEEP", "c")
        return python, span_columns(spans, keys)

    for keys in (("id", "parent", "track", "start", "end", "level"), ("id", "start", "end"), ("level", "parent")):
        python, c = both(spans, keys)
        assert list(c) == list(keys) and all(np.array_equal(c[k], python[k]) for k in keys)
    assert (both(spans, ("parent",))[1]["parent"] == -1).any()
    odd = [*spans, Span(999, None, OP, "float", 2.0, 7.9, 1)]  # type: ignore[arg-type]
    python, c = both(odd, ("start", "end"))
    assert all(np.array_equal(c[k], python[k]) for k in ("start", "end"))


def test_the_c_copies_are_what_copy_with_parent_makes() -> None:
    """``_sweep.with_parents``: a new list, the rows replaced by copies with the new parent and
    no live-recording links, the other slots the same objects; the input list and spans untouched."""
    sweep = pytest.importorskip("mltrace._sweep", reason="the C sweeps were not built")
    import numpy as np

    from mltrace.tracer.passes.nesting import _copy_with_parent, _with_parents

    spans = [Span(i, None, OP, f"op{i}", i, i + 10, 1, {"k": [i]}) for i in range(1, 6)]
    spans[2]._up = spans[0]  # a live span's link, which a copy drops
    before = list(spans)
    rows, parents = np.array([0, 2, 4], dtype=np.int64), np.array([7, 8, -1], dtype=np.int64)
    got = _with_parents(sweep, spans, rows, parents)
    want = [_copy_with_parent(s, {0: 7, 2: 8, 4: None}[i]) if i in (0, 2, 4) else s for i, s in enumerate(spans)]
    assert got == want and got is not spans and spans == before and spans[0].parent_id is None
    for i in (0, 2, 4):
        assert type(got[i]) is Span and got[i] is not spans[i] and got[i].attrs is spans[i].attrs
        assert got[i]._up is None and got[i]._fin is None
    assert got[1] is spans[1] and spans[2]._up is spans[0]

    class Marked(Span):
        __slots__ = ("mark",)

    mixed = [*spans, Marked(9, None, OP, "sub", 0, 1, 1)]
    out = _with_parents(sweep, mixed, np.array([5, 1], dtype=np.int64), np.array([3, 4], dtype=np.int64))
    assert type(out[5]) is Span and out[5].parent_id == 3 and out[1].parent_id == 4  # made by the constructor


def test_the_c_kernel_rows_are_the_python_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu_library's kernel spans (a str ``gpu.kernel.name``) found in C (``_sweep.str_rows``)
    and by Python: the same rows; attributes that are no dict are read by Python."""
    pytest.importorskip("mltrace._sweep", reason="the C sweeps were not built")
    from types import MappingProxyType

    from mltrace.tracer.passes.gpu_library import _kernel_rows

    attrs: list[dict[str, object]] = [{}, {"gpu.kernel.name": "sgemm"}, {"gpu.kernel.name": 7}, {"x": "sgemm"}, {"gpu.kernel.name": None}]
    spans = [Span(i, None, K, f"k{i}", i, i + 1, 2, dict(attrs[i % len(attrs)])) for i in range(40)]

    def both(spans: list[Span]) -> tuple[list[int], list[int]]:
        monkeypatch.setenv("MLTRACE_SWEEP", "python")
        python = _kernel_rows(spans)
        monkeypatch.setenv("MLTRACE_SWEEP", "c")
        return python, _kernel_rows(spans)

    python, c = both(spans)
    assert c == python == [i for i in range(40) if i % len(attrs) == 1]
    spans[3].attrs = MappingProxyType({"gpu.kernel.name": "relu"})  # type: ignore[assignment]
    python, c = both(spans)
    assert c == python and 3 in c
