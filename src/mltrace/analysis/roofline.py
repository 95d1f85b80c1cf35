"""Work estimates for the roofline: FLOPs and bytes of a layer call or an op call.

A layer's work comes, in order of preference, from:

1. explicit attributes on the span (``ml.flops``, ``ml.bytes``), e.g. set with
   ``mltrace.span(..., **{"ml.flops": …})``;
2. where op spans inside it have ``ml.flops`` (from torch.profiler), its own ops' plus its
   child layers' work (each child's by these rules, a pooling child's from its formula);
3. a formula for its layer type (``ml.layer.type``) over the span's
   ``ml.input.shapes``, ``ml.output.shapes`` and ``ml.layer.params``
   (``FORMULAS`` lists the types);
4. the sum over its child layers (containers);
5. its inputs, outputs and parameters (``io``): a lower bound on the bytes
   any implementation must move, and no FLOPs.

Bytes are the tensors read and written plus the weights: inputs + outputs +
parameters, times the element size of the data type. This counts each tensor
once (perfect caching), so it is a lower bound of the real traffic. A layer
with neither explicit bytes nor a formula moves what its child layers and its
own ops (those directly in it, ``op_bytes`` each) move, and at least its
inputs, outputs and parameters.

All numbers are per call: FLOP and bytes. See docs/ANALYSIS.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: Element size (bytes) by dtype name, as torch (``float32``) and Kineto
#: (``float``, ``c10::BFloat16``) write them.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "float64": 8,
    "double": 8,
    "float16": 2,
    "half": 2,
    "c10::Half": 2,
    "bfloat16": 2,
    "c10::BFloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
    "int64": 8,
    "long int": 8,
    "long": 8,
    "int32": 4,
    "int": 4,
    "int16": 2,
    "short int": 2,
    "int8": 1,
    "signed char": 1,
    "uint8": 1,
    "unsigned char": 1,
    "bool": 1,
    "complex64": 8,
    "c10::complex<float>": 8,
    "complex128": 16,
    "tensor(float)": 4,
    "tensor(float16)": 2,
    "tensor(int64)": 8,
}
#: Integer element types: the indices of a lookup.
_INTEGER = frozenset(
    ("int64", "long int", "long", "int32", "int", "int16", "short int", "int8", "signed char", "uint8", "unsigned char", "tensor(int64)")
)
_FLOATING = frozenset("float32 float float64 double float16 half c10::Half bfloat16 c10::BFloat16 tensor(float) tensor(float16)".split())
_DEFAULT_ELEMENT = 4

#: Work source names, weakest last.
EXPLICIT, OPS, FORMULA, CHILDREN, IO = "explicit", "ops", "formula", "children", "io"


@dataclass(frozen=True)
class Work:
    """What one call computes and moves.

    Attributes:
        flops: floating-point operations (FLOP); a multiply-add counts 2.
        bytes: bytes read and written, weights included.
        source: where the numbers come from: "explicit", "ops", "formula",
            "children" or "io" (see the module docstring).
    """

    flops: float
    bytes: float
    source: str

    @property
    def intensity(self) -> float:
        """Arithmetic intensity (FLOP/byte); inf when nothing is moved."""
        if self.bytes > 0:
            return self.flops / self.bytes
        return float("inf") if self.flops > 0 else 0.0


def numel(shape: Any) -> int:
    """Number of elements of a shape list (1 for a scalar ``[]``; 0 if not a shape)."""
    if not isinstance(shape, (list, tuple)):
        return 0
    n = 1
    for d in shape:
        if not isinstance(d, int) or d < 0:
            return 0
        n *= d
    return n


def element_bytes(dtype: Any) -> int:
    """Size (bytes) of one element of ``dtype``; 4 for unknown names."""
    return DTYPE_BYTES.get(dtype, _DEFAULT_ELEMENT) if isinstance(dtype, str) else _DEFAULT_ELEMENT


def _shapes(attrs: dict[str, Any], key: str) -> list[list[int]]:
    """The tensor shapes of a span's attribute; a shape with a dimension that is not a whole
    number (a symbolic one, "batch", from a model's declared inputs) becomes [], not known."""
    value = attrs.get(key)
    if not isinstance(value, list):
        return []
    return [s if all(type(d) is int for d in s) else [] for s in value if isinstance(s, list)]


def _dtypes(attrs: dict[str, Any], key: str, count: int) -> list[Any]:
    value = attrs.get(key)
    out = list(value) if isinstance(value, list) else []
    return out + [None] * (count - len(out))


def _tensor_bytes(shapes: Sequence[Any], dtypes: Sequence[Any]) -> int:
    total = 0
    for shape, dtype in zip(shapes, dtypes):
        if isinstance(shape, list) and shape:  # [] is a scalar argument, not a tensor
            total += numel(shape) * element_bytes(dtype)
    return total


def _param_element_bytes(dtypes: Sequence[Any]) -> int:
    # Weights have the activations' floating type (an Embedding's int64 indices do not say).
    for d in dtypes:
        if isinstance(d, str) and d in _FLOATING:
            return element_bytes(d)
    return _DEFAULT_ELEMENT


def io_bytes(attrs: dict[str, Any]) -> int:
    """Inputs + outputs + parameters of a layer span, in bytes."""
    ins = _shapes(attrs, "ml.input.shapes")
    outs = _shapes(attrs, "ml.output.shapes")
    in_types = _dtypes(attrs, "ml.input.dtypes", len(ins))
    out_types = _dtypes(attrs, "ml.output.dtypes", len(outs))
    params = attrs.get("ml.layer.params")
    params = params if isinstance(params, int) and params > 0 else 0
    return _tensor_bytes(ins, in_types) + _tensor_bytes(outs, out_types) + params * _param_element_bytes([*in_types, *out_types])


# -- formulas ----------------------------------------------------------------
# Each takes (input shapes, output shapes, parameter count) and returns FLOPs of
# one call, or None when the shapes do not fit.

Shapes = list[list[int]]


def _linear(ins: Shapes, outs: Shapes, params: int) -> float | None:
    if not ins or not outs or not ins[0] or not outs[0]:
        return None
    k, n = ins[0][-1], outs[0][-1]
    if n <= 0:
        return None
    m = numel(outs[0]) // n
    return 2.0 * m * n * k


def _conv(ins: Shapes, outs: Shapes, params: int) -> float | None:
    # Weights are Cout·(Cin/groups)·kernel volume (+ Cout of bias): per output
    # element, params // Cout multiply-adds (bias adds at most 1 to that).
    if not outs or len(outs[0]) < 3 or params <= 0:
        return None
    cout = outs[0][1]
    if cout <= 0:
        return None
    return 2.0 * numel(outs[0]) * (params // cout)


def _conv_transpose(ins: Shapes, outs: Shapes, params: int) -> float | None:
    # Weights are Cin·(Cout/groups)·kernel volume: each input element scatters that many MACs.
    if not ins or len(ins[0]) < 3 or params <= 0:
        return None
    cin = ins[0][1]
    if cin <= 0:
        return None
    return 2.0 * numel(ins[0]) * (params // cin)


def _attention(ins: Shapes, outs: Shapes, params: int) -> float | None:
    # Q/K/V and output projections, plus QKᵀ and attention·V. The batch
    # dimension of a 3-D input is taken as the smaller of its first two
    # (batch_first is not recorded); sequences are usually longer than batches.
    if not ins or len(ins[0]) != 3:
        return None
    q = ins[0]
    k = ins[1] if len(ins) > 1 and len(ins[1]) == 3 else q
    e = q[-1]
    batch = min(q[0], q[1])
    if batch <= 0:
        return None
    lq, lk = numel(q) // (e * batch), numel(k) // (e * batch)
    projections = 2.0 * batch * (lq + 2 * lk) * e * e + 2.0 * batch * lq * e * e
    scores = 2.0 * 2.0 * batch * lq * lk * e
    return projections + scores


def _recurrent(ins: Shapes, outs: Shapes, params: int) -> float | None:
    # Every weight is used once per token and direction: ≈ 2·params FLOP per token.
    if not ins or len(ins[0]) < 2 or params <= 0:
        return None
    tokens = numel(ins[0]) // max(ins[0][-1], 1)
    return 2.0 * params * tokens


def _per_output(cost: float) -> Any:
    def formula(ins: Shapes, outs: Shapes, params: int) -> float | None:
        ref = outs[0] if outs else (ins[0] if ins else None)
        return cost * numel(ref) if ref is not None else None

    return formula


def _per_input(cost: float) -> Any:
    def formula(ins: Shapes, outs: Shapes, params: int) -> float | None:
        return cost * numel(ins[0]) if ins else None

    return formula


def _no_flops(ins: Shapes, outs: Shapes, params: int) -> float | None:
    return 0.0


_ELEMENTWISE = (
    "ReLU ReLU6 LeakyReLU PReLU ELU SELU CELU GELU SiLU Mish Sigmoid Tanh Hardtanh Hardswish Hardsigmoid "
    "Softplus Softsign Tanhshrink Threshold LogSigmoid GLU"
).split()
_NORMS = (
    "BatchNorm1d BatchNorm2d BatchNorm3d LayerNorm GroupNorm InstanceNorm1d InstanceNorm2d InstanceNorm3d RMSNorm LocalResponseNorm"
).split()
_POOLS = (
    "MaxPool1d MaxPool2d MaxPool3d AvgPool1d AvgPool2d AvgPool3d AdaptiveAvgPool1d AdaptiveAvgPool2d AdaptiveAvgPool3d "
    "AdaptiveMaxPool1d AdaptiveMaxPool2d AdaptiveMaxPool3d LPPool1d LPPool2d"
).split()

#: Layer type → FLOPs formula. Types that move data without arithmetic map to 0.
FORMULAS: dict[str, Any] = {
    "Linear": _linear,
    "LazyLinear": _linear,
    "NonDynamicallyQuantizableLinear": _linear,
    "Bilinear": _linear,
    "Conv1d": _conv,
    "Conv2d": _conv,
    "Conv3d": _conv,
    "LazyConv1d": _conv,
    "LazyConv2d": _conv,
    "LazyConv3d": _conv,
    "ConvTranspose1d": _conv_transpose,
    "ConvTranspose2d": _conv_transpose,
    "ConvTranspose3d": _conv_transpose,
    "MultiheadAttention": _attention,
    "LSTM": _recurrent,
    "GRU": _recurrent,
    "RNN": _recurrent,
    "Softmax": _per_output(5.0),
    "LogSoftmax": _per_output(5.0),
    "Softmax2d": _per_output(5.0),
    "Upsample": _per_output(4.0),
    "UpsamplingBilinear2d": _per_output(4.0),
    "UpsamplingNearest2d": _per_output(0.0),
    "Embedding": _no_flops,
    "EmbeddingBag": _per_output(1.0),
    "Dropout": _no_flops,
    "Dropout1d": _no_flops,
    "Dropout2d": _no_flops,
    "Dropout3d": _no_flops,
    "Identity": _no_flops,
    "Flatten": _no_flops,
    "Unflatten": _no_flops,
    "PixelShuffle": _no_flops,
    "ZeroPad2d": _no_flops,
    "ConstantPad2d": _no_flops,
    **{t: _per_output(1.0) for t in _ELEMENTWISE},
    **{t: _per_output(5.0) for t in _NORMS},
    **{t: _per_input(1.0) for t in _POOLS},
}

#: Types that return their input (or a view of it) in inference: no bytes moved.
VIEW_TYPES = frozenset({"Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "Identity", "Flatten", "Unflatten"})
#: Table lookups: they move the rows they return (read and write), not their weights.
GATHER_TYPES = frozenset({"Embedding", "EmbeddingBag"})


def formula_type(layer_type: str, attrs: dict[str, Any]) -> str:
    """The type whose formula a layer's work comes from: its own (``ml.layer.type``) where it has
    one, else the torch.nn class it derives from (``ml.layer.base_type``: a model library's
    ``nn.Embedding`` subclass is an Embedding)."""
    if layer_type in FORMULAS:
        return layer_type
    base = attrs.get("ml.layer.base_type")
    return base if isinstance(base, str) and base in FORMULAS else layer_type


def layer_formula_work(layer_type: str, attrs: dict[str, Any]) -> Work | None:
    """Work of one call of a layer from its type's formula (``formula_type``), or None if the
    type has none.

    Args:
        layer_type: ``ml.layer.type`` ("Conv2d").
        attrs: the layer span's attributes (shapes, dtypes, params, ``ml.layer.base_type``).
    """
    layer_type = formula_type(layer_type, attrs)
    formula = FORMULAS.get(layer_type)
    if formula is None:
        return None
    ins = _shapes(attrs, "ml.input.shapes")
    outs = _shapes(attrs, "ml.output.shapes")
    params = attrs.get("ml.layer.params")
    flops = formula(ins, outs, params if isinstance(params, int) else 0)
    if flops is None:
        return None
    if layer_type in VIEW_TYPES:
        moved = 0
    elif layer_type in GATHER_TYPES:
        # A lookup reads only the rows it returns, not the whole table.
        in_types = _dtypes(attrs, "ml.input.dtypes", len(ins))
        out_bytes = _tensor_bytes(outs, _dtypes(attrs, "ml.output.dtypes", len(outs)))
        moved = _tensor_bytes(ins, in_types) + 2 * out_bytes
    else:
        moved = io_bytes(attrs)
    return Work(float(flops), float(moved), FORMULA)


def explicit_work(attrs: dict[str, Any]) -> tuple[float | None, float | None]:
    """``ml.flops`` and ``ml.bytes`` of a span when set (numbers), else None for each."""
    flops = attrs.get("ml.flops")
    moved = attrs.get("ml.bytes")
    f = float(flops) if isinstance(flops, (int, float)) and not isinstance(flops, bool) and flops >= 0 else None
    b = float(moved) if isinstance(moved, (int, float)) and not isinstance(moved, bool) and moved >= 0 else None
    return f, b


#: A sparse tensor's accessors, and the constructors that wrap given indices and values: they
#: return parts of it, not copies. Its recorded shape is the dense one, so an estimate from
#: shapes counts every element, zeros included (bytes here; FLOPs in the ops around them).
SPARSE_ACCESSORS = frozenset(
    {
        "aten::_values", "aten::_indices", "aten::values", "aten::indices", "aten::_nnz",
        "aten::sparse_dim", "aten::dense_dim", "aten::is_coalesced", "aten::crow_indices",
        "aten::col_indices", "aten::ccol_indices", "aten::row_indices",
        "aten::_sparse_coo_tensor_unsafe", "aten::_sparse_coo_tensor_with_dims_and_tensors",
        "aten::_sparse_compressed_tensor_unsafe", "aten::_sparse_csr_tensor_unsafe",
    }
)  # fmt: skip

#: Ops that return a view of their input or its metadata (``SPARSE_ACCESSORS`` among them), or
#: allocate without writing: they move no data. Where one must copy (a reshape of a
#: non-contiguous tensor, ``contiguous``, ``to`` another dtype), the copy is a child op of its
#: own (``aten::clone``, ``aten::copy_``, ``aten::_to_copy``), counted there.
#: Dropout in inference returns its input; in training its work is its child ops.
NO_DATA_OPS = frozenset(
    {
        "aten::view", "aten::_unsafe_view", "aten::view_as", "aten::reshape", "aten::_reshape_alias",
        "aten::as_strided", "aten::select", "aten::slice", "aten::narrow", "aten::transpose", "aten::t",
        "aten::numpy_T", "aten::mT", "aten::mH", "aten::adjoint", "aten::matrix_H",
        "aten::permute", "aten::movedim", "aten::swapaxes", "aten::expand", "aten::expand_as",
        "aten::squeeze", "aten::unsqueeze", "aten::flatten", "aten::unflatten", "aten::split",
        "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::diagonal", "aten::unfold",
        "aten::detach", "detach", "aten::alias", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg",
        "aten::contiguous", "aten::to", "aten::empty", "aten::empty_like", "aten::empty_strided",
        "aten::resize_", "aten::as_strided_", "aten::set_", "aten::squeeze_", "aten::unsqueeze_",
        "aten::transpose_", "aten::t_", "aten::detach_",
        "aten::dropout", "aten::feature_dropout", "aten::alpha_dropout", "aten::feature_alpha_dropout",
        "aten::size", "aten::stride", "aten::numel", "aten::dim", "aten::is_same_size",
        "aten::cudnn_is_acceptable", "aten::is_pinned", "aten::_has_compatible_shallow_copy_type",
        "aten::new_empty", "aten::new_empty_strided",
        "aten::view_as_real", "aten::view_as_complex", "aten::conj", "aten::_conj", "aten::_neg_view",
        "aten::real", "aten::imag",
    }
) | SPARSE_ACCESSORS  # fmt: skip


def reads_sparse(op_name: str) -> bool:
    """Whether an op runs on a sparse tensor only: one of its accessors (``SPARSE_ACCESSORS``)
    or a sparse kernel (``aten::_sparse_*``). An op with one inside reads a sparse tensor."""
    return op_name in SPARSE_ACCESSORS or op_name.startswith("aten::_sparse_")


def gather_bytes(attrs: dict[str, Any]) -> int:
    """Bytes an embedding lookup or ``index_select`` moves: the rows it reads, written out
    once, plus its indices; not the whole table. The indices are the first integer tensor
    after the first input (the first tensor there where no dtype says), the table the tensor
    just before them: TorchScript's interpreter can record values of its stack ahead of an op's
    own inputs (``aten::embedding`` as ``[[2, 16, 64], [512, 64], [1, 16], …]``: the previous
    op's output, the table, the indices), which the conversion drops only where the op's range
    shows that the interpreter called it (``aten_flops.own_arguments``). Where the shapes are
    missing, ``op_bytes``."""
    ins = _shapes(attrs, "ml.input.shapes")
    types = _dtypes(attrs, "ml.input.dtypes", len(ins))
    tensors = [i for i, s in enumerate(ins) if i > 0 and s]
    integer = [i for i in tensors if types[i] in _INTEGER]
    if not tensors:
        return op_bytes(attrs)
    at = (integer or tensors)[0]
    table = next((j for j in range(at - 1, -1, -1) if ins[j]), None)
    if table is None:
        return op_bytes(attrs)
    row = numel(ins[table][1:]) if len(ins[table]) > 1 else 1
    rows = numel(ins[at])
    return 2 * rows * row * element_bytes(types[table]) + rows * element_bytes(types[at])


def element_gather_bytes(attrs: dict[str, Any]) -> int:
    """Bytes ``aten::gather(input, dim, index)`` moves: one input element read per index
    and written out, plus the indices; not the whole input. Where the shapes are missing,
    ``op_bytes``."""
    ins = _shapes(attrs, "ml.input.shapes")
    types = _dtypes(attrs, "ml.input.dtypes", len(ins))
    if len(ins) < 3 or not ins[0] or not ins[2]:
        return op_bytes(attrs)
    picked = numel(ins[2])
    return 2 * picked * element_bytes(types[0]) + picked * element_bytes(types[2])


def op_bytes(attrs: dict[str, Any]) -> int:
    """Bytes one op call moves: its tensor inputs plus its output.

    Ops record input shapes only (torch.profiler's ``Input Dims``); without
    ``ml.output.shapes`` the output is taken to be as large as the largest
    input, which holds for elementwise ops and is a lower bound for most others.
    An explicit ``ml.bytes`` wins.
    """
    moved = attrs.get("ml.bytes")
    if isinstance(moved, (int, float)) and not isinstance(moved, bool):
        return int(moved)
    ins = _shapes(attrs, "ml.input.shapes")
    in_types = _dtypes(attrs, "ml.input.dtypes", len(ins))
    total = 0
    largest = 0
    for shape, dtype in zip(ins, in_types):
        if shape:
            size = numel(shape) * element_bytes(dtype)
            total += size
            largest = max(largest, size)
    outs = _shapes(attrs, "ml.output.shapes")
    if outs:
        return total + _tensor_bytes(outs, _dtypes(attrs, "ml.output.dtypes", len(outs)))
    return total + largest


#: Ops whose bytes follow their own rule (by op name); every other op's are ``op_bytes``.
OP_BYTES_RULES: dict[str, Callable[[dict[str, Any]], int]] = {
    "aten::embedding": gather_bytes,  # the rows its indices pick (its first input is the table)
    "aten::index_select": gather_bytes,
    "aten::gather": element_gather_bytes,  # the elements its index picks
}


def roofline_time_ns(flops: float, moved: float, flops_per_s: float, bytes_per_s: float) -> float:
    """The least time (ns) the roofline allows for this work: max(FLOP/peak, bytes/bandwidth)."""
    t_compute = flops / flops_per_s if flops_per_s > 0 else 0.0
    t_memory = moved / bytes_per_s if bytes_per_s > 0 else 0.0
    return max(t_compute, t_memory) * 1e9


def attainable_flops(intensity: float, flops_per_s: float, bytes_per_s: float) -> float:
    """The roofline: min(peak FLOP/s, intensity · bandwidth), in FLOP/s."""
    return min(flops_per_s, intensity * bytes_per_s)
