"""The recorder's switch gate: while a source switches a recording cycle of every thread
(torch.profiler's op cycles), a span begun on another thread waits for the switch's end, so no
request runs its first ops while nothing records them."""

from __future__ import annotations

import itertools
import threading
import time

from mltrace.run.levels import Level
from mltrace.tracer.clock import now_ns
from mltrace.tracer.recorder import Recorder
from mltrace.tracer.tracks import TrackRegistry


def _recorder() -> Recorder:
    return Recorder(TrackRegistry(), itertools.count(1))


def test_a_span_begun_on_another_thread_during_a_switch_waits_for_its_end() -> None:
    recorder = _recorder()
    release = recorder.holding_new_spans()
    begun: list[tuple[int, int]] = []

    def request() -> None:
        span = recorder.begin("request", Level.USER)
        begun.append((span.start_ns, now_ns()))
        recorder.end(span)

    thread = threading.Thread(target=request)
    thread.start()
    time.sleep(0.05)
    assert begun == []  # still waiting
    assert recorder.open_on_other_threads()  # registered open before it waits: a switch check sees it
    released_ns = now_ns()
    release()
    thread.join(5)
    ((start_ns, returned_ns),) = begun
    assert released_ns <= start_ns <= returned_ns  # its time begins when the switch let it go


def test_the_switching_thread_and_later_spans_do_not_wait() -> None:
    recorder = _recorder()
    release = recorder.holding_new_spans()
    span = recorder.begin("switching thread", Level.USER)
    assert not recorder.wait_while_switching() and not recorder.open_on_other_threads()
    recorder.end(span)
    release()
    waited: list[bool] = []
    thread = threading.Thread(target=lambda: waited.append(recorder.wait_while_switching()))
    thread.start()
    thread.join(5)
    assert waited == [False]


def test_a_given_start_time_stays() -> None:
    recorder = _recorder()
    release = recorder.holding_new_spans()
    spans = []
    thread = threading.Thread(target=lambda: spans.append(recorder.begin("given", Level.USER, start_ns=123)))
    thread.start()
    time.sleep(0.02)
    release()
    thread.join(5)
    assert spans[0].start_ns == 123
