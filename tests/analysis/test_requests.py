"""Requests and ranks from runs built by hand, where every number is known: which spans are
requests, where their time went, each rank's collective time and the straggler, and the report
JSON's ``requests``, ``ranks`` and ``run.unfollowed`` against the schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from analysis.schema_check import errors
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.peaks import Peaks, PeakSet
from mltrace.analysis.ranks import is_collective, rank_times
from mltrace.analysis.report_data import build_report
from mltrace.analysis.report_schema import REPORT_SCHEMA
from mltrace.analysis.requests import find_requests, union_ns
from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.viewers.markdown import render_markdown
from mltrace.viewers.services import straggler_line

PEAKS = PeakSet(Peaks("cpu", "test CPU", 100e9, 10e9, "assumed"))
SERVER = {"mltrace.otel.kind": "server"}
LINEAR = {"ml.layer.type": "Linear"}


def _run(spans: list[Span], meta: dict[str, Any] | None = None, tracks: dict[int, Track] | None = None) -> Run:
    tracks = tracks or {1: Track(1, TrackKind.THREAD, "worker", 7, 1), 2: Track(2, TrackKind.THREAD, "worker-2", 7, 2)}
    return Run(Path("hand"), {"name": "hand", "complete": True, **(meta or {})}, tracks, spans)


def _service() -> list[Span]:
    """Two OTel server requests and a user span around a model call that is no request (the run has server spans).

    Request 1 (0..10,000): preprocessing op 500..1,500; model calls 2,000..5,000 and 6,000..8,000
    (layer fc 2,100..4,900 holding op aten::addmm 2,200..4,800; layer fc2 6,100..7,900);
    an inner server span 2,500..3,000 (counted with the outer one). Request 2 (20,000..23,000):
    one model call 20,500..22,000 on another thread.
    """
    return [
        Span(1, None, Level.USER, "POST /predict", 0, 10_000, 1, {**SERVER, "app.request.id": "r1"}),
        Span(2, 1, Level.OP, "aten::randn", 500, 1_500, 1, {}),
        Span(3, 1, Level.MODEL, "Net", 2_000, 5_000, 1, {}),
        Span(4, 3, Level.LAYER, "fc", 2_100, 4_900, 1, LINEAR),
        Span(5, 4, Level.OP, "aten::addmm", 2_200, 4_800, 1, {}),
        Span(6, 3, Level.USER, "POST /inner", 2_500, 3_000, 1, SERVER),
        Span(7, 1, Level.MODEL, "Net", 6_000, 8_000, 1, {}),
        Span(8, 7, Level.LAYER, "fc2", 6_100, 7_900, 1, LINEAR),
        Span(9, None, Level.USER, "POST /predict", 20_000, 23_000, 2, {**SERVER, "app.request.id": "r2"}),
        Span(10, 9, Level.MODEL, "Net", 20_500, 22_000, 2, {}),
        Span(11, None, Level.USER, "warm-up", 30_000, 31_000, 1, {}),
        Span(12, 11, Level.MODEL, "Net", 30_100, 30_900, 1, {}),
    ]


def test_union_counts_overlaps_once() -> None:
    assert union_ns([(0, 10), (5, 20), (30, 40), (35, 36)]) == 30
    assert union_ns([]) == 0


def test_server_spans_are_the_requests_and_their_time_is_split() -> None:
    req = find_requests(run=_run(_service()))
    assert req is not None
    assert (req.source, req.names, req.count) == ("otel-server", ["POST /predict"], 2)  # the inner one counts as the outer
    assert (req.p50_ns, req.total_ns, req.model_ns) == (6_500, 13_000, 5_000 + 1_500)
    slow, fast = req.slowest
    assert (slow.label, slow.pid, slow.total_ns, slow.model_calls, slow.model_ns) == ("r1", 7, 10_000, 2, 5_000)
    assert (slow.before_model_ns, slow.between_models_ns, slow.after_model_ns, slow.outside_ops_ns) == (2_000, 1_000, 2_000, 1_000)
    assert slow.outside_ns == 5_000
    assert [(x.name, x.ns, x.type) for x in slow.layers] == [("fc", 2_800, "Linear"), ("fc2", 1_800, "Linear")]
    assert [(x.name, x.ns) for x in slow.ops] == [("aten::addmm", 2_600), ("aten::randn", 1_000)]
    assert (fast.label, fast.model_ns, fast.before_model_ns, fast.after_model_ns) == ("r2", 1_500, 500, 1_000)


def test_mltrace_pauses_are_left_out_of_a_requests_time() -> None:
    """Pauses after request 1's first model call (5,000..5,600) and after its last
    (8,000..8,300), and one outside every request: request 1 is 900 shorter, its
    between and after parts less by their pause, and the text says what was left out."""
    # The last pause is the first thread's (tid 1), inside request 2 on the second's: not request 2's.
    pauses = {"torch_profiler": {"pauses": [[1, 5_000, 5_600], [1, 8_000, 8_300], [1, 12_000, 13_000], [1, 20_600, 20_700]]}}
    req = find_requests(run=_run(_service(), meta=pauses))
    assert req is not None
    slow = req.slowest[0]
    assert (slow.total_ns, slow.paused_ns, slow.model_ns) == (9_100, 900, 5_000)
    assert (slow.before_model_ns, slow.between_models_ns, slow.after_model_ns) == (2_000, 400, 1_700)
    assert (req.total_ns, req.paused_ns, req.p50_ns) == (12_100, 900, 6_050)
    assert req.slowest[1].paused_ns == 0 and req.slowest[1].total_ns == 3_000
    run = _run(_service(), meta=pauses)
    report = build_report(run, analyze(run, PEAKS))
    assert not errors(report, REPORT_SCHEMA)
    assert report["requests"]["paused_ns"] == 900 and report["requests"]["slowest"][0]["paused_ns"] == 900
    assert "mltrace's own pauses 900 ns left out" in render_markdown(report)


def test_without_server_spans_the_outermost_user_spans_around_models_are() -> None:
    spans = [
        Span(1, None, Level.USER, "request", 0, 1_000, 1, {"request_id": 5}),
        Span(2, 1, Level.USER, "inference", 100, 900, 1, {}),
        Span(3, 2, Level.MODEL, "Net", 200, 800, 1, {}),
        Span(4, None, Level.USER, "load", 2_000, 3_000, 1, {}),  # no model inside: not a request
        Span(5, None, Level.MODEL, "Net", 4_000, 4_500, 1, {}),  # in no request
    ]
    req = find_requests(run=_run(spans))
    assert req is not None and (req.source, req.names, req.count, req.model_ns) == ("user", ["request"], 1, 600)
    (only,) = req.slowest
    assert (only.label, only.before_model_ns, only.after_model_ns) == ("5", 200, 200)


def test_a_span_holding_several_requests_of_one_name_is_a_group_not_a_request() -> None:
    """An asyncio task's ``gather`` of request spans (their model calls on worker threads) and a
    traced ``main`` around them hold two or more ``request`` spans each: the requests are those,
    and a span around model calls outside any group (``inline``) is one too; a request holding
    spans of different names (``encode``, ``decode``) stays one request."""
    spans = [
        Span(1, None, Level.USER, "main", 0, 100_000, 1, {}),
        Span(2, 1, Level.USER, "batch_of", 0, 10_000, 1, {}),
        Span(3, 2, Level.USER, "request", 0, 4_000, 1, {"request_id": 1}),
        Span(4, 3, Level.MODEL, "Net", 1_000, 2_000, 2, {}),
        Span(5, 2, Level.USER, "request", 500, 6_000, 1, {"request_id": 2}),
        Span(6, 5, Level.MODEL, "Net", 2_500, 3_500, 2, {}),
        Span(7, 1, Level.USER, "batch_of", 20_000, 30_000, 1, {}),
        Span(8, 7, Level.USER, "request", 20_000, 25_000, 1, {"request_id": 3}),
        Span(9, 8, Level.USER, "encode", 20_500, 21_500, 1, {}),
        Span(10, 9, Level.MODEL, "Net", 20_600, 21_400, 2, {}),
        Span(11, 8, Level.USER, "decode", 22_000, 24_000, 1, {}),
        Span(12, 11, Level.MODEL, "Net", 22_100, 23_900, 2, {}),
        Span(13, 7, Level.USER, "request", 21_000, 22_000, 1, {"request_id": 4}),
        Span(14, 13, Level.MODEL, "Net", 21_100, 21_900, 2, {}),
        Span(15, 1, Level.USER, "inline", 40_000, 41_000, 1, {}),
        Span(16, 15, Level.MODEL, "Net", 40_100, 40_900, 1, {}),
    ]
    req = find_requests(run=_run(spans), slowest=5)
    assert req is not None and (req.source, req.names, req.count) == ("user", ["request", "inline"], 5)
    assert sorted((r.label, r.model_calls, r.model_ns) for r in req.slowest if r.name == "request") == [
        ("1", 1, 1_000),
        ("2", 1, 1_000),
        ("3", 2, 2_600),
        ("4", 1, 800),
    ]


def test_a_run_without_request_spans_has_no_requests() -> None:
    spans = [Span(1, None, Level.MODEL, "Net", 0, 1_000, 1, {}), Span(2, None, Level.USER, "setup", 2_000, 3_000, 1, {})]
    assert find_requests(run=_run(spans)) is None
    assert find_requests(run=_run([])) is None


def _ranked() -> Run:
    """Rank 0 (pid 10) waits 900 ns in collectives (a c10d op and the gloo work it enqueued,
    overlapping by 100), rank 1 (pid 11) 300: rank 1 is the straggler."""
    tracks = {1: Track(1, TrackKind.THREAD, "MainThread", 10, 10), 2: Track(2, TrackKind.THREAD, "gloo", 10, 12)}
    tracks[3] = Track(3, TrackKind.THREAD, "MainThread", 11, 11)
    spans = [
        Span(1, None, Level.MODEL, "Net", 0, 1_000, 1, {}),
        Span(2, None, Level.OP, "c10d::allreduce_", 1_100, 1_500, 1, {}),
        Span(3, None, Level.USER, "gloo:all_reduce", 1_400, 2_000, 2, {}),
        Span(4, None, Level.MODEL, "Net", 0, 1_600, 3, {}),
        Span(5, None, Level.USER, "gloo:all_reduce", 1_700, 2_000, 3, {}),
        Span(6, None, Level.OP, "aten::add", 2_100, 2_200, 3, {}),
    ]
    dist = {"world_size": 2, "backend": "gloo"}
    processes = [
        {"pid": 9, "role": "main"},
        {"pid": 10, "role": "rank 0", "distributed": {"rank": 0, **dist}},
        {"pid": 11, "role": "rank 1", "distributed": {"rank": 1, **dist}},
    ]
    return _run(spans, {"processes": processes}, tracks)


def test_each_rank_waits_in_collectives_and_the_least_waiting_is_the_straggler() -> None:
    got = rank_times(run=_ranked())
    assert got is not None and (got.world_size, got.backend, got.straggler) == (2, "gloo", 1)
    r0, r1 = got.ranks
    assert (r0.rank, r0.pid, r0.model_calls, r0.model_ns, r0.collective_ns) == (0, 10, 1, 1_000, 900)
    assert r0.collectives == [("gloo:all_reduce", 1, 600), ("c10d::allreduce_", 1, 400)]
    assert (r1.rank, r1.model_ns, r1.collective_ns) == (1, 1_600, 300)


def test_no_straggler_on_a_tie_and_no_ranks_without_torch_distributed() -> None:
    run = _ranked()
    moved = run.replace(spans=[s for s in run.spans if s.id != 2] + [Span(7, None, Level.USER, "gloo:all_reduce", 0, 1, 3, {})])
    got = rank_times(run=moved)
    assert got is not None and [r.collective_ns for r in got.ranks] == [600, 301] and got.straggler == 1
    even = run.replace(spans=[s for s in run.spans if s.id not in (2, 3)] + [Span(7, None, Level.USER, "gloo:barrier", 0, 300, 1, {})])
    got = rank_times(run=even)
    assert got is not None and got.straggler is None  # both ranks waited 300 ns
    assert rank_times(run=_run(_service())) is None


def test_collectives_before_the_first_model_call_are_set_up_not_the_straggler() -> None:
    """Rank 0 started first and waited 5,000 ns in DDP's set-up all_gather for rank 1's start-up;
    from their first model calls on, rank 0 waits 900 and rank 1 300: rank 1 is the straggler,
    and the set-up wait is said apart."""
    run = _ranked()
    shift = 10_000
    spans = [Span(s.id, s.parent_id, s.level, s.name, s.start_ns + shift, s.end_ns + shift, s.track_id, s.attrs) for s in run.spans]
    spans.append(Span(20, None, Level.USER, "gloo:all_gather", 4_000, 9_000, 2, {}))  # rank 0, before its model call
    spans.append(Span(21, None, Level.USER, "gloo:all_gather", 8_900, 9_000, 3, {}))  # rank 1, arriving late
    got = rank_times(run=run.replace(spans=spans))
    assert got is not None and got.straggler == 1
    assert [(r.collective_ns, r.setup_ns) for r in got.ranks] == [(5_900, 5_000), (400, 100)]
    line = straggler_line(got.as_dict())
    assert line is not None
    assert line.startswith("Straggler: rank 1 waits least in collectives from their first model call on (300 ns, against 900 ns on rank 0)")
    assert line.endswith("before it (set-up), rank 0 waited 5.0 µs in collectives for the others' start-up")


def test_collective_names() -> None:
    names = ["c10d::allreduce_", "gloo:all_reduce", "nccl:all_gather", "record_param_comms", "ncclDevKernel_AllReduce_Sum_f32"]
    assert all(is_collective(n) for n in names)
    assert not any(is_collective(n) for n in ["aten::add", "all_reduce_helper", "gloo", "my_nccl:x"])


def test_report_json_has_requests_ranks_and_unfollowed_children() -> None:
    ranked = _ranked()
    shifted = [Span(s.id + 100, None, s.level, s.name, s.start_ns, s.end_ns, s.track_id + 10, s.attrs) for s in ranked.spans]
    tracks = {tid + 10: Track(tid + 10, tr.kind, tr.name, tr.pid, tr.tid) for tid, tr in ranked.tracks.items()}
    run = _run(_service() + shifted, ranked.meta, {**_run([]).tracks, **tracks})
    run.meta["unfollowed"] = [{"pid": 42, "ppid": 9, "argv": ["python", "-c", "import torch\nprint(1)"], "reason": "ImportError: no"}]
    data = build_report(run, analyze(run, PEAKS))
    assert errors(data, REPORT_SCHEMA) == []
    assert data["requests"]["count"] == 2 and data["requests"]["slowest"][0]["outside_ns"] == 5_000
    assert data["ranks"]["straggler"] == 1 and [r["collective_ns"] for r in data["ranks"]["ranks"]] == [900, 300]
    assert data["run"]["unfollowed"] == [{"pid": 42, "argv": ["python", "-c", "import torch\nprint(1)"], "reason": "ImportError: no"}]
    md = render_markdown(data).splitlines()
    line = "Limitation: process 42 (python -c import torch print(1)) was not followed: ImportError: no"
    assert [ln for ln in md if "was not followed" in ln] == [line]
    assert "### Requests" in md and "### Ranks" in md
    assert any(ln.startswith("Straggler: rank 1 waits least") for ln in md)
    empty = build_report(_run([]), analyze(_run([]), PEAKS))
    assert (empty["requests"], empty["ranks"], empty["run"]["unfollowed"]) == (None, None, [])
    assert errors(empty, REPORT_SCHEMA) == []


def test_a_profiler_stop_inside_the_op_levels_early_end_counts_once() -> None:
    """The op level's early end (run.json ``op_window``: 8,000..9,500) holds torch.profiler's last
    stop, which ``torch_profiler.pauses`` keeps too (8,200..8,900): request 1 (0..10,000, last
    model call ending at 8,000) has 1,500 ns left out, not 2,200, and 500 after its last model
    call, not -200."""
    end = {"ended_ns": 8_000, "pause_s": 1_500e-9, "thread": 1}
    meta = {"torch_profiler": {"pauses": [[1, 8_200, 8_900]]}, "op_window": {**end, "frameworks": {"pytorch": dict(end)}}}
    req = find_requests(run=_run(_service(), meta=meta))
    assert req is not None
    slow = req.slowest[0]
    assert (slow.paused_ns, slow.total_ns, slow.after_model_ns) == (1_500, 8_500, 500)


def test_torchs_own_ranges_around_model_calls_are_no_requests() -> None:
    """An LBFGS ``Optimizer.step`` range holds the model calls of its closure; it is torch's range,
    not the program's span (``run/ranges.py``), so it is no request, while a span of the
    program's inside it is."""
    step = {"torch.range": "optimizer"}
    spans = [
        Span(1, None, Level.USER, "Optimizer.step#LBFGS.step", 0, 10_000, 1, step),
        Span(2, 1, Level.MODEL, "Net", 1_000, 2_000, 1, {}),
        Span(3, 1, Level.MODEL, "Net", 3_000, 4_000, 1, {}),
    ]
    assert find_requests(run=_run(spans)) is None
    spans += [Span(4, 1, Level.USER, "closure", 4_500, 6_000, 1, {}), Span(5, 4, Level.MODEL, "Net", 5_000, 5_500, 1, {})]
    req = find_requests(run=_run(spans))
    assert req is not None and (req.names, req.count, req.model_ns) == (["closure"], 1, 500)
