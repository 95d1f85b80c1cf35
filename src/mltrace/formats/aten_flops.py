"""FLOP counts of ATen ops from what ``record_shapes`` records, computed after the run.

``aten_flops`` counts an op from its Kineto ``cpu_op`` event's ``Input Dims`` (tensor
shapes) and ``Concrete Inputs`` (scalar and int-list arguments as strings: ``"[2, 2]"``,
``"4"``), so the program runs without ``with_flops``. The ops torch counts get torch's
rules; other convolutions, ``linear``, ``matmul``, attention and the fused encoder layer
get 2 FLOP per multiply-add of their products (softmax, norms, activations and biases
inside them are not counted), and so do the recurrent layers (LSTM, GRU, RNN: each token
through each weight matrix). The activation functions (``aten::relu``, ``gelu``, ``silu``,
``sigmoid``, …, in place or not) get 1 FLOP per element of their input, as the layer
formula counts their modules (``analysis/roofline.FORMULAS``), so a module that calls one
(a model library's own activation wrapper) has its work known; the normalizations and
softmax get 5 per element, as the formula counts ``nn.LayerNorm`` and ``nn.Softmax`` (a
layer of an exported program, whose spans carry no shapes for the formula, then has its
work from its ops in every call). Ops that wrap each other (``aten::conv2d`` →
``aten::convolution`` → ``aten::mkldnn_convolution``) each get the count; sums over a
layer take only the outermost (``analysis/span_pass``). An op that TorchScript's interpreter
called is read from its own arguments (``own_arguments``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Dims = Sequence[Any]


def _numel(shape: Any) -> int | None:
    if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
        return None
    return _prod(shape)


def _int_list(text: Any, rank: int) -> list[int] | None:
    """``"[2, 2]"`` → [2, 2]; ``"2"`` → [2, 2] (one value for every dimension)."""
    if not isinstance(text, str) or not text:
        return None
    try:
        values = [int(v) for v in text.strip("[]").split(",")]
    except ValueError:
        return None
    if len(values) == 1:
        values *= rank
    return values if len(values) == rank else None


def _prod(values: Sequence[int]) -> int:
    n = 1
    for v in values:
        n *= v
    return n


def _conv(
    dims: Dims, concrete: Sequence[Any], stride_at: int | None, padding_at: int | None, dilation_at: int | None, transposed: bool = False
) -> int | None:
    """2 · N · positions · numel(weight): output positions, or input positions when ``transposed``.

    ``*_at`` say where stride, padding and dilation are among the op's
    arguments (None: not an argument, all ones or zeros).
    """
    if len(dims) < 2:
        return None
    x, w = dims[0], dims[1]
    if not (isinstance(x, list) and isinstance(w, list) and len(w) >= 3 and len(x) >= len(w) - 1):
        return None
    if not all(isinstance(d, int) for d in (*x, *w)):
        return None
    rank = len(w) - 2
    spatial, kernel = x[-rank:], w[2:]
    n = _prod(x[: -rank - 1]) if len(x) > rank + 1 else 1
    if transposed:
        return 2 * n * _prod(spatial) * _prod(w)
    ones, zeros = [1] * rank, [0] * rank

    def arg(at: int | None, default: list[int]) -> list[int] | None:
        if at is None:
            return default
        if at >= len(concrete):
            return None
        return _int_list(concrete[at], rank)

    stride, padding, dilation = arg(stride_at, ones), arg(padding_at, zeros), arg(dilation_at, ones)
    if stride is None or padding is None or dilation is None:
        return None  # e.g. padding="same" (recorded as ""): the output size is not in the record
    out = [(size + 2 * p - d * (k - 1) - 1) // st + 1 for size, k, st, p, d in zip(spatial, kernel, stride, padding, dilation)]
    if any(o <= 0 for o in out):
        return None
    return 2 * n * _prod(out) * _prod(w)


def _conv2d(dims: Dims, concrete: Sequence[Any]) -> int | None:
    x, w = (dims[0], dims[1]) if len(dims) >= 2 else (None, None)
    if not (isinstance(x, list) and isinstance(w, list) and len(x) == 4 and len(w) == 4):
        return None  # torch counts batched 2-D convolutions only
    return _conv(dims, concrete, 3, 4, 5)


def _convolution(dims: Dims, concrete: Sequence[Any]) -> int | None:
    """``aten::convolution`` and ``aten::_convolution``: stride, padding, dilation, transposed."""
    if len(concrete) < 7:
        return None
    return _conv(dims, concrete, 3, 4, 5, transposed=concrete[6] == "True")


def _matmul(a: Any, b: Any, batched: bool) -> int | None:
    """2 · M · K · N (``mm``), 2 · B · M · K · N (``bmm``)."""
    rank = 3 if batched else 2
    if not (isinstance(a, list) and isinstance(b, list) and len(a) == rank and len(b) == rank):
        return None
    if a[-1] != b[-2]:
        return None
    batch = a[0] if batched else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


def _addmm(dims: Dims, _concrete: Sequence[Any]) -> int | None:
    """``self + mat1 @ mat2`` (``aten::addmm``, and ``aten::_addmm_activation`` with its ReLU/GELU); the add is not counted."""
    return _matmul(dims[1], dims[2], False) if len(dims) >= 3 else None


def _broadcast_matmul(a: Any, b: Any) -> int | None:
    """``torch.matmul``'s rules: vectors, matrices and broadcast batches of matrices."""
    if not (isinstance(a, list) and isinstance(b, list) and a and b):
        return None
    if not all(isinstance(d, int) for d in (*a, *b)):
        return None
    if len(b) == 1:  # (..., K) @ (K,) or (K,) @ (K,)
        return 2 * _prod(a) if a[-1] == b[0] else None
    if len(a) == 1:  # (K,) @ (..., K, N)
        return 2 * _prod(b) if a[0] == b[-2] else None
    if a[-1] != b[-2]:
        return None
    batch_a, batch_b = a[:-2], b[:-2]
    width = max(len(batch_a), len(batch_b))
    batch_a, batch_b = [1] * (width - len(batch_a)) + batch_a, [1] * (width - len(batch_b)) + batch_b
    batch = _prod([max(i, j) for i, j in zip(batch_a, batch_b)])
    return 2 * batch * a[-2] * a[-1] * b[-1]


