"""Requests of a service: their latency and, for the slowest, where the time went.

A *request* is a span that stands for one piece of work the program was asked to do:

- the program's own OpenTelemetry server spans (user spans with ``mltrace.otel.kind`` =
  ``server``), where the run has any;
- else each outermost user span (``mltrace.span(...)``, an OpenTelemetry span that is not a
  server span) that has a model call inside it, leaving out the groups of requests: such a
  span that holds two or more such spans of one name (a batch of requests gathered by an
  asyncio task, a loop over requests, a program's ``main``) is no request, the spans inside
  it are; torch's own ``record_function`` ranges (``run/ranges.py``: an LBFGS
  ``Optimizer.step`` holds the model calls of its closure) are not the program's spans and
  are no requests.

A request nested in another request counts once, as the outer one. A request's time is
split into the model calls inside it (``model_ns``: their union, so calls overlapping on
two threads count once) and the rest: before the first model call, between model calls,
after the last one; ``outside_ops_ns`` is the part of the rest that ops ran in (the
program's own tensor code: pre- and post-processing). The slowest requests also get their
top layers and ops by self time (the span's time less that of its children of the same
level). Each request names the line that started it, where its span records one
(``code.*``: a ``generate()``'s user line, a ``mltrace.span`` block's ``with`` line).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mltrace.analysis.coldstart import percentile_ns
from mltrace.analysis.pauses import Pauses, PausesByTrack
from mltrace.analysis.tree import Tree, tree_of
from mltrace.run.levels import Level
from mltrace.run.ranges import torch_range_kind

if TYPE_CHECKING:
    import numpy as np

    from mltrace.run.store import Run
    from mltrace.run.table import SpanTable

__all__ = ["NameTime", "Request", "Requests", "find_requests", "union_ns"]

#: Attribute keys whose value names a request, first found wins (``Request.label``).
_LABEL_KEYS = ("app.request.id", "request_id", "request.id", "http.request.id", "http.route", "url.path", "http.target")


@dataclass(frozen=True)
class NameTime:
    """A layer or op name, its self time (ns) within one request, and (layers) its type."""

    name: str
    ns: int
    type: str | None = None


@dataclass(frozen=True)
class Request:
    """One request and where its time went.

    Attributes:
        name: the request span's name.
        label: the value of its first attribute that names it (``_LABEL_KEYS``), or None.
        source: ``path:line`` of its span's ``code.*`` attributes (the line that started it), or None.
        pid: the process it ran in.
        start_ns, total_ns: its start (session clock) and duration.
        model_calls: model calls inside it (outermost model spans).
        model_ns: the union of their time, clipped to the request.
        before_model_ns, between_models_ns, after_model_ns: the rest of its time, before the
            first model call, in the gaps between model calls, after the last one (all of it
            is ``before_model_ns`` in a request with no model call).
        outside_ops_ns: the union of the time of ops inside the request but in no model call.
        layers, ops: its top layers and ops by self time, largest first.
        paused_ns: mltrace's own pauses inside it (``analysis/pauses.py``), left out of
            ``total_ns`` and of the parts outside its model calls.
    """

    name: str
    label: str | None
    pid: int
    start_ns: int
    total_ns: int
    model_calls: int
    model_ns: int
    before_model_ns: int
    between_models_ns: int
    after_model_ns: int
    outside_ops_ns: int
    layers: list[NameTime] = field(default_factory=list)
    ops: list[NameTime] = field(default_factory=list)
    source: str | None = None
    paused_ns: int = 0

    @property
    def outside_ns(self) -> int:
        """The request's time outside every model call."""
        return self.total_ns - self.model_ns

    def as_dict(self) -> dict[str, Any]:
        """The report JSON's ``requests.slowest[]`` entry."""
        keys: tuple[str, ...] = ("name", "label", "source", "pid", "start_ns", "total_ns", "model_calls", "model_ns", "outside_ns")
        keys += ("before_model_ns", "between_models_ns", "after_model_ns", "outside_ops_ns", "paused_ns")
        out: dict[str, Any] = {k: getattr(self, k) for k in keys}
        out["layers"] = [{"name": x.name, "type": x.type, "ns": x.ns} for x in self.layers]
        out["ops"] = [{"name": x.name, "ns": x.ns} for x in self.ops]
        return out


@dataclass(frozen=True)
class Requests:
    """The requests of a run.

    Attributes:
        source: ``otel-server`` (the program's OpenTelemetry server spans) or ``user``
            (outermost user spans with a model call inside, groups of requests left out).
        names: the request spans' names, most frequent first.
        count: how many requests.
        p50_ns, p90_ns, p99_ns: percentiles of their durations (mltrace's own pauses left out).
        total_ns: their durations summed (the same).
        model_ns: their model time summed.
        slowest: the slowest requests, slowest first, each with where its time went.
        paused_ns: mltrace's own pauses inside them, left out of the durations.
    """

    source: str
    names: list[str]
    count: int
    p50_ns: int
    p90_ns: int
    p99_ns: int
    total_ns: int
    model_ns: int
    slowest: list[Request]
    paused_ns: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The report JSON's ``requests`` section."""
        keys = ("source", "names", "count", "p50_ns", "p90_ns", "p99_ns", "total_ns", "model_ns", "paused_ns")
        return {**{k: getattr(self, k) for k in keys}, "slowest": [r.as_dict() for r in self.slowest]}


