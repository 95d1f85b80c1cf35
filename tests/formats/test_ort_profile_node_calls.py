"""Which model call an ONNX Runtime node event belongs to when several threads run one session.

Records as ONNX Runtime 1.31 writes them (``tests/formats/test_ort_profile_steps.py``), times in
µs after the profiler's start. Thread 1's call ends the op level: its ``model_run`` is written.
Thread 2's call is in flight when profiling ends, so its node events are written and its
``model_run`` is not; one of them lies within thread 1's run, one after it.
"""

from __future__ import annotations

import itertools
from typing import Any

from mltrace.formats.ort_profile import LiveRun, OrtEvents, ort_profile_to_events
from mltrace.run.levels import Level
from mltrace.tracer.tracks import TrackRegistry


def event(cat: str, name: str, ts: int, dur: int, tid: int) -> dict[str, Any]:
    args = {"op_name": "Conv"} if cat == "Node" else {}
    return {"cat": cat, "pid": 3533, "tid": tid, "dur": dur, "ts": ts, "ph": "X", "name": name, "args": args}


PROFILE = [
    event("Node", "conv_a1_kernel_time", 110, 40, tid=1),
    event("Node", "conv_b1_kernel_time", 130, 40, tid=2),  # within thread 1's run
    event("Node", "conv_pool_kernel_time", 160, 20, tid=9),  # a pool thread of the parallel executor
    event("Node", "conv_a2_kernel_time", 150, 40, tid=1),
    event("Session", "model_run", 100, 100, tid=1),
    event("Node", "conv_b2_kernel_time", 205, 10, tid=2),  # after it: in no run written
]
LIVE = [LiveRun(1, 90_000, 210_000, tid=1), LiveRun(2, 120_000, 400_000, tid=2)]


def convert(ops_end_ns: int | None = None) -> OrtEvents:
    ids = itertools.count(1_000)
    return ort_profile_to_events(
        PROFILE,
        start_ns=0,
        to_session_ns=lambda ns: ns,
        tracks=TrackRegistry(pid=4242),
        new_id=lambda: next(ids),
        levels=frozenset({Level.MODEL, Level.LAYER, Level.OP}),
        live_runs=LIVE,
        ops_end_ns=ops_end_ns,
    )


def layer_parents(out: OrtEvents) -> dict[str, int | None]:
    return {s.name: s.parent_id for s in out.spans if s.level == Level.LAYER}


def test_a_node_goes_under_the_call_of_its_own_thread() -> None:
    """Thread 2's nodes go under its own live call, whether or not thread 1's run holds them in
    time; a pool thread's node (no call of its own) under the run that holds it."""
    out = convert()
    assert layer_parents(out) == {"conv_a1": 1, "conv_b1": 2, "conv_pool": 1, "conv_a2": 1, "conv_b2": 2}
    assert all(s.level != Level.MODEL for s in out.spans)  # both calls have their live span


def test_nodes_of_a_call_that_ended_after_the_op_level_are_left_out() -> None:
    """With the op level's end between the two calls' ends, the analysis counts thread 1's call
    alone as a call with ops: thread 2's nodes (part of its call) are left out, and counted."""
    out = convert(ops_end_ns=250_000)
    assert layer_parents(out) == {"conv_a1": 1, "conv_pool": 1, "conv_a2": 1}
    assert [s.name for s in out.spans if s.level == Level.OP] == ["Conv", "Conv", "Conv"]
    assert out.stats.skipped["node of a call that ended after the op level's end"] == 2
    assert (out.stats.node_spans, out.stats.op_spans) == (3, 3)


def test_a_call_that_ended_before_the_op_level_keeps_its_nodes() -> None:
    out = convert(ops_end_ns=400_000)
    assert layer_parents(out) == {"conv_a1": 1, "conv_b1": 2, "conv_pool": 1, "conv_a2": 1, "conv_b2": 2}
