"""Merging runs into one: the events of several processes (a program's followed children, or
run directories recorded on several hosts) in one run with one clock.

Every run's span, flow and track ids start at 1, so a merged run's ids are shifted past those
already in it, and a process id that another merged run already uses is given a free one
(``Track.pid``). Times are moved onto the first run's session clock: not at all where both
runs read the same CLOCK_MONOTONIC (same ``clock.boot_id``), else through each run's clock
anchor (its monotonic and epoch readings), so the error is the hosts' epoch clocks' offset.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from mltrace.run.events import Flow, Instant, Track, TrackKind
from mltrace.run.store import Run


def clock_shift_ns(base: dict[str, Any], other: dict[str, Any]) -> int:
    """What to add to ``other``'s session times (run.json ``clock``) to put them on ``base``'s."""
    b, o = base.get("clock") or {}, other.get("clock") or {}
    if b.get("boot_id") and b.get("boot_id") == o.get("boot_id"):
        return 0  # one host since one boot: one CLOCK_MONOTONIC
    keys = ("anchor_monotonic_ns", "anchor_epoch_ns")
    if not all(isinstance(c.get(k), int) for c in (b, o) for k in keys):
        return 0
    return (o["anchor_epoch_ns"] - o["anchor_monotonic_ns"]) - (b["anchor_epoch_ns"] - b["anchor_monotonic_ns"])


class RunMerger:
    """Appends runs to a base run (``add``), then gives the merged run (``run``)."""

    def __init__(self, base: Run) -> None:
        self.base = base
        self.tracks: dict[int, Track] = dict(base.tracks)
        self.spans = list(base.spans)
        self.instants = list(base.instants)
        self.counters = list(base.counters)
        self.flows = list(base.flows)
        self.pids = {t.pid for t in self.tracks.values()}
        self._next_id = 1 + max((s.id for s in self.spans), default=0)
        self._next_id = max(self._next_id, 1 + max((f.id for f in self.flows), default=0))

    def add(self, other: Run, shift_ns: int = 0, pid: int | None = None) -> dict[int, int]:
        """Appends ``other``'s events (its span objects are changed in place), its times moved by
        ``shift_ns``. ``pid``: the process id its events belong to, where its tracks name none.
        Returns the process ids of ``other`` that were given new ones (old → new)."""
        id_off = self._next_id - 1
        track_off = max(self.tracks, default=0)
        pids = self._pid_map({t.pid for t in other.tracks.values()} or ({pid} if pid else set()))
        for t in other.tracks.values():
            parent = t.parent_track + track_off if t.parent_track >= 0 else -1
            self.tracks[t.id + track_off] = replace(t, id=t.id + track_off, pid=pids.get(t.pid, t.pid), parent_track=parent)
        top = id_off
        for s in other.spans:
            s.id += id_off
            top = max(top, s.id)
            if s.parent_id is not None:
                s.parent_id += id_off
            s.track_id += track_off
            s.start_ns += shift_ns
            if s.end_ns >= 0:
                s.end_ns += shift_ns
            self.spans.append(s)
        self.instants.extend(Instant(i.name, i.ts_ns + shift_ns, i.track_id + track_off, i.level, i.attrs) for i in other.instants)
        self.counters.extend(replace(c, track_id=c.track_id + track_off, ts_ns=c.ts_ns + shift_ns) for c in other.counters)
        flows = [Flow(f.id + id_off, f.from_span + id_off, f.to_span + id_off, f.kind) for f in other.flows]
        self.flows.extend(flows)
        self._next_id = 1 + max([top, *(f.id for f in flows)])
        return {old: new for old, new in pids.items() if old != new}

    def add_process(self, pid: int, name: str) -> int:
        """Gives process ``pid``, which recorded nothing, a thread track of its own (so a trace
        shows it); returns its pid in the merged run."""
        new = self._pid_map([pid])[pid]
        track_id = max(self.tracks, default=0) + 1
        self.tracks[track_id] = Track(id=track_id, kind=TrackKind.THREAD, name=name, pid=new, tid=new)
        return new

    def _pid_map(self, pids: Iterable[int]) -> dict[int, int]:
        """Keeps each process id that no merged run uses yet; gives the others free ones."""
        out: dict[int, int] = {}
        for pid in sorted(pids):
            new = pid
            while new in self.pids:
                new = max(self.pids) + 1
            self.pids.add(new)
            out[pid] = new
        return out

    def run(self) -> Run:
        """The merged run (the base run's path and metadata)."""
        return self.base.replace(tracks=self.tracks, spans=self.spans, instants=self.instants, counters=self.counters, flows=self.flows)


#: run.json keys of a finished run that a merged run computes again.
_RECOMPUTED = ("complete", "summary", "events_bytes", "correlation", "processes", "merged_from")


def merge_runs(runs: list[Run]) -> Run:
    """One run holding every event of ``runs`` (each a whole run directory: one process, or a
    program and its followed children), on the first run's clock (``clock_shift_ns``). Its
    metadata is the first run's, with ``processes`` listing every process of every run and
    ``merged_from`` each run's directory, id and clock shift."""
    base = runs[0]
    merger = RunMerger(base)
    processes = list(_processes(base.meta))
    sources = [_source(base, 0)]
    for other in runs[1:]:
        shift = clock_shift_ns(base.meta, other.meta)
        renamed = merger.add(other, shift)
        for process in _processes(other.meta):
            processes.append({**process, "pid": renamed.get(process.get("pid"), process.get("pid"))})  # type: ignore[arg-type]
        sources.append(_source(other, shift))
    meta = {k: v for k, v in base.meta.items() if k not in _RECOMPUTED}
    meta.update(processes=processes, merged_from=sources)
    return merger.run().replace(meta=meta)


def _processes(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The processes of a run: its ``processes`` (a run with followed children), else one."""
    listed = meta.get("processes")
    if isinstance(listed, list) and listed:
        return [p for p in listed if isinstance(p, dict)]
    host = (meta.get("host") or {}).get("hostname") if isinstance(meta.get("host"), dict) else None
    return [{"pid": meta.get("pid"), "role": meta.get("name") or "run", "host": host}]


def _source(run: Run, shift_ns: int) -> dict[str, Any]:
    return {"path": str(run.path), "run_id": run.meta.get("run_id"), "name": run.meta.get("name"), "clock_shift_ns": shift_ns}
