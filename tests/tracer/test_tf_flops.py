"""FLOP counts of TensorFlow graph ops (``tf_flops``): formulas against hand counts, and a real function graph."""

from __future__ import annotations

import pytest

from mltrace.formats.tf_flops import (
    FlopTable,
    OpWork,
    graph_work,
    keras_attention_flops,
    keras_layer_flops,
    keras_layer_kind,
    op_flops,
    runtime_kind,
    scope_of,
    top_scopes,
)

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


def test_einsums_by_hand() -> None:
    """Attention's products as Keras's MultiHeadAttention writes them: 2 x output elements x the summed letters."""
    key, query, scores = [2, 16, 4, 8], [2, 10, 4, 8], [2, 4, 10, 16]
    assert op_flops("einsum", [key, query], scores, equation="aecd,abcd->acbe") == (2.0 * (2 * 4 * 10 * 16) * 8, False)
    assert op_flops("einsum", [scores, [2, 16, 4, 6]], [2, 10, 4, 6], equation="acbe,aecd->abcd") == (2.0 * 480 * 16, False)
    # "...", an implicit output (the letters written once: ik), an outer product, an unknown batch (per row).
    assert op_flops("einsum", [[3, 5, 7], [7, 2]], [3, 5, 2], equation="...j,jk->...k") == (2.0 * 30 * 7, False)
    assert op_flops("einsum", [[5, 7], [7, 2]], [5, 2], equation="ij,jk") == (2.0 * 10 * 7, False)
    assert op_flops("einsum", [[5], [3]], [5, 3], equation="i,j->ij") == (2.0 * 15, False)
    assert op_flops("einsum", [[None, 5, 7], [None, 7, 2]], [None, 5, 2], equation="bij,bjk->bik") == (2.0 * 10 * 7, True)
    # Not counted: three operands, a summed dimension of unknown size, no equation.
    assert op_flops("einsum", [[2, 3], [3, 4], [4, 5]], [2, 5], equation="ij,jk,kl->il") is None
    assert op_flops("einsum", [[5, None], [None, 2]], [5, 2], equation="ij,jk->ik") is None
    assert op_flops("einsum", [[5, 7], [7, 2]], [5, 2]) is None


def test_eager_keras_layers_by_hand() -> None:
    assert keras_layer_kind(["Conv2D", "BaseConv", "Layer"]) == "conv"
    assert keras_layer_kind(["DepthwiseConv2D", "BaseDepthwiseConv", "Layer"]) == "depthwise"
    assert keras_layer_kind(["DepthwiseConv2D", "DepthwiseConv", "Conv2D", "Conv", "Layer"]) == "depthwise"  # tf_keras
    assert keras_layer_kind(["EinsumDense", "Layer"]) == "einsum" and keras_layer_kind(["Dense", "Layer"]) == "dense"
    assert keras_layer_kind(["Conv2DTranspose", "Conv2D", "Conv", "Layer"]) is None  # tf_keras: a transposed Conv2D
    assert keras_layer_kind(["SeparableConv2D", "BaseSeparableConv", "Layer"]) is None
    assert keras_layer_kind(["MultiHeadAttention", "Layer"]) == "attention"
    # Dense on (2, 5, 7) → (2, 5, 3): 2 x 30 x 7.
    assert keras_layer_flops("dense", [2, 5, 7], [2, 5, 3]) == 2.0 * 30 * 7
    # Conv2D 3x3, 8 input channels in 2 groups, 16 filters: 2 x output elements x 9 x 4.
    assert keras_layer_flops("conv", [1, 8, 8, 8], [1, 8, 8, 16], kernel_size=(3, 3), groups=2) == 2.0 * 1024 * 36
    assert keras_layer_flops("conv", [1, 8, 8, 8], [1, 16, 8, 8], kernel_size=(3, 3), channels_first=True) == 2.0 * 1024 * 72
    assert keras_layer_flops("conv", [1, 8, 8, 6], [1, 8, 8, 16], kernel_size=(3, 3), groups=4) is None  # 6 channels, 4 groups
    # Depthwise 3x3, multiplier 2 on 4 channels: 2 x 512 x 9.
    assert keras_layer_flops("depthwise", [1, 8, 8, 4], [1, 8, 8, 8], kernel_size=(3, 3)) == 2.0 * 512 * 9
    # EinsumDense: the input dimensions the kernel sums over (c; with "...", aligned from the right).
    assert keras_layer_flops("einsum", [2, 128, 256], [2, 128, 8, 32], equation="abc,cde->abde") == 2.0 * 2 * 128 * 256 * 256
    assert keras_layer_flops("einsum", [2, 4, 5, 7], [2, 4, 5, 3], equation="...b,bc->...c") == 2.0 * 120 * 7
    assert keras_layer_flops("einsum", [2, 7], [2, 3], equation="ab,bc") is None
    assert keras_layer_flops("dense", [-1, 7], [-1, 3]) is None  # an unknown dimension


