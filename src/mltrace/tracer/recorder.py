"""The live recorder: begin/end spans on per-context stacks, streamed to disk.

The parent of a new span is the innermost open span of the calling context
(a ``ContextVar``, so threads and asyncio tasks each have their own stack).
Completed events go to lock-free deques; a daemon thread drains them every
flush interval into the run directory, so a killed run loses at most one
interval of events.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from mltrace.native import c_helper
from mltrace.run.events import Attrs, CounterSample, Event, Flow, Instant, Span, Track
from mltrace.run.levels import Level
from mltrace.run.redact import needs_redaction, redact_values
from mltrace.settings import SPAN_UNTRACK
from mltrace.tracer.clock import now_ns
from mltrace.tracer.tracks import TrackRegistry

log = logging.getLogger("mltrace")

#: The innermost open span of the current context (thread or asyncio task).
current_span: ContextVar[Span | None] = ContextVar("mltrace_current_span", default=None)


#: The longest a span begun during another thread's cycle switch waits for its end: a switch
#: takes milliseconds; a stuck one must not hold the program's threads.
SWITCH_WAIT_S = 5.0


def take_all(queue: deque[Any]) -> list[Any]:
    """Every item of ``queue`` now, popped from the left (items appended meanwhile stay)."""
    return [queue.popleft() for _ in range(len(queue))]


class Recorder:
    """Records live events of one session.

    Args:
        tracks: the session's track registry.
        ids: the session's id allocator (shared with post-hoc sources).
    """

    def __init__(self, tracks: TrackRegistry, ids: itertools.count[int]) -> None:
        self.tracks = tracks
        self._ids = ids
        self._local = threading.local()
        #: pthread ident → track id of every thread that recorded (samplers report idents).
        self.thread_idents: dict[int, int] = {}
        self.done: deque[Span] = deque()
        helper = c_helper("_untrack", SPAN_UNTRACK)
        #: Takes a finished span out of the cyclic garbage collector until the flusher drops it
        #: (``_untrack.c``): queued spans would otherwise be promoted by the program's young
        #: collections and bring full collections into its threads.
        self._untrack: Callable[[Span], object] | None = helper.untrack_span if helper is not None else None
        self.instants: deque[Instant] = deque()
        self.counters: deque[CounterSample] = deque()
        self.flows: deque[Flow] = deque()
        self._open: dict[int, Span] = {}
        #: Spans a source keeps open outside ``begin``/``end`` (the program's own OpenTelemetry
        #: spans): key → (start ns, track id), one dict per source.
        self.external_open: list[dict[Any, tuple[int, int]]] = []
        self._producers: list[tuple[Callable[[], list[Span]], Callable[[], tuple[bytes, bytes, int]] | None]] = []
        #: Spans taken by ``drain`` so far (the session's span limit counts them).
        self.spans_drained = 0
        self._innermost: Callable[[], int | None] | None = None
        #: Replace the values of secret-looking attribute names of user spans and instants
        #: (``run/redact.py``; the session sets it from ``ProfileOptions.redact``).
        self.redact = True
        #: Set while a source switches a recording cycle (``holding_new_spans``): spans begun
        #: meanwhile on other threads wait for its end (``wait_while_switching``).
        self._switch_done: threading.Event | None = None
        self._switching_thread: int | None = None

    def add_producer(self, produce: Callable[[], list[Span]], encode: Callable[[], tuple[bytes, bytes, int]] | None = None) -> None:
        """Adds a source of completed spans kept outside ``done``, taken at every drain.

        For a hot path that records something cheaper than a Span and builds
        the spans later, in the flusher (the PyTorch layer level). ``encode``,
        if given, takes the same spans as events.jsonl rows instead, for
        ``drain(encoded=True)``: the templates first written in this batch and
        the span rows (``store.encode_batch``'s ``span_templates`` and ``span_rows``),
        and how many spans the rows are.
        """
        self._producers.append((produce, encode))

    def set_innermost(self, innermost: Callable[[], int | None] | None) -> None:
        """Tells ``begin`` of open spans that do not go through ``current_span``.

        ``innermost()`` returns the id of the calling thread's innermost such
        span, or None. A new span's parent is whichever of it and
        ``current_span`` began last (ids grow with time), so a user span opened
        inside a PyTorch layer nests under the layer.
        """
        self._innermost = innermost

    def _track_id(self) -> int:
        # Thread-local, not keyed by thread ident: idents are reused once a thread ends.
        try:
            return self._local.track_id  # type: ignore[no-any-return]
        except AttributeError:
            tid = self.tracks.current_thread().id
            self._local.track_id = tid
            self.thread_idents[threading.get_ident()] = tid
            return tid

    def begin(self, name: str, level: Level, attrs: Attrs | None = None, start_ns: int | None = None) -> Span:
        """Opens a span as a child of the current context's innermost span. A user span's
        attributes whose names look secret are stored as ``[redacted]`` (``redact``)."""
        if attrs and level is Level.USER and self.redact and needs_redaction(attrs):
            attrs = redact_values(attrs)
        up = current_span.get()
        parent_id = up.id if up is not None else None
        if self._innermost is not None:
            inner = self._innermost()
            if inner is not None and (parent_id is None or inner > parent_id):
                parent_id = inner
        span = Span(
            next(self._ids),
            parent_id,
            level,
            name,
            now_ns() if start_ns is None else start_ns,
            -1,
            self._track_id(),
            attrs,
        )
        span._up = up
        current_span.set(span)
        self._open[span.id] = span
        if self._switch_done is not None and parent_id is None and self.wait_while_switching() and start_ns is None:
            span.start_ns = now_ns()  # the span's work begins once the switch let it go
        return span

    def holding_new_spans(self) -> Callable[[], None]:
        """Makes outermost spans begun from now on other threads wait (``wait_while_switching``)
        until the returned function is called: a source that stops and restarts a recorder of
        every thread (torch.profiler's cycles) closes this gate, then checks
        ``open_on_other_threads``; a span begun meanwhile is either seen open or waits, so none
        runs inside the switch. A span inside one already open goes on (a request's model
        call), so that a stop waiting for the open spans to end (``TorchOpSource``'s last stop)
        waits for their calls, not for its own gate."""
        done = threading.Event()
        self._switching_thread = threading.get_ident()
        self._switch_done = done

        def release() -> None:
            self._switch_done = None
            self._switching_thread = None
            done.set()

        return release

    def wait_while_switching(self) -> bool:
        """Waits (up to ``SWITCH_WAIT_S``) while another thread's switch holds new spans; call it
        after the new span is registered open. Returns whether it waited."""
        done = self._switch_done
        if done is None or threading.get_ident() == self._switching_thread:
            return False
        done.wait(SWITCH_WAIT_S)
        return True

    def end(self, span: Span, end_ns: int | None = None) -> None:
        """Closes ``span`` and makes its parent current again; queues it for the flusher, out of
        the cyclic garbage collector's lists where the C helper is built."""
        self.close(span, end_ns)
        if self._untrack is not None:
            self._untrack(span)
        self.done.append(span)

    def close(self, span: Span, end_ns: int | None = None) -> None:
        """Closes ``span`` as ``end`` does, without queueing it: the source that began it keeps
        the call in a form of its own and hands it over as a producer (``add_producer``)."""
        span.end_ns = now_ns() if end_ns is None else end_ns
        current_span.set(span._up)
        span._up = None
        self._open.pop(span.id, None)

    def open_here(self, level: Level) -> bool:
        """Whether a span of ``level`` begun on the calling thread is still open."""
        mine = self._track_id()
        return any(span.track_id == mine and span.level is level for span in list(self._open.values()))

    def open_on_other_threads(self) -> bool:
        """Whether a span begun on another thread than the calling one is still open."""
        mine = self._track_id()
        if any(span.track_id != mine for span in list(self._open.values())):
            return True
        return any(track != mine for spans in self.external_open for _, track in list(spans.values()))

    def earliest_open_ns(self) -> int | None:
        """The start of the earliest span still open (begun and not ended; a source's own open
        spans too), or None where none is."""
        starts = [span.start_ns for span in list(self._open.values())]
        starts += [start for spans in self.external_open for start, _ in list(spans.values())]
        return min(starts, default=None)

    def close_open_spans(self, at_ns: int) -> int:
        """Ends spans left open (an interrupt, an exception through a hook) at ``at_ns``.

        Returns how many were closed; each gets ``mltrace.truncated = True``.
        """
        spans = list(self._open.values())
        for span in spans:
            span.attrs["mltrace.truncated"] = True
            span.end_ns = max(at_ns, span.start_ns)
            span._up = None
            self.done.append(span)
        self._open.clear()
        return len(spans)

    def instant(self, name: str, level: Level = Level.USER, attrs: Attrs | None = None) -> None:
        """Records a point event on the calling thread's track (attributes redacted as in ``begin``)."""
        if attrs and level is Level.USER and self.redact and needs_redaction(attrs):
            attrs = redact_values(attrs)
        self.instants.append(Instant(name, now_ns(), self._track_id(), level, attrs or {}))

    def counter(self, track: Track, value: float, ts_ns: int | None = None) -> None:
        """Records one counter value."""
        self.counters.append(CounterSample(track.id, now_ns() if ts_ns is None else ts_ns, value))

    def new_id(self) -> int:
        """A fresh event id, unique within the session."""
        return next(self._ids)

    def drain(self, encoded: bool = False) -> dict[str, list[Any]]:
        """Takes every completed event recorded so far (thread-safe).

        With ``encoded``, producers that can encode their spans themselves
        give them as ``span_rows`` and ``span_templates`` (encoded rows, bytes)
        rather than ``spans``.
        """

        spans = take_all(self.done)
        span_rows: list[bytes] = []
        span_templates: list[bytes] = []
        for produce, encode in self._producers:
            try:
                if encoded and encode is not None:
                    templates, rows, count = encode()
                    span_templates.append(templates)
                    span_rows.append(rows)
                    self.spans_drained += count
                else:
                    spans.extend(produce())
            except Exception as exc:  # a source's bug must not stop the other events
                log.warning("mltrace: building spans failed: %s", exc)
        self.spans_drained += len(spans)
        for span in spans:
            fin = span._fin
            if fin is not None:
                span._fin = None
                try:
                    fin(span)
                except Exception as exc:  # a source's bug must not lose the span
                    span.attrs["mltrace.error"] = f"attribute finalizer failed: {exc}"
        batch = {
            "tracks": take_all(self.tracks.pending),
            "spans": spans,
            "instants": take_all(self.instants),
            "counters": take_all(self.counters),
            "flows": take_all(self.flows),
        }
        if encoded:
            batch["span_rows"] = [r for r in span_rows if r]
            batch["span_templates"] = [t for t in span_templates if t]
        return batch


#: Flushes whose times a ``Flusher`` keeps; later ones are counted and not kept.
FLUSHES_KEPT = 100_000


class Flusher(threading.Thread):
    """Calls ``flush()`` every ``interval_s`` seconds, and at once when woken (``wake``), until
    stopped; keeps each flush's times (``flushes``), mltrace's own work beside the program's."""

    def __init__(self, flush: Callable[[], None], interval_s: float) -> None:
        super().__init__(name="mltrace-flusher", daemon=True)
        self._flush = flush
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._woken = threading.Event()
        #: (begin ns, end ns, CPU ns of the flusher's thread) of each flush kept, session clock.
        self.flushes: list[tuple[int, int, int]] = []
        #: Flushes run, kept or not, and their summed wall and CPU time (ns).
        self.count = 0
        self.wall_ns = 0
        self.cpu_ns = 0

    def run(self) -> None:
        while True:
            self._woken.wait(self._interval_s)
            if self._stopped.is_set():
                return
            self._woken.clear()
            began, cpu = now_ns(), time.thread_time_ns()
            try:
                self._flush()
            except Exception as exc:  # never into the user's program
                log.warning("mltrace: streaming flush failed: %s", exc)
            self._count(began, now_ns(), time.thread_time_ns() - cpu)

    def _count(self, began: int, ended: int, cpu_ns: int) -> None:
        """Counts one flush and keeps its times while fewer than ``FLUSHES_KEPT`` are kept."""
        self.count += 1
        self.wall_ns += ended - began
        self.cpu_ns += cpu_ns
        if len(self.flushes) < FLUSHES_KEPT:
            self.flushes.append((began, ended, cpu_ns))

    def summary(self) -> dict[str, Any]:
        """What run.json keeps of the flushes (``flushes``): counts, sums and each kept flush's
        [begin ns, end ns, CPU ns]."""
        return {
            "count": self.count,
            "wall_ns": self.wall_ns,
            "cpu_ns": self.cpu_ns,
            "interval_s": self._interval_s,
            "kept": [list(f) for f in self.flushes],
        }

    def wake(self) -> None:
        """Has the next flush run now rather than at the end of the interval."""
        self._woken.set()

    def stop(self, timeout_s: float = 10) -> None:
        """Stops the thread, waiting at most ``timeout_s`` for a flush in progress."""
        self._stopped.set()
        self._woken.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=timeout_s)


def events_of(batch: list[Event]) -> dict[str, list[Any]]:
    """Splits a mixed list of post-hoc events into the store's batch keys."""
    out: dict[str, list[Any]] = {"tracks": [], "spans": [], "instants": [], "counters": [], "flows": []}
    for e in batch:
        if isinstance(e, Span):
            out["spans"].append(e)
        elif isinstance(e, Instant):
            out["instants"].append(e)
        elif isinstance(e, CounterSample):
            out["counters"].append(e)
        elif isinstance(e, Flow):
            out["flows"].append(e)
        else:
            out["tracks"].append(e)
    return out