def _linear(dims: Dims, _concrete: Sequence[Any]) -> int | None:
    """2 · numel(input) · out_features."""
    if len(dims) < 2:
        return None
    x, w = dims[0], dims[1]
    if not (isinstance(x, list) and isinstance(w, list) and x and len(w) == 2 and x[-1] == w[1]):
        return None
    numel = _numel(x)
    return 2 * numel * w[0] if numel is not None else None


def _attention(dims: Dims, _concrete: Sequence[Any]) -> int | None:
    """Q·Kᵀ and (softmax)·V of scaled dot-product attention: 2 · B · L · S · (E + E_v), B every leading dimension of Q."""
    if len(dims) < 3:
        return None
    q, k, v = dims[0], dims[1], dims[2]
    if not all(isinstance(t, list) and len(t) >= 2 and all(isinstance(d, int) for d in t) for t in (q, k, v)):
        return None
    batch, length, e = _prod(q[:-2]), q[-2], q[-1]
    source, e_v = k[-2], v[-1]
    return 2 * batch * length * source * (e + e_v)


def _mha(batch: int, length: int, source: int, e: int) -> int:
    """Projections of Q (length rows), K and V (source rows each) and of the output, and attention:
    2 · B · (L + 2S) · E² + 2 · B · L · E² + 4 · B · L · S · E."""
    return 2 * batch * (length + 2 * source) * e * e + 2 * batch * length * e * e + 4 * batch * length * source * e


def _batch_length_e(t: Any) -> tuple[int, int, int] | None:
    if not (isinstance(t, list) and len(t) in (2, 3) and all(isinstance(d, int) for d in t)):
        return None  # a nested tensor (padded batch on the fast path) records no shape
    return (t[0] if len(t) == 3 else 1), t[-2], t[-1]


def _native_mha(dims: Dims, _concrete: Sequence[Any]) -> int | None:
    if len(dims) < 3:
        return None
    q, k = _batch_length_e(dims[0]), _batch_length_e(dims[1])
    if q is None or k is None:
        return None
    return _mha(q[0], q[1], k[1], q[2])


