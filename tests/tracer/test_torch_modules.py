"""PyTorch model and layer spans on real torch.nn models, in-process."""

from __future__ import annotations

import collections
import copy
import importlib.util
import inspect
import itertools
import re
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import mltrace
from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.coldstart import call_kinds
from mltrace.analysis.report_data import build_report
from mltrace.run.levels import Level
from mltrace.run.store import Run
from mltrace.tracer.sources.torch_modules import HOT_PATH_ENV

HAVE_C = importlib.util.find_spec("mltrace._layercall") is not None


@pytest.fixture(autouse=True)
def _both_hot_paths(hot_path: str) -> str:
    """Every test here runs with both layer hot paths (conftest's ``hot_path``)."""
    return hot_path


def _trace(tmp_path: Path, fn, **options) -> Run:  # type: ignore[no-untyped-def]
    with mltrace.profile(output=tmp_path / "run", summary=False, level=options.pop("level", "layer"), **options):
        fn()
    return mltrace.load_run(tmp_path / "run")


class _Echo(nn.Module):
    """Returns its arguments: one as it came, several as a tuple."""

    def forward(self, *args: Any) -> Any:
        return args[0] if len(args) == 1 else args


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


def test_a_jit_trace_records_the_graph_and_code_it_records_plain(tmp_path: Path) -> None:
    """Inside ``torch.jit.trace`` a shape read is recorded (``aten::size`` nodes that shift the
    graph's value numbers) and a tensor held in a wrapper's local names the value: mltrace reads
    shapes there with the trace paused and holds no tensor, so a printed graph and code are the
    plain ones, and the layers still have their shapes."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    net, x = Net().eval(), torch.randn(2, 8)

    def printed() -> tuple[str, str]:
        traced = torch.jit.trace(net, x)
        return tuple(re.sub(r"___torch_mangle_\d+\.", "", str(text)) for text in (traced.graph, traced.code))  # type: ignore[return-value]

    plain: list[tuple[str, str]] = [printed()]
    run = _trace(tmp_path, lambda: plain.append(printed()))
    assert plain[1] == plain[0] and "%input" in plain[0][0]
    assert {s.name for s in run.spans if s.level == Level.MODEL} == {"Net"}  # the trace's calls (and its check's)
    layers = [s for s in run.spans if s.level == Level.LAYER]
    assert sorted({s.name for s in layers}) == ["a", "b"]
    assert all(s.attrs["ml.input.shapes"] == [[2, 8]] for s in layers)


def test_the_c_hot_path_reads_libtorchs_tracing_state_as_torch_does(tmp_path: Path, hot_path: str) -> None:
    """The C hot path's tracing check reads libtorch's per-thread state itself (no pybind11 call
    a module call): it agrees with ``torch._C._is_tracing`` inside a trace, outside and on
    another thread, and run.json says which check ran."""
    if hot_path != "c":
        pytest.skip("the C hot path's check")
    from mltrace import _layercall

    seen: list[tuple[Any, bool]] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((_layercall.tracing_now(), torch._C._is_tracing()))
            return x * 2

    def go() -> None:
        probe = Probe()
        probe(torch.ones(2))
        torch.jit.trace(probe, torch.ones(2), check_trace=False)
        thread = threading.Thread(target=lambda: seen.append((_layercall.tracing_now(), torch._C._is_tracing())))
        thread.start()
        thread.join()

    run = _trace(tmp_path, go)
    assert run.meta["sources"]["torch.modules"]["jit_tracing_check"] == "libtorch"
    assert seen == [(False, False), (True, True), (False, False)]


def test_torchscript_gets_a_model_span_and_a_limitation(tmp_path: Path) -> None:
    scripted = torch.jit.script(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    run = _trace(tmp_path, lambda: scripted(torch.randn(1, 3)))
    assert len([s for s in run.spans if s.level == Level.MODEL]) == 1
    assert _names(run) == []
    assert any("TorchScript" in lim for lim in run.meta["limitations"])


def test_every_model_call_gets_its_own_call_site_invocation_and_notes(tmp_path: Path) -> None:
    """Call sites are remembered by code object and instruction: two lines of one function,
    called in turn, must each be the site of their own calls, a helper's line the site of the
    calls made through it, and invocations count per model. Two ScriptModules (one class in
    torch) each get their own limitation."""
    import inspect

    net = nn.Linear(3, 3)
    other = nn.ReLU()

    class First(nn.Sequential):
        pass

    class Second(nn.Sequential):
        pass

    first = torch.jit.script(First(nn.Linear(3, 3)))
    second = torch.jit.script(Second(nn.ReLU()))
    x = torch.ones(1, 3)
    here = inspect.getsourcelines(test_every_model_call_gets_its_own_call_site_invocation_and_notes)[1]
    lines: list[int] = []

    def through_helper() -> None:
        other(x)

    def work() -> None:
        for _ in range(3):
            net(x)
            other(x)
            through_helper()
        first(x)
        second(x)

    body = inspect.getsource(test_every_model_call_gets_its_own_call_site_invocation_and_notes).splitlines()
    for needle in ("            net(x)", "            other(x)", "        other(x)"):
        lines.append(here + body.index(needle))
    run = _trace(tmp_path, work)
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    scripted = ["First (TorchScript)", "Second (TorchScript)"]  # the scripted class's own name
    assert [s.name for s in models] == ["Linear", "ReLU", "ReLU"] * 3 + scripted
    expected = [lines[0], lines[1], lines[2]] * 3
    assert [s.attrs["ml.call.line.number"] for s in models[:9]] == expected
    assert {s.attrs["ml.call.file.path"] for s in models} == {__file__}
    assert [s.attrs["ml.model.invocation"] for s in models[:9:3]] == [1, 2, 3]
    assert [s.attrs["ml.model.invocation"] for s in models[1:9:3]] == [1, 3, 5]  # the ReLU, both sites
    notes = [lim for lim in run.meta["limitations"] if "TorchScript" in lim]
    assert len(notes) == 2 and "ScriptModule First:" in notes[0] and "ScriptModule Second:" in notes[1]


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


@pytest.mark.parametrize("level", ["model", "layer"])
def test_a_module_introspects_as_without_mltrace(tmp_path: Path, level: str) -> None:
    """``inspect.signature`` of a module and of ``nn.Module.__call__``, and its names, are torch's
    (a library that read a model's signature failed under the C hot path)."""
    net = nn.Sequential(nn.Linear(2, 2))
    plain = (str(inspect.signature(net)), str(inspect.signature(nn.Module.__call__)), nn.Module.__call__.__name__)
    seen: list[tuple[str, str, str]] = []

    def go() -> None:
        seen.append((str(inspect.signature(net)), str(inspect.signature(nn.Module.__call__)), nn.Module.__call__.__name__))
        net(torch.ones(1, 2))

    _trace(tmp_path, go, level=level)
    assert seen == [plain] and plain[2] == "_wrapped_call_impl"


class _Flaky(nn.Module):
    """Raises on odd inputs' first element, after its layer ran."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if int(x[0, 0]) % 2:
            raise ValueError("odd")
        return y


@pytest.mark.parametrize("level", ["model", "layer"])
def test_a_model_call_that_raised_is_marked(tmp_path: Path, level: str, hot_path: str) -> None:
    """The model span of a call that raised has ``error.type`` (the OpenTelemetry attribute a
    user span has too); the program still gets its exception, and other calls are unmarked."""
    net = _Flaky()
    raised: list[str] = []

    def go() -> None:
        for i in range(4):
            try:
                net(torch.full((1, 2), float(i)))
            except ValueError as exc:
                raised.append(str(exc))

    run = _trace(tmp_path, go, level=level)
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert raised == ["odd", "odd"]
    assert [s.attrs.get("error.type") for s in models] == [None, "ValueError", None, "ValueError"]


def test_model_level_wraps_call_instead_of_global_hooks(tmp_path: Path) -> None:
    from torch.nn.modules import module as m

    net = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))
    hooked: list[tuple[int, ...]] = []
    net[1][1].register_forward_hook(lambda mod, args, out: hooked.append(tuple(out.shape)))

    def go() -> None:
        assert not m._global_forward_hooks and not m._global_forward_pre_hooks  # torch's fast path stays
        assert inspect.isfunction(m.Module.__call__)  # a Python function (TorchDynamo inlines it)
        net(torch.randn(3, 4))
        assert hooked == [(3, 2)]  # a nested module's own hook still runs
        with pytest.raises(RuntimeError):
            net(torch.randn(3, 5))  # shape error inside: the model span still closes
        net[1](torch.randn(3, 4))

    run = _trace(tmp_path, go, level="model")
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert [s.name for s in models] == ["Sequential", "Sequential", "Sequential.1"]  # a submodule on its own: a model apart
    assert [s.attrs["ml.input.shapes"] for s in models] == [[[3, 4]], [[3, 5]], [[3, 4]]]
    assert models[0].attrs["ml.output.shapes"] == [[3, 2]]
    assert "ml.output.shapes" not in models[1].attrs
    assert not [s for s in run.spans if s.level == Level.LAYER]
    assert hooked == [(3, 2), (3, 2)]


class _Pass(nn.Module):
    def forward(self, *args: object, **kwargs: object) -> object:
        return args[0] if args else None


def test_layer_attributes_for_every_argument_form(tmp_path: Path) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.p = _Pass()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)  # one tensor in, one out: the wrapper's short form
            self.p(x, x.half())  # several tensors
            self.p([x, (x,)], {"k": x})  # nested containers
            self.p(input=x)  # keyword arguments only: no input shapes
            self.p(3)  # no tensor at all
            self.p((y, y.int()))  # a tuple out
            return y

    run = _trace(tmp_path, lambda: Net()(torch.randn(2, 4)))
    layers = sorted((s for s in run.spans if s.level == Level.LAYER), key=lambda s: s.start_ns)
    assert [s.name for s in layers] == ["lin", "p", "p", "p", "p", "p"]
    for s in layers:
        assert s.attrs["ml.layer.path"] == s.name and s.attrs["ml.framework"] == "pytorch"
        assert not [k for k in s.attrs if k.startswith("_")]  # raw values never leak
    lin = layers[0].attrs
    assert lin["ml.layer.type"] == "Linear" and lin["ml.layer.params"] == 15
    assert (lin["ml.input.shapes"], lin["ml.input.dtypes"]) == ([[2, 4]], ["float32"])
    assert (lin["ml.output.shapes"], lin["ml.output.dtypes"]) == ([[2, 3]], ["float32"])
    two, nested, kw, scalar, tup = (s.attrs for s in layers[1:])
    assert (two["ml.input.shapes"], two["ml.input.dtypes"]) == ([[2, 4], [2, 4]], ["float32", "float16"])
    assert (two["ml.output.shapes"], two["ml.output.dtypes"]) == ([[2, 4]], ["float32"])
    assert nested["ml.input.shapes"] == [[2, 4]]  # tensors one container deep
    assert nested["ml.output.shapes"] == [[2, 4], [2, 4]]  # the list it returns, and the tuple in it
    assert "ml.input.shapes" not in kw and "ml.output.shapes" not in kw
    assert "ml.input.shapes" not in scalar and "ml.output.shapes" not in scalar
    assert (tup["ml.output.shapes"], tup["ml.output.dtypes"]) == ([[2, 3], [2, 3]], ["float32", "int32"])


def test_user_spans_and_layer_spans_nest_both_ways(tmp_path: Path) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Sequential(nn.ReLU())
            self.b = nn.Tanh()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with mltrace.span("around-b"):  # a user span around a layer
                x = self.b(x)
            return self.a(x)

    class Inner(nn.ReLU):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with mltrace.span("inside-layer"):  # a user span inside a layer
                return super().forward(x)

    net = Net()
    net.a[0] = Inner()
    run = _trace(tmp_path, lambda: net(torch.randn(2)))
    by_name = {s.name: s for s in run.spans}
    assert by_name["around-b"].parent_id == by_name["Net"].id
    assert by_name["b"].parent_id == by_name["around-b"].id
    assert by_name["a"].parent_id == by_name["Net"].id
    assert by_name["a.0"].parent_id == by_name["a"].id
    assert by_name["inside-layer"].parent_id == by_name["a.0"].id
    assert all(s.parent_id is None or s.parent_id in {t.id for t in run.spans} for s in run.spans)


def test_stopping_inside_a_layer_truncates_the_open_spans(tmp_path: Path) -> None:
    profile = mltrace.profile(output=tmp_path / "run", summary=False, level="layer")

    class Stopper(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            profile.stop()
            return x

    net = nn.Sequential(nn.ReLU(), nn.Sequential(Stopper()))
    profile.start()
    try:
        net(torch.randn(2))
        net(torch.randn(2))  # after stop: plain torch again
    finally:
        profile.stop()
    run = mltrace.load_run(tmp_path / "run")
    truncated = sorted(s.name for s in run.spans if s.attrs.get("mltrace.truncated"))
    assert truncated == ["1", "1.0", "Sequential"]
    assert sorted(s.name for s in run.spans) == ["0", "1", "1.0", "Sequential"]
    assert all(s.end_ns >= s.start_ns for s in run.spans)


@pytest.mark.parametrize("level", ["model", "layer"])
def test_compiled_modules_and_earlier_call_wrappers_are_honoured(tmp_path: Path, level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The wrappers call Module._call_impl themselves, as torch's __call__ does, unless
    # Module.compile() set _compiled_call_impl or someone else wrapped __call__ first.
    monkeypatch.delenv("MLTRACE_TORCH_HOOKS", raising=False)
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    compiled: list[int] = []

    def fake_compiled(x: torch.Tensor) -> torch.Tensor:
        compiled.append(1)
        return x

    net[1]._compiled_call_impl = fake_compiled
    theirs: list[str] = []
    torch_call = nn.Module.__call__

    def their_call(self: nn.Module, *args: object, **kwargs: object) -> object:
        theirs.append(type(self).__name__)
        return torch_call(self, *args, **kwargs)

    run = _trace(tmp_path / "a", lambda: net(torch.randn(1, 2)), level=level)
    assert compiled == [1]
    if level == "layer":
        assert _names(run) == ["0", "1"]
    nn.Module.__call__ = their_call  # type: ignore[method-assign]
    try:
        run = _trace(tmp_path / "b", lambda: net(torch.randn(1, 2)), level=level)
    finally:
        nn.Module.__call__ = torch_call  # type: ignore[method-assign]
    assert theirs == ["Sequential", "Linear", "ReLU"] and compiled == [1, 1]
    assert _names(run, Level.MODEL) == ["Sequential"]
    if level == "layer":
        assert _names(run) == ["0", "1"]


def test_a_span_begun_inside_a_layer_gets_the_layer_as_parent_when_recorded(tmp_path: Path) -> None:
    # Layer calls do not switch current_span (the hot path records frames);
    # Recorder.begin asks the torch source for the innermost open layer.
    from mltrace.tracer.session import active_session

    parents: list[int | None] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            session = active_session()
            assert session is not None
            span = session.recorder.begin("probe", Level.USER)
            parents.append(span.parent_id)
            session.recorder.end(span)
            return x

    net = nn.Sequential(nn.Sequential(Probe()))
    run = _trace(tmp_path, lambda: net(torch.randn(2)))
    by_name = {s.name: s for s in run.spans}
    assert parents == [by_name["0.0"].id]
    assert by_name["probe"].parent_id == by_name["0.0"].id


def test_a_module_shared_by_two_models_gets_its_path_in_each(tmp_path: Path) -> None:
    shared = nn.ReLU()
    first = nn.Sequential(nn.Sequential(shared))
    second = nn.Sequential(nn.Identity(), shared)

    def go() -> None:
        for _ in range(2):
            first(torch.randn(2))
            second(torch.randn(2))

    run = _trace(tmp_path, go)
    assert _names(run) == ["0", "0.0", "0", "1"] * 2


class _Autoencoder(nn.Module):
    """A model whose ``decode`` calls two submodules of one class, and whose ``sample`` calls
    one through a helper function."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 4)
        self.dec = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 8))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.dec[2](self.dec[0](z))

    def sample(self) -> torch.Tensor:
        return _through_a_helper(self.dec, torch.randn(1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x))


