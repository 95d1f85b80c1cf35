"""TensorFlow profiler XSpace (``*.xplane.pb``) → mltrace events (pure functions).

``host_profile`` flattens the host plane of the ``XSpace`` that
``tf.profiler.experimental.start/stop`` writes to
``<logdir>/plugins/profile/<run>/<host>.xplane.pb``; ``xspace_to_events`` turns its
graph ops, graph-function calls and eager ops into model, layer (from Keras name
scopes) and op spans. The protobuf classes come from TensorFlow's ``xplane_pb2``
file, so reading a profile does not import TensorFlow. tests/data/tensorflow/ holds
real profiles (TensorFlow 2.21) of the shapes read here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from mltrace.formats.tf_flops import FlopTable
from mltrace.run.events import Event, Span, Track
from mltrace.run.levels import Level
from mltrace.tracer.tracks import TrackRegistry

HOST_PLANE = "/host:CPU"
TASK_PLANE = "Task Environment"

#: Ops that move or read data for a layer rather than compute it: they are
#: op spans but do not open layer spans (the executor runs variable reads of
#: later layers early, which would cut layers into fragments).
BOOKKEEPING_OPS = frozenset({"ReadVariableOp", "VarHandleOp", "Const", "NoOp", "Identity", "_Send", "_Recv", "_Arg", "_Retval"})

#: Ops that read a variable: their node sits in the scope of the layer that reads it
#: (``net_1/conv_1/Conv2D/ReadVariableOp``). The executor runs them as soon as it can, at the
#: start of a step, before that layer's span begins; such a read stays the model's span's child
#: (it ran outside the layer's time) and names its layer in ``ml.tf.layer``, as every op left in
#: the model's span whose scopes name a layer does (``_group_spans``).
VARIABLE_READ_OPS = frozenset({"ReadVariableOp"})

#: Synthetic thread ids for TensorFlow's own threads start here: above Linux's
#: largest pid (2^22), so they never collide with a real thread id.
SYNTHETIC_TID_BASE = 0x40000000

_OP_EVENT = re.compile(r"(?P<node>[^:]+):(?P<type>[A-Za-z_][A-Za-z0-9_]*)\Z")
_UNIQUIFIER = re.compile(r"(.+)_\d+\Z")
_WRAPPER_SCOPES = frozenset({"StatefulPartitionedCall", "PartitionedCall"})
_M64 = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995
_SEED = 0xC70F6907
_PB2: ModuleType | None = None


def std_thread_hash(ident: int) -> int:
    """``std::hash<std::thread::id>`` of a ``pthread_t`` with libstdc++ (signed 64 bits).

    TSL names host-tracer lines by it; ``ident`` is ``threading.get_ident()``
    (CPython returns ``pthread_self()``). This is libstdc++'s
    ``_Hash_bytes(&id, 8, 0xc70f6907)``.
    """
    value = ident & _M64
    h = (_SEED ^ (8 * _MUL)) & _M64
    data = ((value * _MUL) & _M64) ^ (((value * _MUL) & _M64) >> 47)
    h ^= (data * _MUL) & _M64
    h = (h * _MUL) & _M64
    h = ((h ^ (h >> 47)) * _MUL) & _M64
    h ^= h >> 47
    return h - (1 << 64) if h >= (1 << 63) else h


def synthetic_tid(line_id: int) -> int:
    """A stable track tid for a TensorFlow thread whose OS id is unknown."""
    return SYNTHETIC_TID_BASE | (line_id & 0x3FFFFFFF)


def xplane_pb2() -> ModuleType:
    """TensorFlow's ``xplane_pb2`` module, without importing TensorFlow when it is not loaded.

    Raises:
        ImportError: if TensorFlow (and so the proto module) is not installed.
    """
    global _PB2
    if _PB2 is not None:
        return _PB2
    if "tensorflow" in sys.modules:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2 as pb2  # type: ignore[import-not-found]

        _PB2 = pb2
        return pb2
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("reading an xplane.pb needs TensorFlow's protobuf classes: pip install tensorflow-cpu")
    path = os.path.join(list(spec.submodule_search_locations)[0], "tsl", "profiler", "protobuf", "xplane_pb2.py")
    file_spec = importlib.util.spec_from_file_location("mltrace._tf_xplane_pb2", path)
    if file_spec is None or file_spec.loader is None or not os.path.exists(path):
        raise ImportError(f"this TensorFlow has no {path}")
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    _PB2 = module
    return module


def read_xspace(source: str | os.PathLike[str] | bytes) -> Any:
    """Parses an ``xplane.pb`` file (or its bytes) into an ``XSpace`` message.

    Raises:
        ValueError: if the data is not an XSpace.
        OSError: if the file cannot be read.
    """
    data = bytes(source) if isinstance(source, (bytes, bytearray)) else Path(source).read_bytes()
    space = xplane_pb2().XSpace()
    try:
        space.ParseFromString(data)
    except Exception as exc:  # google.protobuf.message.DecodeError
        raise ValueError(f"not an XSpace: {exc}") from None
    if not any(p.name == HOST_PLANE for p in space.planes):
        raise ValueError("not a TensorFlow host profile (no /host:CPU plane)")
    return space


def find_xplane_files(logdir: str | os.PathLike[str]) -> list[Path]:
    """Every ``*.xplane.pb`` under ``logdir/plugins/profile/``, oldest run first."""
    return sorted(Path(logdir).glob("plugins/profile/*/*.xplane.pb"))


# -- flattening ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class XEventRow:
    """One host event with absolute times.

    Attributes:
        line_id: its line's id (TSL thread id).
        name: the event's name.
        start_ns: start, ns since the Unix epoch.
        end_ns: end, ns since the Unix epoch.
        stats: the event's stats (reference values resolved to their names).
    """

    line_id: int
    name: str
    start_ns: int
    end_ns: int
    stats: Mapping[str, Any]


@dataclass
class HostProfile:
    """The host plane of an XSpace, flattened.

    Attributes:
        start_ns: ``profile_start_time`` (ns since the epoch), 0 if absent.
        stop_ns: ``profile_stop_time`` (ns since the epoch), 0 if absent.
        lines: line id → thread name.
        events: every event, in line order then time order.
        hostnames: the XSpace's host names.
        clock: ``"relative"`` (line times after ``profile_start_time``) or
            ``"absolute"`` (older profiles: line times since the epoch).
    """

    start_ns: int = 0
    stop_ns: int = 0
    lines: dict[int, str] = field(default_factory=dict)
    events: list[XEventRow] = field(default_factory=list)
    hostnames: list[str] = field(default_factory=list)
    clock: str = "relative"


_WANTED_STATS = frozenset({"eager_op", "is_func", "tf_function_call"})


def host_profile(space: Any, wanted_stats: Iterable[str] = _WANTED_STATS) -> HostProfile:
    """Flattens the host plane's events into rows with absolute epoch times.

    Args:
        space: an ``XSpace`` message (see ``read_xspace``).
        wanted_stats: stat names to keep on each row (resolving every stat
            of every event is slow on large profiles).
    """
    out = HostProfile(hostnames=list(space.hostnames))
    wanted = frozenset(wanted_stats)
    host = None
    for plane in space.planes:
        if plane.name == TASK_PLANE:
            names = {k: v.name for k, v in plane.stat_metadata.items()}
            for st in plane.stats:
                key = names.get(st.metadata_id)
                if key == "profile_start_time":
                    out.start_ns = int(st.uint64_value or st.int64_value)
                elif key == "profile_stop_time":
                    out.stop_ns = int(st.uint64_value or st.int64_value)
        elif plane.name == HOST_PLANE:
            host = plane
    if host is None:
        return out
    stat_names = {k: v.name for k, v in host.stat_metadata.items()}
    wanted_ids = {k for k, v in stat_names.items() if v in wanted}
    event_names = {k: v.name for k, v in host.event_metadata.items()}
    # Line timestamps after 1e17 ns (1973) are absolute: profiles before TF normalised them.
    absolute = any(line.timestamp_ns > 10**17 for line in host.lines)
    out.clock = "absolute" if absolute else "relative"
    base = 0 if absolute else out.start_ns
    # One line per thread: its id is TSL's thread id (``std_thread_hash``), its name the thread's
    # (``python``, ``tf_Compute/…``). ``line.timestamp_ns`` is ns after ``profile_start_time``,
    # an event's ``offset_ps`` ps after its line's timestamp.
    for line in host.lines:
        out.lines[line.id] = line.display_name or line.name
        line_ns = base + line.timestamp_ns
        rows = []
        for e in line.events:
            start = line_ns + e.offset_ps // 1000
            stats: dict[str, Any] = {}
            if wanted_ids:
                for st in e.stats:
                    if st.metadata_id in wanted_ids:
                        kind = st.WhichOneof("value")
                        value = getattr(st, kind) if kind else None
                        stats[stat_names[st.metadata_id]] = stat_names.get(value, value) if kind == "ref_value" else value
            rows.append(XEventRow(line.id, event_names.get(e.metadata_id, ""), start, start + e.duration_ps // 1000, stats))
        rows.sort(key=lambda r: (r.start_ns, -r.end_ns))
        out.events.extend(rows)
    return out


# -- Keras name scopes → layer paths -------------------------------------------------------


def parse_op_event(name: str) -> tuple[str, str] | None:
    """``"net_1/conv_1/BiasAdd:_MklNativeFusedConv2D"`` → ``(node name, op type)``; None for other events."""
    if "::" in name or " " in name:
        return None
    m = _OP_EVENT.match(name)
    if m is None:
        return None
    return m.group("node"), m.group("type")


@dataclass(frozen=True)
class KerasModelInfo:
    """A Keras model's layers, by the paths mltrace names them with.

    Attributes:
        name: the model's name (``"mobilenetv2_1.00_96"``).
        layers: layer path (``"Conv1"``, ``"head/fc1"``) → layer class name.
        from_scopes: read from graph node names (``models_from_scopes``), not
            from the Keras model itself.
        defined: where the model's ``call`` is defined (``ml.defined.*``).
    """

    name: str
    layers: Mapping[str, str]
    from_scopes: bool = False
    defined: Mapping[str, Any] = field(default_factory=dict)


def _unscope(component: str, known: Callable[[str], bool], strip_first: bool) -> str | None:
    """A name scope component → the layer name it stands for, or None."""
    m = _UNIQUIFIER.match(component)
    stripped = m.group(1) if m is not None else None
    order = (stripped, component) if strip_first else (component, stripped)
    for cand in order:
        if cand is not None and known(cand):
            return cand
    return None


def layer_of_node(node: str, models: Mapping[str, KerasModelInfo]) -> tuple[KerasModelInfo, str] | None:
    """The model and the deepest layer path a graph node's name scopes lead to.

    ``net_1/head_1/fc1_1/Relu`` with model ``net`` holding ``head`` and
    ``head/fc1`` → ``(net, "head/fc1")``. Scopes before the model's (a
    function call inlined into the graph: ``StatefulPartitionedCall/net_1/…``)
    are skipped. A scope that is uniquified on the
    model (``net_1``) is taken to be uniquified on every layer below it too
    (TensorFlow adds the suffix when the function graph re-enters the scopes),
    which decides between layers named ``conv`` and ``conv_1``.

    Returns:
        ``(model, layer path)`` (the path is ``""`` for ops of the model
        outside any layer), or None when no scope is a known model.
    """
    comps = node.split("/")
    model: KerasModelInfo | None = None
    strip_first = False
    start = -1
    # The model's scope is usually first; function calls inlined into the graph add their own
    # scopes before it ("StatefulPartitionedCall/net_1/…" in evaluate()).
    while model is None and start < len(comps) - 2:
        start += 1
        model = models.get(comps[start])
        if model is None:
            m = _UNIQUIFIER.match(comps[start])
            if m is not None:
                model = models.get(m.group(1))
                strip_first = model is not None
    if model is None:
        return None
    path = ""
    layers = model.layers
    for comp in comps[start + 1 : -1]:
        prefix = f"{path}/" if path else ""

        def is_layer(c: str, prefix: str = prefix) -> bool:
            return f"{prefix}{c}" in layers

        name = _unscope(comp, is_layer, strip_first)
        if name is None:
            break
        path = f"{prefix}{name}"
    return model, path


# -- conversion ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LiveModelSpan:
    """A model span the live wrappers recorded (session clock, ns).

    Attributes:
        span_id: the span's id.
        start_ns: its start (ns, session clock).
        end_ns: its end (ns, session clock).
        tid: OS id of the calling thread.
        model: the Keras model's name.
        eager: whether the call ran eagerly (``__call__``) rather than as a
            graph function (``predict``, ``evaluate``).
    """

    span_id: int
    start_ns: int
    end_ns: int
    tid: int
    model: str
    eager: bool


@dataclass
class XSpaceStats:
    """What a conversion found.

    Attributes:
        events: host events read.
        graph_ops: graph-op events seen.
        graph_ops_in_models: those inside a model span (converted).
        eager_ops_in_models: eager ops inside a model span (converted).
        layer_spans: layer spans made from name scopes.
        op_spans: op spans made.
        ops_outside_layers: op spans of a model outside every layer.
        layer_ops_outside_layers: of them, those whose node's scopes name their layer
            (``ml.tf.layer``): run apart from that layer's span (a fragment of its call that
            ``merge_layer_fragments`` did not keep: a BatchNormalization's ``Rsqrt`` of its
            variance, run with the step's variable reads), variable reads included.
        variable_reads_outside_layers: of those, the variable reads (``VARIABLE_READ_OPS``):
            run before (or after) their layer's span.
        function_models: model spans made for ``tf.function`` calls.
        function_calls_unmatched: graph-function calls outside model spans
            whose ops led to no Keras model (not recorded as model calls).
        ops_with_flops: graph op spans given ``ml.flops``.
        xla_calls: model spans made for XLA-compiled calls (no layers).
        fragments_merged: layer spans folded into another span of the same
            layer call (one layer span per layer per call).
        skipped: events not converted, by reason.
        unknown_scopes: up to 10 node names whose first scope is no known model.
        lines_matched: host lines mapped to a Python thread by their id.
    """

    events: int = 0
    graph_ops: int = 0
    graph_ops_in_models: int = 0
    eager_ops_in_models: int = 0
    layer_spans: int = 0
    op_spans: int = 0
    ops_outside_layers: int = 0
    layer_ops_outside_layers: int = 0
    variable_reads_outside_layers: int = 0
    function_models: int = 0
    fragments_merged: int = 0
    function_calls_unmatched: int = 0
    ops_with_flops: int = 0
    xla_calls: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    unknown_scopes: list[str] = field(default_factory=list)
    lines_matched: int = 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {
            "events": self.events,
            "graph_ops": self.graph_ops,
            "graph_ops_in_models": self.graph_ops_in_models,
            "eager_ops_in_models": self.eager_ops_in_models,
            "layer_spans": self.layer_spans,
            "op_spans": self.op_spans,
            "ops_outside_layers": self.ops_outside_layers,
            "layer_ops_outside_layers": self.layer_ops_outside_layers,
            "variable_reads_outside_layers": self.variable_reads_outside_layers,
            "function_models": self.function_models,
            "fragments_merged": self.fragments_merged,
            "function_calls_unmatched": self.function_calls_unmatched,
            "ops_with_flops": self.ops_with_flops,
            "xla_calls": self.xla_calls,
            "skipped": dict(self.skipped),
            "unknown_scopes": list(self.unknown_scopes),
            "lines_matched": self.lines_matched,
        }


@dataclass
class XSpaceEvents:
    """The result of ``xspace_to_events``."""

    spans: list[Span] = field(default_factory=list)
    tracks: list[Track] = field(default_factory=list)
    stats: XSpaceStats = field(default_factory=XSpaceStats)

    def events(self) -> list[Event]:
        """The spans as one list (tracks are queued by the registry)."""
        return list(self.spans)


class _Intervals:
    """Model spans sorted by start, for "which one contains t" queries."""

    def __init__(self, spans: Sequence[tuple[int, int, Any]]) -> None:
        self.spans = sorted(spans, key=lambda s: (s[0], -s[1]))
        self.starts = [s[0] for s in self.spans]

    def containing(self, start: int, end: int, accept: Callable[[Any], bool] = lambda _: True) -> Any:
        import bisect

        i = bisect.bisect_right(self.starts, start)
        best = None
        for j in range(i - 1, -1, -1):
            s, e, item = self.spans[j]
            if s <= start and end <= e and accept(item):
                best = item
                break
            if i - j > 64:  # model spans rarely nest deeper; stop scanning far back
                break
        return best


_GraphOp = tuple[int, int, XEventRow, str, str]  # (start, end, row, node name, op type), session ns


def _layer_fragments(
    graph: Sequence[_GraphOp],
    idxs: Sequence[int],
    model_id: int,
    track_id: int,
    known: Mapping[str, KerasModelInfo],
    stats: XSpaceStats,
    new_id: Callable[[], int] | None,
) -> tuple[list[Span], list[int]]:
    """Layer spans around runs of consecutive ops of one layer on one thread (fragments).

    Each run of ops (in time order) under one name scope opens a layer span,
    nested by the layer's path below ``model_id``; bookkeeping ops
    (``BOOKKEEPING_OPS``) neither open nor close one.

    Args:
        graph: every graph op.
        idxs: the ops of one model call (or step) on one thread, in time order.
        model_id: the model span's id (the parent of top-level layers).
        track_id: the thread's track.
        known: known Keras models by name.
        stats: where node names of no known model are noted.
        new_id: allocates span ids; None: no layer spans (every op's parent is the model).

    Returns:
        The layer spans, and each op's parent span id (in ``idxs`` order).
    """
    paths: list[tuple[str, ...]] = []
    types_of: dict[str, str] = {}
    for i in idxs:
        found = layer_of_node(graph[i][3], known)
        if found is None:
            if len(stats.unknown_scopes) < 10 and graph[i][3] not in stats.unknown_scopes:
                stats.unknown_scopes.append(graph[i][3])
            paths.append(())
            continue
        info, path = found
        parts = tuple(path.split("/")) if path else ()
        paths.append(parts)
        for k in range(1, len(parts) + 1):
            p = "/".join(parts[:k])
            types_of.setdefault(p, info.layers.get(p, ""))
    spans: list[Span] = []
    stack: list[tuple[tuple[str, ...], Span]] = []
    parents: list[int] = []
    for i, parts in zip(idxs, paths):
        s, e, _, _, op_type = graph[i]
        if op_type in BOOKKEEPING_OPS:
            # Inside the innermost open span of its own layer (if that span is open), else the model.
            parent = model_id
            for sp_parts, sp in reversed(stack):
                if parts[: len(sp_parts)] == sp_parts:
                    parent = sp.id if sp.end_ns >= s else parent
                    break
            parents.append(parent)
            continue
        keep = 0
        while keep < len(stack) and keep < len(parts) and stack[keep][0] == parts[: keep + 1]:
            keep += 1
        del stack[keep:]
        if new_id is not None:
            for k in range(keep, len(parts)):
                sub = parts[: k + 1]
                path = "/".join(sub)
                up = stack[-1][1].id if stack else model_id
                attrs = {
                    "ml.framework": "tensorflow",
                    "ml.layer.path": path,
                    "ml.layer.type": types_of.get(path, ""),
                    "ml.tf.mode": "graph",
                }
                span = Span(new_id(), up, Level.LAYER, path, s, e, track_id, attrs)
                stack.append((sub, span))
                spans.append(span)
        for _, sp in stack:
            sp.end_ns = max(sp.end_ns, e)
        parents.append(stack[-1][1].id if stack else model_id)
    return spans, parents


def _fragment_work(graph: Sequence[_GraphOp], parent_of: Mapping[int, int], layers: Sequence[Span]) -> dict[int, int]:
    """Each layer span's compute time: its non-bookkeeping ops' durations, nested spans' included (ns)."""
    up = {s.id: s.parent_id for s in layers}
    work = dict.fromkeys(up, 0)
    for i, parent in parent_of.items():
        s, e, _, _, op_type = graph[i]
        if op_type in BOOKKEEPING_OPS:
            continue
        sid: int | None = parent
        while sid is not None and sid in work:
            work[sid] += e - s
            sid = up[sid]
    return work


@dataclass
class MergedLayers:
    """The layer spans of one call after ``merge_layer_fragments``.

    Attributes:
        kept: one span per layer path (parents resolved past dropped spans).
        moved_to: dropped span id → the id of the span that takes its children.
    """

    kept: list[Span]
    moved_to: dict[int, int]

    def resolve(self, span_id: int) -> int:
        """The span that holds what ``span_id`` held: itself when kept, else its nearest kept ancestor."""
        while span_id in self.moved_to:
            span_id = self.moved_to[span_id]
        return span_id


def merge_layer_fragments(layers: Sequence[Span], model_id: int, work: Mapping[int, int]) -> MergedLayers:
    """One layer span per layer path in one model call (or step).

    TensorFlow's executor runs a layer's ops as soon as their inputs are ready,
    so one layer call can show as several runs of ops (a BatchNormalization's
    ``Rsqrt`` of its variance before the convolution that feeds it, its
    ``Mul`` after), each a fragment span, and on several threads at once (a
    MultiHeadAttention's ``query`` projection on one, its ``key`` and ``value``
    on another). Per path, top-down, the fragment with the most compute time
    (``work``, ns) is kept, preferring one inside the kept span of its parent
    layer. A fragment on another thread that runs while the kept span does (their
    intervals overlap) and under the same parent is the same call: it joins the
    kept span, which grows to cover it (and then may overlap more such
    fragments), so its ops and nested spans are the layer's whichever thread ran
    them. The other fragments are dropped and their ops and nested spans move to
    the dropped span's nearest kept ancestor (which contains them in time), so no
    span lies outside its parent.

    Args:
        layers: the fragment spans (parents first within each path's nesting).
        model_id: the model span's id.
        work: compute time per span id (ns).

    Returns:
        The kept spans (their ``parent_id`` and times updated) and the moves.
    """
    by_path: dict[str, list[Span]] = {}
    for s in layers:
        by_path.setdefault(s.name, []).append(s)
    merged = MergedLayers([], {})
    kept_by_path: dict[str, int] = {}

    def call_of(s: Span) -> int:  # the kept span (or model) a fragment's parent now is
        return merged.resolve(s.parent_id if s.parent_id is not None else model_id)

    for path in sorted(by_path, key=lambda p: p.count("/")):
        parent_call = kept_by_path.get(path.rpartition("/")[0], model_id) if "/" in path else model_id
        fragments = by_path[path]
        best = max(fragments, key=lambda s: (call_of(s) == parent_call, work.get(s.id, 0), -s.start_ns))
        kept_by_path[path] = best.id
        merged.kept.append(best)
        for s in _join_concurrent(best, [s for s in fragments if s is not best], merged, call_of):
            merged.moved_to[s.id] = s.parent_id if s.parent_id is not None else model_id
    for s in merged.kept:
        if s.parent_id is not None:
            s.parent_id = merged.resolve(s.parent_id)
    merged.kept.sort(key=lambda s: (s.start_ns, -s.end_ns))
    return merged


def _join_concurrent(kept: Span, others: Sequence[Span], merged: MergedLayers, call_of: Callable[[Span], int]) -> list[Span]:
    """Joins to ``kept`` the fragments of its path that ran on another thread while it ran, under
    the same parent call (``call_of``; see ``merge_layer_fragments``): they move to it and it grows
    to cover them, until no other one overlaps it. Returns the fragments not joined."""
    home = call_of(kept)
    left = list(others)
    grown = True
    while grown:
        grown = False
        for s in list(left):
            if s.track_id != kept.track_id and s.start_ns <= kept.end_ns and kept.start_ns <= s.end_ns and call_of(s) == home:
                merged.moved_to[s.id] = kept.id
                kept.start_ns, kept.end_ns = min(kept.start_ns, s.start_ns), max(kept.end_ns, s.end_ns)
                left.remove(s)
                grown = True
    return left


def _ops_by_function_call(
    graph: Sequence[_GraphOp], pending: Sequence[int], functions: Sequence[tuple[int, int, XEventRow]], live: _Intervals
) -> list[tuple[tuple[int, int, XEventRow], list[int]]]:
    """The graph ops (indices in ``pending``) inside each graph-function call outside the live model spans, in call order."""
    outside = [(s, e, row) for s, e, row in functions if live.containing(s, e) is None]
    calls = _Intervals([(s, e, k) for k, (s, e, _) in enumerate(outside)])
    by_call: dict[int, list[int]] = {}
    for i in pending:
        k = calls.containing(graph[i][0], graph[i][1])
        if k is not None:
            by_call.setdefault(k, []).append(i)
    return [(outside[k], idxs) for k, idxs in sorted(by_call.items(), key=lambda kv: (outside[kv[0]][0], outside[kv[0]][1]))]


def function_entry(function: str) -> tuple[str, str]:
    """A graph function's runtime name → (Keras method, entry point).

    ``__inference_signature_wrapper_serving_default_401`` (a reloaded
    SavedModel's signature) → ``("saved_model", "serving_default")``;
    ``__inference_restored_function_body_12`` (a reloaded ``tf.function``
    attribute, e.g. ``model.export``'s ``serve``) → ``("saved_model",
    "restored_function")``; anything else (``__inference_serve_88``, a
    ``tf.function`` of the program) → ``("tf.function", "serve")``.
    """
    base = re.sub(r"_\d+\Z", "", function.removeprefix("__inference_"))
    if base.startswith("signature_wrapper_"):
        return "saved_model", base.removeprefix("signature_wrapper_")
    if base == "restored_function_body":
        return "saved_model", "restored_function"
    return "tf.function", base


def models_from_scopes(nodes: Iterable[str]) -> dict[str, KerasModelInfo]:
    """Keras models guessed from graph node names alone (a SavedModel whose Keras model this process never saw).

    Wrapper scopes (``StatefulPartitionedCall``, ``PartitionedCall``) are
    skipped; the next scope, less its ``_<n>`` suffix, is the model and the one
    after it a top-level layer (type unknown). Nodes with fewer scopes add
    nothing.
    """
    layers: dict[str, dict[str, str]] = {}
    for node in nodes:
        comps = [c for c in node.split("/") if c not in _WRAPPER_SCOPES]
        if len(comps) < 3:
            continue
        model, layer = (_UNIQUIFIER.sub(r"\1", c) for c in comps[:2])
        layers.setdefault(model, {})[layer] = ""
    return {name: KerasModelInfo(name, paths, from_scopes=True) for name, paths in layers.items()}


def _function_model(
    call: tuple[int, int, XEventRow],
    nodes: Sequence[str],
    known: dict[str, KerasModelInfo],
    new_id: Callable[[], int],
    track_id: int,
    pythons: Mapping[int, tuple[int, str]],
    out: XSpaceEvents,
    site: Mapping[str, Any],
    xla_model: str | None = None,
    signatures: Mapping[str, str] | None = None,
    traced_from: int | None = None,
) -> LiveModelSpan | None:
    """A model span for one graph-function call whose ops ran a Keras model (None: no model found).

    The model is the known one most of the call's nodes lead to, else, for a
    SavedModel, one read from the node names (``models_from_scopes``, added to
    ``known``). A ``tf.function`` call is
    named by the model; a SavedModel signature by ``<model>:<signature>``.
    ``site``: the ``code.*`` attributes of the Python line that made the call.
    ``xla_model``: the model of an XLA-compiled call, whose ops the profiler
    does not show (``ml.tf.xla``; no layers). ``signatures``: signature keys by
    function name, where ``tf.saved_model.load`` gave them. ``traced_from``: the start of the
    ``tf.function`` call around it, when that call traced the function first: the span
    begins there, so the call's tracing is in it (``ml.tf.trace_ns``), not idle time before it.
    """
    start, end, row = call
    method, entry = function_entry(str(row.stats["eager_op"]))
    entry = (signatures or {}).get(str(row.stats["eager_op"]), entry)
    names = Counter(found[0].name for node in nodes if (found := layer_of_node(node, known)) is not None)
    if not names and method == "saved_model":
        for info in models_from_scopes(nodes).values():
            known.setdefault(info.name, info)
        names = Counter(found[0].name for node in nodes if (found := layer_of_node(node, known)) is not None)
    if not names and xla_model is not None and xla_model in known:
        names = Counter({xla_model: 1})
    if not names:
        return None
    model_name = names.most_common(1)[0][0]
    guessed = known[model_name].from_scopes
    attrs: dict[str, Any] = {
        "ml.framework": "tensorflow",
        "ml.layer.type": "Model",
        "ml.keras.method": method,
        "ml.tf.function": row.stats["eager_op"],
        "ml.model.name": model_name,
    }
    if method == "saved_model":
        attrs["ml.tf.signature"] = entry
    if guessed:
        attrs["ml.tf.model_from_scopes"] = True
    if xla_model is not None:
        attrs["ml.tf.xla"] = True
    if traced_from is not None and traced_from < start:
        attrs["ml.tf.trace_ns"] = start - traced_from
        start = traced_from
    attrs.update(known[model_name].defined)
    if site:
        attrs.update(site)
        attrs["ml.call.file.path"], attrs["ml.call.line.number"] = site["code.file.path"], site["code.line.number"]
    name = f"{model_name}:{entry}" if method == "saved_model" else model_name
    sid = new_id()
    out.spans.append(Span(sid, None, Level.MODEL, name, start, end, track_id, attrs))
    out.stats.function_models += 1
    return LiveModelSpan(sid, start, end, pythons.get(row.line_id, (0, ""))[0], model_name, False)


@dataclass(frozen=True, slots=True)
class FunctionCall:
    """A graph-function call as Python made it (``ConcreteFunction._call_flat``).

    Attributes:
        start_ns: its start (ns, session clock).
        end_ns: its end (ns, session clock).
        function: the function's runtime name (the profiler's ``eager_op``).
        batch: the first dimension of its first input, None if unknown.
        site: ``code.*`` of the model-code line that made the call.
    """

    start_ns: int
    end_ns: int
    function: str
    batch: int | None
    site: Mapping[str, Any] | None = None


class _FunctionWork:
    """FLOPs of the graph ops of one function call, from its function's ``FlopTable`` and the call's batch size."""

    def __init__(self, calls: Sequence[FunctionCall], tables: Mapping[str, FlopTable]) -> None:
        self.calls = _Intervals([(c.start_ns, c.end_ns, c) for c in calls])
        self.tables = tables

    def python_call(self, call: tuple[int, int, str]) -> FunctionCall | None:
        """The Python call of a profiled function call (start, end, function name), if recorded."""
        mid = (call[0] + call[1]) // 2  # the two clocks agree to a few µs; the Python call holds the middle
        found: FunctionCall | None = self.calls.containing(mid, mid, lambda c: c.function == call[2])
        return found

    def flops(self, graph: Sequence[_GraphOp], idxs: Sequence[int], call: tuple[int, int, str] | None) -> list[float | None]:
        """``ml.flops`` of each op in ``idxs`` (time order) run by ``call`` (start, end, function name)."""
        table = self.tables.get(call[2]) if call is not None else None
        if call is None or table is None:
            return [None] * len(idxs)
        py = self.python_call(call)
        return table.take(((graph[i][3], graph[i][4]) for i in idxs), py.batch if py is not None else None)


def whole_function_op(name: str) -> str | None:
    """The function of an event that runs a whole graph function as one op
    (``__inference_f_67:__inference_f_67``: XLA's compiled cluster), else None."""
    head, sep, tail = name.partition(":")
    return head if sep and head == tail and head.startswith("__inference_") else None


def _xla_call_model(
    call: tuple[int, int, XEventRow],
    xla_runs: Mapping[tuple[int, str], Sequence[int]],
    model_names: Mapping[str, str],
    live: _Intervals,
    made: set[tuple[int, int, int]],
) -> str | None:
    """The model of a graph-function call that ran as one XLA op (outside live spans, not yet a
    model span), by its function's name; None otherwise."""
    start, end, row = call
    name = str(row.stats["eager_op"])
    if (start, end, row.line_id) in made or name not in model_names or live.containing(start, end) is not None:
        return None
    if not any(start <= t <= end for t in xla_runs.get((row.line_id, name), ())):
        return None
    return model_names[name]


_Call = tuple[int, int, XEventRow]  # a graph-function call (EagerExecute with is_func): start, end (session ns), row
_CallKey = tuple[int, int, int]  # (start, end, line id)


@dataclass
class HostEvents:
    """A host profile's events by what they become (times on the session clock, ns).

    Attributes:
        graph: graph ops (``node:Type`` events) as ``(start, end, row, node name, op type)``.
        functions: graph-function calls (``EagerExecute`` with ``is_func``).
        eager: eager ops (``EagerExecute`` of one op).
        xla_runs: (line id, function) → starts of the events that ran the whole function as one op.
        traced: ``tf.function`` calls that traced their function first (the event TensorFlow
            records around ``Function.__call__``, stat ``tf_function_call`` ``traced-…``), as
            (start, end, (start, line id)).
    """

    graph: list[_GraphOp] = field(default_factory=list)
    functions: list[_Call] = field(default_factory=list)
    eager: list[_Call] = field(default_factory=list)
    xla_runs: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    traced: list[tuple[int, int, tuple[int, int]]] = field(default_factory=list)


def sort_host_events(rows: Iterable[XEventRow], to_session_ns: Callable[[int], int]) -> HostEvents:
    """Sorts host events into graph ops, function calls, eager ops and XLA runs; other events are dropped.

    Graph execution (``predict``, ``tf.function``) shows one executor TraceMe per op,
    ``<node name>:<op type>``, on the inter-op pool's threads (``tf_Compute``); eager execution
    an ``EagerExecute`` on the calling thread, with stats ``eager_op`` (the op type, or the
    function's name) and ``is_func``. Around each ``tf.function`` call, on the calling thread,
    an event named after the Python function has stat ``tf_function_call``: ``traced-…`` when
    the call traced its function before running it.
    """
    out = HostEvents()
    for row in rows:
        mode = row.stats.get("tf_function_call")
        if mode is not None:
            if str(mode).startswith("traced"):
                start = to_session_ns(row.start_ns)
                out.traced.append((start, to_session_ns(row.end_ns), (start, row.line_id)))
            continue
        parsed = parse_op_event(row.name)
        if parsed is not None:
            out.graph.append((to_session_ns(row.start_ns), to_session_ns(row.end_ns), row, parsed[0], parsed[1]))
        elif row.name == "EagerExecute" and "eager_op" in row.stats:
            item = (to_session_ns(row.start_ns), to_session_ns(row.end_ns), row)
            (out.functions if row.stats.get("is_func") else out.eager).append(item)
        elif (whole := whole_function_op(row.name)) is not None:
            out.xla_runs.setdefault((row.line_id, whole), []).append(to_session_ns(row.start_ns))
    return out


def line_thread(line_id: int, python_threads: Mapping[int, tuple[int, str]], line_names: Mapping[int, str]) -> tuple[int, str]:
    """The (tid, name) of a host line's track: the Python thread it is, else a synthetic tid and the line's name."""
    mapped = python_threads.get(line_id)
    if mapped is not None:
        return mapped
    return synthetic_tid(line_id), line_names.get(line_id, f"tf thread {line_id}")


def call_key(call: _Call) -> _CallKey:
    """A function call's identity: (start, end, line id)."""
    return call[0], call[1], call[2].line_id


def call_function(call: _Call) -> tuple[int, int, str]:
    """A function call as (start, end, function name), as ``_FunctionWork`` takes it."""
    return call[0], call[1], str(call[2].stats["eager_op"])


def number_steps(keys: Iterable[tuple[int, _CallKey | None]]) -> dict[tuple[int, _CallKey | None], int]:
    """Numbers the steps (graph-function calls) of each model span from 0, in time order;
    keys without a step get no number."""
    numbers: dict[tuple[int, _CallKey | None], int] = {}
    per_model: Counter[int] = Counter()
    for key in sorted((k for k in keys if k[1] is not None), key=lambda k: (k[0], k[1] or (0, 0, 0))):
        numbers[key] = per_model[key[0]]
        per_model[key[0]] += 1
    return numbers


def graph_op_attrs(node: str, op_type: str, flops: float | None) -> dict[str, Any]:
    """The attributes of a graph op's span."""
    attrs: dict[str, Any] = {"ml.framework": "tensorflow", "ml.op.name": op_type, "ml.op.type": op_type, "ml.tf.node": node}
    if flops is not None:
        attrs["ml.flops"] = flops
    return attrs


def eager_op_attrs(op_type: str) -> dict[str, Any]:
    """The attributes of an eager op's span."""
    return {"ml.framework": "tensorflow", "ml.op.name": op_type, "ml.op.type": op_type, "ml.tf.mode": "eager"}


class _Converter:
    """One ``xspace_to_events`` conversion: its inputs, the tracks it used and its output."""

    def __init__(
        self,
        profile: HostProfile,
        tracks: TrackRegistry,
        new_id: Callable[[], int],
        levels: frozenset[Level] | set[Level],
        pythons: Mapping[int, tuple[int, str]],
        pid: int | None,
        known: dict[str, KerasModelInfo],
        live: _Intervals,
        work: _FunctionWork,
    ) -> None:
        self.profile = profile
        self.tracks = tracks
        self.new_id = new_id
        self.want_layer, self.want_op = Level.LAYER in levels, Level.OP in levels
        self.pythons = pythons
        self.pid = pid
        self.known = known
        self.live = live
        self.work = work
        self.out = XSpaceEvents(stats=XSpaceStats(events=len(profile.events)))
        self.skipped: Counter[str] = Counter()
        self.used: dict[int, Track] = {}
        self.traced = _Intervals([])  # tf.function calls that traced (``HostEvents.traced``)

    def track_of(self, line_id: int) -> Track:
        """The track of a host line (``line_thread``)."""
        tid, name = line_thread(line_id, self.pythons, self.profile.lines)
        t = self.tracks.thread(tid, name, pid=self.pid)
        self.used[t.id] = t
        return t

    def site_of(self, call: _Call) -> Mapping[str, Any]:
        """The ``code.*`` of the Python line that made a function call, if recorded."""
        py = self.work.python_call(call_function(call))
        return py.site if py is not None and py.site else {}

    def function_model(
        self, call: _Call, nodes: Sequence[str], signatures: Mapping[str, str] | None, xla_model: str | None = None
    ) -> LiveModelSpan | None:
        """``_function_model`` for a call on its line's track."""
        track = self.track_of(call[2].line_id).id
        line = call[2].line_id
        traced = self.traced.containing(call[0], call[1], lambda item: item[1] == line)
        return _function_model(
            call,
            nodes,
            self.known,
            self.new_id,
            track,
            self.pythons,
            self.out,
            self.site_of(call),
            xla_model,
            signatures,
            traced_from=traced[0] if traced is not None else None,
        )


@dataclass
class _Owners:
    """Which model span holds each graph op, and the model spans made for function calls.

    Attributes:
        owner: per graph op, its model span (None: outside every one).
        made_ids: ids of the model spans made for function calls.
        made_calls: the calls they were made for.
        unmatched: function calls whose ops led to no known model.
        call_of: model span id (or step key) → its function call (start, end, function name).
    """

    owner: list[LiveModelSpan | None]
    made_ids: set[int] = field(default_factory=set)
    made_calls: set[_CallKey] = field(default_factory=set)
    unmatched: set[_CallKey] = field(default_factory=set)
    call_of: dict[Any, tuple[int, int, str]] = field(default_factory=dict)


def _function_call_models(cv: _Converter, host: HostEvents, signatures: Mapping[str, str] | None) -> _Owners:
    """Graph ops in a live model span belong to it; those of a function call outside every live
    span to a model span made for the call when its ops ran a known model."""
    owners = _Owners([cv.live.containing(s, e) for s, e, *_ in host.graph])
    pending = [i for i, o in enumerate(owners.owner) if o is None]
    if not pending or not host.functions:
        return owners
    for call, idxs in _ops_by_function_call(host.graph, pending, host.functions, cv.live):
        made = cv.function_model(call, [host.graph[i][3] for i in idxs], signatures)
        if made is None:
            owners.unmatched.add(call_key(call))
            continue
        owners.made_ids.add(made.span_id)
        owners.call_of[made.span_id] = call_function(call)
        owners.made_calls.add(call_key(call))
        for i in idxs:
            owners.owner[i] = made
    return owners


def _xla_models(
    cv: _Converter, host: HostEvents, owners: _Owners, model_names: Mapping[str, str], signatures: Mapping[str, str] | None
) -> None:
    """A model span (without layers) for each function call that ran as one XLA op."""
    for call in host.functions:
        model = _xla_call_model(call, host.xla_runs, model_names, cv.live, owners.made_calls)
        if model is not None and cv.function_model(call, (), signatures, model) is not None:
            cv.out.stats.xla_calls += 1
            owners.unmatched.discard(call_key(call))


def _group_ops(cv: _Converter, host: HostEvents, owners: _Owners) -> dict[tuple[int, _CallKey | None], list[int]]:
    """Graph ops by (model span id, step): a graph model call (predict, evaluate) runs one graph
    function per batch; each is one call of each layer."""
    steps = _Intervals([(s, e, call_key((s, e, row))) for s, e, row in host.functions if cv.live.containing(s, e) is not None])
    owners.call_of.update({call_key(c): call_function(c) for c in host.functions})
    groups: dict[tuple[int, _CallKey | None], list[int]] = {}
    for i, o in enumerate(owners.owner):
        if o is None:
            cv.skipped["graph op outside model spans"] += 1
            continue
        step = steps.containing(host.graph[i][0], host.graph[i][1]) if not o.eager and o.span_id not in owners.made_ids else None
        groups.setdefault((o.span_id, step), []).append(i)
    return groups


def _group_layers(cv: _Converter, graph: Sequence[_GraphOp], idxs: Sequence[int], model_id: int) -> tuple[list[Span], dict[int, int]]:
    """The layer fragments of one group's ops, thread by thread, and each op's parent span id."""
    layers: list[Span] = []
    parent_of: dict[int, int] = {}
    by_line: dict[int, list[int]] = {}
    for i in idxs:
        by_line.setdefault(graph[i][2].line_id, []).append(i)
    for line_id, line_idxs in by_line.items():
        t = cv.track_of(line_id)
        line_idxs.sort(key=lambda i: (graph[i][0], -graph[i][1]))
        made, parents = _layer_fragments(graph, line_idxs, model_id, t.id, cv.known, cv.out.stats, cv.new_id if cv.want_layer else None)
        layers.extend(made)
        parent_of.update(zip(line_idxs, parents))
    return layers, parent_of


def _group_spans(
    cv: _Converter,
    graph: Sequence[_GraphOp],
    key: tuple[int, _CallKey | None],
    idxs: list[int],
    call: tuple[int, int, str] | None,
    step_no: int | None,
) -> None:
    """The layer spans (fragments merged) and op spans of one group's ops."""
    stats = cv.out.stats
    model_id = key[0]
    layers, parent_of = _group_layers(cv, graph, idxs, model_id)
    moved = merge_layer_fragments(layers, model_id, _fragment_work(graph, parent_of, layers))
    stats.fragments_merged += len(layers) - len(moved.kept)
    for span in moved.kept:
        if step_no is not None:
            span.attrs["ml.tf.step"] = step_no
        cv.out.spans.append(span)
    stats.layer_spans += len(moved.kept)
    if cv.want_op:
        idxs.sort(key=lambda i: (graph[i][0], -graph[i][1]))
        for i, f in zip(idxs, cv.work.flops(graph, idxs, call)):
            s, e, row, node, op_type = graph[i]
            parent = moved.resolve(parent_of[i])
            stats.ops_with_flops += f is not None
            attrs = graph_op_attrs(node, op_type, f)
            if parent == model_id and (layer := _layer_named(node, cv.known)):
                attrs["ml.tf.layer"] = layer
                stats.layer_ops_outside_layers += 1
                stats.variable_reads_outside_layers += op_type in VARIABLE_READ_OPS
            cv.out.spans.append(Span(cv.new_id(), parent, Level.OP, op_type, s, e, cv.track_of(row.line_id).id, attrs))
            stats.op_spans += 1
            stats.ops_outside_layers += parent == model_id
    stats.graph_ops_in_models += len(idxs)


def _layer_named(node: str, known: Mapping[str, KerasModelInfo]) -> str:
    """The path of the layer whose scope a node is in (a variable read's: the layer that reads the
    variable, ``net_1/head_1/fc1_1/MatMul/ReadVariableOp`` → ``head/fc1``; a BatchNormalization's
    ``net_1/bn_1/batchnorm/Rsqrt`` → ``bn``), or "" where its scopes name no layer of a known model."""
    found = layer_of_node(node, known)
    return found[1] if found is not None else ""


def _eager_spans(cv: _Converter, eager: Sequence[_Call]) -> None:
    """Eager ops inside eager model spans on the same thread; their parent (a layer span, or the
    model) is set by ``nest_by_containment`` on that thread."""
    for s, e, row in eager:
        mapped = cv.pythons.get(row.line_id)
        tid = mapped[0] if mapped is not None else None

        def same_thread(m: LiveModelSpan, tid: int | None = tid) -> bool:
            return m.tid == tid

        if cv.live.containing(s, e, same_thread) is None:
            cv.skipped["eager op outside model spans"] += 1
            continue
        t = cv.track_of(row.line_id)
        op_type = str(row.stats["eager_op"])
        cv.out.spans.append(Span(cv.new_id(), None, Level.OP, op_type, s, e, t.id, eager_op_attrs(op_type)))
        cv.out.stats.op_spans += 1
        cv.out.stats.eager_ops_in_models += 1


def xspace_to_events(
    profile: HostProfile,
    *,
    to_session_ns: Callable[[int], int],
    tracks: TrackRegistry,
    new_id: Callable[[], int],
    levels: frozenset[Level] | set[Level],
    live_models: Sequence[LiveModelSpan] = (),
    models: Mapping[str, KerasModelInfo] | None = None,
    python_threads: Mapping[int, tuple[int, str]] | None = None,
    pid: int | None = None,
    function_calls: Sequence[FunctionCall] = (),
    function_flops: Mapping[str, FlopTable] | None = None,
    function_model_names: Mapping[str, str] | None = None,
    signatures: Mapping[str, str] | None = None,
) -> XSpaceEvents:
    """Converts a host profile into layer and op spans under the model spans.

    Graph ops (``node:Type`` events) inside a live model span (any thread)
    become op spans on their thread, and each run of consecutive ops of one
    layer (by name scope) a layer span around them, nested by the layer's
    path, with the model span as parent. A ``tf.function`` call
    (``EagerExecute`` with ``is_func``) outside every live span whose ops
    belong to a known model becomes a model span itself. Eager ops
    (``EagerExecute``) inside a live model span on the same thread
    become op spans there (their parent layer is found by
    ``nest_by_containment``); inside ``predict`` those are the input
    pipeline's. Events outside model spans are not converted.

    Args:
        profile: the flattened host plane (``host_profile``).
        to_session_ns: converts epoch ns to the session clock.
        tracks: allocates thread tracks.
        new_id: allocates span ids.
        levels: layer spans need ``LAYER``, op spans ``OP``.
        live_models: the model spans the live wrappers recorded.
        models: known Keras models by name, with their layer paths.
        python_threads: ``std_thread_hash(ident)`` → (OS thread id, name) of
            Python threads; their lines go on the threads' own tracks.
        pid: the process id for thread tracks (default: the registry's).
        function_calls: graph-function calls seen from Python (their batch sizes).
        function_flops: counted ops of each graph function by name (``tf_flops``);
            graph ops of a function call get ``ml.flops`` from them.
        function_model_names: the Keras model each graph function runs, by its
            name (from its Python graph): an XLA-compiled call, one op to the
            profiler, becomes a model span without layers.
        signatures: a loaded SavedModel's signature keys by function name
            (``tf.saved_model.load``); other signatures are named from the
            function's name (``function_entry``).

    Returns:
        The spans (explicit parents) and stats.
    """
    known = dict(models or {})
    pythons = python_threads or {}
    live = _Intervals([(m.start_ns, m.end_ns, m) for m in live_models])
    work = _FunctionWork(function_calls, function_flops or {})
    cv = _Converter(profile, tracks, new_id, levels, pythons, pid, known, live, work)
    stats = cv.out.stats
    stats.lines_matched = sum(1 for line_id in profile.lines if line_id in pythons)
    host = sort_host_events(profile.events, to_session_ns)
    cv.traced = _Intervals(host.traced)
    stats.graph_ops = len(host.graph)
    owners = _function_call_models(cv, host, signatures)
    _xla_models(cv, host, owners, function_model_names or {}, signatures)
    stats.function_calls_unmatched = len(owners.unmatched)
    groups = _group_ops(cv, host, owners)
    step_numbers = number_steps(groups)
    for key, idxs in groups.items():
        call = owners.call_of.get(key[1] if key[1] is not None else key[0])
        _group_spans(cv, host.graph, key, idxs, call, step_numbers.get(key))
    if cv.want_op:
        _eager_spans(cv, host.eager)
    stats.skipped = dict(cv.skipped)
    cv.out.tracks = list(cv.used.values())
    return cv.out