def _encoder_layer(dims: Dims, _concrete: Sequence[Any]) -> int | None:
    """Self-attention (``_mha`` with S = L) and the feed-forward block, 4 · B · L · E · F."""
    if len(dims) < 15:
        return None
    src, ffn_1 = _batch_length_e(dims[0]), dims[14]
    if src is None or not (isinstance(ffn_1, list) and len(ffn_1) == 2 and isinstance(ffn_1[0], int)):
        return None
    batch, length, e = src
    return _mha(batch, length, length, e) + 4 * batch * length * e * ffn_1[0]


def _tokens(x: Any) -> int | None:
    """Time steps × batch of a recurrent layer's input: ``[T, B, I]`` (or ``[B, T, I]``), or the
    ``[N, I]`` data of a packed sequence."""
    if not (isinstance(x, list) and len(x) in (2, 3) and all(isinstance(d, int) for d in x)):
        return None
    return _prod(x[:-1])


def _recurrent(dims: Dims, _concrete: Sequence[Any]) -> int | None:
    """``aten::lstm``/``gru``/``rnn_tanh``/``rnn_relu``: 2 · tokens · the weights' elements.

    Every layer and direction multiplies each token by its input-hidden and hidden-hidden
    matrices (and an LSTM's projection), the 2-D tensors of the parameter list (biases and
    gate arithmetic are not counted); the hidden state's tensors have three dimensions."""
    tokens = _tokens(dims[0]) if dims else None
    if tokens is None:
        return None
    params = [s for arg in dims[1:] if isinstance(arg, list) for s in arg if isinstance(s, list) and len(s) == 2]
    if not params or not all(isinstance(d, int) for s in params for d in s):
        return None
    return 2 * tokens * sum(_prod(s) for s in params)


def _mkldnn_rnn_layer(dims: Dims, _concrete: Sequence[Any]) -> int | None:
    """One layer and direction of oneDNN's recurrent layer: 2 · tokens · (W_ih + W_hh elements)."""
    if len(dims) < 3:
        return None
    tokens, w_ih, w_hh = _tokens(dims[0]), _numel(dims[1]), _numel(dims[2])
    if tokens is None or w_ih is None or w_hh is None:
        return None
    return 2 * tokens * (w_ih + w_hh)


def _per_element(dims: Dims, _concrete: Sequence[Any]) -> int | None:
    """An activation function: 1 FLOP per element of its input."""
    return _numel(dims[0]) if dims else None


#: The activation functions' ops (torch counts none of them), in place or not: ``relu6``
#: and ``selu`` nest ``hardtanh`` and ``elu``, ``prelu`` its kernel, ``log_sigmoid`` its forward
#: (a layer sums only the outermost op with a count).
ACTIVATION_OPS = frozenset(
    f"aten::{name}{suffix}"
    for name in (
        "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "gelu", "silu", "mish", "sigmoid", "tanh",
        "hardtanh", "hardswish", "hardsigmoid", "softplus", "threshold", "prelu", "_prelu_kernel",
        "log_sigmoid", "log_sigmoid_forward",
    )
    for suffix in ("", "_")
)  # fmt: skip


def _five_per_element(dims: Dims, _concrete: Sequence[Any]) -> int | None:
    """A normalization or softmax: 5 FLOP per element of its input."""
    n = _per_element(dims, _concrete)
    return 5 * n if n is not None else None


#: The normalizations' and softmax's ops (torch counts none of them), counted as the layer
#: formula counts ``nn.LayerNorm`` and ``nn.Softmax``: each wrapper and the kernel it calls
#: (a layer sums only the outermost op with a count).
NORMALIZATION_OPS = frozenset(
    f"aten::{name}"
    for name in (
        "batch_norm", "_batch_norm_impl_index", "native_batch_norm", "_native_batch_norm_legit",
        "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional", "cudnn_batch_norm",
        "miopen_batch_norm", "layer_norm", "native_layer_norm", "group_norm", "native_group_norm",
        "instance_norm", "rms_norm", "_fused_rms_norm", "softmax", "_softmax", "_safe_softmax",
        "log_softmax", "_log_softmax",
    )
)  # fmt: skip