def test_eager_attention_by_hand() -> None:
    # Cross-attention: query (2, 10, 16), value (2, 12, 8), 3 heads, key_dim 4, value_dim 5, output (2, 10, 16).
    projections = 2.0 * 3 * ((2 * 10 * 16 + 2 * 12 * 8) * 4 + 2 * 12 * 8 * 5 + 2 * 10 * 16 * 5)
    products = 2.0 * 2 * 3 * 10 * 12 * (4 + 5)  # QK^T over key_dim, then A.V over value_dim
    kw = {"num_heads": 3, "key_dim": 4, "value_dim": 5}
    assert keras_attention_flops([2, 10, 16], [2, 12, 8], [2, 12, 8], [2, 10, 16], **kw) == projections + products
    # A key of its own (12 x 6): its projection, not the value's, sums over key_dim.
    with_key = projections + 2.0 * 3 * (2 * 12 * 6 - 2 * 12 * 8) * 4 + products
    assert keras_attention_flops([2, 10, 16], [2, 12, 8], [2, 12, 6], [2, 10, 16], **kw) == with_key
    # Attention over axis 2 of (2, 4, 10, 8): the 4 rows are a batch dimension; by default axes 1 and 2 (7 x 9 positions).
    over_2 = keras_attention_flops([2, 4, 10, 8], [2, 4, 12, 8], [2, 4, 12, 8], [2, 4, 10, 8], attention_axes=(2,), **kw)
    assert over_2 == 2.0 * 3 * ((640 + 768) * 4 + 768 * 5 + 640 * 5) + 2.0 * 8 * 3 * 10 * 12 * 9
    both = keras_attention_flops([2, 7, 9, 8], [2, 7, 9, 8], [2, 7, 9, 8], [2, 7, 9, 8], **kw)
    assert both == 2.0 * 3 * 1008 * (4 + 4 + 5 + 5) + 2.0 * 2 * 3 * 63 * 63 * 9
    assert keras_attention_flops([-1, 10, 16], [2, 12, 8], [2, 12, 8], [2, 10, 16], **kw) is None  # unknown batch
    assert keras_attention_flops([2, 10, 16], [2, 12, 8], [2, 12, 8], [2, 10, 16], attention_axes=(-1,), **kw) is None


def test_runtime_ops_take_their_scopes_counts_in_order() -> None:
    assert runtime_kind("_MklNativeFusedConv2D") == "conv" and runtime_kind("_MklNativeFusedDepthwiseConv2dNative") == "depthwise"
    assert runtime_kind("_MklNativeFusedMatMul") == "matmul" and runtime_kind("Relu") is None
    assert runtime_kind("_MklEinsum") == "einsum" and runtime_kind("Einsum") == "einsum"
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
                z = tf.matmul(tf.reshape(y, [-1, 1024]), tf.ones([1024, 10]))
            with tf.name_scope("att"):
                return tf.einsum("bi,bj->bij", z, z)

    graph = f.get_concrete_function().graph
    table = graph_work(graph)
    assert top_scopes(graph).most_common(1)[0][0] == "net"
    assert table.by_scope == {
        "net/conv": [OpWork("conv", 2.0 * 1024 * 36, True)],
        "net/fc": [OpWork("matmul", 2.0 * 10 * 1024, True)],
        "net/att/einsum": [OpWork("einsum", 2.0 * 100, True)],  # tf.einsum opens a scope of its own
    }
