"""Call sites (docs/CONVENTIONS.md, "Call sites"): every layer span names the model-code line that
called it, with both layer hot paths, on a model written the way users write them."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import mltrace
from mltrace.run.levels import Level
from mltrace.tracer.callsite import CodeKeyed, is_model_code, is_stdlib


def logged(fn: Any) -> Any:
    """A decorator as model libraries write them (functools.wraps)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    @logged
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)  # LINE: block.proj


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.Sequential(nn.ReLU()))
        layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.act = nn.GELU()
        self.block = Block()
        self.scripted = torch.jit.script(nn.Sequential(nn.Linear(16, 16), nn.ReLU()))
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.stem(x).flatten(2).transpose(1, 2)  # LINE: stem
        h = self.encoder(f)  # LINE: encoder
        h = self.act(h)  # LINE: act first
        h = self.block(self.act(h))  # LINE: act second
        h = self.scripted(h)  # LINE: scripted
        return self.head(h[:, 0])  # LINE: head


def _line(tag: str) -> int:
    lines = inspect.getsource(sys.modules[__name__]).splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# LINE: {tag}"))


def test_every_layer_names_the_model_code_line_that_called_it(tmp_path: Path, hot_path: str) -> None:
    net = Net().eval()
    with mltrace.profile(output=tmp_path / "run", summary=False, level="layer"), torch.no_grad():
        for _ in range(2):
            net(torch.randn(1, 3, 4, 4))
    run = mltrace.load_run(tmp_path / "run")
    assert run.meta["sources"]["torch.modules"]["layer_hot_path"].split(" ")[0] == hot_path
    layers = [s for s in run.spans if s.level == Level.LAYER]
    sites: dict[str, set[tuple[str, int]]] = {}
    for s in layers:
        sites.setdefault(s.name, set()).add((s.attrs["code.file.path"], s.attrs["code.line.number"]))
    here = __file__
    expected = {
        # nested Sequential: torch's Sequential.forward in between is not a call site
        "stem": {(here, _line("stem"))},
        "stem.0": {(here, _line("stem"))},
        "stem.1.0": {(here, _line("stem"))},
        # torch's own modules all the way down: the line that called the outermost
        "encoder": {(here, _line("encoder"))},
        "encoder.layers.0": {(here, _line("encoder"))},
        # one module, two call sites: each call its own line
        "act": {(here, _line("act first")), (here, _line("act second"))},
        # a decorated forward is model code: its body's line calls proj
        "block": {(here, _line("act second"))},
        "block.proj": {(here, _line("block.proj"))},
        "head": {(here, _line("head"))},
    }
    for name, want in expected.items():
        assert sites.get(name) == want, name
    # TorchScript runs its submodules without nn.Module.__call__: the scripted module is one
    # span at its call site, with no layer spans inside it.
    assert sites["scripted"] == {(here, _line("scripted"))}
    assert not any(n.startswith("scripted.") for n in sites)
    by_name = {s.name: s for s in layers}
    assert by_name["block"].attrs["code.function.name"] == "Net.forward"
    assert by_name["block.proj"].attrs["code.function.name"] == "Block.forward"
    # Where each forward is defined, decorators unwrapped: Block.forward here, not functools' wrapper.
    assert by_name["block"].attrs["ml.defined.file.path"] == here
    assert by_name["block"].attrs["ml.defined.line.number"] == Block.forward.__wrapped__.__code__.co_firstlineno  # type: ignore[attr-defined]
    assert by_name["stem.0"].attrs["ml.defined.file.path"].endswith("torch/nn/modules/conv.py")
    (model,) = {s.attrs["code.line.number"] for s in run.spans if s.level == Level.MODEL}
    assert model > _line("head")  # the model's own call site: the loop above


class Compiled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stem(x).mean((2, 3)))