_RULES: dict[str, Callable[[Dims, Sequence[Any]], int | None]] = {
    # torch's own (with_flops)
    "aten::conv2d": _conv2d,
    "aten::mm": lambda d, _c: _matmul(d[0], d[1], False) if len(d) >= 2 else None,
    "aten::addmm": _addmm,
    "aten::bmm": lambda d, _c: _matmul(d[0], d[1], True) if len(d) >= 2 else None,
    "aten::baddbmm": lambda d, _c: _matmul(d[1], d[2], True) if len(d) >= 3 else None,
    "aten::mul": lambda d, _c: _numel(d[0]) if d else None,  # one per element of the first input
    "aten::add": lambda d, _c: _numel(d[0]) if d else None,
    # mltrace's: the ops torch counts nothing for
    "aten::conv1d": lambda d, c: _conv(d, c, 3, 4, 5),
    "aten::conv3d": lambda d, c: _conv(d, c, 3, 4, 5),
    "aten::convolution": _convolution,
    "aten::_convolution": _convolution,
    "aten::mkldnn_convolution": lambda d, c: _conv(d, c, 4, 3, 5),
    "aten::_slow_conv2d_forward": lambda d, c: _conv(d, c, 4, 5, None),
    "aten::cudnn_convolution": lambda d, c: _conv(d, c, 3, 2, 4),
    "aten::cudnn_convolution_transpose": lambda d, c: _conv(d, c, None, None, None, transposed=True),
    "aten::miopen_convolution": lambda d, c: _conv(d, c, 4, 3, 5),
    "aten::_nnpack_spatial_convolution": lambda d, c: _conv(d, c, 4, 3, None),
    "aten::thnn_conv2d": lambda d, c: _conv(d, c, 4, 5, None),
    "aten::conv_transpose1d": lambda d, c: _conv(d, c, None, None, None, transposed=True),
    "aten::conv_transpose2d": lambda d, c: _conv(d, c, None, None, None, transposed=True),
    "aten::conv_transpose3d": lambda d, c: _conv(d, c, None, None, None, transposed=True),
    "aten::slow_conv_transpose2d": lambda d, c: _conv(d, c, None, None, None, transposed=True),
    "aten::linear": _linear,
    "aten::_addmm_activation": _addmm,
    "aten::matmul": lambda d, _c: _broadcast_matmul(d[0], d[1]) if len(d) >= 2 else None,
    "aten::scaled_dot_product_attention": _attention,
    "aten::_scaled_dot_product_flash_attention_for_cpu": _attention,
    "aten::_scaled_dot_product_attention_math": _attention,
    "aten::_scaled_dot_product_flash_attention": _attention,
    "aten::_scaled_dot_product_efficient_attention": _attention,
    "aten::_scaled_dot_product_cudnn_attention": _attention,
    "aten::_native_multi_head_attention": _native_mha,
    "aten::_transformer_encoder_layer_fwd": _encoder_layer,
    "aten::lstm": _recurrent,
    "aten::gru": _recurrent,
    "aten::rnn_tanh": _recurrent,
    "aten::rnn_relu": _recurrent,
    "aten::mkldnn_rnn_layer": _mkldnn_rnn_layer,
    **dict.fromkeys(ACTIVATION_OPS, _per_element),
    **dict.fromkeys(NORMALIZATION_OPS, _five_per_element),
}


