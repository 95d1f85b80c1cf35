"""PyTorch model and layer spans on real torch.nn models, in-process."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import mltrace
from mltrace.run.store import Run
from mltrace.tracer.levels import Level


def _trace(tmp_path: Path, fn, **options) -> Run:  # type: ignore[no-untyped-def]
    with mltrace.profile(output=tmp_path / "run", summary=False, level=options.pop("level", "layer"), **options):
        fn()
    return mltrace.load_run(tmp_path / "run")


def _names(run: Run, level: Level = Level.LAYER) -> list[str]:
    return [s.name for s in sorted(run.spans, key=lambda s: s.start_ns) if s.level == level]


def test_repeated_and_shared_modules(tmp_path: Path) -> None:
    shared = nn.Linear(4, 4)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = shared
            self.b = nn.Sequential(shared, nn.ReLU())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(self.a(x)))

    net = Net()
    run = _trace(tmp_path, lambda: [net(torch.randn(2, 4)) for _ in range(2)])
    assert _names(run, Level.MODEL) == ["Net", "Net"]
    assert _names(run) == ["a", "a", "b", "b.0", "b.1"] * 2
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert [m.attrs["ml.model.invocation"] for m in models] == [1, 2]


def test_modules_created_after_tracing_starts_and_functional_calls(tmp_path: Path) -> None:
    class Lazy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not hasattr(self, "late"):
                self.late = nn.Linear(3, 3)
            return nn.ReLU()(self.late(x))  # a module that is no child at all

    def go() -> None:
        m = Lazy()
        m(torch.randn(1, 3))

    run = _trace(tmp_path, go)
    assert _names(run) == ["late", "<ReLU>"]


def test_user_hooks_no_grad_and_inference_mode(tmp_path: Path) -> None:
    seen = []
    net = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    handle = net[0].register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    try:

        def go() -> None:
            with torch.no_grad():
                net(torch.randn(5, 2))
            with torch.inference_mode():
                net(torch.randn(5, 2))

        run = _trace(tmp_path, go)
    finally:
        handle.remove()
    assert seen == [(5, 2), (5, 2)]  # the user's hook still runs
    assert _names(run) == ["0", "1", "0", "1"]


def test_exception_inside_a_layer_closes_its_spans(tmp_path: Path) -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("bad input")

    net = nn.Sequential(nn.Linear(2, 2), Boom())

    def go() -> None:
        with pytest.raises(RuntimeError):
            net(torch.randn(1, 2))
        net[0](torch.randn(1, 2))  # tracing goes on correctly afterwards

    run = _trace(tmp_path, go)
    assert _names(run, Level.MODEL) == ["Sequential", "Linear"]
    assert _names(run) == ["0", "1"]
    assert all(s.end_ns >= s.start_ns and "mltrace.truncated" not in s.attrs for s in run.spans)


def test_threads_trace_their_own_models(tmp_path: Path) -> None:
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def go() -> None:
        ts = [threading.Thread(target=lambda: net(torch.randn(2, 8))) for _ in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    run = _trace(tmp_path, go)
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert len(models) == 3 and len({m.track_id for m in models}) == 3
    by_id = run.span_by_id()
    for s in run.spans:
        if s.level == Level.LAYER:
            assert by_id[s.parent_id].track_id == s.track_id


def test_torchscript_gets_a_model_span_and_a_limitation(tmp_path: Path) -> None:
    scripted = torch.jit.script(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    run = _trace(tmp_path, lambda: scripted(torch.randn(1, 3)))
    assert len([s for s in run.spans if s.level == Level.MODEL]) == 1
    assert _names(run) == []
    assert any("TorchScript" in lim for lim in run.meta["limitations"])


def test_hooks_installed_when_torch_is_imported_later(tmp_path: Path) -> None:
    # In a fresh interpreter: the session starts before torch is imported.
    import subprocess
    import sys

    code = (
        "import sys, mltrace\n"
        f"p = mltrace.profile(output={str(tmp_path / 'late')!r}, summary=False).start()\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
        "torch.nn.Linear(2, 2)(torch.randn(1, 2))\n"
        "p.stop()\n"
        "from torch.nn.modules import module as m\n"
        "assert not m._global_forward_hooks and not m._global_forward_pre_hooks\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr.decode()
    run = mltrace.load_run(tmp_path / "late")
    assert _names(run, Level.MODEL) == ["Linear"]


def test_model_level_wraps_call_instead_of_global_hooks(tmp_path: Path) -> None:
    from torch.nn.modules import module as m

    net = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))

    def go() -> None:
        assert not m._global_forward_hooks and not m._global_forward_pre_hooks  # torch's fast path stays
        net(torch.randn(3, 4))
        with pytest.raises(RuntimeError):
            net(torch.randn(3, 5))  # shape error inside: the model span still closes
        net[1](torch.randn(3, 4))

    run = _trace(tmp_path, go, level="model")
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert [s.name for s in models] == ["Sequential", "Sequential", "Sequential"]
    assert [s.attrs["ml.input.shapes"] for s in models] == [[[3, 4]], [[3, 5]], [[3, 4]]]
    assert models[0].attrs["ml.output.shapes"] == [[3, 2]]
    assert "ml.output.shapes" not in models[1].attrs
    assert not [s for s in run.spans if s.level == Level.LAYER]
