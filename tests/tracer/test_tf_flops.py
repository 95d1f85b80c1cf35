"""FLOP counts of TensorFlow graph ops (``tf_flops``): formulas against hand counts, and a real function graph."""

from __future__ import annotations

import pytest

from mltrace.formats.tf_flops import FlopTable, OpWork, graph_work, op_flops, runtime_kind, scope_of, top_scopes

# Imported here, not in a test: TensorFlow's import adds import hooks, which conftest counts as leaked.
tf = pytest.importorskip("tensorflow")


def test_formulas_by_hand() -> None:
    # Conv2D: NHWC output 1x8x8x16, HWIO kernel 3x3x4x16 → 2 x 1024 x 36.
    assert op_flops("conv", [[1, 8, 8, 4], [3, 3, 4, 16]], [1, 8, 8, 16]) == (2.0 * 1024 * 36, False)
    # Unknown batch: per row, scaled later.
    assert op_flops("conv", [[None, 8, 8, 4], [3, 3, 4, 16]], [None, 8, 8, 16]) == (2.0 * 1024 * 36, True)
    # Depthwise 3x3, multiplier 2 on 4 channels: output 1x8x8x8 → 2 x 512 x 9.
    assert op_flops("depthwise", [[1, 8, 8, 4], [3, 3, 4, 2]], [1, 8, 8, 8]) == (2.0 * 512 * 9, False)
    # MatMul 5x7 @ 7x3, and with transpose_a (7x5)ᵀ.
    assert op_flops("matmul", [[5, 7], [7, 3]], [5, 3]) == (2.0 * 15 * 7, False)
    assert op_flops("matmul", [[7, 5], [7, 3]], [5, 3], transpose_a=True) == (2.0 * 15 * 7, False)
    assert op_flops("matmul", [[None, None, 7], [7, 3]], [None, None, 3]) is None  # two unknown dimensions


def test_runtime_ops_take_their_scopes_counts_in_order() -> None:
    assert runtime_kind("_MklNativeFusedConv2D") == "conv" and runtime_kind("_MklNativeFusedDepthwiseConv2dNative") == "depthwise"
    assert runtime_kind("_MklNativeFusedMatMul") == "matmul" and runtime_kind("Relu") is None
    assert scope_of("StatefulPartitionedCall/m_1/fc_1/BiasAdd") == "m_1/fc_1"
    table = FlopTable(
        {"m_1/conv_1": [OpWork("conv", 100.0, True)], "m_1/fc_1": [OpWork("matmul", 10.0, False), OpWork("matmul", 20.0, False)]}
    )
    ops = [
        ("StatefulPartitionedCall/m_1/conv_1/Relu", "_MklNativeFusedConv2D"),
        ("m_1/fc_1/BiasAdd", "_MklNativeFusedMatMul"),
        ("m_1/fc_1/MatMul_1", "MatMul"),
        ("m_1/fc_1/MatMul_2", "MatMul"),  # a third product the graph did not have
        ("m_1/fc_1/Relu", "Relu"),
    ]
    assert table.take(ops, batch=4) == [400.0, 10.0, 20.0, None, None]
    assert table.take(ops[:1], batch=None) == [None]  # per-row counts need the batch size


def test_a_real_function_graph() -> None:
    @tf.function(input_signature=[tf.TensorSpec([None, 8, 8, 4], tf.float32)])
    def f(x: object) -> object:
        with tf.name_scope("net"):
            with tf.name_scope("conv"):
                y = tf.nn.conv2d(x, tf.ones([3, 3, 4, 16]), strides=1, padding="SAME")
            with tf.name_scope("fc"):
                return tf.matmul(tf.reshape(y, [-1, 1024]), tf.ones([1024, 10]))

    graph = f.get_concrete_function().graph
    table = graph_work(graph)
    assert top_scopes(graph).most_common(1)[0][0] == "net"
    assert table.by_scope == {"net/conv": [OpWork("conv", 2.0 * 1024 * 36, True)], "net/fc": [OpWork("matmul", 2.0 * 10 * 1024, True)]}