#: How many arguments each op with a rule takes, as torch declares its main overload (the out=
#: tensors of its ``.out`` overload not counted), and those of the ops whose bytes follow their
#: own rule (``analysis/roofline.OP_BYTES_RULES``).
ARITY: dict[str, int] = {
    "aten::linear": 3, "aten::matmul": 2, "aten::mm": 2, "aten::bmm": 2, "aten::addmm": 5,
    "aten::baddbmm": 5, "aten::_addmm_activation": 6, "aten::mul": 2, "aten::add": 3,
    "aten::conv1d": 7, "aten::conv2d": 7, "aten::conv3d": 7, "aten::convolution": 9, "aten::_convolution": 13,
    "aten::conv_transpose1d": 8, "aten::conv_transpose2d": 8, "aten::conv_transpose3d": 8,
    "aten::slow_conv_transpose2d": 8, "aten::mkldnn_convolution": 7, "aten::_slow_conv2d_forward": 6,
    "aten::thnn_conv2d": 6, "aten::cudnn_convolution": 9, "aten::cudnn_convolution_transpose": 10,
    "aten::miopen_convolution": 9, "aten::_nnpack_spatial_convolution": 5,
    "aten::scaled_dot_product_attention": 8, "aten::_scaled_dot_product_attention_math": 9,
    "aten::_scaled_dot_product_flash_attention_for_cpu": 7, "aten::_scaled_dot_product_flash_attention": 7,
    "aten::_scaled_dot_product_efficient_attention": 8, "aten::_scaled_dot_product_cudnn_attention": 9,
    "aten::_native_multi_head_attention": 13, "aten::_transformer_encoder_layer_fwd": 20,
    "aten::lstm": 9, "aten::gru": 9, "aten::rnn_tanh": 9, "aten::rnn_relu": 9, "aten::mkldnn_rnn_layer": 16,
    "aten::relu": 1, "aten::relu_": 1, "aten::relu6": 1, "aten::relu6_": 1, "aten::leaky_relu": 2,
    "aten::leaky_relu_": 2, "aten::elu": 4, "aten::elu_": 4, "aten::selu": 1, "aten::selu_": 1,
    "aten::celu": 2, "aten::celu_": 2, "aten::gelu": 2, "aten::gelu_": 2, "aten::silu": 1, "aten::silu_": 1,
    "aten::mish": 1, "aten::mish_": 1, "aten::sigmoid": 1, "aten::sigmoid_": 1, "aten::tanh": 1,
    "aten::tanh_": 1, "aten::hardtanh": 3, "aten::hardtanh_": 3, "aten::hardswish": 1, "aten::hardswish_": 1,
    "aten::hardsigmoid": 1, "aten::hardsigmoid_": 1, "aten::softplus": 3, "aten::threshold": 3,
    "aten::threshold_": 3, "aten::prelu": 2, "aten::_prelu_kernel": 2, "aten::log_sigmoid": 1,
    "aten::log_sigmoid_forward": 1,
    "aten::batch_norm": 9, "aten::_batch_norm_impl_index": 9, "aten::native_batch_norm": 8,
    "aten::_native_batch_norm_legit": 8, "aten::_native_batch_norm_legit_no_training": 7,
    "aten::_native_batch_norm_legit_functional": 8, "aten::cudnn_batch_norm": 8, "aten::miopen_batch_norm": 8,
    "aten::layer_norm": 6, "aten::native_layer_norm": 5, "aten::group_norm": 6, "aten::native_group_norm": 8,
    "aten::instance_norm": 9, "aten::rms_norm": 4, "aten::_fused_rms_norm": 4, "aten::softmax": 3,
    "aten::_softmax": 3, "aten::_safe_softmax": 3, "aten::log_softmax": 3, "aten::_log_softmax": 3,
    "aten::embedding": 5, "aten::index_select": 3, "aten::gather": 4,
}  # fmt: skip
#: The args of an op's record that hold one value per input, as ``Input Dims`` does.
_PER_INPUT = ("Input Dims", "Input type", "Input Strides", "Concrete Inputs")


def own_arguments(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """The record of an op that TorchScript's interpreter called, without the values of the
    interpreter's stack that torch records ahead of the op's own arguments (a scripted
    model's ``aten::linear`` as ``[[2, 16, 8], [2, 16, 8], [8, 8], [8]]``: a value that waits
    on the stack for a later op, then the input, weight and bias): the last ``ARITY`` values of
    each per-input list. ``args`` itself where the op's arity is not known or the record holds
    no more values than it (an out= overload's record, one value longer, is read as one
    stack value ahead of the main overload's)."""
    arity = ARITY.get(name)
    dims = args.get("Input Dims")
    if arity is None or not isinstance(dims, list) or len(dims) <= arity:
        return args
    extra = len(dims) - arity
    own = dict(args)
    for key in _PER_INPUT:
        values = args.get(key)
        if isinstance(values, list) and len(values) == len(dims):
            own[key] = values[extra:]
    return own


def aten_flops(name: str, args: dict[str, Any]) -> int | None:
    """FLOPs of one Kineto ``cpu_op`` event from its args, or None where torch counts none
    (or the record lacks what the count needs)."""
    rule = _RULES.get(name)
    if rule is None:
        return None
    dims = args.get("Input Dims")
    if not isinstance(dims, list):
        return None
    concrete = args.get("Concrete Inputs")
    try:
        flops = rule(dims, concrete if isinstance(concrete, list) else [])
    except (TypeError, IndexError):
        return None
    return flops if flops else None
