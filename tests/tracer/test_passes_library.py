"""attach_library_calls, from small tables of spans."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from mltrace.run.events import Span, Track, TrackKind
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.tracer.passes.library import _Containing, _with_nested, attach_library_calls

OP, LIB, LY = Level.OP, Level.LIBRARY, Level.LAYER


@pytest.fixture(params=["c", "python"], autouse=True)
def sweep(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test twice: spans picked and sorted on columns read in C, and by Python loops."""
    monkeypatch.setenv("MLTRACE_SWEEP", request.param)
    return str(request.param)


MAIN, WORKER, SOURCE, GPU = 1, 2, 3, 9  # tracks; SOURCE: where the source put every call

TRACKS = {
    MAIN: Track(MAIN, TrackKind.THREAD, "MainThread", 100, 100),
    WORKER: Track(WORKER, TrackKind.THREAD, "worker", 100, 101),
    SOURCE: Track(SOURCE, TrackKind.THREAD, "starter", 100, 102),
    GPU: Track(GPU, TrackKind.GPU_STREAM, "GPU 0 stream 7", 100, device=0, stream=7),
}


def op(i: int, name: str, start: int, end: int, track: int = MAIN, level: Level = OP) -> Span:
    return Span(i, None, level, name, start, end, track, {})


def onednn(i: int, start: int, end: int) -> Span:
    attrs = {"ml.library.name": "oneDNN", "ml.library.exec_ns": end - start, "ml.library.seq": i}
    return Span(i, None, LIB, "oneDNN convolution jit:avx2", start, end, SOURCE, attrs)


def mkl(i: int, seq: int, receive: int, exec_ns: int, name: str = "MKL", desc: str = "") -> Span:
    attrs: dict[str, Any] = {
        "ml.library.name": name,
        "ml.library.kind": "SGEMM",
        "ml.library.desc": desc,
        "ml.library.exec_ns": exec_ns,
        "ml.library.seq": seq,
        "ml.library.untimed": True,
        "ml.library.receive_ns": receive,
    }
    return Span(i, None, LIB, f"{name} SGEMM", receive - exec_ns, receive, SOURCE, attrs)


def run_of(spans: list[Span]) -> Run:
    return Run(path=Path("."), meta={}, tracks=dict(TRACKS), spans=spans)


def placed(run: Run) -> dict[int, tuple[int | None, int, int, int]]:
    """id -> (parent, start, end, track) of every library span."""
    return {s.id: (s.parent_id, s.start_ns, s.end_ns, s.track_id) for s in run.spans if s.level == LIB}


def test_timed_calls_go_to_the_innermost_containing_op_on_its_thread() -> None:
    spans = [
        op(1, "model", 0, 100_000, level=Level.MODEL),
        op(2, "aten::conv2d", 10_000, 50_000),
        op(3, "aten::mkldnn_convolution", 12_000, 48_000),
        op(4, "aten::conv2d", 20_000, 40_000, track=WORKER),  # another thread, wider
        op(5, "aten::relu", 60_000, 70_000),
        onednn(10, 13_000, 30_000),  # inside 3 (and 2, and 4)
        onednn(11, 11_000, 12_500),  # starts 1 µs before 3: within the slack of µs stamps
        onednn(14, 21_000, 39_000),  # innermost container is on the worker thread
        onednn(12, 80_000, 90_000),  # in no op: the model span
        onednn(13, 200_000, 210_000),  # in nothing
    ]
    out = attach_library_calls(run_of(spans))
    got = placed(out)
    assert got[10] == (3, 13_000, 30_000, MAIN)
    assert got[11] == (3, 12_000, 12_500, MAIN)  # clipped to its op: nests in it
    assert got[14] == (4, 21_000, 39_000, WORKER)
    assert got[12] == (1, 80_000, 90_000, MAIN)
    # in nothing: set apart, a root on a lane of its own beside the track it was read on
    lane = got[13][3]
    assert got[13] == (None, 200_000, 210_000, lane) and lane not in (MAIN, WORKER, SOURCE)
    assert out.tracks[lane].kind == TrackKind.ASYNC and out.tracks[lane].parent_track == SOURCE
    assert next(s for s in out.spans if s.id == 13).attrs["ml.library.placement"] == "unplaced"
    assert out.meta["correlation"]["attach_library_calls"] == {"timed": 4, "untimed": 0, "unattached": 1}


