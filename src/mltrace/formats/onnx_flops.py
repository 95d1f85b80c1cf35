"""FLOP counts of ONNX Runtime kernels from the shapes they ran with.

``onnx_flops`` counts a convolution, matrix product or attention kernel from the
run-time ``input_type_shape`` / ``output_type_shape`` of its profile event, taken after
graph optimisation (NCHWc ``Conv``, ``FusedConv``, a ``Gemm`` made of MatMul and Add),
so no shape inference is needed. ORT leaves out weights it pre-packed (a ``Gemm``'s B),
so every formula needs only the activation input and the output. A multiply-add counts
2 FLOP, as in ``aten_flops``; other kernels get no count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Shapes = Sequence[Sequence[int]]


def _numel(shape: Sequence[int]) -> int | None:
    """Elements of a shape; None when a dimension is unknown (negative)."""
    n = 1
    for d in shape:
        if d < 0:
            return None
        n *= d
    return n


def _conv(ins: Shapes, outs: Shapes, *, nhwc: bool = False, weight_at: int = 1) -> int | None:
    """2 · N · (output positions) · numel(W); NCHWc outputs are [N, C, H, W] too."""
    if len(ins) <= weight_at or not outs or len(outs[0]) < 3:
        return None
    out, w = outs[0], ins[weight_at]
    if len(w) != len(out):
        return None
    positions = _numel([out[0], *(out[1:-1] if nhwc else out[2:])])
    weight = _numel(w)
    if positions is None or weight is None:
        return None
    return 2 * positions * weight


def _qlinear_conv(ins: Shapes, outs: Shapes) -> int | None:
    """QLinearConv's inputs are (x, x_scale, x_zero_point, w, …)."""
    return _conv(ins, outs, weight_at=3)


def _nhwc_conv(ins: Shapes, outs: Shapes) -> int | None:
    return _conv(ins, outs, nhwc=True)


def _conv_transpose(ins: Shapes, outs: Shapes) -> int | None:
    """2 · N · (input positions) · numel(W): every input element meets the whole kernel."""
    if len(ins) < 2 or len(ins[0]) < 3:
        return None
    x, w = ins[0], ins[1]
    positions, weight = _numel([x[0], *x[2:]]), _numel(w)
    if positions is None or weight is None:
        return None
    return 2 * positions * weight


def _gemm(ins: Shapes, outs: Shapes) -> int | None:
    """2 · M · K · N with A [M, K] (or [K, M] when transposed) and Y [M, N]."""
    if not ins or not outs or len(ins[0]) != 2 or len(outs[0]) != 2:
        return None
    (a0, a1), (m, n) = ins[0], outs[0]
    k = a1 if a0 == m else a0
    if min(k, m, n) < 0:
        return None
    return 2 * m * k * n


def _matmul(ins: Shapes, outs: Shapes) -> int | None:
    """2 · numel(Y) · K, K being A's last dimension unless B shows A is transposed.

    With B present, K is the dimension of A's last two that B's last two share
    (``FusedMatMul``'s ``transA``/``transB`` are on the fused node, not in the
    profile); a 1-D A is a vector of K.
    """
    if not ins or not outs:
        return None
    a, y = ins[0], outs[0]
    if not a:
        return None
    k = a[-1]
    if len(a) >= 2 and len(ins) > 1 and len(ins[1]) >= 2:
        b = ins[1][-2:]
        if a[-1] not in b and a[-2] in b:
            k = a[-2]
    elements = _numel(y) if y else 1
    if elements is None or k < 0:
        return None
    return 2 * elements * k


def _qlinear_matmul(ins: Shapes, outs: Shapes) -> int | None:
    """QLinearMatMul's inputs are (a, a_scale, a_zero_point, b, …)."""
    if len(ins) < 4:
        return _matmul(ins[:1], outs)
    return _matmul([ins[0], ins[3]], outs)


def _attention(ins: Shapes, outs: Shapes) -> int | None:
    """com.microsoft Attention: input [B, S, H], weights [H, 3H] (packed QKV): the QKV
    projection 2 · B · S · H · 3H and the attention 4 · B · S² · H."""
    if not ins or len(ins[0]) != 3:
        return None
    b, s, h = ins[0]
    if min(b, s, h) < 0:
        return None
    projection = 2 * b * s * h * 3 * h
    return projection + 4 * b * s * s * h


def _mha(ins: Shapes, outs: Shapes) -> int | None:
    """MultiHeadAttention / GroupQueryAttention: Q [B, S, E], K [B, L, E], V [B, L, E_v]:
    2 · B · S · L · (E + E_v)."""
    if len(ins) < 3 or len(ins[0]) != 3:
        return None
    q, k, v = ins[0], ins[1], ins[2]
    b, s, e = q
    # K and V may be [B, L, E] or per head [B, N, L, h]; their second-to-last dim is L.
    length = k[-2] if len(k) >= 3 else s
    e_v = v[-1] if len(v) == 3 else v[1] * v[3] if len(v) == 4 else e
    if min(b, s, e, length, e_v) < 0:
        return None
    return 2 * b * s * length * (e + e_v)


#: Kernel op type → FLOP count from (input shapes, output shapes).
FORMULAS: dict[str, Callable[[Shapes, Shapes], int | None]] = {
    "Conv": _conv,
    "FusedConv": _conv,
    "ConvInteger": _conv,
    "NhwcFusedConv": _nhwc_conv,
    "QLinearConv": _qlinear_conv,
    "ConvTranspose": _conv_transpose,
    "Gemm": _gemm,
    "FusedGemm": _gemm,
    "MatMul": _matmul,
    "FusedMatMul": _matmul,
    "MatMulInteger": _matmul,
    "MatMulIntegerToFloat": _matmul,
    "DynamicQuantizeMatMul": _matmul,
    "MatMulNBits": _matmul,
    "QLinearMatMul": _qlinear_matmul,
    "Attention": _attention,
    "MultiHeadAttention": _mha,
    "GroupQueryAttention": _mha,
}


#: Convolution kernels: their weight's run-time shape may be padded (NCHWc), see ``onnx_flops``.
CONV_OPS = frozenset({"Conv", "FusedConv", "ConvInteger", "NhwcFusedConv", "QLinearConv", "ConvTranspose"})


def onnx_flops(op_type: str, in_shapes: Shapes, out_shapes: Shapes, weight: Sequence[int] | None = None) -> int | None:
    """FLOPs (FLOP) of one kernel execution from its run-time shapes, or None when the
    op has no formula (``FORMULAS``) or the shapes do not fit it.

    Args:
        op_type: the kernel's op type (``"Conv"``).
        in_shapes: its input shapes as run (elements).
        out_shapes: its output shapes as run.
        weight: a convolution's weight shape as exported. ORT's NCHWc layout pads a
            weight's channels to its block size (``[4, 3, 7, 7]`` runs as
            ``[16, 3, 7, 7]``), so, given, it replaces the run-time one.
    """
    formula = FORMULAS.get(op_type)
    if formula is None:
        return None
    if weight is not None and op_type in CONV_OPS:
        at = 3 if op_type == "QLinearConv" else 1
        if len(in_shapes) > at and len(in_shapes[at]) == len(weight):
            in_shapes = [*in_shapes[:at], weight, *in_shapes[at + 1 :]]
    try:
        return formula(in_shapes, out_shapes)
    except (TypeError, ValueError, IndexError):
        return None
