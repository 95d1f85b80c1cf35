"""FLOP counts of TensorFlow graph ops, from the graph's static shapes (pure functions).

TensorFlow's profiler records no shapes for CPU graph ops and runs rewritten ops
(``Conv2D`` + ``BiasAdd`` + ``Relu`` as one ``_MklNativeFusedConv2D`` named after the
``Relu``), so ``graph_work`` counts the convolutions, matrix products and einsums of the Python
graph of the function that ran, by name scope (nested function calls included), and
``FlopTable.take`` hands them to the runtime ops of the same scope and kind in order.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any

#: Graph op type → kind of work.
GRAPH_KINDS = {
    "Conv2D": "conv",
    "Conv3D": "conv",
    "DepthwiseConv2dNative": "depthwise",
    "MatMul": "matmul",
    "BatchMatMul": "matmul",
    "BatchMatMulV2": "matmul",
    "BatchMatMulV3": "matmul",
    "Einsum": "einsum",
}
_CALL_OPS = frozenset({"StatefulPartitionedCall", "PartitionedCall"})
_WRAPPER_SCOPES = frozenset({"StatefulPartitionedCall", "PartitionedCall"})
_UNIQUIFIER = re.compile(r"(.+)_\d+\Z")

Shape = Sequence[int | None]


def runtime_kind(op_type: str) -> str | None:
    """The kind of work of a runtime op type (``_MklNativeFusedConv2D`` → ``"conv"``), or None."""
    if "Einsum" in op_type:
        return "einsum"
    if "Depthwise" in op_type:
        return "depthwise"
    if "Conv2D" in op_type or "Conv3D" in op_type:
        return "conv"
    if "MatMul" in op_type:
        return "matmul"
    return None


def op_flops(
    kind: str, inputs: Sequence[Shape], output: Shape, transpose_a: bool = False, equation: str | None = None
) -> tuple[float, bool] | None:
    """FLOPs of one graph op, and whether they are per batch row (the output's one unknown dimension taken as 1).

    Multiply-adds × 2: a convolution's output elements × its kernel volume × input channels
    per group; a depthwise convolution's output elements × its kernel area; a matrix
    product's output elements × its inner dimension; a two-operand einsum's output elements ×
    the sizes of the letters it sums over (``_einsum_summed``). Fused bias adds and activations are
    not counted. A shape whose batch dimension is unknown (a SavedModel signature's
    ``(None, 16, 16, 3)``) is counted per row, to be scaled by the call's batch size.

    Args:
        kind: ``conv``, ``depthwise``, ``matmul`` or ``einsum`` (``GRAPH_KINDS``).
        inputs: the op's input shapes (None: unknown dimension).
        output: its output shape.
        transpose_a: a matrix product's ``transpose_a``/``adj_x``.
        equation: an einsum's ``equation`` attribute (``BTNH,BSNH->BNTS``).

    Returns:
        (FLOP, per batch row), or None when a shape is unknown beyond one output dimension.
    """
    unknown = sum(d is None for d in output)
    if unknown > 1 or len(inputs) < 2 or not output:
        return None
    out = prod(1 if d is None else d for d in output)
    a, w = inputs[0], inputs[1]
    if kind == "conv" and len(w) >= 3 and all(d is not None for d in w[:-1]):
        inner = prod(d for d in w[:-1] if d is not None)
    elif kind == "depthwise" and len(w) == 4 and w[0] is not None and w[1] is not None:
        inner = w[0] * w[1]
    elif kind == "matmul" and len(a) >= 2:
        k = a[-2] if transpose_a else a[-1]
        if k is None:
            return None
        inner = k
    elif kind == "einsum" and equation is not None:
        summed = _einsum_summed(equation, inputs)
        if summed is None:
            return None
        inner = summed
    else:
        return None
    return 2.0 * out * inner, unknown == 1


def _einsum_summed(equation: str, inputs: Sequence[Shape]) -> int | None:
    """The product of the sizes of the letters a two-operand einsum sums over (those of its
    operands missing from its output: ``BTNH,BSNH->BNTS`` → H), 1 where it sums over none (an
    outer or elementwise product); a letter's size is its largest in the operands (a size-1
    dimension broadcasts), a ``...`` stands for the dimensions between the letters before and after
    it. None for another number of operands (TensorFlow contracts three or more pairwise, in an
    order the equation does not give) or a summed dimension of unknown size."""
    lhs, arrow, out = equation.replace(" ", "").partition("->")
    specs = lhs.split(",")
    if len(specs) != 2 or len(inputs) != 2:
        return None
    if not arrow:  # implicit output: the letters written once
        letters = lhs.replace(",", "").replace(".", "")
        out = "".join(c for c in letters if letters.count(c) == 1)
    sizes: dict[str, int] = {}
    for spec, shape in zip(specs, inputs):
        head, dots, tail = spec.partition("...")
        if "." in head or "." in tail or len(head) + len(tail) > len(shape) or (not dots and len(spec) != len(shape)):
            return None
        dims = [*shape[: len(head)], *shape[len(shape) - len(tail) :]]
        for letter, dim in zip(head + tail, dims):
            if letter in out:
                continue
            if dim is None:
                return None
            sizes[letter] = max(sizes.get(letter, 1), dim)
    return prod(sizes.values())


def keras_layer_kind(mro_names: Iterable[str]) -> str | None:
    """The kind of work of a Keras layer class, from the names of its classes (``type(layer).__mro__``):
    ``dense``, ``einsum`` (EinsumDense), ``depthwise`` (DepthwiseConv1D/2D), ``conv`` (Conv1D/2D/3D),
    ``attention`` (MultiHeadAttention), or None for other layers (transposed and separable convolutions
    among them)."""
    names = set(mro_names)
    if "MultiHeadAttention" in names:
        return "attention"
    if any("Transpose" in n or "Separable" in n for n in names):
        return None
    if "EinsumDense" in names:
        return "einsum"
    if "Dense" in names:
        return "dense"
    if any("Depthwise" in n for n in names):
        return "depthwise"
    if "BaseConv" in names or "Conv" in names:
        return "conv"
    return None


def keras_layer_flops(
    kind: str,
    inputs: Shape,
    output: Shape,
    *,
    kernel_size: Sequence[int] = (),
    groups: int = 1,
    channels_first: bool = False,
    equation: str | None = None,
) -> float | None:
    """FLOPs of one eager call of a Keras layer, from its input and output shapes and its settings,
    counted as ``op_flops`` counts the op it runs in a graph: 2 x output elements x the inner
    dimension, which is a Dense layer's input features, a convolution's kernel volume x input
    channels per group, a depthwise convolution's kernel volume, and for an EinsumDense the input
    dimensions its ``equation`` sums over with the kernel (``abc,cde->abde``: c). Bias adds and
    activations are not counted; None when a dimension is unknown or the shapes do not fit the kind."""
    if not output or not inputs or any(d is None or d < 0 for d in (*output, *inputs)):
        return None
    ins = [int(d) for d in inputs if d is not None]
    if kind == "dense":
        inner = ins[-1]
    elif kind in ("conv", "depthwise") and kernel_size and len(ins) >= 3:
        inner = prod(kernel_size)
        if kind == "conv":
            channels = ins[1] if channels_first else ins[-1]
            if groups < 1 or channels % groups:
                return None
            inner *= channels // groups
    elif kind == "einsum" and equation is not None:
        found = _contracted(equation, ins)
        if found is None:
            return None
        inner = found
    else:
        return None
    return 2.0 * prod(int(d) for d in output if d is not None) * inner


def keras_attention_flops(
    query: Shape,
    value: Shape,
    key: Shape,
    output: Shape,
    *,
    num_heads: int,
    key_dim: int,
    value_dim: int,
    attention_axes: Sequence[int] | None = None,
) -> float | None:
    """FLOPs of one eager call of a Keras MultiHeadAttention, counted as ``op_flops`` counts its ops in
    a graph: its four projections (2 x each input's elements x heads x key_dim, value_dim for the value;
    2 x output elements x heads x value_dim for the output) and its two attention products, the scores
    QK^T (2 x B x heads x T x S x key_dim) and their use on V (the same with value_dim). T and S are the
    products of the query's and the key's ``attention_axes`` (by default all but the first and last),
    B that of the query's other dimensions but the last. The projections are its EinsumDense child
    layers' FLOPs too: this is the layer's whole work. None when a dimension is unknown or the axes do not fit."""
    shapes = (query, value, key, output)
    if any(not s or any(d is None or d < 0 for d in s) for s in shapes) or len(key) != len(query):
        return None
    q, v, k, out = ([int(d) for d in s if d is not None] for s in shapes)
    rank = len(q)
    axes = {a % rank for a in attention_axes} if attention_axes is not None else set(range(1, rank - 1))
    if not axes or rank - 1 in axes:
        return None
    batch = prod(q[i] for i in range(rank - 1) if i not in axes)
    t, s = prod(q[i] for i in axes), prod(k[i] for i in axes)
    projections = 2.0 * num_heads * ((prod(q) + prod(k)) * key_dim + prod(v) * value_dim + prod(out) * value_dim)
    return projections + 2.0 * batch * num_heads * t * s * (key_dim + value_dim)


def _contracted(equation: str, inputs: Sequence[int]) -> int | None:
    """The product of the input dimensions an EinsumDense equation (``input,kernel->output``) sums
    over with its kernel: the kernel's letters not in the output, sized by the input (its letters
    aligned from the right, after a leading ``...``)."""
    lhs, arrow, out = equation.replace(" ", "").partition("->")
    operands = lhs.split(",")
    if not arrow or len(operands) != 2:
        return None
    spec, kernel = operands
    letters = spec.removeprefix("...")
    if "." in letters or "." in kernel or len(letters) > len(inputs) or (letters == spec and len(letters) != len(inputs)):
        return None
    size = dict(zip(letters, inputs[len(inputs) - len(letters) :]))
    summed = [c for c in kernel if c not in out]
    if any(c not in size for c in summed):
        return None
    return prod(size[c] for c in summed)


def scope_of(node: str) -> str:
    """A node's name scope less function-call wrapper scopes: ``StatefulPartitionedCall/m_1/fc_1/MatMul`` → ``m_1/fc_1``."""
    comps = [c for c in node.split("/")[:-1] if c not in _WRAPPER_SCOPES]
    return "/".join(comps)


