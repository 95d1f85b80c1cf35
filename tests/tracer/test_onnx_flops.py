"""FLOP counts of ONNX Runtime kernels (``onnx_flops``), against hand counts and torch's own."""

from __future__ import annotations

import pytest

from mltrace.formats.onnx_flops import onnx_flops


@pytest.mark.parametrize(
    ("op", "ins", "outs", "flops"),
    [
        # 2 · N · C_out · H · W · C_in · kH · kW
        ("Conv", [[2, 3, 32, 32], [16, 3, 7, 7]], [[2, 16, 16, 16]], 2 * 2 * 16 * 16 * 16 * 3 * 7 * 7),
        # NCHWc with a fused residual input: the extra input changes nothing
        ("Conv", [[1, 16, 8, 8], [16, 16, 3, 3], [16], [1, 16, 8, 8]], [[1, 16, 8, 8]], 2 * 16 * 64 * 16 * 9),
        # grouped (depthwise): C_in / groups = 1
        ("FusedConv", [[1, 32, 8, 8], [32, 1, 3, 3]], [[1, 32, 8, 8]], 2 * 32 * 64 * 9),
        ("NhwcFusedConv", [[1, 8, 8, 16], [32, 16, 1, 1]], [[1, 8, 8, 32]], 2 * 64 * 32 * 16),
        ("ConvInteger", [[1, 3, 32, 32], [16, 3, 7, 7], [], []], [[1, 16, 16, 16]], 2 * 256 * 16 * 147),
        ("QLinearConv", [[1, 3, 8, 8], [], [], [4, 3, 3, 3], [], [], [], []], [[1, 4, 6, 6]], 2 * 36 * 4 * 27),
        ("ConvTranspose", [[1, 4, 5, 5], [4, 2, 3, 3]], [[1, 2, 7, 7]], 2 * 25 * 72),
        # Gemm: the weight was pre-packed and is missing; A [M, K] and Y [M, N] suffice
        ("Gemm", [[1, 32], [10]], [[1, 10]], 2 * 1 * 32 * 10),
        ("Gemm", [[32, 4], [10, 32]], [[4, 10]], 2 * 4 * 32 * 10),  # transA
        ("MatMul", [[8, 16], [16, 48]], [[8, 48]], 2 * 8 * 16 * 48),
        ("MatMul", [[2, 4, 8, 16], [2, 4, 16, 8]], [[2, 4, 8, 8]], 2 * 2 * 4 * 8 * 8 * 16),
        # Q·Kᵀ as ORT fuses it (transBatchA, transB): K is the shared last dimension
        ("FusedMatMul", [[8, 1, 2, 4], [8, 1, 2, 4]], [[1, 2, 8, 8]], 2 * 128 * 4),
        ("FusedMatMul", [[2, 6, 8], [2, 6, 5]], [[2, 8, 5]], 2 * 80 * 6),  # transA: K = A[-2]
        ("MatMulInteger", [[1, 8, 16], [16, 32], [], []], [[1, 8, 32]], 2 * 256 * 16),
        ("Attention", [[2, 8, 16], [16, 48], [48]], [[2, 8, 16]], 2 * 2 * 8 * 16 * 48 + 4 * 2 * 64 * 16),
        ("MultiHeadAttention", [[2, 8, 16], [2, 6, 16], [2, 6, 16]], [[2, 8, 16]], 2 * 2 * 8 * 6 * 32),
    ],
)
def test_counts(op: str, ins: list[list[int]], outs: list[list[int]], flops: int) -> None:
    assert onnx_flops(op, ins, outs) == flops


@pytest.mark.parametrize(
    ("op", "ins", "outs"),
    [
        ("Relu", [[1, 4]], [[1, 4]]),  # no formula: elementwise work is judged by its bytes
        ("Conv", [[1, 3, 8, 8]], [[1, 4, 6, 6]]),  # the weight's shape is missing
        ("Conv", [[-1, 3, 8, 8], [4, 3, 3, 3]], [[-1, 4, 6, 6]]),  # a dimension is unknown
        ("Gemm", [[1, 2, 3]], [[1, 3]]),
        ("MatMul", [], [[2, 2]]),
    ],
)
def test_no_count(op: str, ins: list[list[int]], outs: list[list[int]]) -> None:
    assert onnx_flops(op, ins, outs) is None


def test_agrees_with_torch_flop_counter() -> None:
    """The shapes of a torch Conv2d and Linear give the count torch's own counter gives."""
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    conv = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=2, bias=False)
    linear = torch.nn.Linear(64, 24)
    x, v = torch.randn(2, 8, 15, 15), torch.randn(5, 64)
    for module, inp in ((conv, x), (linear, v)):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            y = module(inp)
        ins = [list(inp.shape), list(module.weight.shape)]
        op = "Conv" if module is conv else "Gemm"
        if op == "Gemm":
            ins = [list(inp.shape), [24]]  # as ORT's profile shows it: the weight pre-packed
        assert onnx_flops(op, ins, [list(y.shape)]) == counter.get_total_flops()
