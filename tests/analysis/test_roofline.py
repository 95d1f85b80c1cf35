"""Work formulas (FLOPs, bytes) from tables of layer shapes."""

from __future__ import annotations

import pytest

from mltrace.analysis.roofline import (
    FORMULA,
    attainable_flops,
    element_bytes,
    explicit_work,
    io_bytes,
    layer_formula_work,
    numel,
    op_bytes,
    roofline_time_ns,
)


def attrs(ins: list[list[int]], outs: list[list[int]], params: int = 0, dtype: str = "float32") -> dict[str, object]:
    return {
        "ml.input.shapes": ins,
        "ml.input.dtypes": [dtype] * len(ins),
        "ml.output.shapes": outs,
        "ml.output.dtypes": [dtype] * len(outs),
        "ml.layer.params": params,
    }


@pytest.mark.parametrize(
    ("layer_type", "ins", "outs", "params", "flops"),
    [
        # Linear(512 → 256) on [8, 512]: 2·M·N·K
        ("Linear", [[8, 512]], [[8, 256]], 512 * 256 + 256, 2 * 8 * 256 * 512),
        # 3-D input: M is every leading element
        ("Linear", [[4, 16, 64]], [[4, 16, 32]], 64 * 32, 2 * 64 * 32 * 64),
        # Conv2d(3 → 64, 7×7, stride 2) on 1×3×64×64 → 1×64×32×32, with bias (params // Cout = 147 + 0)
        ("Conv2d", [[1, 3, 64, 64]], [[1, 64, 32, 32]], 64 * 3 * 49 + 64, 2 * 64 * 32 * 32 * (3 * 49 + 1)),
        # without bias
        ("Conv2d", [[1, 3, 64, 64]], [[1, 64, 32, 32]], 64 * 3 * 49, 2 * 64 * 32 * 32 * 3 * 49),
        # depthwise (groups = 32): weights 32·1·3·3
        ("Conv2d", [[2, 32, 8, 8]], [[2, 32, 8, 8]], 32 * 9, 2 * 2 * 32 * 8 * 8 * 9),
        ("Conv1d", [[1, 4, 100]], [[1, 8, 98]], 8 * 4 * 3, 2 * 8 * 98 * 12),
        # ConvTranspose2d(16 → 8, 2×2): each input element scatters Cout·k² MACs
        ("ConvTranspose2d", [[1, 16, 4, 4]], [[1, 8, 8, 8]], 16 * 8 * 4, 2 * 16 * 16 * 32),
        ("ReLU", [[2, 10]], [[2, 10]], 0, 20),
        ("LayerNorm", [[2, 10]], [[2, 10]], 20, 5 * 20),
        ("MaxPool2d", [[1, 2, 4, 4]], [[1, 2, 2, 2]], 0, 32),
        ("Dropout", [[2, 10]], [[2, 10]], 0, 0),
        # MultiheadAttention, [L=10, N=2, E=8] (batch = the smaller of dims 0 and 1)
        (
            "MultiheadAttention",
            [[10, 2, 8], [10, 2, 8], [10, 2, 8]],
            [[10, 2, 8]],
            4 * 64 + 4 * 8,
            2 * 2 * (10 + 20) * 64 + 2 * 2 * 10 * 64 + 4 * 2 * 10 * 10 * 8,
        ),
        ("LSTM", [[5, 1, 10]], [[5, 1, 20]], 1000, 2 * 1000 * 5),
    ],
)
def test_formula_flops(layer_type: str, ins: list[list[int]], outs: list[list[int]], params: int, flops: int) -> None:
    work = layer_formula_work(layer_type, attrs(ins, outs, params))
    assert work is not None and work.source == FORMULA
    assert work.flops == flops


def test_bytes_are_inputs_outputs_and_weights() -> None:
    a = attrs([[8, 512]], [[8, 256]], 512 * 256 + 256)
    expected = (8 * 512 + 8 * 256 + 512 * 256 + 256) * 4
    assert io_bytes(a) == expected
    work = layer_formula_work("Linear", a)
    assert work is not None and work.bytes == expected
    assert work.intensity == pytest.approx(work.flops / expected)
    half = layer_formula_work("Linear", attrs([[8, 512]], [[8, 256]], 512 * 256 + 256, dtype="bfloat16"))
    assert half is not None and half.bytes == expected / 2