@dataclass(frozen=True, slots=True)
class OpWork:
    """The work of one graph op.

    Attributes:
        kind: ``conv``, ``depthwise``, ``matmul`` or ``einsum``.
        flops: FLOP (per batch row when ``per_row``).
        per_row: whether ``flops`` scales with the call's batch size.
    """

    kind: str
    flops: float
    per_row: bool


@dataclass
class FlopTable:
    """The counted ops of one function, by name scope (``scope_of``), in graph order."""

    by_scope: dict[str, list[OpWork]] = field(default_factory=dict)

    def take(self, ops: Iterable[tuple[str, str]], batch: int | None) -> list[float | None]:
        """FLOPs of a call's runtime ops ``(node name, op type)``, in order: the n-th op of a kind in a
        scope gets the n-th counted op of that kind there; None where nothing matches, or the count is
        per row and the batch size is unknown."""
        used: dict[tuple[str, str], int] = {}
        out: list[float | None] = []
        for node, op_type in ops:
            kind = runtime_kind(op_type)
            if kind is None:
                out.append(None)
                continue
            scope = scope_of(node)
            n = used.get((scope, kind), 0)
            used[(scope, kind)] = n + 1
            mine = [w for w in self.by_scope.get(scope, ()) if w.kind == kind]
            if n >= len(mine) or (mine[n].per_row and batch is None):
                out.append(None)
                continue
            out.append(mine[n].flops * (batch if mine[n].per_row and batch is not None else 1))
        return out


