"""A kernel-level run recorded on an H100 (tests/data/runs/h100_resnet50_bert), replayed."""

from __future__ import annotations

import statistics

import pytest

from mltrace.analysis.gpu import gpu_tables, is_gpu_activity
from mltrace.run.levels import Level
from mltrace.run.store import Run
from support.runs import unpack_run


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return unpack_run("h100_resnet50_bert", tmp_path_factory.mktemp("h100") / "run")


def _ancestors(run: Run, span_id: int | None) -> list[Level]:
    by_id = run.span_by_id()
    out = []
    while span_id is not None and span_id in by_id and len(out) < 256:
        span = by_id[span_id]
        out.append(span.level)
        span_id = span.parent_id
    return out


def test_every_kernel_inside_a_model_call_reaches_an_op_and_a_layer(run: Run) -> None:
    kernels = [s for s in run.spans if is_gpu_activity(s) and s.attrs["gpu.activity"] == "kernel"]
    assert len(kernels) > 1000
    placed = [_ancestors(run, k.parent_id) for k in kernels]
    inside = [a for a in placed if Level.MODEL in a]
    assert len(inside) > 0.98 * len(kernels)  # the rest: weights and inputs moved to fp16 before the first call
    assert all(Level.OP in a and Level.LAYER in a for a in inside)
    tables = gpu_tables(run)
    names = {k.name for k in tables.kernels}
    assert any("cudnn" in n.lower() or "sm90" in n.lower() or "xmma" in n.lower() for n in names)


def test_the_cold_call_is_apart_from_the_steady_ones(run: Run) -> None:
    """What the execution-modes issue must separate: the first call's one-time costs."""
    calls: dict[str, list[int]] = {}
    for s in sorted(run.spans, key=lambda s: s.start_ns):
        if s.name in ("ResNet", "BertModel", "conv1"):
            calls.setdefault(s.name, []).append(s.end_ns - s.start_ns)
    assert [len(v) for v in calls.values()] == [4, 4, 4]
    for name, durations in calls.items():
        cold, steady = durations[0], durations[1:]
        assert cold > 10 * statistics.median(steady), name


def test_call_sites_of_the_recording_are_model_code(run: Run) -> None:
    """Recorded before call sites existed: code.* is the forward's definition there, and readers
    that want the definition fall back to it (analysis.sweep)."""
    from mltrace.analysis.sweep import _defined_at

    model = next(s for s in run.spans if s.level == Level.MODEL and s.name == "ResNet")
    assert _defined_at(model.attrs) is not None and "torchvision/models/resnet.py" in str(_defined_at(model.attrs))