def test_views_move_nothing_and_lookups_move_rows() -> None:
    dropout = layer_formula_work("Dropout", attrs([[2, 10]], [[2, 10]]))
    assert dropout is not None and (dropout.flops, dropout.bytes) == (0, 0)
    emb = {
        "ml.input.shapes": [[2, 16]],
        "ml.input.dtypes": ["int64"],
        "ml.output.shapes": [[2, 16, 256]],
        "ml.output.dtypes": ["float32"],
        "ml.layer.params": 30522 * 256,
    }
    work = layer_formula_work("Embedding", emb)
    assert work is not None
    assert work.bytes == 2 * 16 * 8 + 2 * (2 * 16 * 256 * 4)  # indices + rows read + rows written, not the table


def test_unknown_type_or_shapes_give_no_formula() -> None:
    assert layer_formula_work("MyBlock", attrs([[1, 2]], [[1, 2]])) is None
    assert layer_formula_work("Conv2d", {"ml.layer.params": 10}) is None  # no shapes recorded
    assert layer_formula_work("Linear", {}) is None


def test_symbolic_dimensions_are_not_known_sizes() -> None:
    """A shape with a dimension that is not a whole number (a model's declared "batch", a
    symbolic size written as text) gives no formula and no bytes for that tensor, not an error."""
    symbolic = {"ml.input.shapes": [["batch", 3, 16, 16]], "ml.output.shapes": [["s0", 8, 16, 16]], "ml.layer.params": 224}
    assert layer_formula_work("Conv2d", symbolic) is None
    assert io_bytes(symbolic) == 224 * 4  # the weights only
    half = {**symbolic, "ml.output.shapes": [[1, 8, 16, 16]]}
    work = layer_formula_work("Conv2d", half)
    assert work is not None and work.flops == 2 * 8 * 16 * 16 * (224 // 8)


def test_io_bytes_of_scalars_and_missing_fields() -> None:
    assert io_bytes({}) == 0
    assert io_bytes({"ml.input.shapes": [[], [3]], "ml.input.dtypes": ["Scalar", "float64"]}) == 3 * 8
    assert numel([2, 3, 4]) == 24 and numel([]) == 1 and numel("x") == 0 and numel([2, -1]) == 0


@pytest.mark.parametrize(
    ("dtype", "size"),
    [
        ("float32", 4),
        ("float", 4),
        ("c10::BFloat16", 2),
        ("bfloat16", 2),
        ("c10::Half", 2),
        ("long int", 8),
        ("int64", 8),
        ("bool", 1),
        ("?", 4),
    ],
)
def test_element_sizes(dtype: str, size: int) -> None:
    assert element_bytes(dtype) == size


def test_op_bytes_from_kineto_style_inputs() -> None:
    # aten::add(float[1000], float[1000], Scalar): two inputs, output as large as the largest input
    op = {"ml.input.shapes": [[1000], [1000], []], "ml.input.dtypes": ["float", "float", "Scalar"]}
    assert op_bytes(op) == 3 * 1000 * 4
    assert op_bytes({**op, "ml.output.shapes": [[10]], "ml.output.dtypes": ["float"]}) == 2 * 4000 + 40
    assert op_bytes({**op, "ml.bytes": 7}) == 7


def test_explicit_work_accepts_numbers_only() -> None:
    assert explicit_work({"ml.flops": 10, "ml.bytes": 2.5}) == (10.0, 2.5)
    assert explicit_work({"ml.flops": "10", "ml.bytes": True}) == (None, None)
    assert explicit_work({"ml.flops": -1}) == (None, None)


def test_roofline_time_and_attainable() -> None:
    # 1 GFLOP at 100 GFLOP/s = 10 ms; 1 GB at 10 GB/s = 100 ms: memory dominates
    assert roofline_time_ns(1e9, 1e9, 100e9, 10e9) == pytest.approx(100e6)
    assert roofline_time_ns(1e9, 0, 100e9, 10e9) == pytest.approx(10e6)
    assert attainable_flops(1.0, 100e9, 10e9) == pytest.approx(10e9)
    assert attainable_flops(1000.0, 100e9, 10e9) == pytest.approx(100e9)