def _shape(tensor: Any) -> list[int | None] | None:
    try:
        dims = tensor.shape.as_list()
    except (ValueError, AttributeError):  # unknown rank
        return None
    return list(dims)


def graph_work(graph: Any, depth: int = 0) -> FlopTable:
    """Counts a TensorFlow ``FuncGraph``'s convolutions, matrix products and einsums, nested function calls included.

    Args:
        graph: a ``FuncGraph`` (``ConcreteFunction.graph``).
        depth: nesting depth (calls deeper than 8 are not followed).
    """
    table = FlopTable()
    for op in graph.get_operations():
        kind = GRAPH_KINDS.get(op.type)
        if kind is not None:
            _add(table, op, kind)
        elif op.type in _CALL_OPS and depth < 8:
            inner = _called_graph(graph, op)
            if inner is not None:
                for scope, works in graph_work(inner, depth + 1).by_scope.items():
                    table.by_scope.setdefault(scope, []).extend(works)
    return table


def _add(table: FlopTable, op: Any, kind: str) -> None:
    ins = [_shape(t) for t in op.inputs]
    out = _shape(op.outputs[0]) if op.outputs else None
    if out is None or any(s is None for s in ins):
        return
    transpose = False
    for attr in ("transpose_a", "adj_x"):
        try:
            transpose = bool(op.get_attr(attr))
            break
        except ValueError:
            continue
    work = op_flops(kind, [s for s in ins if s is not None], out, transpose, _equation(op) if kind == "einsum" else None)
    if work is not None:
        table.by_scope.setdefault(scope_of(op.name), []).append(OpWork(kind, work[0], work[1]))


def _equation(op: Any) -> str | None:
    """An einsum op's ``equation`` attribute, None if it has none."""
    try:
        value = op.get_attr("equation")
    except ValueError:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _called_graph(graph: Any, op: Any) -> Any:
    """The graph of the function a call op runs, when the graph holds it."""
    try:
        fn = graph._get_function(op.get_attr("f").name)
    except Exception:
        return None
    return getattr(fn, "graph", None)


def top_scopes(graph: Any, depth: int = 0) -> Counter[str]:
    """How many ops of a ``FuncGraph`` (nested function calls included) lie under each outermost name
    scope, less its ``_<n>`` suffix (``tiny_1/fc_1/MatMul`` → ``tiny``): which Keras model a function runs,
    where the profiler shows none of its ops (XLA runs the whole function as one)."""
    counts: Counter[str] = Counter()
    for op in graph.get_operations():
        if op.type in _CALL_OPS and depth < 8:
            inner = _called_graph(graph, op)
            if inner is not None:
                counts.update(top_scopes(inner, depth + 1))
            continue
        comps = [c for c in op.name.split("/") if c not in _WRAPPER_SCOPES]
        if len(comps) >= 2:
            m = _UNIQUIFIER.match(comps[0])
            counts[m.group(1) if m is not None else comps[0]] += 1
    return counts