def _compiled_calls(backend: str, calls: int) -> tuple[list[torch.Tensor], int, int]:
    """Outputs of ``calls`` calls of a freshly compiled model, its graph breaks and its graphs."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    compiled = torch.compile(Compiled().eval(), backend=backend)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        outputs = [compiled(x) for _ in range(calls)]  # LINE: compiled call
    return outputs, sum(counters["graph_break"].values()), int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("level", ["layer", "op"])
def test_torch_compile_is_untouched_and_each_compiled_call_is_one_span(tmp_path: Path, hot_path: str, level: str) -> None:
    """Tracing adds no graph break and no graph (TorchDynamo compiles what it would plain); the
    compiled region is one model span per call, at the line that called it."""
    pytest.importorskip("torch._dynamo")
    plain, plain_breaks, plain_graphs = _compiled_calls("eager", 3)
    with mltrace.profile(output=tmp_path / "run", summary=False, level=level):
        traced, traced_breaks, traced_graphs = _compiled_calls("eager", 3)
    assert (traced_breaks, traced_graphs) == (plain_breaks, plain_graphs) == (0, 1)
    assert all(torch.equal(a, b) for a, b in zip(plain, traced))
    run = mltrace.load_run(tmp_path / "run")
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert [s.name for s in models] == ["Compiled (compiled)"] * 3
    assert {(s.attrs["code.file.path"], s.attrs["code.line.number"]) for s in models} == {(__file__, _line("compiled call"))}
    # What Dynamo compiled runs without nn.Module calls: no layer spans inside.
    assert not [s for s in run.spans if s.level == Level.LAYER]


class Branching(nn.Module):
    """A forward with a data-dependent branch: a graph break TorchDynamo handles at forward's frame."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            h = h * 2
        return self.b(h)


def _compiled_counts(make: Callable[[], Callable[[torch.Tensor], torch.Tensor]], inputs: list[torch.Tensor]) -> dict[str, Any]:
    """The outputs of calls of what ``make`` compiles afresh (seeded), one a tensor of
    ``inputs``, and Dynamo's counters."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    compiled = make()
    with torch.no_grad():
        outputs = [compiled(x) for x in inputs]
    return {
        "outputs": [o.tolist() for o in outputs],
        "graph_break": dict(counters["graph_break"]),
        "frames": dict(counters["frames"]),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "calls_captured": counters["stats"]["calls_captured"],
    }


def _dynamo_counts() -> dict[str, Any]:
    """Three calls of a freshly compiled ``Branching``: its outputs and Dynamo's counters."""
    return _compiled_counts(
        lambda: torch.compile(Branching().eval(), backend="eager"), [torch.full((2, 8), float(i) - 1.0) for i in range(3)]
    )


@pytest.mark.parametrize("level", ["model", "layer", "op"])
def test_a_graph_break_in_forward_counts_as_it_does_plain(tmp_path: Path, hot_path: str, level: str) -> None:
    """mltrace's frames on the module-call path are never compiled: Dynamo starts at forward,
    so a break there is handled as plain (no break counted, the same frames and graphs)."""
    pytest.importorskip("torch._dynamo")
    plain = _dynamo_counts()
    with mltrace.profile(output=tmp_path / "run", summary=False, level=level):
        traced = _dynamo_counts()
    assert traced == plain
    assert plain["frames"]["total"] >= 2  # forward and the code after the break


