"""torch.distributed ranks: each rank's model time and its time in collectives, and the straggler.

A run's processes are listed in run.json's ``processes``; those where torch.distributed ran
carry ``distributed`` (``rank``, ``world_size``, ``backend``). A rank's spans are those on its
process's tracks (``Track.pid``). Its model time is the sum of its outermost model calls; its
collective time is the union of the time of its collective spans (``is_collective``: c10d's
ops, the backends' record functions, NCCL kernels), so a c10d op and the backend's work for it
count once where they overlap. In a collective every rank waits for the last one to arrive,
so the rank that spends least time in collectives is the slowest: the straggler. The
collectives a rank began before its first model call (``init_process_group``'s barrier,
DistributedDataParallel's parameter checks and broadcast) wait for the other ranks' start-up,
not their inference: that part of its collective time is its set-up (``setup_ns``), which
the straggler leaves out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mltrace.analysis.requests import union_ns
from mltrace.analysis.tree import tree_of
from mltrace.run.levels import Level

if TYPE_CHECKING:
    from mltrace.run.store import Run

__all__ = ["Rank", "RankTimes", "is_collective", "rank_times"]

#: Span names of collectives: c10d's ops, the backends' record functions, NCCL kernels.
_COLLECTIVE = re.compile(
    r"^(c10d::|c10d_functional::|_c10d_functional::|gloo:|nccl:|mpi:|ucc:|record_param_comms$)|^nccl(Dev)?Kernel_",
)
#: Levels collective spans are recorded at (the backends' record functions are user spans).
_LEVELS = (int(Level.OP), int(Level.USER), int(Level.KERNEL))


def is_collective(name: str) -> bool:
    """Whether a span name is a collective's (``c10d::allreduce_``, ``gloo:all_reduce``, an NCCL kernel…)."""
    return _COLLECTIVE.search(name) is not None


@dataclass(frozen=True)
class Rank:
    """One rank's time.

    Attributes:
        rank: its torch.distributed rank.
        pid: its process.
        role: its role in run.json (``rank 1``).
        model_calls, model_ns: its outermost model calls and their summed time.
        collective_ns: the union of its collective spans' time.
        collectives: per collective span name, ``(name, spans, summed time)``, largest first.
        setup_ns: the part of ``collective_ns`` that the union of its collective spans begun
            from its first model call on leaves out (its set-up: the others' start-up; 0
            where it made no model call).
    """

    rank: int
    pid: int
    role: str
    model_calls: int
    model_ns: int
    collective_ns: int
    collectives: list[tuple[str, int, int]] = field(default_factory=list)
    setup_ns: int = 0


@dataclass(frozen=True)
class RankTimes:
    """The ranks of a run.

    Attributes:
        world_size: the world size the ranks reported (None when they did not agree or say).
        backend: their backend (None likewise).
        ranks: one entry per rank, by rank.
        straggler: the rank that waited least in collectives, or None (fewer than two ranks
            with collectives, or a tie).
    """

    world_size: int | None
    backend: str | None
    ranks: list[Rank]
    straggler: int | None

    def wait_range_ns(self) -> tuple[int, int]:
        """The least and the most collective time of a rank."""
        times = [r.collective_ns for r in self.ranks]
        return (min(times), max(times)) if times else (0, 0)

    def as_dict(self) -> dict[str, Any]:
        """The report JSON's ``ranks`` section."""
        return {
            "world_size": self.world_size,
            "backend": self.backend,
            "straggler": self.straggler,
            "ranks": [
                {
                    "rank": r.rank,
                    "pid": r.pid,
                    "role": r.role,
                    "model_calls": r.model_calls,
                    "model_ns": r.model_ns,
                    "collective_ns": r.collective_ns,
                    "collectives": [{"name": n, "spans": c, "ns": ns} for n, c, ns in r.collectives],
                    "setup_ns": r.setup_ns,
                }
                for r in self.ranks
            ],
        }


def rank_times(*, run: Run) -> RankTimes | None:
    """Each rank's model and collective time, or None in a run with no torch.distributed rank."""
    procs = _ranked_processes(run.meta)
    if not procs:
        return None
    import numpy as np

    t = run.table
    level = t.level.astype(np.int64)
    pid_of_track = {tid: tr.pid for tid, tr in run.tracks.items()}
    pids = np.fromiter((pid_of_track.get(int(x), 0) for x in t.track.tolist()), dtype=np.int64, count=len(t))
    is_model = level == int(Level.MODEL)
    outer_model = is_model & ~tree_of(t).ancestor_or(is_model) if len(t) else is_model
    coll_names = np.fromiter((is_collective(nm) for nm in t.names), dtype=bool, count=len(t.names))
    is_coll = np.isin(level, _LEVELS) & coll_names[t.name] if len(t) else np.zeros(0, dtype=bool)
    ranks = [_rank(t, p, pids == p["pid"], outer_model, is_coll) for p in procs]
    ranks.sort(key=lambda r: r.rank)
    return RankTimes(
        world_size=_agreed(p["distributed"].get("world_size") for p in procs),
        backend=_agreed(p["distributed"].get("backend") for p in procs),
        ranks=ranks,
        straggler=_straggler(ranks),
    )


def _ranked_processes(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """run.json's processes that carry a torch.distributed rank."""
    out = []
    for p in meta.get("processes") or []:
        dist = p.get("distributed") if isinstance(p, dict) else None
        if isinstance(dist, dict) and isinstance(dist.get("rank"), int) and isinstance(p.get("pid"), int):
            out.append(p)
    return out


def _rank(t: Any, proc: dict[str, Any], mine: Any, outer_model: Any, is_coll: Any) -> Rank:
    import numpy as np

    models = np.nonzero(mine & outer_model)[0]
    colls = np.nonzero(mine & is_coll)[0]
    per: dict[str, list[int]] = {}
    for row in colls.tolist():
        entry = per.setdefault(t.names[int(t.name[row])], [0, 0])
        entry[0] += 1
        entry[1] += int(t.end[row] - t.start[row])
    total = union_ns([(int(t.start[r]), int(t.end[r])) for r in colls.tolist()])
    past_setup = total
    if len(models):  # the collectives begun from its first model call on
        later = colls[t.start[colls] >= t.start[models].min()]
        past_setup = union_ns([(int(t.start[r]), int(t.end[r])) for r in later.tolist()])
    return Rank(
        rank=int(proc["distributed"]["rank"]),
        pid=int(proc["pid"]),
        role=str(proc.get("role") or f"pid {proc['pid']}"),
        model_calls=len(models),
        model_ns=int((t.end[models] - t.start[models]).sum()),
        collective_ns=total,
        collectives=sorted(((nm, c, ns) for nm, (c, ns) in per.items()), key=lambda x: (-x[2], x[0])),
        setup_ns=total - past_setup,
    )


def _agreed(values: Any) -> Any:
    """The one value every rank gave, else None."""
    seen = {v for v in values if v is not None}
    return seen.pop() if len(seen) == 1 else None


def _straggler(ranks: list[Rank]) -> int | None:
    """The rank that waited least in collectives past its set-up, or None (fewer than two
    ranks waited, or a tie)."""
    waiting = [(r.rank, r.collective_ns - r.setup_ns) for r in ranks if r.collective_ns > r.setup_ns]
    if len(waiting) < 2:
        return None
    least = min(ns for _, ns in waiting)
    slowest = [rank for rank, ns in waiting if ns == least]
    return slowest[0] if len(slowest) == 1 else None
