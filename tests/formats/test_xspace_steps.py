"""The steps of ``xspace_to_events``, one table each.

Every row is a host event as TensorFlow 2.21 wrote it in tests/data/tensorflow/
(``keras_nested.xplane.pb``: line ids, names and stats as ``host_profile`` reads them).
"""

from __future__ import annotations

from typing import Any

import pytest

from mltrace.formats.xspace import (
    SYNTHETIC_TID_BASE,
    XEventRow,
    call_function,
    call_key,
    eager_op_attrs,
    graph_op_attrs,
    line_thread,
    number_steps,
    sort_host_events,
)

PYTHON = -5828656899990645124  # the line of the Python thread that called the model
COMPUTE = -8855742678736127697  # a tf_Compute line

PREDICT_STEP = XEventRow(
    PYTHON,
    "EagerExecute",
    1795323816034416714,
    1795323816035135691,
    {"eager_op": "__inference_one_step_on_data_distributed_145", "is_func": 1},
)
EAGER_OP = XEventRow(PYTHON, "EagerExecute", 1795323815991429349, 1795323815992193807, {"eager_op": "RangeDataset", "is_func": 0})
FUSED_CONV = XEventRow(COMPUTE, "net_1/conv_1/BiasAdd:_MklNativeFusedConv2D", 1795323816034724619, 1795323816034961876, {})
READ_VARIABLE = XEventRow(COMPUTE, "net_1/conv_1/Reshape/ReadVariableOp:ReadVariableOp", 1795323816034658689, 1795323816034659202, {})
XLA_RUN = XEventRow(PYTHON, "__inference_<lambda>_67:__inference_<lambda>_67", 1795323816050300000, 1795323816050800000, {})
OTHER = [
    XEventRow(PYTHON, "EagerLocalExecute: RangeDataset", 1795323815991432103, 1795323815992193353, {}),
    XEventRow(PYTHON, "MakeIterator::RangeDataset", 1795323816019573003, 1795323816019577721, {}),
    XEventRow(PYTHON, "EagerExecute", 1795323816019573003, 1795323816019577721, {}),  # no eager_op stat
]
BASE = 1795323815000000000


def session(ns: int) -> int:
    return ns - BASE


@pytest.mark.parametrize(
    ("row", "where", "expected"),
    [
        (
            FUSED_CONV,
            "graph",
            (session(FUSED_CONV.start_ns), session(FUSED_CONV.end_ns), FUSED_CONV, "net_1/conv_1/BiasAdd", "_MklNativeFusedConv2D"),
        ),
        (
            READ_VARIABLE,
            "graph",
            (
                session(READ_VARIABLE.start_ns),
                session(READ_VARIABLE.end_ns),
                READ_VARIABLE,
                "net_1/conv_1/Reshape/ReadVariableOp",
                "ReadVariableOp",
            ),
        ),
        (PREDICT_STEP, "functions", (session(PREDICT_STEP.start_ns), session(PREDICT_STEP.end_ns), PREDICT_STEP)),
        (EAGER_OP, "eager", (session(EAGER_OP.start_ns), session(EAGER_OP.end_ns), EAGER_OP)),
    ],
)
def test_sort_host_events_one_row(row: XEventRow, where: str, expected: tuple[Any, ...]) -> None:
    host = sort_host_events([row], session)
    lists = {"graph": host.graph, "functions": host.functions, "eager": host.eager}
    assert lists.pop(where) == [expected]
    assert all(v == [] for v in lists.values()) and host.xla_runs == {}


def test_sort_host_events_xla_runs_and_others() -> None:
    host = sort_host_events([*OTHER, XLA_RUN, XLA_RUN], session)
    assert (host.graph, host.functions, host.eager) == ([], [], [])
    assert host.xla_runs == {(PYTHON, "__inference_<lambda>_67"): [session(XLA_RUN.start_ns)] * 2}


@pytest.mark.parametrize(
    ("line_id", "expected"),
    [
        (PYTHON, (10922, "MainThread")),
        (COMPUTE, (SYNTHETIC_TID_BASE | (COMPUTE & 0x3FFFFFFF), "tf_Compute/-8855742678736127697")),
        (1234, (SYNTHETIC_TID_BASE | 1234, "tf thread 1234")),
    ],
)
def test_line_thread(line_id: int, expected: tuple[int, str]) -> None:
    names = {PYTHON: "python", COMPUTE: "tf_Compute/-8855742678736127697"}
    assert line_thread(line_id, {PYTHON: (10922, "MainThread")}, names) == expected


def test_call_key_and_function() -> None:
    call = (34416714, 35135691, PREDICT_STEP)
    assert call_key(call) == (34416714, 35135691, PYTHON)
    assert call_function(call) == (34416714, 35135691, "__inference_one_step_on_data_distributed_145")


STEP_1 = (100, 200, PYTHON)
STEP_2 = (300, 400, PYTHON)


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ([(1, STEP_1), (1, STEP_2)], {(1, STEP_1): 0, (1, STEP_2): 1}),
        ([(1, STEP_2), (1, STEP_1)], {(1, STEP_1): 0, (1, STEP_2): 1}),  # numbered by time, not by order seen
        ([(1, STEP_1), (2, STEP_2), (2, None)], {(1, STEP_1): 0, (2, STEP_2): 0}),  # per model span; no step, no number
        ([(3, None)], {}),
    ],
)
def test_number_steps(keys: list[tuple[int, Any]], expected: dict[Any, int]) -> None:
    assert number_steps(keys) == expected


@pytest.mark.parametrize(
    ("node", "op_type", "flops", "expected"),
    [
        (
            "net_1/head_1/fc1_1/Relu",
            "_MklNativeFusedMatMul",
            16384.0,
            {
                "ml.framework": "tensorflow",
                "ml.op.name": "_MklNativeFusedMatMul",
                "ml.op.type": "_MklNativeFusedMatMul",
                "ml.tf.node": "net_1/head_1/fc1_1/Relu",
                "ml.flops": 16384.0,
            },
        ),
        (
            "net_1/gap_1/Mean",
            "Mean",
            None,
            {"ml.framework": "tensorflow", "ml.op.name": "Mean", "ml.op.type": "Mean", "ml.tf.node": "net_1/gap_1/Mean"},
        ),
    ],
)
def test_graph_op_attrs(node: str, op_type: str, flops: float | None, expected: dict[str, Any]) -> None:
    assert graph_op_attrs(node, op_type, flops) == expected


def test_eager_op_attrs() -> None:
    assert eager_op_attrs("RangeDataset") == {
        "ml.framework": "tensorflow",
        "ml.op.name": "RangeDataset",
        "ml.op.type": "RangeDataset",
        "ml.tf.mode": "eager",
    }
