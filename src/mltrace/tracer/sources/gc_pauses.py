"""The traced program's cyclic garbage collections, from ``gc.callbacks``.

A full collection of a process with a framework loaded holds every Python thread for 100 ms or
more, inside whichever layer call allocated the object that set it off. The report would
count that as the layer's time (and call the layer overhead-bound); with the pauses recorded
it says how much of a call's time was the collector's (``analysis/gcpauses.py``).

``GcPauseSource`` adds one callback to ``gc.callbacks`` for the session (the program's own
callbacks still run, in their order) and takes it out at ``stop()``. Each collection costs it
two clock reads and a few list operations (docs/PERFORMANCE.md). Every collection is counted
by generation (run.json ``gc.collections``: count and ns); those of the older generations and
those of 1 ms or more are kept as pauses (``gc.pauses``: thread, begin ns, end ns, generation,
as ``torch_profiler.pauses`` has them) and drawn on the ``python.gc`` counter track (the
generation plus one while it runs). Counters are not a hierarchy level: it runs at every level.
"""

from __future__ import annotations

import gc
import threading
from typing import TYPE_CHECKING, Any

from mltrace.run.events import Event, Track
from mltrace.run.levels import Level
from mltrace.tracer.clock import now_ns
from mltrace.tracer.sources.base import Source

if TYPE_CHECKING:
    from mltrace.tracer.sources.base import SessionView

#: The counter track of the collections kept: the generation plus one while one runs, else 0.
GC_TRACK = "python.gc"
#: A young (generation 0) collection at least this long is kept as a pause; older ones always are.
KEEP_YOUNG_NS = 1_000_000
#: Pauses kept at most; the later ones are counted (``gc.pauses_left_out``) and not kept.
PAUSES_KEPT = 100_000
#: The generations of CPython's collector.
GENERATIONS = 3


class GcPauseSource(Source):
    """The program's garbage collections as pauses of its threads (run.json ``gc``)."""

    name = "python.gc"
    levels: tuple[Level, ...] = ()

    def __init__(self) -> None:
        self._session: SessionView | None = None
        self._track: Track | None = None
        self._began = -1
        #: Per generation: collections, and their summed duration (ns).
        self.counts = [0] * GENERATIONS
        self.total_ns = [0] * GENERATIONS
        #: (native thread id, begin ns, end ns, generation) of the collections kept.
        self.pauses: list[tuple[int, int, int, int]] = []
        self.left_out = 0

    def available(self) -> str | None:
        return None

    def start(self, session: SessionView) -> None:
        self._session = session
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks``' callback: notes the start, and at the stop counts the collection
        and keeps it where it is long or of an older generation. Collections never overlap
        (CPython runs one at a time), so one start time is enough."""
        if phase == "start":
            self._began = now_ns()
            return
        began, ended = self._began, now_ns()
        if began < 0:
            return  # started before the session did
        self._began = -1
        generation = info.get("generation", 0)
        if not 0 <= generation < GENERATIONS:
            return
        self.counts[generation] += 1
        self.total_ns[generation] += ended - began
        if generation == 0 and ended - began < KEEP_YOUNG_NS:
            return
        if len(self.pauses) >= PAUSES_KEPT:
            self.left_out += 1
            return
        self.pauses.append((threading.get_native_id(), began, ended, generation))
        session = self._session
        if session is not None:
            if self._track is None:  # the run has the track once it has a pause to draw
                self._track = session.tracks.counter(GC_TRACK)
            session.recorder.counter(self._track, generation + 1, began)
            session.recorder.counter(self._track, 0, ended)

    def _remove(self) -> None:
        """Takes the callback out of ``gc.callbacks`` (where the program left it)."""
        try:
            gc.callbacks.remove(self._on_collection)
        except ValueError:
            pass

    def release_in_forked_child(self) -> None:
        """In a child forked while the session runs: records nothing more."""
        self._remove()
        self._session = None

    def stop(self) -> list[Event]:
        self._remove()
        session = self._session
        if session is not None:
            session.meta["gc"] = {
                "collections": [[n, ns] for n, ns in zip(self.counts, self.total_ns)],
                "pauses": [list(p) for p in self.pauses],
                "keep_young_ns": KEEP_YOUNG_NS,
                "pauses_left_out": self.left_out,
            }
        return []