def _nested_ops(rng: random.Random, track: int, first_id: int, t0: int, t1: int, depth: int) -> list[Span]:
    """Properly nested random ops in [t0, t1) on one track, some with equal intervals."""
    out: list[Span] = []
    t = t0
    while depth and t < t1 - 10:
        start = rng.randrange(t, t1 - 5)
        end = rng.randrange(start + 1, min(t1, start + (t1 - t0) // 2 + 2))
        i = first_id + len(out)
        out.append(op(i, "aten::op", start, end, track=track))
        if rng.random() < 0.1:  # an op and its only child, the same interval (aten::conv2d → aten::convolution)
            out.append(op(i + 1, "aten::op", start, end, track=track))
        out += _nested_ops(rng, track, first_id + len(out), start, end, depth - 1)
        t = end
    return out


def test_the_containment_index_finds_what_a_scan_of_every_op_finds() -> None:
    """``_Containing`` (sorted, blocks skipped) against the rule written as a scan of every op."""

    def scan(ops: list[Span], start: int, end: int, slack: int, prefer: int) -> Span | None:
        inside = [c for c in ops if c.start_ns - slack <= start and end <= c.end_ns + slack]
        return max(inside, key=lambda c: (c.start_ns, -c.end_ns, c.track_id == prefer, -c.id), default=None)

    rng = random.Random(7)
    for trial in range(30):
        ops: list[Span] = []
        for track in (MAIN, WORKER):
            ops += _nested_ops(rng, track, 1 + len(ops), 0, 100_000, depth=rng.randrange(1, 5))
        if trial % 3 == 0:  # a long op across everything (a user's record_function region)
            ops.append(op(len(ops) + 1, "region", 0, 100_000))
        index = _Containing(ops, block=rng.choice((1, 4, 64)))
        for _ in range(200):
            if rng.random() < 0.3:  # an op's own interval, or its ends' neighbours
                some = rng.choice(ops)
                start, end = some.start_ns + rng.choice((-1, 0, 1)), some.end_ns + rng.choice((-1, 0, 1))
            else:
                start = rng.randrange(-1_000, 101_000)
                end = start + rng.choice((0, 1, 50, 2_000, 30_000))
            slack = rng.choice((0, 2_000))
            prefer = rng.choice((MAIN, WORKER, SOURCE))
            want = scan(ops, start, end, slack, prefer)
            got = index.innermost(start, end, slack, prefer)
            assert (got.id if got else None) == (want.id if want else None), (trial, start, end, slack, prefer)


def test_slack_absorbs_microsecond_stamps() -> None:
    spans = [op(1, "aten::mkldnn_convolution", 10_000, 20_000, track=WORKER), onednn(2, 9_500, 20_800)]
    assert placed(attach_library_calls(run_of(spans)))[2] == (1, 10_000, 20_000, WORKER)  # clipped to its op
    assert placed(attach_library_calls(run_of(spans), slack_ns=100))[2][0] is None


def test_untimed_mkl_calls_follow_issue_order_into_leaf_caller_ops() -> None:
    spans = [
        op(1, "aten::linear", 100_000, 200_000),
        op(2, "aten::t", 101_000, 105_000),
        op(3, "aten::addmm", 110_000, 190_000),  # leaf caller inside aten::linear
        op(4, "aten::relu", 200_000, 250_000),
        op(5, "aten::bmm", 300_000, 400_000),
        op(6, "aten::_scaled_dot_product_flash_attention_for_cpu", 500_000, 530_000),
        mkl(20, 0, receive=185_000, exec_ns=50_000),  # ends inside addmm
        mkl(21, 1, receive=420_000, exec_ns=30_000),  # received after bmm ended (reader delay): bmm's one batched call
        mkl(22, 2, receive=510_000, exec_ns=10_000),  # three calls in one attention op
        mkl(23, 3, receive=515_000, exec_ns=10_000),
        mkl(24, 4, receive=520_000, exec_ns=10_000),
    ]
    spans[7].attrs["ml.library.kind"] = "SGEMM_BATCH"
    out = attach_library_calls(run_of(spans))
    got = placed(out)
    assert got[20] == (3, 135_000, 185_000, MAIN)
    assert got[21] == (5, 370_000, 400_000, MAIN)  # clipped to the op's end
    assert got[22] == (6, 500_000, 510_000, MAIN)
    assert got[23] == (6, 510_000, 515_000, MAIN)  # does not overlap the call before it
    assert got[24] == (6, 515_000, 520_000, MAIN)
    assert all(s.attrs["ml.library.placement"] == "estimated" for s in out.spans if s.level == LIB)
    assert out.meta["correlation"]["attach_library_calls"] == {"timed": 0, "untimed": 5, "unattached": 0}


def test_untimed_calls_never_go_back_in_issue_order_nor_to_long_finished_ops() -> None:
    spans = [
        op(1, "aten::mm", 100_000, 200_000),
        op(2, "aten::mm", 300_000, 400_000),
        mkl(10, 0, receive=250_000, exec_ns=60_000),  # the first mm: the only op started in time
        mkl(11, 1, receive=352_000, exec_ns=40_000),  # the first mm is full: the next one
        mkl(12, 2, receive=500_000_000, exec_ns=10_000),  # 499.6 ms after every op ended (max lag: 250 ms)
        mkl(13, 3, receive=50_000, exec_ns=10_000, name="MKL"),  # before any op
    ]
    out = attach_library_calls(run_of(spans))
    got = placed(out)
    assert got[10] == (1, 140_000, 200_000, MAIN)
    assert got[11] == (2, 312_000, 352_000, MAIN)  # never back to op 1
    lane = got[12][3]  # unplaced: one lane beside the source's track
    assert out.tracks[lane].parent_track == SOURCE
    assert got[12] == (None, 499_990_000, 500_000_000, lane)
    assert got[13] == (None, 40_000, 50_000, lane)


def test_calls_go_to_the_first_op_with_room_so_late_receipts_do_not_matter() -> None:
    # Three projections with the same shapes, one SGEMM each. Read in one batch 5 ms later,
    # every line has the same receipt time: issue order and each op's room place them.
    shapes = [[768], [128, 768], [768, 768], [], []]
    ops = [op(i, "aten::addmm", 100_000 * i, 100_000 * i + 60_000) for i in (1, 2, 3)]
    for o in ops:
        o.attrs["ml.input.shapes"] = shapes
    desc = "T,N,768,128,768,*,*,768,*,768,*,*,768"
    calls = [mkl(10 + i, i, receive=5_000_000, exec_ns=50_000, desc=desc) for i in range(3)]
    got = placed(attach_library_calls(run_of([*ops, *calls])))
    assert [got[10 + i][0] for i in range(3)] == [1, 2, 3]


def test_an_op_that_issued_a_timed_call_issued_no_mkl_call() -> None:
    # bf16 matmuls go through oneDNN (a timed line), so the MKL call belongs to the next op.
    spans = [
        op(1, "aten::addmm", 100_000, 200_000),
        op(2, "aten::addmm", 300_000, 400_000),
        onednn(10, 120_000, 180_000),
        mkl(11, 11, receive=5_000_000, exec_ns=50_000),  # issued after the oneDNN call
    ]
    got = placed(attach_library_calls(run_of(spans)))
    assert got[10][0] == 1 and got[11][0] == 2


def test_input_shapes_keep_a_late_call_out_of_the_next_op() -> None:
    conv = op(1, "aten::_slow_conv2d_forward", 0, 100_000)
    conv.attrs["ml.input.shapes"] = [[1, 2, 8, 8], [4, 2, 3, 3], [], [4], [], []]  # 36 pixels, 4 channels, 2*3*3 taps
    mm = op(2, "aten::mm", 110_000, 200_000)
    mm.attrs["ml.input.shapes"] = [[20, 64], [64, 192]]
    im2col = "N,N,36,4,18,*,*,36,*,18,*,*,36"  # received 36 µs after mm began
    proj = "T,N,192,20,64,*,*,64,*,64,*,*,192"
    spans = [conv, mm, mkl(10, 0, receive=150_000, exec_ns=14_000, desc=im2col), mkl(11, 1, receive=190_000, exec_ns=60_000, desc=proj)]
    got = placed(attach_library_calls(run_of(spans)))
    assert got[10][0] == 1 and got[11][0] == 2
    # a linear layer's GEMM received late, while the convolution ran: the weight shape says no
    linear = op(3, "aten::addmm", 90_000, 95_000)
    linear.attrs["ml.input.shapes"] = [[10], [2, 32], [32, 10], [], []]
    late = mkl(12, 0, receive=97_000, exec_ns=2_000, desc="T,N,10,2,32,*,*,32,*,32,*,*,10")
    conv2 = op(4, "aten::_slow_conv2d_forward", 96_000, 120_000)
    conv2.attrs["ml.input.shapes"] = conv.attrs["ml.input.shapes"]
    assert placed(attach_library_calls(run_of([linear, conv2, late])))[12][0] == 3
    # without recorded shapes, issue order and room still give the first call to the convolution
    del mm.attrs["ml.input.shapes"]
    got = placed(attach_library_calls(run_of(spans)))
    assert got[10][0] == 1 and got[11][0] == 2


def test_batched_calls_skip_single_matrix_ops() -> None:
    spans = [op(1, "aten::bmm", 0, 100_000), op(2, "aten::addmm", 110_000, 200_000), mkl(10, 0, receive=150_000, exec_ns=20_000)]
    spans[2].attrs.update({"ml.library.kind": "SGEMM_BATCH", "ml.library.desc": "T,N,*,*,*"})
    assert placed(attach_library_calls(run_of(spans)))[10][0] == 1
    spans[2].attrs["ml.library.kind"] = "SGEMM"  # a plain SGEMM may come from either: the first with room
    assert placed(attach_library_calls(run_of(spans)))[10][0] == 1
    spans[0] = op(1, "aten::bmm", 0, 10_000)  # too short for a 20 µs call
    assert placed(attach_library_calls(run_of(spans)))[10][0] == 2


def test_untimed_onednn_calls_use_leaf_ops() -> None:
    spans = [
        op(1, "aten::conv2d", 0, 100_000),
        op(2, "aten::mkldnn_convolution", 10_000, 90_000),
        mkl(5, 0, receive=95_000, exec_ns=20_000, name="oneDNN"),
    ]
    got = placed(attach_library_calls(run_of(spans)))
    assert got[5] == (2, 70_000, 90_000, MAIN)


def test_other_spans_and_gpu_libraries_are_untouched_and_input_is_not_modified() -> None:
    cublas = Span(7, None, LIB, "cuBLAS gemm", 10_000, 20_000, GPU, {"ml.library.name": "cuBLAS"})
    call = onednn(8, 12_000, 18_000)
    spans = [op(1, "aten::mkldnn_convolution", 10_000, 20_000), cublas, call]
    run = run_of(spans)
    out = attach_library_calls(run)
    assert out.spans[0] is spans[0] and out.spans[1] is cublas
    assert placed(out)[8] == (1, 12_000, 18_000, MAIN)
    assert call.parent_id is None and call.track_id == SOURCE  # the input run is unchanged
    assert run.meta == {}


def test_run_without_library_calls_is_returned_as_is() -> None:
    spans = [op(1, "aten::mm", 0, 10)]
    out = attach_library_calls(run_of(spans))
    assert out.spans == spans
    assert out.meta["correlation"]["attach_library_calls"] == {"timed": 0, "untimed": 0, "unattached": 0}


def test_attached_call_takes_the_framework_of_its_op() -> None:
    from pathlib import Path

    from mltrace.run.events import Span, Track
    from mltrace.run.levels import Level
    from mltrace.run.store import Run
    from mltrace.tracer.passes.library import attach_library_calls

    op = Span(1, None, Level.OP, "Conv2D", 0, 1000, 1, {"ml.framework": "tensorflow", "ml.op.name": "Conv2D"})
    call = Span(2, None, Level.LIBRARY, "oneDNN convolution", 100, 900, 1, {"ml.library.name": "oneDNN"})
    run = Run(path=Path("."), meta={}, tracks={1: Track(1, "thread", "main", 1, 1)}, spans=[op, call])
    out = {s.id: s for s in attach_library_calls(run).spans}
    assert out[2].parent_id == 1
    assert out[2].attrs["ml.framework"] == "tensorflow"


def test_late_untimed_call_is_bounded_by_the_next_timed_call_of_its_thread() -> None:
    # One thread: mm (MKL) then a convolution (oneDNN). The MKL line was read 5 ms late,
    # after the next mm had started; the oneDNN call after it in issue order says it ended by 300 µs.
    spans = [
        op(1, "aten::mm", 100_000, 200_000),
        op(2, "aten::mkldnn_convolution", 300_000, 400_000),
        op(3, "aten::mm", 4_000_000, 4_100_000),
        mkl(10, 0, receive=5_000_000, exec_ns=50_000),
        onednn(11, 310_000, 390_000),
    ]
    got = placed(attach_library_calls(run_of(spans)))
    assert got[11][0] == 2
    assert got[10] == (1, 150_000, 200_000, MAIN)  # not the later mm its receipt time alone would pick


def test_no_bound_when_several_threads_issue_calls() -> None:
    # The oneDNN call ran on another thread: it says nothing about when the MKL call ended.
    spans = [
        op(2, "aten::mkldnn_convolution", 300_000, 400_000, track=WORKER),
        op(3, "aten::mm", 4_000_000, 4_100_000),
        mkl(10, 0, receive=4_200_000, exec_ns=50_000),
        onednn(11, 310_000, 390_000),
    ]
    got = placed(attach_library_calls(run_of(spans)))
    assert got[11][0] == 2
    assert got[10][0] == 3
    # on one thread the same oneDNN call bounds the MKL call's end to 310 µs: no op fits
    spans[0] = op(2, "aten::mkldnn_convolution", 300_000, 400_000)
    assert placed(attach_library_calls(run_of(spans)))[10][0] is None


def test_flash_attention_calls_have_block_sizes() -> None:
    # The CPU flash-attention kernel multiplies (query block x key block) tiles: M and N are
    # block sizes (128, 32), only K (the head dimension, 64) is an input dimension.
    flash = op(1, "aten::_scaled_dot_product_flash_attention_for_cpu", 100_000, 200_000)
    flash.attrs["ml.input.shapes"] = [[1, 4, 128, 64], [1, 4, 128, 64], [1, 4, 128, 64], [], []]
    calls = [
        mkl(10, 0, receive=150_000, exec_ns=20_000, desc="T,N,128,32,64,*,*,768,*,768,*,*,128"),
        mkl(11, 1, receive=160_000, exec_ns=20_000, desc="N,N,64,32,128,*,*,768,*,128,*,*,64"),
    ]
    got = placed(attach_library_calls(run_of([flash, *calls])))
    assert got[10][0] == 1 and got[11][0] == 1
    # a GEMM sharing no dimension with the inputs is still ruled out
    other = mkl(12, 0, receive=150_000, exec_ns=20_000, desc="T,N,768,96,256,*,*,256,*,256,*,*,768")
    assert placed(attach_library_calls(run_of([flash, other])))[12][0] is None


def test_an_op_making_several_calls_keeps_them_when_lines_come_late() -> None:
    # A native convolution makes one im2col GEMM per image; read late, both lines share a
    # receipt time. Room packed from the op's start keeps both in it; the next op gets the next.
    conv = op(1, "aten::_slow_conv2d_forward", 0, 100_000)
    conv.attrs["ml.input.shapes"] = [[2, 2, 8, 8], [4, 2, 3, 3], [], [4], [], []]
    mm = op(2, "aten::mm", 110_000, 200_000)
    im2col = "N,N,36,4,18,*,*,36,*,18,*,*,36"
    spans = [
        conv,
        mm,
        mkl(10, 0, receive=5_000_000, exec_ns=40_000, desc=im2col),
        mkl(11, 1, receive=5_000_000, exec_ns=40_000, desc=im2col),
        mkl(12, 2, receive=5_000_000, exec_ns=40_000),
    ]
    got = placed(attach_library_calls(run_of(spans)))
    assert [got[i][0] for i in (10, 11, 12)] == [1, 1, 2]
    assert got[10][2] <= got[11][1]  # laid out one after the other


def _nested_by_walk(spans: list[Span]) -> set[int]:
    """``_with_nested`` the plain way: every open span checked for each span that starts."""
    stack: list[Span] = []
    inner: set[int] = set()
    for s in spans:
        while stack and stack[-1].end_ns <= s.start_ns:
            stack.pop()
        inner.update(outer.id for outer in stack if s.end_ns <= outer.end_ns)
        stack.append(s)
    return inner


def test_spans_with_nested_ones_match_the_walk_down_every_open_span() -> None:
    """The shortcut (only the innermost open span while the open ones nest) finds the same
    spans as checking every open span, on nested, touching and crossing intervals alike."""
    rng = random.Random(7)
    crossing_cases = 0
    for _ in range(2000):
        spans = []
        for i in range(rng.randint(0, 25)):
            start = rng.randint(0, 60)
            spans.append(Span(i + 1, None, Level.OP, "op", start, start + rng.randint(0, 25), 1, {}))
        spans.sort(key=lambda s: (s.start_ns, -s.end_ns, s.id))
        crossing_cases += any(a.start_ns < b.start_ns < a.end_ns < b.end_ns for a in spans for b in spans)
        assert _with_nested(spans) == _nested_by_walk(spans)
    assert crossing_cases > 500  # the case where the shortcut must not be taken was tried


def _request_gemm(i: int, start: int, end: int, batch: int, track: int) -> Span:
    """A request thread's ``aten::addmm`` at batch ``batch``: x [batch, 128] @ w [128, 10]."""
    o = op(i, "aten::addmm", start, end, track=track)
    o.attrs["ml.input.shapes"] = [[10], [batch, 128], [128, 10], [], []]
    return o


def _request_call(i: int, seq: int, receive: int, batch: int) -> Span:
    return mkl(i, seq, receive=receive, exec_ns=20_000, desc=f"T,N,10,{batch},128,*,*,128,*,128,*,*,10")


def test_calls_of_server_threads_issued_in_turn_each_find_their_thread_op() -> None:
    """Two request threads: the worker's op started first, the main thread's call was issued
    first. Issue order binds each thread's calls, not one thread's calls to another's ops:
    the worker's call still goes to the worker's op."""
    spans = [
        _request_gemm(1, 100_000, 400_000, batch=4, track=WORKER),
        _request_gemm(2, 150_000, 300_000, batch=1, track=MAIN),
        _request_gemm(3, 500_000, 700_000, batch=1, track=MAIN),
        _request_call(10, 0, receive=290_000, batch=1),
        _request_call(11, 1, receive=390_000, batch=4),
        _request_call(12, 2, receive=690_000, batch=1),
    ]
    out = attach_library_calls(run_of(spans))
    got = placed(out)
    assert [got[i][0] for i in (10, 11, 12)] == [2, 1, 3]
    assert [got[i][3] for i in (10, 11, 12)] == [MAIN, WORKER, MAIN]
    assert out.meta["correlation"]["attach_library_calls"] == {"timed": 0, "untimed": 3, "unattached": 0}


def test_a_thread_never_goes_back_to_its_own_earlier_op() -> None:
    """Issue order still binds one thread: after a call went to the main thread's second op,
    a later call with the first op's shapes is not put back into the first op."""
    spans = [
        _request_gemm(1, 100_000, 300_000, batch=2, track=MAIN),
        _request_gemm(2, 400_000, 600_000, batch=1, track=MAIN),
        _request_call(10, 0, receive=590_000, batch=1),
        _request_call(11, 1, receive=600_000, batch=2),
    ]
    got = placed(attach_library_calls(run_of(spans)))
    assert got[10][0] == 2
    assert got[11][0] is None


def test_a_call_read_in_one_process_never_goes_to_another_process_op() -> None:
    """A followed child's calls are read on the child's own track: an op of the parent with
    the same shapes, running at the time, did not make them."""
    other = 7
    tracks = {**TRACKS, other: Track(other, TrackKind.THREAD, "child", 200, 200)}
    spans = [_request_gemm(1, 100_000, 300_000, batch=1, track=MAIN), _request_call(10, 0, receive=290_000, batch=1)]
    spans[1] = Span(10, None, LIB, spans[1].name, spans[1].start_ns, spans[1].end_ns, other, spans[1].attrs)
    got = placed(attach_library_calls(Run(path=Path("."), meta={}, tracks=tracks, spans=spans)))
    assert got[10][0] is None
    spans[1] = Span(10, None, LIB, spans[1].name, spans[1].start_ns, spans[1].end_ns, SOURCE, spans[1].attrs)
    assert placed(attach_library_calls(run_of(spans)))[10][0] == 1


def test_flash_attention_calls_of_a_decode_step_span_the_cached_keys() -> None:
    """A decode step with a KV cache: one query against 33 cached keys. Its block GEMMs are
    (33, 1, 32) and (32, 1, 33): the key block is the keys' length, longer than the query's."""
    flash = op(1, "aten::_scaled_dot_product_flash_attention_for_cpu", 100_000, 200_000)
    flash.attrs["ml.input.shapes"] = [[1, 4, 1, 32], [1, 4, 33, 32], [1, 4, 33, 32], [], []]
    calls = [
        mkl(10, 0, receive=150_000, exec_ns=2_000, desc="T,N,33,1,32,*,*,32,*,32,*,*,33"),
        mkl(11, 1, receive=160_000, exec_ns=2_000, desc="N,N,32,1,33,*,*,32,*,33,*,*,32"),
    ]
    got = placed(attach_library_calls(run_of([flash, *calls])))
    assert got[10][0] == 1 and got[11][0] == 1
    # a block longer than both sequences is still ruled out
    other = mkl(12, 0, receive=150_000, exec_ns=2_000, desc="T,N,64,1,32,*,*,32,*,32,*,*,64")
    assert placed(attach_library_calls(run_of([flash, other])))[12][0] is None
