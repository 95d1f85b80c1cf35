"""The run's processes: each one's model calls and spans, for a run of several processes.

A run of ``mltrace python`` that followed children (multiprocessing, pools, DataLoader workers,
``subprocess``, torchrun's ranks) lists every process in run.json's ``processes``, the
program's own first. A process's spans are those on its tracks (``Track.pid``); its model calls
are its outermost model spans, cold ones included (as the ranks section counts them). The
report's other sections add every process's spans together: this one says which process made
the model calls and which recorded nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from mltrace.analysis.tree import tree_of
from mltrace.run.levels import Level

if TYPE_CHECKING:
    from mltrace.run.store import Run

__all__ = ["ProcessRow", "process_rows"]


@dataclass(frozen=True)
class ProcessRow:
    """One process of the run.

    Attributes:
        pid: its pid (as its spans' tracks carry it).
        role: what it is to the program (``main``, ``rank 1``, ``DataLoader worker 0``,
            ``SpawnPoolWorker-2``, ``pid 123``).
        start: how it started (``exec``, ``fork``), None for the program's own process.
        parent: the role of the process that started it (``rank 1``; ``pid 123`` for one
            the run does not list, a forkserver), None for the program's own process.
        model_calls, model_ns: its outermost model calls and their summed time.
        spans: its spans.
        note: what the run says of it ("" for nothing): it had not finished its trace, it
            recorded nothing (and why), it recorded no deeper than a level.
    """

    pid: int
    role: str
    start: str | None
    parent: str | None
    model_calls: int
    model_ns: int
    spans: int
    note: str

    def as_dict(self) -> dict[str, Any]:
        """One entry of the report JSON's ``processes`` section: every field, by its name."""
        return asdict(self)


def process_rows(*, run: Run) -> list[ProcessRow] | None:
    """One row per process run.json lists, in its order; None where it lists fewer than two."""
    listed = [p for p in run.meta.get("processes") or [] if isinstance(p, dict) and isinstance(p.get("pid"), int)]
    if len(listed) < 2:
        return None
    import numpy as np

    t = run.table
    pid_of_track = {tid: tr.pid for tid, tr in run.tracks.items()}
    pids = np.fromiter((pid_of_track.get(int(x), 0) for x in t.track.tolist()), dtype=np.int64, count=len(t))
    is_model = t.level.astype(np.int64) == int(Level.MODEL)
    outer_model = is_model & ~tree_of(t).ancestor_or(is_model) if len(t) else is_model
    roles = {p["pid"]: str(p.get("role") or f"pid {p['pid']}") for p in listed}
    rows = []
    for p in listed:
        mine = pids == p["pid"]
        models = np.nonzero(mine & outer_model)[0]
        rows.append(
            ProcessRow(
                pid=int(p["pid"]),
                role=roles[p["pid"]],
                start=p.get("start") if isinstance(p.get("start"), str) else None,
                parent=roles.get(p["ppid"], f"pid {p['ppid']}") if isinstance(p.get("ppid"), int) else None,
                model_calls=len(models),
                model_ns=int((t.end[models] - t.start[models]).sum()),
                spans=int(mine.sum()),
                note=_note(p),
            )
        )
    return rows


def _note(process: dict[str, Any]) -> str:
    """What run.json says of ``process``: unfinished (still running at the run's end, or ended
    before its finish), its note, its level cap, and the command line of one started by exec
    that has no role but its pid ("" for nothing)."""
    parts = []
    if process.get("finished") is False:
        parts.append(_UNFINISHED.get(process.get("running"), _UNFINISHED[None]))
    for key in ("note", "level"):
        if isinstance(process.get(key), str) and process[key]:
            parts.append(process[key])
    command = process.get("command")
    anonymous = process.get("role") in (None, f"pid {process.get('pid')}")
    if anonymous and process.get("start") == "exec" and isinstance(command, list) and command:
        parts.append("command: " + " ".join(map(str, command)))
    return "; ".join(parts)


#: The note of a process that had not finished its trace, by run.json's ``running``: still
#: running at the run's end, ended before its finish (a child's finish runs at its exit, in
#: ``os._exit`` and on SIGTERM, so one that ended without it was killed), or not said.
_UNFINISHED: dict[object, str] = {
    True: "was still running when the run ended: what it streamed",
    False: "ended before it finished its trace (killed): what it streamed",
    None: "had not finished its trace: what it streamed",
}