class BreakingBlock(nn.Module):
    """A block whose forward breaks the graph where it calls ``graph_break``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        torch._dynamo.graph_break()
        return torch.relu(y)


def _compiled_function_counts() -> dict[str, Any]:
    """Two calls of a freshly compiled function that calls a model with a graph break inside:
    the outputs and Dynamo's counters. The model call ends outside any graph, on a thread
    where Dynamo looks at every frame that runs."""

    def make() -> Callable[[torch.Tensor], torch.Tensor]:
        net = nn.Sequential(BreakingBlock(), nn.Linear(8, 2)).eval()
        return torch.compile(lambda t: net(t) * 2, backend="eager")

    return _compiled_counts(make, [torch.full((2, 8), float(i)) for i in range(2)])


@pytest.mark.parametrize("level", ["model", "layer", "op"])
def test_a_model_called_from_a_compiled_function_compiles_as_it_does_plain(tmp_path: Path, hot_path: str, level: str) -> None:
    """A compiled function that calls a model with a graph break inside has the outputs, graphs,
    breaks, captured calls and frames it has plain: mltrace's own work at the model call's end
    (listeners, the op level's cycle switch, the standard library under them) runs where
    TorchDynamo looks at every frame, and it skips all of it (it counted 55 more frames)."""
    pytest.importorskip("torch._dynamo")
    plain = _compiled_function_counts()
    with mltrace.profile(output=tmp_path / "run", summary=False, level=level):
        traced = _compiled_function_counts()
    assert traced == plain
    assert plain["frames"]["total"] >= 3  # the function, forward and the code after the break
    run = mltrace.load_run(tmp_path / "run")
    assert [s.name for s in run.spans if s.level == Level.MODEL] == ["Sequential", "Sequential"]


def test_model_calls_of_another_thread_are_recorded_while_one_compiles(tmp_path: Path, hot_path: str) -> None:
    """``torch.compiler.is_compiling()`` is true on every thread while one compiles: the eager
    calls of another thread meanwhile are still model and layer spans."""
    pytest.importorskip("torch._dynamo")
    import torch._dynamo

    inside, done = threading.Event(), threading.Event()

    def held_backend(gm: Any, example_inputs: Any) -> Any:
        inside.set()
        done.wait(60)
        return gm

    def eager_calls() -> None:
        inside.wait(60)
        net = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
        try:
            with torch.no_grad():
                for _ in range(3):
                    net(torch.randn(2, 4))
        finally:
            done.set()

    torch._dynamo.reset()
    with mltrace.profile(output=tmp_path / "run", summary=False, level="layer"):
        other = threading.Thread(target=eager_calls)
        other.start()
        compiled = torch.compile(Compiled().eval(), backend=held_backend)
        with torch.no_grad():
            compiled(torch.randn(2, 3, 8, 8))
        other.join(60)
    run = mltrace.load_run(tmp_path / "run")
    eager = [s for s in run.spans if s.level == Level.MODEL and s.name == "Sequential"]
    assert len(eager) == 3
    assert sorted(s.name for s in run.spans if s.level == Level.LAYER and s.parent_id in {m.id for m in eager}) == [
        "0",
        "0",
        "0",
        "1",
        "1",
        "1",
    ]


def test_framework_files_are_never_call_sites() -> None:
    assert not is_model_code(torch.nn.modules.conv.__file__)
    assert not is_model_code(functools.__file__)  # the standard library
    assert not is_model_code(mltrace.__file__)
    assert not is_model_code(os.path.join(sysconfig.get_path("scripts"), "mltrace"))  # the console script's launcher
    typing_extensions = importlib.util.find_spec("typing_extensions")
    if typing_extensions is not None and typing_extensions.origin:
        assert not is_model_code(typing_extensions.origin)  # a decorator's wrapper (quantize_dynamic's)
    assert is_model_code(__file__)
    transformers = importlib.util.find_spec("transformers")
    if transformers is not None and transformers.origin:
        assert is_model_code(transformers.origin)  # model libraries are model code


def _module_stacks(exported: Any) -> list[list[str]]:
    """The module path of each node of an exported program's graph, outermost first."""
    return [[path for path, _ in node.meta.get("nn_module_stack", {}).values()] for node in exported.graph.nodes]


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_inside_a_session_records_only_the_exported_programs_calls(tmp_path: Path, hot_path: str, strict: bool) -> None:
    """torch.export traces with TorchDynamo (strict) or torch.fx, which save and restore
    ``nn.Module.__call__`` around their tracing: the layer level's own must be what is put back,
    and export's tracing is no model call. Strict export starts at ``forward`` only where
    ``model.__call__`` is ``nn.Module.__call__``, as it is without mltrace. The exported
    program is the same graph, and its calls are model spans."""
    pytest.importorskip("torch.export")
    net = Compiled().eval()
    x = torch.randn(2, 3, 8, 8)
    plain = torch.export.export(net, (x,), strict=strict)
    with mltrace.profile(output=tmp_path / "run", summary=False, level="layer"):
        exported = torch.export.export(net, (x,), strict=strict)
        program = exported.module()
        with torch.no_grad():
            outputs = [program(x) for _ in range(2)]  # LINE: exported call
        installed = torch.nn.Module.__dict__["__call__"]
    assert torch.equal(outputs[0], net(x))
    assert str(exported.graph) == str(plain.graph) and _module_stacks(exported) == _module_stacks(plain)
    assert installed is not torch.nn.modules.module.Module._wrapped_call_impl  # still mltrace's
    run = mltrace.load_run(tmp_path / "run")
    models = [s for s in run.spans if s.level == Level.MODEL]
    assert [s.name for s in models] == ["Compiled (exported)"] * 2  # the exported class, not torch's GraphModule
    assert {s.attrs["code.line.number"] for s in models} == {_line("exported call")}
    assert not [n for n in run.meta.get("limitations", []) if "re-wrapped" in n]


def test_a_code_keyed_cache_tells_code_objects_apart_and_starts_over_when_full() -> None:
    first = compile("a = 1", "<a>", "exec")
    second = compile("b = 2", "<b>", "exec")
    cache: CodeKeyed[str] = CodeKeyed(limit=2)
    assert cache.put(first, 3, "first@3") == "first@3"
    assert cache.get(first, 3) == "first@3" and cache.get(first, 4) is None and cache.get(second, 3) is None
    cache.put(second, 3, "second@3")
    cache.put(first, 5, "first@5")  # the third entry: the cache starts over
    assert cache.get(first, 3) is None and cache.get(first, 5) == "first@5"


def test_is_stdlib_knows_the_standard_library_from_packages_and_scripts() -> None:
    import json

    assert is_stdlib(json.__file__) and is_stdlib(os.__file__)
    assert not is_stdlib(torch.__file__) and not is_stdlib(__file__) and not is_stdlib("<string>")


#: An installed model library: a pipeline that calls the program's model on its behalf.
_LIBRARY = '''"""A pipeline as model libraries write them."""

import threading


class Pipeline:
    def __init__(self, model):
        self.model = model

    def __call__(self, x):
        return self._forward(x)

    def _forward(self, x):
        return self.model(x)  # LIBRARY: model call


def _collect(pipe, x, out):
    out.append(pipe(x))


def in_a_thread(pipe, x):
    out = []
    thread = threading.Thread(target=_collect, args=(pipe, x, out))
    thread.start()
    thread.join()
    return out[0]
'''


@pytest.fixture
def installed_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``_LIBRARY`` as the package ``fakepipe`` in a ``site-packages/`` folder on ``sys.path``."""
    root = tmp_path / "lib" / "site-packages"
    (root / "fakepipe").mkdir(parents=True)
    (root / "fakepipe" / "__init__.py").write_text(_LIBRARY)
    monkeypatch.syspath_prepend(str(root))
    sys.modules.pop("fakepipe", None)
    module = importlib.import_module("fakepipe")
    yield module
    sys.modules.pop("fakepipe", None)


class Tower(nn.Module):
    """A model of the program's own, which an installed library's pipeline calls."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.act = nn.Sequential(nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.proj(x))  # LINE: tower layers


def _site(span: Any) -> tuple[str, int]:
    return span.attrs["code.file.path"], span.attrs["code.line.number"]


def test_a_model_called_by_an_installed_library_names_the_programs_line(tmp_path: Path, hot_path: str, installed_library: Any) -> None:
    """A model call's call site is the program's line past the installed library that made the
    call (none on a thread the library started: then the library's line); its layers keep
    the line that called each of them."""
    pipe = installed_library.Pipeline(Tower().eval())
    bare = installed_library.Pipeline(nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval())
    x = torch.randn(2, 8)
    with mltrace.profile(output=tmp_path / "run", summary=False, level="layer"), torch.no_grad():
        pipe(x)  # LINE: pipeline call
        bare(x)  # LINE: bare pipeline call
        installed_library.in_a_thread(pipe, x)
    run = mltrace.load_run(tmp_path / "run")
    assert run.meta["sources"]["torch.modules"]["layer_hot_path"].split(" ")[0] == hot_path
    library = (installed_library.__file__, next(i for i, t in enumerate(_LIBRARY.splitlines(), 1) if t.endswith("# LIBRARY: model call")))
    here = __file__
    tower, sequential, threaded = sorted((s for s in run.spans if s.level == Level.MODEL), key=lambda s: s.start_ns)
    assert _site(tower) == (here, _line("pipeline call"))
    assert (tower.attrs["ml.call.file.path"], tower.attrs["ml.call.line.number"]) == _site(tower)
    assert tower.attrs["code.function.name"].endswith("test_a_model_called_by_an_installed_library_names_the_programs_line")
    assert _site(sequential) == (here, _line("bare pipeline call"))
    assert _site(threaded) == library  # no frame of the program's on the library's thread
    layers: dict[tuple[int, str], set[tuple[str, int]]] = {}
    for s in run.spans:
        if s.level == Level.LAYER:
            model = next(m for m in (tower, sequential, threaded) if m.start_ns <= s.start_ns <= m.end_ns)
            layers.setdefault((model.start_ns, s.name.rsplit("/", 1)[-1]), set()).add(_site(s))
    inside = here, _line("tower layers")
    for model in (tower, threaded):
        assert layers[(model.start_ns, "proj")] == layers[(model.start_ns, "act")] == layers[(model.start_ns, "act.0")] == {inside}
    # torch's own modules all the way down: the line that called the outermost, the library's
    assert layers[(sequential.start_ns, "0")] == layers[(sequential.start_ns, "1")] == {library}