def union_ns(intervals: Sequence[tuple[int, int]]) -> int:
    """The time covered by ``(start, end)`` intervals, overlaps counted once."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def find_requests(*, run: Run, slowest: int = 3, top: int = 3) -> Requests | None:
    """The run's requests (see the module docstring), or None when it has none.

    Args:
        run: a loaded run.
        slowest: how many of the slowest requests to explain.
        top: layers and ops listed per explained request.
    """
    import numpy as np

    t = run.table
    if not len(t):
        return None
    level = t.level.astype(np.int64)
    tree = tree_of(t)
    is_model = level == int(Level.MODEL)
    outer_model = is_model & ~tree.ancestor_or(is_model)
    source, candidates = _candidates(t, level, tree, outer_model)
    if not len(candidates):
        return None
    is_req = np.zeros(len(t), dtype=bool)
    is_req[candidates] = True
    rows = candidates[~tree.ancestor_or(is_req)[candidates]]
    is_req[:] = False
    is_req[rows] = True
    near = tree.nearest(is_req)
    models = _group(near, outer_model)
    pauses_of = PausesByTrack(run)
    pauses = {r: pauses_of.of(int(t.track[r])) for r in rows.tolist()}
    paused = {r: p.within(int(t.start[r]), int(t.end[r])) for r, p in pauses.items()}
    dur = {r: int(t.end[r]) - int(t.start[r]) - paused[r] for r in rows.tolist()}
    model_ns = {int(r): _clipped_union(t, models.get(int(r), []), int(r)) for r in rows.tolist()}
    order = sorted(rows.tolist(), key=lambda r: (-dur[r], int(t.start[r])))
    durations = list(dur.values())
    explained = [_explain(run, t, r, models.get(r, []), (near, level, tree), top, pauses[r]) for r in order[:slowest]]
    names = _names(t, rows)
    return Requests(
        source=source,
        names=names,
        count=len(rows),
        p50_ns=percentile_ns(durations, 50) or 0,
        p90_ns=percentile_ns(durations, 90) or 0,
        p99_ns=percentile_ns(durations, 99) or 0,
        total_ns=sum(durations),
        model_ns=sum(model_ns.values()),
        slowest=explained,
        paused_ns=sum(paused.values()),
    )


def _candidates(t: SpanTable, level: np.ndarray, tree: Tree, outer_model: np.ndarray) -> tuple[str, np.ndarray]:
    """``("otel-server", rows)`` where the run has OpenTelemetry server spans, else ``("user", rows)``:
    the user spans that have a model call inside them and are no group of requests (``_groups``)."""
    import numpy as np

    user = np.nonzero(level == int(Level.USER))[0]
    torchs = [i for i, name in enumerate(t.names) if torch_range_kind(name) is not None]
    user = user[~np.isin(t.name[user], torchs)]  # torch's own ranges are not the program's spans
    server_sets = {k for k in np.unique(t.attr[user]).tolist() if t.attr_set(k).get("mltrace.otel.kind") == "server"}
    if server_sets:
        return "otel-server", user[np.isin(t.attr[user], list(server_sets))]
    parent = t.parent_row()
    has_model = np.zeros(len(t), dtype=bool)
    rows = np.nonzero(outer_model)[0]
    while len(rows):  # mark every ancestor of an outermost model call
        rows = parent[rows]
        rows = rows[(rows >= 0) & ~has_model[np.maximum(rows, 0)]]
        has_model[rows] = True
    found = user[has_model[user]]
    return "user", found[~_groups(t, tree, found)]


def _groups(t: SpanTable, tree: Tree, rows: np.ndarray) -> np.ndarray:
    """For each of ``rows`` (user spans around model calls), whether it holds two or more of
    them of one name: a group of requests (a batch, a loop over requests, a program's main
    function), not a request itself."""
    import numpy as np

    if not len(rows):
        return np.zeros(0, dtype=bool)
    is_row = np.zeros(len(t), dtype=bool)
    is_row[rows] = True
    near = tree.nearest(is_row)
    holders, names = [], []
    anc, name = near[rows], t.name[rows]
    while len(anc):  # each row's name, once for every one of ``rows`` above it
        keep = anc >= 0
        anc, name = anc[keep], name[keep]
        holders.append(anc)
        names.append(name)
        anc = near[anc]
    holder, held = np.concatenate(holders), np.concatenate(names).astype(np.int64)
    width = int(held.max()) + 1 if len(held) else 1
    pairs, counts = np.unique(holder.astype(np.int64) * width + held, return_counts=True)
    group = np.zeros(len(t), dtype=bool)
    group[pairs[counts >= 2] // width] = True
    return group[rows]


def _group(near: np.ndarray, mask: np.ndarray) -> dict[int, list[int]]:
    """Rows where ``mask`` holds, by their nearest request (rows in no request left out)."""
    import numpy as np

    out: dict[int, list[int]] = {}
    rows = np.nonzero(mask & (near >= 0))[0]
    for row, req in zip(rows.tolist(), near[rows].tolist()):
        out.setdefault(req, []).append(row)
    return out


def _clipped_union(t: SpanTable, rows: list[int], req: int) -> int:
    lo, hi = int(t.start[req]), int(t.end[req])
    return union_ns([(max(lo, int(t.start[r])), min(hi, int(t.end[r]))) for r in rows if int(t.end[r]) > lo and int(t.start[r]) < hi])


def _explain(
    run: Run, t: SpanTable, req: int, models: list[int], where: tuple[np.ndarray, np.ndarray, Tree], top: int, pauses: Pauses
) -> Request:
    """Where the time of request ``req`` went (``where``: each row's nearest request, level and
    the tree); mltrace's own pauses are left out of its time outside the model calls."""
    import numpy as np

    near, level, tree = where
    lo, hi = int(t.start[req]), int(t.end[req])
    spans = sorted((max(lo, int(t.start[r])), min(hi, int(t.end[r]))) for r in models)
    spans = [(s, e) for s, e in spans if e > s]
    model_ns = union_ns(spans)
    first, last = (spans[0][0], max(e for _, e in spans)) if spans else (hi, hi)
    before = first - lo - pauses.within(lo, first)
    after = hi - last - pauses.within(last, hi)
    paused = pauses.within(lo, hi)
    inside = near == req
    in_model = np.zeros(len(t), dtype=bool)
    in_model[models] = True
    in_model = in_model | tree.ancestor_or(in_model)
    is_op = level == int(Level.OP)
    loose_ops = np.nonzero(inside & is_op & ~in_model & ~tree.ancestor_or(is_op))[0]
    track = run.tracks.get(int(t.track[req]))
    attrs = t.attrs(req)
    return Request(
        name=t.names[int(t.name[req])],
        label=_label(attrs),
        source=_source(attrs),
        pid=track.pid if track is not None else 0,
        start_ns=lo,
        total_ns=hi - lo - paused,
        model_calls=len(models),
        model_ns=model_ns,
        before_model_ns=before,
        between_models_ns=max(0, hi - lo - paused - model_ns - before - after),
        after_model_ns=after,
        outside_ops_ns=union_ns([(int(t.start[r]), int(t.end[r])) for r in loose_ops.tolist()]),
        layers=_top_self(t, np.nonzero(inside & (level == int(Level.LAYER)))[0], top),
        ops=_top_self(t, np.nonzero(inside & is_op)[0], top),
        paused_ns=paused,
    )


