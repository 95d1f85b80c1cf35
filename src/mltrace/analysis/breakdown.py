"""Where the time went: per level, per layer, per layer type.

Definitions (all times in ns):

- A span's *total* time is its duration.
- A layer's *self* time is its total minus the total of its direct children at
  the model, layer or user level (ops, library calls and kernels inside a layer
  are its contents, not its children in this sense).
- A level's *time* is the sum of the durations of the spans of that level that
  have no ancestor of the same level, so nested layers are not counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mltrace.run.levels import Level
from mltrace.run.store import Run

_OP_LEVELS = (Level.OP, Level.LIBRARY, Level.KERNEL)  # they end together, with the op level


@dataclass
class LevelTime:
    """Time recorded at one level."""

    level: Level
    spans: int
    time_ns: int


@dataclass
class LayerStat:
    """One layer (or model), aggregated over its calls.

    Attributes:
        name: the layer path ("layer1.0.conv1") or the model's class name.
        level: MODEL or LAYER.
        type: the layer type ("Conv2d").
        calls: number of calls.
        total_ns: sum of call durations (ns).
        self_ns: sum of self times (ns); where the layer level ended early, a model row sums
            only the calls that have layer spans.
        file, line: the layer's source (``code.file.path``, ``code.line.number``): the call
            site in model code in runs that record ``ml.defined.*``, where the layer's
            ``forward`` is defined in older runs.
        defined_file, defined_line: where the layer's ``forward`` is defined
            (``ml.defined.file.path``, ``ml.defined.line.number``); None when not recorded.
        ops: op name → (calls, total ns) of ops nested directly in this layer.
    """

    name: str
    level: Level
    type: str
    calls: int = 0
    total_ns: int = 0
    self_ns: int = 0
    file: str | None = None
    line: int | None = None
    framework: str = ""
    ops: dict[str, list[int]] = field(default_factory=dict)
    defined_file: str | None = None
    defined_line: int | None = None

    @property
    def location(self) -> str:
        """``file:line`` or "" when unknown."""
        return f"{self.file}:{self.line}" if self.file else ""

    @property
    def defined(self) -> str:
        """``file:line`` of the ``forward`` definition, or "" when not recorded."""
        return f"{self.defined_file}:{self.defined_line}" if self.defined_file else ""


@dataclass
class TypeStat:
    """All layers of one type together."""

    type: str
    calls: int = 0
    self_ns: int = 0


@dataclass
class Breakdown:
    """The report's data.

    Attributes:
        levels: time per hierarchy level present.
        layers: model and layer stats, by total time, largest first.
        types: layer types, by self time, largest first.
        model_calls: number of model spans.
        model_ns: total model time (ns).
        wall_ns: first start to last end over all spans (ns).
        span_count: number of spans.
        ops_outside_layers: op spans inside a model span but in no layer span, less those
            that name their layer below.
        ops_outside_layers_ns: the time of the outermost of them (ns): a nested op's is in its
            outer op's.
        reads_outside_layers: variable reads inside a model span and in no layer span that
            name the layer they read for (``ml.tf.layer``: TensorFlow ran them before that
            layer's span began); not counted in ``ops_outside_layers``.
        reads_outside_layers_ns: the time of the outermost of them (ns).
        layer_ops_outside_layers: the other ops inside a model span and in no layer span that
            name their layer (``ml.tf.layer``: TensorFlow ran them apart from the rest of that
            layer's call, a BatchNormalization's arithmetic on its weights alone with the step's
            variable reads); not counted in ``ops_outside_layers``.
        layer_ops_outside_layers_ns: the time of the outermost of them (ns).
        ops_outside_models: op spans in no model span at all (program code around the model).
        layer_model_calls: where the layer level ended before the run did
            (run.json ``layer_window``), the model calls that started before it (those
            in flight then finish their layer spans); else None.
        layer_model_ns: their total time (ns), the base of layer shares; else None.
        op_model_ns: the time of those of them that also ended before their framework's op
            level did (``op_window``, ``OpEnds``), the base of op, library and kernel shares;
            else None.
        op_model_calls: the number of those calls; else None.
    """

    levels: list[LevelTime]
    layers: list[LayerStat]
    types: list[TypeStat]
    model_calls: int
    model_ns: int
    wall_ns: int
    span_count: int
    ops_outside_layers: int = 0
    ops_outside_layers_ns: int = 0
    ops_outside_models: int = 0
    reads_outside_layers: int = 0
    reads_outside_layers_ns: int = 0
    layer_ops_outside_layers: int = 0
    layer_ops_outside_layers_ns: int = 0
    layer_model_calls: int | None = None
    layer_model_ns: int | None = None
    op_model_ns: int | None = None
    op_model_calls: int | None = None

    def base_ns(self, level: Level) -> int:
        """The model time a level's share is of: the model calls during which it recorded; 0
        (no share: the viewers print "-") for user spans, the program's own marks, which hold
        model calls (a request, a ``generate()``) as often as they lie inside one."""
        if level is Level.USER:
            return 0
        if level is Level.LAYER and self.layer_model_ns is not None:
            return self.layer_model_ns
        if level in _OP_LEVELS and self.op_model_ns is not None:
            return self.op_model_ns
        return self.model_ns

    def calls_for(self, level: Level) -> int:
        """The model calls during which a level recorded (all of them unless it ended early)."""
        if level is Level.LAYER and self.layer_model_calls is not None:
            return self.layer_model_calls
        if level in _OP_LEVELS and self.op_model_calls is not None:
            return self.op_model_calls
        return self.model_calls


@dataclass(frozen=True)
class OpEnds:
    """When the op level ended before the run did (run.json ``op_window``), per framework.

    Each framework's op level ends after its own model calls (``--op-inferences``), so a
    model or layer call has ops if it ended before its framework's end. Runs written before
    the per-framework windows (and runs whose op sources name no framework) have one end,
    ``default``, for every call.
    """

    default: int | None = None
    by_framework: dict[str, int | None] = field(default_factory=dict)
    #: Per framework, the intervals in which its op level recorded nothing while its converter
    #: caught up (run.json ``torch_profiler.unrecorded``; sorted, session clock ns): a call
    #: that overlaps one has no ops.
    gaps: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def ended(self) -> bool:
        """Whether any framework's op level ended before the run did."""
        return self.default is not None or any(v is not None for v in self.by_framework.values())

    @property
    def paused(self) -> bool:
        """Whether some framework's op level recorded nothing for a while (``gaps``)."""
        return any(self.gaps.values())

    @property
    def partial(self) -> bool:
        """Whether some model calls ran without the op level: it ended early, or paused."""
        return self.ended or self.paused

    def of(self, framework: object) -> int | None:
        """The end that applies to a call of ``framework`` (its ``ml.framework``), or None."""
        if not self.by_framework:
            return self.default
        return self.by_framework.get(framework) if isinstance(framework, str) else None


def op_ends(run: Run) -> OpEnds:
    """The op level's ends from run.json's ``op_window``, and its pauses from
    ``torch_profiler.unrecorded`` (``OpEnds``)."""
    window = run.meta.get("op_window")
    frameworks = window.get("frameworks") if isinstance(window, dict) else None
    gaps = _torch_gaps(run)
    if not isinstance(frameworks, dict) or not frameworks:
        return OpEnds(window_end(run, "op_window"), gaps=gaps)
    ends = {str(fw): _ns(entry.get("ended_ns") if isinstance(entry, dict) else None) for fw, entry in frameworks.items()}
    return OpEnds(None, ends, gaps)


def _torch_gaps(run: Run) -> dict[str, list[tuple[int, int]]]:
    """The torch op level's pauses (run.json ``torch_profiler.unrecorded``), sorted, for
    ``OpEnds.gaps``; pairs that are not two session times are left out."""
    stats = run.meta.get("torch_profiler")
    raw = stats.get("unrecorded") if isinstance(stats, dict) else None
    if not isinstance(raw, list):
        return {}
    gaps = []
    for pair in raw:
        if isinstance(pair, list) and len(pair) == 2:
            begin, end = _ns(pair[0]), _ns(pair[1])
            if begin is not None and end is not None and begin <= end:
                gaps.append((begin, end))
    return {"pytorch": sorted(gaps)} if gaps else {}


def _ns(value: object) -> int | None:
    """A session-clock time from run.json, or None where it is none (another type, or beyond
    64 bits)."""
    if isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < (1 << 63):
        return value
    return None


def window_end(run: Run, key: str) -> int | None:
    """When a level ended before the run did (session clock ns), from run.json's ``key``
    (``op_window``, ``layer_window``); else None."""
    window = run.meta.get(key)
    return _ns(window.get("ended_ns") if isinstance(window, dict) else None)


@dataclass
class ChainLink:
    """One step down a cross-stack chain: the heaviest child at the next level."""

    level: Level
    name: str
    total_ns: int
    detail: str = ""


@dataclass
class Chain:
    """A layer and the path of its heaviest work down the stack.

    E.g. ``layer3.0.conv1 → aten::mkldnn_convolution → oneDNN convolution jit:avx2``.

    Attributes:
        layer: the layer path.
        type: the layer type.
        calls: number of calls.
        self_ns: the layer's self time summed over its calls (ns).
        links: op → library call or kernel, heaviest first at each step.
        hot_line: the hottest sampled source line inside the layer, if sampled.
    """

    layer: str
    type: str
    calls: int
    self_ns: int
    links: list[ChainLink] = field(default_factory=list)
    hot_line: str | None = None


def cross_stack_chains(run: Run, layers: list[LayerStat]) -> list[Chain]:
    """Each of ``layers`` with its heaviest op and library/kernel under it.

    Children are aggregated by name over all calls of a layer path; kernels count
    through their launch call (a kernel's parent is the API call that launched it).
    The op of a chain is the heaviest op directly in the layer (with nothing but
    user spans between); its library call or kernel is the heaviest one directly
    in those ops (with nothing but ops and user spans between).

    Args:
        run: the run.
        layers: the layers to describe, in the order shown (the report's top layers by self time).
    """
    import numpy as np

    from mltrace.analysis.tree import pair_sums, tree_of

    t = run.table
    if not layers or not len(t):
        return [Chain(x.name, x.type, x.calls, x.self_ns) for x in layers]
    names = t.names
    index = {nm: i for i, nm in enumerate(names)}
    lv = t.level.astype(np.int64)
    name = t.name.astype(np.int64)
    tree = tree_of(t)
    parent = tree.parent
    is_op = lv == int(Level.OP)
    is_layer = lv == int(Level.LAYER)
    is_struct = is_layer | (lv == int(Level.MODEL))
    is_lk = (lv == int(Level.LIBRARY)) | (lv == int(Level.KERNEL))
    nos = tree.nearest(is_op | is_struct)  # nearest op, layer or model above
    nlk = tree.nearest(is_lk | is_struct)  # nearest library call, kernel, layer or model above
    chain_op = is_op & (nos >= 0) & is_struct[np.maximum(nos, 0)]
    cop = np.full(len(t), -1, dtype=np.int64)  # the chain op at or above each span
    for rows in tree.by_depth:
        p = parent[rows]
        inherited = np.where(p >= 0, cop[np.maximum(p, 0)], -1)
        cop[rows] = np.where(chain_op[rows], rows, np.where(is_struct[rows], -1, inherited))
    wanted = np.zeros(len(names), dtype=bool)
    for x in layers:
        if x.name in index:
            wanted[index[x.name]] = True
    # Ops directly in the wanted layers: (layer name, op name) → ns.
    ops = np.nonzero(chain_op & is_layer[np.maximum(nos, 0)])[0]
    ops = ops[wanted[name[nos[ops]]]]
    dur = np.maximum(t.end - t.start, 0).astype(np.float64)
    op_ns = pair_sums(name[nos[ops]], name[ops], dur[ops])
    # Library calls and kernels directly in those ops: (layer, op, name) → ns.
    lks = np.nonzero(is_lk & (cop >= 0))[0]
    c = cop[lks]
    lks = lks[(nlk[lks] == nos[c]) & is_layer[np.maximum(nos[c], 0)]]
    c = cop[lks]
    lks, c = lks[wanted[name[nos[c]]]], c[wanted[name[nos[c]]]]
    lk_ns = pair_sums(name[nos[c]] * len(names) + name[c], name[lks], dur[lks])
    last_row = {int(k): int(r) for r, k in zip(lks.tolist(), name[lks].tolist())}
    chains: list[Chain] = []
    for x in layers:
        chain = Chain(x.name, x.type, x.calls, x.self_ns)
        li = index.get(x.name)
        if li is None:
            chains.append(chain)
            continue
        calls = np.nonzero(is_layer & (name == li))[0]
        hot: dict[str, int] = {}
        sets, counts = np.unique(t.attr[calls], return_counts=True)
        for k, times in zip(sets.tolist(), counts.tolist()):
            for loc, ns in t.attr_set(k).get("ml.source.hot_lines", ()):
                hot[loc] = hot.get(loc, 0) + int(ns) * times
        if hot:
            chain.hot_line = max(hot.items(), key=lambda kv: kv[1])[0]
        by_op = op_ns.get(li)
        if by_op:
            oi, (_, ons) = max(by_op.items(), key=lambda kv: (kv[1][1], -kv[0]))
            chain.links.append(ChainLink(Level.OP, names[oi], ons))
            deeper = lk_ns.get(li * len(names) + oi, {})
            deeper = {k: v for k, v in deeper.items() if not names[k].startswith(("cuda", "cu"))} or deeper
            if deeper:
                ki, (_, kns) = max(deeper.items(), key=lambda kv: (kv[1][1], -kv[0]))
                row = last_row[ki]
                lib = t.attrs(row).get("ml.library.name", "")
                chain.links.append(ChainLink(Level(int(lv[row])), names[ki], kns, str(lib)))
        chains.append(chain)
    return chains


def layers_named_by_model(run: Run) -> Run:
    """``run`` with each layer path that more than one model has named after its model too.

    A layer's span is named by its path inside its model, so two models with a layer at the
    same path (a GAN's generator and discriminator, each with a ``main`` Sequential) would
    share a report row: ``main.0`` as a Conv2d with a ConvTranspose2d's ops. Where a path is
    under more than one model name, its calls become ``Generator.main.0`` and
    ``Discriminator.main.0``; every other name, and ``run`` where none is shared, stay."""
    import numpy as np

    from mltrace.analysis.tree import tree_of

    t = run.table
    if not len(t):
        return run
    level = t.level.astype(np.int64)
    name = t.name.astype(np.int64)
    tree = tree_of(t)
    model = tree.nearest(level == int(Level.MODEL))
    rows = np.nonzero((level == int(Level.LAYER)) & (model >= 0))[0]
    owner = name[model[rows]]
    pairs = np.unique(name[rows] * len(t.names) + owner)
    paths, per_path = np.unique(pairs // len(t.names), return_counts=True)
    shared = paths[per_path > 1]
    if not len(shared):
        return run
    rows = rows[np.isin(name[rows], shared)]
    qualified, which = np.unique(name[rows] * len(t.names) + name[model[rows]], return_inverse=True)
    names = list(t.names) + [f"{t.names[k % len(t.names)]}.{t.names[k // len(t.names)]}" for k in qualified.tolist()]
    renamed = name.copy()
    renamed[rows] = len(t.names) + which.reshape(-1)
    table = t.renamed(renamed.astype(t.name.dtype), names)
    table.cache["tree"] = tree  # the same spans and parents
    return run.replace(spans=None, table=table)
