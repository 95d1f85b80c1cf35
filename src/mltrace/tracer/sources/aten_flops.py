"""FLOP counts of ATen ops from what ``record_shapes`` records, computed after the run.

``torch.profiler(with_flops=True)`` counts FLOPs while the program runs: for
every op it keeps the arguments the count needs, which cost the traced
program ≈ 4 % on the example CNN (``benchmarks/overhead.py``'s op level,
measured side by side with ``record_shapes`` alone; PERFORMANCE.md). The same
counts follow from what ``record_shapes=True`` already writes to each
``cpu_op`` event: ``Input Dims`` (tensor shapes) and ``Concrete Inputs``
(scalar and int-list arguments as strings, e.g. ``"[2, 2]"``, ``"4"``). This
module computes them with torch's own rules, for the ops torch counts:

============================ =====================================================
``aten::conv2d``             2 · N · C_out · H_out · W_out · (C_in / groups) · kH · kW
                             (output size from stride, padding, dilation)
``aten::mm``, ``aten::addmm`` 2 · M · K · N (the bias add is not counted)
``aten::bmm``, ``aten::baddbmm`` 2 · B · M · K · N
``aten::mul``, ``aten::add`` one per element of the first input
============================ =====================================================

``tests/tracer/test_torch_ops.py`` checks every count against torch's own
``with_flops`` on real models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Dims = Sequence[Any]


def _numel(shape: Any) -> int | None:
    if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
        return None
    n = 1
    for d in shape:
        n *= d
    return n


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


def _conv2d(dims: Dims, concrete: Sequence[Any]) -> int | None:
    if len(dims) < 2 or len(concrete) < 7:
        return None
    x, w = dims[0], dims[1]
    if not (isinstance(x, list) and isinstance(w, list) and len(x) == 4 and len(w) == 4):
        return None
    stride, padding, dilation = (_int_list(concrete[i], 2) for i in (3, 4, 5))
    if stride is None or padding is None or dilation is None:
        return None  # e.g. padding="same": the output size is not in the record
    n, _, h, wd = x
    c_out, c_in_per_group, kh, kw = w
    h_out = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    w_out = (wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    if h_out <= 0 or w_out <= 0:
        return None
    return 2 * n * c_out * h_out * w_out * c_in_per_group * kh * kw


def _matmul(a: Any, b: Any, batched: bool) -> int | None:
    rank = 3 if batched else 2
    if not (isinstance(a, list) and isinstance(b, list) and len(a) == rank and len(b) == rank):
        return None
    if a[-1] != b[-2]:
        return None
    batch = a[0] if batched else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


_RULES: dict[str, Callable[[Dims, Sequence[Any]], int | None]] = {
    "aten::conv2d": _conv2d,
    "aten::mm": lambda d, _c: _matmul(d[0], d[1], False) if len(d) >= 2 else None,
    "aten::addmm": lambda d, _c: _matmul(d[1], d[2], False) if len(d) >= 3 else None,
    "aten::bmm": lambda d, _c: _matmul(d[0], d[1], True) if len(d) >= 2 else None,
    "aten::baddbmm": lambda d, _c: _matmul(d[1], d[2], True) if len(d) >= 3 else None,
    "aten::mul": lambda d, _c: _numel(d[0]) if d else None,
    "aten::add": lambda d, _c: _numel(d[0]) if d else None,
}


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
