"""The ops a TorchScript model calls (``torch.jit.script``, ``torch.jit.trace``, frozen) record
values of the interpreter's stack ahead of their own arguments (``aten::conv2d`` while the
residual sum of a linear layer waits on the stack for the output tuple): their FLOPs and bytes
are read from their own arguments, as the eager model's ops' are."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import mltrace
from conftest import run_cli
from mltrace.analysis.roofline import op_bytes
from mltrace.formats.aten_flops import aten_flops, own_arguments
from mltrace.formats.kineto import interpreted_ops
from mltrace.run.events import Span
from mltrace.run.levels import Level
from mltrace.run.store import Run

PROGRAM = textwrap.dedent(
    """
    import warnings

    import torch

    warnings.simplefilter("ignore")


    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.conv = torch.nn.Conv2d(3, 4, 3)

        def forward(self, x, y):
            return x + self.fc(x), self.conv(y)


    x, y = torch.randn(2, 16, 8), torch.randn(1, 3, 8, 8)
    eager = Block().eval()
    traced = torch.jit.trace(eager, (x, y))  # before any other call: its trace records eager calls
    variants = [eager, torch.jit.script(eager), traced, torch.jit.freeze(torch.jit.script(eager))]
    with torch.no_grad():
        for model in variants:
            for _ in range(3):
                model(x, y)
    """
)
#: The FLOPs of the layers' ops, as the eager model's records give them.
LINEAR_FLOPS = 2 * 2 * 16 * 8 * 8
CONV_FLOPS = 2 * 1 * (6 * 6) * (4 * 3 * 3 * 3)


def _outermost_ops(run: Run, model: Span) -> list[Span]:
    """The ATen ops a model call made itself: those under no other ATen op."""
    by_id = {s.id: s for s in run.spans}
    found = []
    for s in run.spans:
        if s.level != Level.OP or s.track_id != model.track_id or not model.start_ns <= s.start_ns <= model.end_ns:
            continue
        parent = by_id.get(s.parent_id) if s.parent_id is not None else None
        if s.name.startswith("aten::") and not (parent is not None and parent.name.startswith("aten::")):
            found.append(s)
    return found


def test_scripted_traced_and_frozen_models_ops_have_the_eager_models_flops_and_bytes(tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(PROGRAM)
    done = run_cli("python", "-q", "-o", str(tmp_path / "run"), "--level", "op", str(script))
    assert done.returncode == 0, done.stderr.decode()
    run = mltrace.load_run(tmp_path / "run")
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert len(models) >= 12
    recorded = 0
    for model in models:
        ops = {s.name: s for s in _outermost_ops(run, model)}
        conv = ops.get("aten::conv2d") or ops["aten::_convolution"]  # a traced graph calls _convolution
        assert ops["aten::linear"].attrs["ml.input.shapes"] == [[2, 16, 8], [8, 8], [8]]
        assert ops["aten::linear"].attrs.get("ml.flops") == LINEAR_FLOPS
        assert conv.attrs["ml.input.shapes"][:3] == [[1, 3, 8, 8], [4, 3, 3, 3], [4]]
        assert conv.attrs.get("ml.flops") == CONV_FLOPS
        assert op_bytes(conv.attrs) == 4 * (1 * 3 * 8 * 8 + 4 * 3 * 3 * 3 + 4 + 1 * 3 * 8 * 8)
        recorded += 1
    assert recorded == len(models)


def _event(name: str, ts: float, dur: float, dims: list[Any], tid: int = 1) -> dict[str, Any]:
    types = ["float" if d else "" for d in dims]
    return {
        "ph": "X",
        "cat": "cpu_op",
        "name": name,
        "pid": 1,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "args": {"Input Dims": dims, "Input type": types},
    }


def test_only_the_ops_a_torchscript_range_calls_itself_drop_the_values_ahead_of_their_arguments() -> None:
    stacked = [[2, 16, 8], [2, 16, 8], [8, 8], [8]]
    forward = _event("forward", 0, 100, [[], [2, 16, 8]])
    called = _event("aten::linear", 10, 20, stacked)
    nested = _event("aten::mul", 12, 2, [[4], [4], [4]])  # an out= overload, called from C++
    eager_out = _event("aten::mul", 200, 2, [[4], [4], [4]])
    other_thread = _event("aten::linear", 10, 20, stacked, tid=2)
    node = _event("MulBackward0", 300, 10, [[4]])  # an autograd node: its formula's ops come from C++
    formula = _event("aten::mul", 302, 2, [[4], [4], [4]])
    graph = _event("<forward op>", 400, 10, [[4]])  # a differentiable graph's forward, interpreted
    in_graph = _event("aten::mul", 402, 2, [[4], [4], [4]])
    found = interpreted_ops([forward, called, nested, eager_out, other_thread, node, formula, graph, in_graph])
    assert found == {id(called["args"]), id(in_graph["args"])}
    own = own_arguments("aten::linear", called["args"])
    assert own["Input Dims"] == [[2, 16, 8], [8, 8], [8]] and own["Input type"] == ["float"] * 3
    assert aten_flops("aten::linear", own) == LINEAR_FLOPS
    assert aten_flops("aten::linear", called["args"]) is None
    assert interpreted_ops([eager_out, called]) == set()  # no TorchScript range: nothing to drop