def _top_self(t: SpanTable, rows: np.ndarray, top: int) -> list[NameTime]:
    """Names of ``rows`` by self time (less their children of the same level), largest first."""
    import numpy as np

    if not len(rows):
        return []
    dur = (t.end[rows] - t.start[rows]).astype(np.int64)
    parent = t.parent_row()[rows]
    index = {int(r): i for i, r in enumerate(rows.tolist())}
    own = dur.copy()
    for i, p in enumerate(parent.tolist()):
        j = index.get(p)
        if j is not None:
            own[j] -= dur[i]
    per: dict[str, int] = {}
    first: dict[str, int] = {}
    for row, name, ns in zip(rows.tolist(), t.name[rows].tolist(), own.tolist()):
        per[t.names[name]] = per.get(t.names[name], 0) + max(0, ns)
        first.setdefault(t.names[name], row)
    ranked = sorted(per.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    return [NameTime(name, ns, _type(t.attrs(first[name]))) for name, ns in ranked]


def _type(attrs: dict[str, object]) -> str | None:
    value = attrs.get("ml.layer.type")
    return value if isinstance(value, str) else None


def _label(attrs: dict[str, object]) -> str | None:
    for key in _LABEL_KEYS:
        value = attrs.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value)
    return None


def _source(attrs: dict[str, object]) -> str | None:
    path, line = attrs.get("code.file.path"), attrs.get("code.line.number")
    if not isinstance(path, str) or not path:
        return None
    return f"{path}:{line}" if isinstance(line, int) and not isinstance(line, bool) else path


def _names(t: SpanTable, rows: np.ndarray) -> list[str]:
    import numpy as np

    uniq, counts = np.unique(t.name[rows], return_counts=True)
    return [t.names[int(u)] for u, _ in sorted(zip(uniq.tolist(), counts.tolist()), key=lambda x: (-x[1], t.names[x[0]]))]