def _through_a_helper(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def test_submodules_called_from_their_models_methods_are_models_of_their_own(tmp_path: Path) -> None:
    """Two ``Linear``s called from ``decode`` are two models named by their place in the model
    that holds them, not one "Linear"; a module called from nowhere inside a model, and a model
    built anew for each call, keep their class's name."""
    model = _Autoencoder()

    def go() -> None:
        for _ in range(2):
            model(torch.randn(2, 8))
            model.decode(torch.randn(2, 4))
        model.sample()
        nn.Linear(4, 6)(torch.randn(1, 4))
        for _ in range(2):
            _Autoencoder()(torch.randn(1, 8))

    run = _trace(tmp_path, go)
    assert _names(run, Level.MODEL) == [
        *["_Autoencoder", "_Autoencoder.dec.0", "_Autoencoder.dec.2"] * 2,
        "_Autoencoder.dec",
        "Linear",
        "_Autoencoder",
        "_Autoencoder",
    ]
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert {m.attrs["ml.layer.type"] for m in models if m.name.startswith("_Autoencoder.dec.")} == {"Linear"}
    assert [m.attrs["ml.model.invocation"] for m in models if m.name == "_Autoencoder.dec.2"] == [1, 2]


def test_layers_running_on_another_thread_at_stop_are_truncated_once(tmp_path: Path) -> None:
    entered = threading.Event()
    release = threading.Event()

    class Wait(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            entered.set()
            release.wait(10)
            return x

    net = nn.Sequential(nn.ReLU(), nn.Sequential(Wait()))
    profile = mltrace.profile(output=tmp_path / "run", summary=False, level="layer")
    profile.start()
    worker = threading.Thread(target=lambda: net(torch.randn(2)))
    try:
        worker.start()
        assert entered.wait(10)
        profile.stop()  # the worker is inside 1.0
    finally:
        release.set()
        worker.join(10)
        profile.stop()
    run = mltrace.load_run(tmp_path / "run")
    assert sorted(s.name for s in run.spans) == ["0", "1", "1.0", "Sequential"]
    truncated = sorted(s.name for s in run.spans if s.attrs.get("mltrace.truncated"))
    assert truncated == ["1", "1.0", "Sequential"]
    by_name = {s.name: s for s in run.spans}
    assert by_name["1.0"].parent_id == by_name["1"].id and by_name["1"].parent_id == by_name["Sequential"].id
    assert by_name["1.0"].attrs["ml.layer.type"] == "Wait"


def test_run_json_names_the_hot_path_that_ran(tmp_path: Path, hot_path: str) -> None:
    run = _trace(tmp_path, lambda: nn.Sequential(nn.Linear(2, 2), nn.ReLU())(torch.ones(1, 2)))
    assert run.meta["sources"]["torch.modules"]["layer_hot_path"].split(" ")[0] == hot_path
    assert _names(run) == ["0", "1"]
    assert run.meta["threads"] == {"torch": torch.get_num_threads()}  # the roofline scales CPU peaks to it


def _span_table(run: Run) -> list[tuple[object, ...]]:
    by_id = run.span_by_id()
    rows = []
    for s in run.spans:
        parent = by_id.get(s.parent_id) if s.parent_id is not None else None
        keep = {k: v for k, v in s.attrs.items() if k not in ("ml.model.invocation", "ml.thread.cpu_ns", "ml.thread.minor_faults")}
        rows.append((s.level.label, s.name, parent.name if parent else None, repr(sorted(keep.items()))))
    return sorted(rows)


def test_both_hot_paths_record_the_same_spans(tmp_path: Path, hot_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C helper and the Python wrapper give identical layer spans (names, parents, shapes,
    dtypes, every attribute) on the example CNN, a TransformerEncoder (nested tensors inside)
    and a module called with and returning containers of tensors."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    try:
        from models import resnet_small
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    cnn = resnet_small().eval()
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2).eval()
    images, tokens = torch.randn(1, 3, 32, 32), torch.randn(2, 5, 32)
    pair = collections.namedtuple("pair", "a b")
    weight = nn.Parameter(torch.ones(3))

    class Forms(nn.Module):
        """Values the C hot path takes apart itself and those it leaves to raw_shapes."""

        def __init__(self) -> None:
            super().__init__()
            self.echo = _Echo()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.echo((x, x.int()))  # a tuple of tensors out
            self.echo([x, (x.half(), 3)], {"k": x})  # a list and a dict in, tensors one level down
            self.echo(pair(x, x))  # a namedtuple: a tuple subclass
            self.echo((weight, x))  # a tensor subclass inside
            self.echo({"a": x, "b": [x, "s"], "c": {"deeper": x}})  # a dict out
            self.echo(x, 2.0, None, "text")  # tensors among scalars
            return x

    def work() -> None:
        with torch.inference_mode():
            cnn(images)
            enc(tokens, src_key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
        Forms()(torch.randn(2, 3))

    tables = {}
    for path in ("c", "python"):
        if path == "c" and not HAVE_C:
            pytest.skip("the C helper mltrace._layercall is not built here")
        monkeypatch.setenv(HOT_PATH_ENV, path)
        tables[path] = _span_table(_trace(tmp_path / path, work))
    assert len(tables["python"]) > 60
    assert tables["c"] == tables["python"]
    (encoder,) = [row for row in tables["c"] if row[:2] == ("model", "TransformerEncoder")]
    assert "('ml.input.keywords', ['src_key_padding_mask'])" in encoder[3]  # its keyword tensor's shape too
    echoes = [row[3] for row in tables["c"] if row[:2] == ("layer", "echo")]
    assert len(echoes) == 6
    outputs = sorted(re.search(r"\('ml.output.shapes', (\[.*?\]\])\)", row).group(1) for row in echoes)  # type: ignore[union-attr]
    # the list-and-dict call (the tuple in the list, the dict: none), the plain tensor; the
    # tuple, the namedtuple and the dict of three; the Parameter with the tensor
    assert outputs == sorted(["[[2, 3]]", "[[2, 3]]", "[[2, 3], [2, 3]]", "[[2, 3], [2, 3]]", "[[2, 3], [2, 3]]", "[[3], [2, 3]]"])


def test_shapes_of_every_rank_and_dtype_reach_the_spans(tmp_path: Path) -> None:
    """The C hot path keeps one tensor's sizes inline up to 8 dimensions and raw beyond, and
    the drain caches encodings by sizes and dtype: a 0-dim tensor, a 9-dim one, and the same
    sizes in two dtypes must each reach their span as they were, flushed between calls so the
    caches are warm, on both hot paths."""
    from mltrace.tracer.session import active_session

    class Pass(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.step = Pass()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.step(x)

    net = Net()
    inputs = [
        torch.ones(()),
        torch.ones((1,) * 9),
        torch.ones(2, 3),
        torch.ones(2, 3, dtype=torch.float64),
        torch.ones(2, 3),
        torch.ones(2, 3, dtype=torch.float64),
    ]

    def work() -> None:
        session = active_session()
        assert session is not None
        for x in inputs:
            net(x)
            session.flush()

    run = _trace(tmp_path, work, flush_interval_s=60)
    layers = sorted((s for s in run.spans if s.level == Level.LAYER), key=lambda s: s.start_ns)
    assert [s.name for s in layers] == ["step"] * len(inputs)
    for span, x in zip(layers, inputs):
        dtype = str(x.dtype).removeprefix("torch.")
        assert span.attrs["ml.input.shapes"] == [list(x.shape)]
        assert span.attrs["ml.output.shapes"] == [list(x.shape)]
        assert span.attrs["ml.input.dtypes"] == span.attrs["ml.output.dtypes"] == [dtype]


def test_encoded_drain_writes_the_spans_the_span_drain_writes(tmp_path: Path) -> None:
    """The flusher encodes layer frames straight to events.jsonl rows unless it streams
    Perfetto (which needs Span objects): both give the same spans, attributes included."""
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2).eval()
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)).eval()

    def work() -> None:
        with torch.inference_mode():
            for _ in range(3):
                enc(torch.randn(2, 5, 16))
                cnn(torch.randn(1, 3, 8, 8))
            cnn(torch.randn(2, 3, 8, 8))  # new shapes after the caches filled

    encoded = _trace(tmp_path / "encoded", work)
    objects = _trace(tmp_path / "objects", work, stream_perfetto=True)
    assert len(_names(encoded)) == 3 * (2 + 4) + 4  # the encoder takes its fast path: layers, no sublayers
    assert _span_table(encoded) == _span_table(objects)
    spans = [s for s in encoded.spans if s.level == Level.LAYER]
    assert all(s.track_id == spans[0].track_id and s.end_ns >= s.start_ns > 0 for s in spans)


def _wide_work(calls: int) -> Callable[[], None]:
    """``calls`` model calls of a net of 100 distinct children in one flush interval: more frames
    than one chunk of the C encoder (``_ENCODE_CHUNK``), with new shapes half-way."""
    net = nn.Sequential(*(nn.Identity() for _ in range(100)))

    def work() -> None:
        for i in range(calls):
            net(torch.zeros(1 + (i >= calls // 2), 2))

    return work


def test_a_flush_of_many_chunks_writes_the_spans_the_span_drain_writes(tmp_path: Path) -> None:
    """The C encoder takes a flush's frames a chunk at a time, giving up the GIL between chunks:
    chunk boundaries change nothing in what is written."""
    from mltrace.tracer.sources import torch_modules

    work = _wide_work(8)
    assert 8 * 100 > 2 * torch_modules._ENCODE_CHUNK
    encoded = _trace(tmp_path / "encoded", work, flush_interval_s=60)
    objects = _trace(tmp_path / "objects", work, flush_interval_s=60, stream_perfetto=True)
    assert len(_names(encoded)) == 800
    assert _span_table(encoded) == _span_table(objects)


def test_a_chunk_that_fails_keeps_the_chunks_before_it_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hot_path: str) -> None:
    """A failure in the middle of a drain writes what the chunks before it encoded, templates
    included (later rows refer to them), drops the rest, and the program goes on."""
    from mltrace.tracer.sources import torch_modules

    if hot_path != "c":
        pytest.skip("the chunked encoder is the C helper's")
    calls = {"n": 0}
    original = torch_modules.TorchModuleSource._encode_chunks

    def failing_second_chunk(self: Any, batch: list[Any], level: int) -> tuple[bytes, bytes, int]:
        encode = self._encode_rows

        def encode_or_fail(*args: Any) -> tuple[bytes, bytes]:
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("encoder failed")
            return encode(*args)  # type: ignore[no-any-return]

        self._encode_rows = encode_or_fail
        try:
            return original(self, batch, level)
        finally:
            self._encode_rows = encode

    monkeypatch.setattr(torch_modules.TorchModuleSource, "_encode_chunks", failing_second_chunk)
    run = _trace(tmp_path, _wide_work(8), flush_interval_s=60)
    assert calls["n"] == 2
    layers = [s for s in run.spans if s.level == Level.LAYER]
    assert len(layers) == torch_modules._ENCODE_CHUNK  # the first chunk, whole
    assert all(s.name.isdigit() and s.attrs["ml.layer.path"] == s.name for s in layers)
    assert len(_names(run, Level.MODEL)) == 8


def test_a_new_module_at_a_dead_ones_address_gets_its_own_path_and_type(tmp_path: Path) -> None:
    """The drain caches each child's path and facts under (parent path, id(child)). Modules made
    and dropped inside forward() often reuse a dead module's address, so a cached entry may
    belong to a dead module of another type: its weak reference must send the drain (C or
    Python) back to working the path out, with a flush between calls so the cache is warm."""
    from mltrace.tracer.session import active_session

    made: list[tuple[int, str]] = []

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.keep = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i in range(8):
                layer = (nn.ReLU if i % 2 == 0 else nn.Tanh)()  # not a child: "<ReLU>", "<Tanh>"
                made.append((id(layer), type(layer).__name__))
                x = self.keep(layer(x))
                del layer
            return x

    net = Net()

    def work() -> None:
        session = active_session()
        assert session is not None
        for _ in range(12):  # enough modules that the allocator reuses an address for the other type
            net(torch.ones(1, 3))
            session.flush()

    run = _trace(tmp_path, work, flush_interval_s=60)
    types_at: dict[int, set[str]] = {}
    for address, kind in made:
        types_at.setdefault(address, set()).add(kind)
    assert any(len(kinds) > 1 for kinds in types_at.values()), "no address was reused by another type: nothing tested"
    layers = sorted((s for s in run.spans if s.level == Level.LAYER), key=lambda s: s.start_ns)
    made_spans = [s for s in layers if s.name != "keep"]
    assert [(s.name, s.attrs["ml.layer.type"]) for s in made_spans] == [(f"<{kind}>", kind) for _, kind in made]
    assert len(layers) == 2 * len(made) == 2 * 8 * 12


def test_c_frames_and_their_shapes_are_not_tracked_by_the_cyclic_gc(tmp_path: Path, hot_path: str) -> None:
    """What a layer frame keeps until the drain cannot form a cycle; tracked, every live frame
    would be traversed by each collection the program's own allocations trigger. The C hot
    path's frame is not a GC object at all; it keeps one tensor's shape inline (nothing of
    torch's is kept: the raw form is built when read), and any other form untracked."""
    import gc

    if hot_path != "c":
        pytest.skip("the Python wrapper's frames are ordinary lists")
    from mltrace.tracer.session import active_session

    seen: list[list[object]] = []

    class Pair(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return a + b, a - b

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(3, 3)
            self.pair = Pair()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.inner(x) + self.inner(x)
            s, d = self.pair(y, x)
            session = active_session()
            assert session is not None
            source = next(s for s in session.started if s.name == "torch.modules")
            seen.extend(source._frames)  # type: ignore[attr-defined]
            return s * d

    _trace(tmp_path, lambda: Outer()(torch.ones(2, 3)), flush_interval_s=60)
    assert len(seen) == 3, "the inner frames were drained before the check"
    for frame in seen:
        assert type(frame).__name__ == "LayerFrame" and not gc.is_tracked(frame)
        assert len(frame) == 11 and list(frame)[2:5] == [frame[2], frame[3], frame[4]]
    linear, _, pair = seen
    for one_tensor in (linear[5], linear[6]):
        assert one_tensor == ((2, 3), torch.float32)
    assert linear[5] is not linear[5]  # inline: built when read
    assert pair[5] is pair[5] and pair[6] is pair[6]  # kept as raw_shapes gave them
    for several in (pair[5], pair[6]):
        assert len(several) == 2 and not gc.is_tracked(several)
        assert not any(gc.is_tracked(part) for part in several)


def test_c_and_python_row_encoders_write_the_same_bytes(tmp_path: Path, hot_path: str) -> None:
    """The drain's two encoders, on the same frames of the example CNN and a TransformerEncoder
    (one tensor, several tensors, a padding mask, nested tensors without shapes)."""
    import json

    if hot_path != "c":
        pytest.skip("the C encoder comes with the C hot path")
    from mltrace.tracer.session import active_session

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    try:
        from models import resnet_small
    finally:
        sys.path.pop(0)
    cnn = resnet_small().eval()
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2).eval()
    taken: list[list[object]] = []

    def work() -> None:
        with torch.inference_mode():
            cnn(torch.randn(1, 3, 32, 32))
            enc(torch.randn(2, 5, 32), src_key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
        enc(torch.randn(2, 5, 32))  # grad mode: the slow path, every sublayer
        session = active_session()
        assert session is not None
        source = next(s for s in session.started if s.name == "torch.modules")
        taken.extend(source._frames)  # type: ignore[attr-defined]
        copies = [list(f) for f in taken]  # not yet placed

        def encode_rows(encoder: str, frames: list[list[object]]) -> tuple[bytes, bytes]:
            if encoder == "python":
                return source._encode_rows_python(frames, 3)  # type: ignore[attr-defined,no-any-return]
            caches = (source._in_json, source._out_json, source._templates)  # type: ignore[attr-defined]
            return source._encode_rows(  # type: ignore[attr-defined,no-any-return]
                frames, source._place, source._shapes_json, *caches, source._template_ids.__next__, 3, source._site_json
            )

        # Fresh caches for the comparison; the session's own stay as its flushes left them.
        kept = source._in_json, source._out_json, source._templates, source._template_ids  # type: ignore[attr-defined]
        outputs = []
        try:
            for encoder, frames in (("c", taken), ("python", copies)):
                source._in_json, source._out_json, source._templates = {}, {}, {}  # type: ignore[attr-defined]
                source._template_ids = itertools.count(1)  # type: ignore[attr-defined]
                # A frame that fails takes the templates of the frames before it out again:
                # they never reach the file, so no later row may refer to them.
                with pytest.raises((TypeError, IndexError)):
                    encode_rows(encoder, [list(f) for f in copies] + [["not a frame"]])
                assert source._templates == {}  # type: ignore[attr-defined]
                outputs.append(encode_rows(encoder, frames))
        finally:
            source._in_json, source._out_json, source._templates, source._template_ids = kept  # type: ignore[attr-defined]
        c_out, python_out = outputs
        assert c_out == python_out
        templates = {t[0]: t for t in json.loads(b"[" + c_out[0] + b"]")}
        rows = json.loads(b"[" + c_out[1] + b"]")
        assert len(rows) == len(taken) > 60
        assert all(r[3] is None and r[7] == {} and r[8] in templates for r in rows)
        assert {templates[r[8]][1] for r in rows} >= {"stem.0", "layers.0.self_attn", "layers.1.linear2"}
        # Call sites are model code, never torch's: the CNN's layers are called from
        # examples/models.py, the encoder's (torch's own modules all the way down) from work().
        sites = {(templates[r[8]][1], templates[r[8]][2]["code.file.path"], templates[r[8]][2]["code.line.number"]) for r in rows}
        assert {f for _, f, _ in sites} == {__file__, sys.modules["models"].__file__}
        assert {f for name, f, _ in sites if name.startswith("layers.")} == {__file__}
        # A ResNet block calls its ReLU from two lines: one layer, two templates that differ in the line.
        assert len({line for name, _, line in sites if name == "layer1.0.relu"}) == 2

    _trace(tmp_path, work, flush_interval_s=60)
    assert taken


def test_span_templates_survive_many_shapes_and_a_cache_that_starts_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drain writes each (layer, shapes) once as a template and rows that refer to it. With
    the template cache capped at 4 entries and a flush after every inference, templates are
    forgotten and written again under new ids across events.jsonl lines; every span must still
    load with its own path and shapes, as the streamed file and as the finished run."""
    import json

    from mltrace.run import store
    from mltrace.tracer.session import active_session
    from mltrace.tracer.sources import torch_modules

    monkeypatch.setattr(torch_modules, "_TEMPLATE_CACHE_MAX", 4)
    net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    batches = [1, 2, 3, 1, 4, 2, 5, 1]
    streamed: list[Run] = []

    def work() -> None:
        session = active_session()
        assert session is not None
        with torch.no_grad():
            for n in batches:
                net(torch.randn(n, 3))
                session.flush()
        streamed.append(store.load_run(session.run_dir))  # what a killed run would leave
        for line in (session.run_dir / store.EVENTS_FILE).read_bytes().splitlines():
            templates.extend(json.loads(line).get("templates", []))

    templates: list[list[object]] = []
    run = _trace(tmp_path, work, flush_interval_s=60)
    distinct = {json.dumps(t[1:]) for t in templates}
    assert len({t[0] for t in templates}) == len(templates) > len(distinct)  # some written again, under new ids
    lines = (tmp_path / "run").joinpath(store.EVENTS_FILE).read_bytes()
    assert b'"templates"' in lines  # the finished run writes repeated layer spans as templates too
    for got in (streamed[0], run):
        layers = sorted((s for s in got.spans if s.level == Level.LAYER), key=lambda s: s.start_ns)
        assert [s.name for s in layers] == ["0", "1", "2"] * len(batches)
        assert [s.attrs["ml.input.shapes"] for s in layers[::3]] == [[[n, 3]] for n in batches]
        assert [s.attrs["ml.output.shapes"] for s in layers[2::3]] == [[[n, 2]] for n in batches]
        assert all(s.attrs["ml.layer.type"] == ("ReLU" if s.name == "1" else "Linear") for s in layers)


def test_forward_is_called_directly_only_where_call_impl_would_do_nothing_else(tmp_path: Path, hot_path: str) -> None:
    """The C hot path calls ``forward`` itself in place of ``Module._call_impl`` only while no hook
    (the module's own or global, forward or backward) is registered, no JIT trace is being recorded
    and ``_call_impl`` is torch's own: hooks, overrides, instance forwards and traces behave as in
    plain torch, on both hot paths."""
    seen: list[str] = []

    class Own(nn.Module):
        def _call_impl(self, *args: object, **kwargs: object) -> object:
            seen.append("own _call_impl")
            return super()._call_impl(*args, **kwargs)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    net = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), Own(), nn.Linear(3, 3))
    net[3].forward = lambda x: seen.append("instance forward") or x * 2  # type: ignore[method-assign]
    x = torch.randn(2, 3)

    def scopes(module: nn.Module) -> list[str]:
        traced = torch.jit.trace(module, x)
        return sorted({n.scopeName() for n in traced.inlined_graph.nodes()})

    plain_scopes = scopes(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))

    def go() -> None:
        net(x)
        pre = net[0].register_forward_pre_hook(lambda m, i: seen.append("pre hook"))
        net(x)
        pre.remove()
        glob = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(f"global {type(m).__name__}"))
        net(x)
        glob.remove()
        back = net[1].register_full_backward_hook(lambda m, gi, go: seen.append("backward hook"))
        net(x.requires_grad_()).sum().backward()
        back.remove()
        seen.append(f"same scopes {scopes(nn.Sequential(nn.Linear(3, 3), nn.ReLU())) == plain_scopes}")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = _trace(tmp_path, go)
    # mltrace's own reads (the parameter count) add nothing to the user's trace
    assert not [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
    assert seen == [
        "own _call_impl", "instance forward",
        "pre hook", "own _call_impl", "instance forward",
        "global Linear", "global ReLU", "own _call_impl", "global Own", "instance forward", "global Linear", "global Sequential",
        "own _call_impl", "instance forward", "backward hook",
        "same scopes True",
    ]  # fmt: skip
    assert plain_scopes != [""]  # the trace records module scopes: _slow_forward ran
    assert _names(run, Level.MODEL)[:4] == ["Sequential"] * 4
    assert _names(run)[:4] == ["0", "1", "2", "3"]
    info = run.meta["sources"]["torch.modules"]
    assert info.get("layer_forward_direct", False) is (hot_path == "c")


def test_hook_reads_go_through_a_class_that_overrides_attribute_access(tmp_path: Path) -> None:
    """Torch's ``_call_impl`` reads a module's hook dicts and ``forward`` as attributes; the C hot
    path reads them from the instance dict only where that is what attribute access gives: a
    class overriding ``__getattribute__``, or a ``forward`` set on the instance, is honoured."""
    reads: list[str] = []

    class Watched(nn.Module):
        def __getattribute__(self, name: str) -> Any:
            if name in ("_forward_hooks", "forward"):
                reads.append(name)
            return super().__getattribute__(name)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    class Doubled(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    net = nn.Sequential(Watched(), Doubled(), nn.ReLU())
    net[1].forward = lambda x: x * 2  # type: ignore[method-assign]
    x = torch.ones(2, 3)
    plain = net(x)
    plain_reads = list(reads)
    reads.clear()
    outputs: list[torch.Tensor] = []
    run = _trace(tmp_path, lambda: outputs.append(net(x)))
    assert torch.equal(outputs[0], plain) and torch.equal(plain, torch.full((2, 3), 4.0))
    assert sorted(reads) == sorted(plain_reads) and "_forward_hooks" in reads and "forward" in reads
    assert _names(run) == ["0", "1", "2"]


def test_a_class_changed_between_calls_is_read_again(tmp_path: Path) -> None:
    """The C hot path remembers what it looked up on a module's class (its ``forward``) until the
    class changes: a ``forward`` replaced on the class, or a forward hook registered, between two
    calls is the one the next call runs."""

    class Step(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    def plus_ten(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x + 10

    net = nn.Sequential(Step(), nn.ReLU())
    x = torch.zeros(1, 2)
    outputs: list[float] = []

    def go() -> None:
        outputs.append(float(net(x)[0, 0]))
        Step.forward = plus_ten  # type: ignore[method-assign]
        outputs.append(float(net(x)[0, 0]))
        handle = net[0].register_forward_hook(lambda m, i, o: o * 2)
        outputs.append(float(net(x)[0, 0]))
        handle.remove()

    run = _trace(tmp_path, go)
    assert outputs == [1.0, 10.0, 20.0]
    assert _names(run) == ["0", "1"] * 3


def test_forward_check_needs_call_impl_to_read_as_verified() -> None:
    from mltrace.tracer.sources.torch_modules import forward_check

    checked = forward_check(nn.Module)
    assert checked is not None and checked[0] is nn.Module.__dict__["_call_impl"] and "_global_forward_hooks" in checked[2]

    class Changed:
        def _call_impl(self, *args: object, **kwargs: object) -> object:
            forward_call = self.forward  # type: ignore[attr-defined]
            if not self._forward_hooks:  # type: ignore[attr-defined]
                return forward_call(*args, **kwargs)
            return None

    assert forward_check(Changed) is None
    assert forward_check(object) is None


def test_forward_check_reads_each_call_impl_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second session, or a forked child's, gets the answer without reading the source again;
    another ``_call_impl`` is read."""
    import inspect

    from mltrace.tracer.sources import torch_modules

    first = torch_modules.forward_check(nn.Module)
    reads: list[object] = []
    getsource = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: reads.append(obj) or getsource(obj))
    assert torch_modules.forward_check(nn.Module) == first and reads == []

    class Other:
        def _call_impl(self, *args: object, **kwargs: object) -> object:
            return None

    assert torch_modules.forward_check(Other) is None and reads == [Other.__dict__["_call_impl"]]
    assert torch_modules.forward_check(Other) is None and len(reads) == 1


def test_model_spans_keep_their_own_shapes_when_conversions_are_cached(tmp_path: Path) -> None:
    """Model spans' shapes (a list of pairs, converted once per distinct list and shared): each
    call still gets the shapes it was called with."""

    class Two(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a.sum() + b.sum()

    net = Two()
    calls = [((2, 3), (4,)), ((5, 1), (4,)), ((2, 3), (4,)), ((2, 3), (7, 7))]
    run = _trace(tmp_path, lambda: [net(torch.ones(*a), torch.ones(*b, dtype=torch.float64)) for a, b in calls])
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert [s.attrs["ml.input.shapes"] for s in models] == [[list(a), list(b)] for a, b in calls]
    assert [s.attrs["ml.input.dtypes"] for s in models] == [["float32", "float64"]] * 4
    assert [s.attrs["ml.output.shapes"] for s in models] == [[[]]] * 4


@pytest.fixture(scope="module")
def gpt2() -> Any:
    """A small GPT-2 (transformers imported here, before the per-test check of import hooks:
    transformers adds one to ``sys.meta_path`` when first imported)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=500, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


def test_a_transformers_generate_computes_the_same_tokens_and_logits_as_plain(tmp_path: Path, gpt2: Any) -> None:
    """mltrace never changes what the program computes, nor torch's thread count: a GPT-2
    ``generate()`` gives bit-identical tokens and per-step logits at the model and layer levels
    (both hot paths: the fixture) as without mltrace, while the layer level records its layers."""
    model = gpt2
    prompt = torch.randint(0, 500, (1, 6), generator=torch.Generator().manual_seed(0))

    def generate() -> tuple[torch.Tensor, list[torch.Tensor], int]:
        with torch.no_grad():
            out = model.generate(
                prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                return_dict_in_generate=True, output_logits=True,
            )  # fmt: skip
        return out.sequences, list(out.logits), torch.get_num_threads()

    plain_tokens, plain_logits, plain_threads = generate()
    for level in ("model", "layer"):
        with mltrace.profile(output=tmp_path / level, summary=False, level=level):
            tokens, logits, threads = generate()
        assert torch.equal(tokens, plain_tokens)
        assert len(logits) == len(plain_logits) == 6
        assert all(torch.equal(a, b) for a, b in zip(logits, plain_logits, strict=True))
        assert threads == plain_threads
        run = mltrace.load_run(tmp_path / level)
        assert _names(run, Level.MODEL) == ["GPT2LMHeadModel"] * 6
        assert ("transformer.h.1.attn" in _names(run)) is (level == "layer")


def test_a_module_called_outside_the_model_is_a_model_of_its_own(tmp_path: Path) -> None:
    """Every outermost module call is a model call, parameters or not, but a loss's: a frozen
    TorchScript model, which has no parameters and no children, is a model. A loss called beside
    the model (``torch.nn.modules.loss._Loss``) is a region of the training step, not a model a
    program infers with: a user-level span marked ``ml.region: loss``, with its own invocation
    numbers and none of the model's layers."""
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.LogSoftmax(dim=1)).eval()
    loss = nn.NLLLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.freeze's own
        frozen = torch.jit.freeze(torch.jit.script(nn.Sequential(nn.Linear(8, 4)).eval()))
    assert not list(frozen.parameters()) and not list(frozen.children())
    x, y = torch.randn(2, 8), torch.tensor([1, 3])

    def go() -> None:
        with torch.no_grad():
            for _ in range(3):
                loss(net(x), y)
            frozen(x)

    run = _trace(tmp_path, go)
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert [s.name for s in models] == ["Sequential"] * 3 + ["Sequential (TorchScript, frozen)"]  # the scripted class's name
    assert [s.attrs["ml.model.invocation"] for s in models] == [1, 2, 3, 1]
    assert models[0].attrs["ml.layer.params"] == 8 * 16 + 16 + 16 * 4 + 4
    losses = [s for s in run.spans if s.level == Level.USER]
    assert [(s.name, s.attrs["ml.region"], s.attrs["ml.model.invocation"]) for s in losses] == [("NLLLoss", "loss", n) for n in (1, 2, 3)]
    assert _names(run) == ["0", "1", "2", "3"] * 3  # the loss has no layers, nor is it one
    data = build_report(run, analyze(run))
    assert sorted((m["name"], m["calls"]) for m in data["models"]) == [("Sequential", 3), ("Sequential (TorchScript, frozen)", 1)]
    assert data["run"]["model_calls"] == 4


@pytest.mark.parametrize("level", ["model", "layer"])
def test_a_model_call_records_its_mode_and_grad_mode(tmp_path: Path, level: str) -> None:
    """Each model call says whether the model was in training mode (``module.training``) and
    autograd on (``torch.is_grad_enabled()``) when it was called: what tells a training step from
    an evaluation (``analysis.coldstart.call_kinds``)."""
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    x = torch.randn(8, 4)

    def go() -> None:
        net.train()
        net(x).sum().backward()
        net.eval()
        with torch.no_grad():
            net(x[:2])
        with torch.inference_mode():
            net(x)
        net(x)

    run = _trace(tmp_path, go, level=level)
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert [(s.attrs["ml.model.training"], s.attrs["ml.grad.enabled"]) for s in models] == [
        (True, True),
        (False, False),
        (False, False),
        (False, True),
    ]
    assert [s.attrs["ml.input.shapes"][0][0] for s in models] == [8, 2, 8, 8]


@pytest.mark.parametrize("level", ["model", "layer"])
def test_a_model_call_records_the_shapes_of_its_keyword_tensors(tmp_path: Path, level: str) -> None:
    """A model span's input shapes are its positional tensors', then its keyword tensors' in
    call order (a tuple of tensors gives one shape each), and ``ml.input.keywords`` names the
    latter; a keyword that holds no tensor is left out. A layer called with keywords keeps its
    positional tensors' shapes only (the layer hot path reads no keywords)."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor | None = None, mask: torch.Tensor | None = None, **extra: Any) -> torch.Tensor:
            assert x is not None and mask is not None
            return self.proj(input=x) * mask

    net = Masked()
    x, mask = torch.randn(3, 4), torch.ones(3, 1, dtype=torch.bool)

    def go() -> None:
        net(x, mask=mask, pair=(x[:1], x[:2]), scale=2.0)
        net(x=x[:2], mask=mask[:2])
        net(x, mask)

    run = _trace(tmp_path, go, level=level)
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert [s.attrs["ml.input.shapes"] for s in models] == [
        [[3, 4], [3, 1], [1, 4], [2, 4]],
        [[2, 4], [2, 1]],
        [[3, 4], [3, 1]],
    ]
    assert [s.attrs.get("ml.input.keywords") for s in models] == [["mask", "pair", "pair"], ["x", "mask"], None]
    assert models[0].attrs["ml.input.dtypes"] == ["float32", "bool", "float32", "float32"]
    assert [call_kinds([s.attrs for s in models])] == [["batch 3", "batch 2", "batch 3"]]
    layers = [s for s in run.spans if s.level == Level.LAYER]
    assert len(layers) == (3 if level == "layer" else 0)
    assert all("ml.input.shapes" not in s.attrs and "ml.input.keywords" not in s.attrs for s in layers)


@pytest.fixture(scope="module")
def bert() -> Any:
    """A small BERT, built from its config (transformers imported before the per-test check of
    import hooks, as for ``gpt2``)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, max_position_embeddings=32
    )
    return transformers.BertModel(config).eval()


def test_a_hugging_face_model_called_with_a_batch_dict_has_batch_kinds(tmp_path: Path, bert: Any) -> None:
    """BERT called as ``model(**encoding)``, as Hugging Face models are: its spans record the
    encoding's shapes and keywords, so its two batch sizes are two kinds of call."""

    def encoding(batch: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (batch, 6))
        return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids)}

    def go() -> None:
        with torch.no_grad():
            for batch in (2, 2, 5, 5):
                bert(**encoding(batch))

    run = _trace(tmp_path, go)
    models = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert [s.attrs["ml.input.shapes"] for s in models] == [[[b, 6]] * 3 for b in (2, 2, 5, 5)]
    assert {tuple(s.attrs["ml.input.keywords"]) for s in models} == {("input_ids", "token_type_ids", "attention_mask")}
    assert call_kinds([s.attrs for s in models]) == ["batch 2", "batch 2", "batch 5", "batch 5"]
    data = build_report(run, analyze(run))
    (model,) = data["models"]
    assert [(k["kind"], k["calls"]) for k in model["kinds"]] == [("batch 2", 2), ("batch 5", 2)]


class _SymbolicNet(nn.Module):
    """A model whose forward also calls a submodule on a tensor it makes itself (a real tensor,
    even while the model runs on torch.fx proxies)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.offset = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.offset(torch.ones(8))


class _Join(nn.Module):
    def forward(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts, dim=-1)


def _graph_by_hand(model: nn.Module, by_keyword: bool) -> torch.fx.GraphModule:
    """An fx graph of a copy of ``model`` built outside ``torch.fx.symbolic_trace``: a Tracer's
    proxy passed to the model's ``__call__`` (positionally or by keyword), then a module called
    on a list of proxies. The copy keeps the graph's tensor constant off ``model``."""
    net = copy.deepcopy(model)
    tracer = torch.fx.Tracer()
    tracer.graph = torch.fx.Graph()
    tracer.root, tracer.tensor_attrs = net, {}  # what Tracer.trace sets before it runs a model
    x = tracer.create_proxy("placeholder", "x", (), {})
    out = net(x=x) if by_keyword else net(x)
    out = _Join()([out, out])
    tracer.create_node("output", "output", (out.node,), {})
    return torch.fx.GraphModule(net, tracer.graph)


@pytest.mark.parametrize("level", ["model", "layer"])
def test_module_calls_on_fx_proxies_are_no_model_or_layer_calls(tmp_path: Path, level: str) -> None:
    """A module called with torch.fx proxies outside ``symbolic_trace`` (a graph built by hand
    through a Tracer) records a graph: no inference, so neither that call nor any module call
    inside it (one on a real tensor included) is a model or layer call, the graph is the one
    built without mltrace, and run.json counts the calls left out. The graph modules then run
    as models."""
    torch.manual_seed(0)
    net = _SymbolicNet().eval()
    plain = _graph_by_hand(net, by_keyword=False).code
    x = torch.randn(2, 8)
    built: list[torch.fx.GraphModule] = []

    def go() -> None:
        built.extend(_graph_by_hand(net, by_keyword) for by_keyword in (False, True))
        with torch.no_grad():
            for graph_module in built:
                graph_module(x)

    run = _trace(tmp_path, go, level=level)
    assert [g.code for g in built] == [plain, plain]
    assert _names(run, Level.MODEL) == ["GraphModule", "GraphModule"]  # the graph modules' calls alone
    assert {s.attrs["ml.model.invocation"] for s in run.spans if s.level == Level.MODEL} == {1}
    assert _names(run) == []  # the graph runs the model's modules as functions: no module call
    assert run.meta["sources"]["torch.modules"]["fx_symbolic_calls"] == 4  # net and _Join, twice
    assert "4 module calls on torch.fx proxies left out" in " ".join(analyze(run).findings.notes)


def test_an_fx_graph_modules_layer_is_defined_where_the_code_it_was_traced_from_is(tmp_path: Path) -> None:
    """torch.fx generates a GraphModule's ``forward`` (``<eval_with_key>.N from FILE:LINE in
    forward``, lines in no file): its model span names the traced ``forward``'s file and line
    as where it is defined, not the generated name with one of its lines."""
    import torch.fx

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.lin(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.block(x) + 1

    graph_module = torch.fx.symbolic_trace(Net())
    run = _trace(tmp_path, lambda: graph_module(torch.ones(2, 3)))
    (model,) = [s for s in run.spans if s.level == Level.MODEL]
    assert model.attrs["ml.defined.file.path"] == __file__
    assert model.attrs["ml.defined.line.number"] == Net.forward.__code__.co_firstlineno
