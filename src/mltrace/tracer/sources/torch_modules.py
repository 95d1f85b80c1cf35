"""PyTorch model and layer levels from a wrapper around ``nn.Module.__call__``.

Every module call becomes a span: the outermost call on a thread is the model
span (named by the model's class), and each nested call a layer span named by
its qualified path in the model (``layer1.0.conv1``). Paths come from the
calling module's children, so shared modules and modules created after tracing
started get the path they were called through.

The wrapper is installed when torch is imported (now, if it already is), never
imports torch itself, and is removed in ``stop()``. It replaces global forward
hooks (still available with ``MLTRACE_TORCH_HOOKS=global``), which route every
module call through torch's slower hooked path and are skipped when a
``KeyboardInterrupt`` unwinds a layer.

Layer calls are recorded as compact frames (one list per call: the module, the
parent frame, id, start, end, raw shapes) on a per-thread stack; the flusher
turns them into spans, with their paths and attributes, when it drains the
recorder. Spans begun elsewhere while a layer is open (``mltrace.span``, other
live sources) find it through ``Recorder.set_innermost``.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import re
import sys
import threading
import time
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from types import CodeType
from typing import TYPE_CHECKING, Any

from mltrace.native import c_helper
from mltrace.run import store
from mltrace.run.events import Event, Span
from mltrace.run.levels import Level
from mltrace.settings import LAYER_HOT_PATH, SPAN_UNTRACK, TORCH_HOOKS
from mltrace.tracer.callsite import CodeKeyed, is_model_code, line_of, program_site, unwrapped
from mltrace.tracer.clock import now_ns
from mltrace.tracer.recorder import take_all
from mltrace.tracer.sources._imports import PostImportHook
from mltrace.tracer.sources.base import Source
from mltrace.tracer.sources.hf_generate import GenerateSpans
from mltrace.tracer.sources.torch_layer_config import layer_config

if TYPE_CHECKING:
    from mltrace.tracer.sources.base import SessionView

try:
    import resource

    _RUSAGE_THREAD: int | None = resource.RUSAGE_THREAD
except (ImportError, AttributeError):  # not on every platform
    _RUSAGE_THREAD = None


def thread_usage() -> tuple[int, int]:
    """The calling thread's CPU time (ns) and minor page faults so far (-1 where unknown):
    two system calls, read at the start and end of each model call."""
    faults = resource.getrusage(_RUSAGE_THREAD).ru_minflt if _RUSAGE_THREAD is not None else -1
    return time.thread_time_ns(), faults


def calls_impl_directly(module_cls: Any, original: Any) -> bool:
    """Whether a wrapper may call ``module._call_impl`` itself instead of ``original``.

    Torch's own ``Module.__call__`` (``_wrapped_call_impl``) does nothing but
    pick ``_compiled_call_impl`` (set by ``Module.compile()``) or
    ``_call_impl``; a wrapper that makes that choice itself saves a Python
    frame per module call (≈ 0.3 µs). Only when ``__call__`` is still torch's.
    """
    return original is getattr(module_cls, "_wrapped_call_impl", None)


#: The start of torch's ``Module._call_impl`` that the C hot path does itself (``forward_check``).
_CALL_IMPL_EARLY_RETURN = """
forward_call = (self._slow_forward if torch._C._get_tracing_state() else self.forward)
if not (self._backward_hooks or self._backward_pre_hooks or self._forward_hooks or self._forward_pre_hooks
        or _global_backward_pre_hooks or _global_backward_hooks
        or _global_forward_hooks or _global_forward_pre_hooks):
    return forward_call(*args, **kwargs)
"""


#: ``forward_check``'s answer for each ``_call_impl`` function it read: reading its source costs
#: milliseconds, and a forked child (whose copy holds its parent's answers) or a later session
#: asks again of the same function.
_forward_checks: dict[Any, tuple[Any, Any, dict[str, Any]] | None] = {}


def forward_check(module_cls: Any) -> tuple[Any, Any, dict[str, Any]] | None:
    """What the C hot path needs to call ``forward`` itself where ``_call_impl`` would do nothing
    else: ``(Module._call_impl, a tracing check, _call_impl's globals)``. The tracing check is
    ``torch._C._is_tracing`` where torch has it: true exactly where ``_get_tracing_state()``
    (what ``_call_impl`` reads) is not None, and about 0.2 µs a module call cheaper inside a
    model, having no state object to convert (docs/PERFORMANCE.md); else ``_get_tracing_state``.

    ``_call_impl`` begins with a check (no JIT trace, no hook of the module's or global) and,
    where it passes, returns ``self.forward(*args, **kwargs)``: one more Python frame a module
    call, which torch's own ``__call__`` pays as well. The C hot path makes the same check and
    calls ``forward`` directly, and calls ``_call_impl`` in every other case. Only where the
    function's first two statements are exactly that check (compared as syntax trees, so
    comments and layout do not matter); None where they are not, or cannot be read. The answer
    for a ``_call_impl`` read once is kept (``_forward_checks``).
    """
    import inspect

    call_impl = module_cls.__dict__.get("_call_impl")
    torch_c = getattr(sys.modules.get("torch"), "_C", None)
    tracing_state = getattr(torch_c, "_is_tracing", None) or getattr(torch_c, "_get_tracing_state", None)
    if not inspect.isfunction(call_impl) or not callable(tracing_state):
        return None
    key = (call_impl, tracing_state)
    if key not in _forward_checks:
        _forward_checks[key] = _read_forward_check(call_impl, tracing_state)
    return _forward_checks[key]


def _read_forward_check(call_impl: Any, tracing_state: Any) -> tuple[Any, Any, dict[str, Any]] | None:
    """``forward_check``'s answer for ``call_impl``, from its source."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(call_impl)))
    except (OSError, TypeError, SyntaxError):
        return None
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef) else []
    expected = ast.parse(_CALL_IMPL_EARLY_RETURN).body
    if [ast.dump(node) for node in body[:2]] != [ast.dump(node) for node in expected]:
        return None
    return call_impl, tracing_state, call_impl.__globals__


def jit_tracing_probe() -> Callable[[], bool]:
    """A function that tells whether a JIT trace (``torch.jit.trace``) is being recorded on this
    thread: ``torch._C._is_tracing``, else whether ``_get_tracing_state()`` has one, else false."""
    torch_c = getattr(sys.modules.get("torch"), "_C", None)
    is_tracing = getattr(torch_c, "_is_tracing", None)
    if callable(is_tracing):
        return is_tracing  # type: ignore[no-any-return]
    state = getattr(torch_c, "_get_tracing_state", None)
    if callable(state):
        return lambda: state() is not None
    return lambda: False


def fx_proxy_check() -> Callable[[tuple[Any, ...], dict[str, Any]], bool]:
    """A function that tells whether a module call's arguments hold a ``torch.fx.Proxy`` (one
    of them, or an item of a list, tuple or dict among them): such a call records an fx graph,
    symbolically, as a ``Tracer`` driven by hand or a graph pass that calls a module on its
    nodes' proxies do (``torch.fx.symbolic_trace`` puts its own ``Module.__call__`` in place
    meanwhile). Always false where torch.fx is not imported. It runs on every model call: plain
    loops, no generator."""
    proxy = getattr(sys.modules.get("torch.fx"), "Proxy", None)
    if not isinstance(proxy, type):
        return lambda args, kwargs: False
    sequences = (list, tuple)

    def holds_proxy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        for value in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(value, proxy):
                return True
            if isinstance(value, sequences):
                for item in value:
                    if isinstance(item, proxy):
                        return True
            elif isinstance(value, dict):
                for item in value.values():
                    if isinstance(item, proxy):
                        return True
        return False

    return holds_proxy


def _libtorch_paths() -> list[str]:
    """The libraries of the imported torch that may hold its JIT tracer (``libtorch_cpu``, or a
    single ``libtorch``), for the C hot path's tracing check (``bind_tracing_state``)."""
    torch = sys.modules.get("torch")
    lib = os.path.join(os.path.dirname(getattr(torch, "__file__", None) or "."), "lib")
    try:
        names = sorted(os.listdir(lib))
    except OSError:
        return []
    return [os.path.join(lib, name) for name in names if name.startswith(("libtorch_cpu.", "libtorch."))]


def _bind_libtorch_tracing_state() -> bool:
    """Has the C hot path read libtorch's JIT tracing state itself (``bind_tracing_state``);
    whether it does. A read that disagrees with torch's own check now (no trace is recorded
    while a session starts) is not used."""
    from mltrace._layercall import bind_tracing_state, tracing_now

    if not any(bind_tracing_state(path) for path in _libtorch_paths()):
        return False
    if tracing_now() is not jit_tracing_probe()():
        bind_tracing_state(None)
        return False
    return True


def _untraced(read: Callable[[Any], Any], value: Any) -> Any:
    """``read(value)`` with any JIT trace of this thread paused: inside ``torch.jit.trace`` a
    parameter count or a shape read would otherwise add nodes to the user's graph (and number
    its values otherwise) and a TracerWarning to their output."""
    c = getattr(sys.modules.get("torch"), "_C", None)
    tracing = getattr(c, "_get_tracing_state", lambda: None)()
    if tracing is None:
        return read(value)
    c._set_tracing_state(None)  # type: ignore[union-attr]
    try:
        return read(value)
    finally:
        c._set_tracing_state(tracing)  # type: ignore[union-attr]


#: The file name torch.fx gives a GraphModule's generated ``forward``: the code it was traced
#: from is named in it (the generated code's own lines are in no file).
_FX_GENERATED = re.compile(r"<eval_with_key>\.\d+ from (?P<file>.+):(?P<line>\d+) in \w+")


def definition_site(code: CodeType) -> tuple[str, int]:
    """Where a module's ``forward`` is defined (file, first line): for torch.fx's generated code,
    the ``forward`` it was traced from."""
    generated = _FX_GENERATED.fullmatch(code.co_filename)
    if generated is not None:
        return generated["file"], int(generated["line"])
    return code.co_filename, code.co_firstlineno


def _has_children(module: Any) -> bool:
    """Whether a module holds child modules (``_modules``; true where that cannot be read)."""
    try:
        return bool(module._modules)
    except Exception:  # noqa: BLE001 - a module that reads its attributes oddly: as one with layers
        return True


def _parameter_count(module: Any) -> int:
    """The module's parameter count (0 where it cannot be read), counted outside any JIT trace."""
    try:
        return int(_untraced(lambda m: sum(int(p.numel()) for p in m.parameters()), module))
    except Exception:
        return 0


def _functions_of(module: types.ModuleType) -> Iterator[types.FunctionType]:
    """The functions a module defines (unwrapped from caches and other decorators), its
    classes' methods and properties included."""
    for value in vars(module).values():
        value = getattr(value, "__wrapped__", value)
        if getattr(value, "__module__", None) != module.__name__:
            continue
        if isinstance(value, types.FunctionType):
            yield value
        elif isinstance(value, type):
            for attr in vars(value).values():
                fn = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
                fn = getattr(fn, "__wrapped__", fn)
                if isinstance(fn, types.FunctionType):
                    yield fn


#: The names of the functions among ``dynamo_skipped_code``'s that call the program's code
#: (``Module.__call__``'s wrappers, a lazily imported module's body): only their own frame is
#: skipped, so TorchDynamo still meets the ``forward`` and module code they run.
CALLS_PROGRAM = frozenset({"__call__", "bound_call", "exec_module"})


def dynamo_skipped_code() -> list[tuple[CodeType, bool]]:
    """The code objects of mltrace's functions that run on a module call or inside one (this
    module's, the layer configuration's, the call-site lookup's, the recorder's, the clock's, the
    torch range counter's and the import hook's), nested functions and generator expressions
    included, each with whether what it calls is skipped too (all but ``CALLS_PROGRAM``): what
    TorchDynamo is told never to compile. Skipping the callees keeps mltrace's own work at a
    model call's end (listeners, cycle switches, the standard library under them) out of
    TorchDynamo's frame counts inside a compiled region, as it is without mltrace."""
    from mltrace.tracer import callsite, clock, recorder
    from mltrace.tracer.sources import _imports, torch_layer_config, torch_open_ranges

    modules = (sys.modules[__name__], torch_layer_config, callsite, clock, recorder, torch_open_ranges, _imports)
    pending = [fn.__code__ for module in modules for fn in _functions_of(module)]
    found: list[tuple[CodeType, bool]] = []
    while pending:
        code = pending.pop()
        found.append((code, code.co_name not in CALLS_PROGRAM))
        pending.extend(c for c in code.co_consts if isinstance(c, CodeType))
    return found


def _recursive_skip(eval_frame: Any) -> Callable[[CodeType], None] | None:
    """A function that has TorchDynamo run a code object and everything it calls as they are
    (``set_code_exec_strategy`` with a recursive skip), or None where this torch has none."""
    set_strategy = getattr(eval_frame, "set_code_exec_strategy", None)
    types_module = sys.modules.get("torch._dynamo.types")
    action = getattr(types_module, "FrameAction", None)
    strategy = getattr(types_module, "FrameExecStrategy", None)
    if not callable(set_strategy) or action is None or strategy is None or not hasattr(action, "SKIP"):
        return None
    skip_all = strategy(action.SKIP, action.SKIP)
    return lambda code: set_strategy(code, skip_all)


def _stands_for(wrapper: Any, original: Any) -> None:
    """Gives a ``Module.__call__`` wrapper the replaced function's names, and the function as
    ``__wrapped__``, which ``inspect.signature`` follows: introspection of a module sees torch's
    ``__call__`` (the C hot path's object answers the same)."""
    for name in ("__name__", "__qualname__", "__doc__"):
        value = getattr(original, name, None)
        if value is not None:
            setattr(wrapper, name, value)
    wrapper.__wrapped__ = original


def compiling_probe() -> Callable[[], bool]:
    """``torch.compiler.is_compiling`` (true while TorchDynamo traces or torch.export captures),
    or a function that is always false where this torch has none. The flag is one for the whole
    process: ``thread_compiling_probe`` tells whether this thread compiles."""
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    probe: Callable[[], bool] = getattr(compiler, "is_compiling", lambda: False)
    return probe


def _tracing_context_getter() -> Callable[[], Any] | None:
    """``torch._guards.TracingContext.try_get`` (this thread's tracing context, or None), or None
    where this torch has none."""
    guards = sys.modules.get("torch._guards")
    if guards is None:
        try:
            import torch._guards as guards
        except ImportError:
            return None
    try_get = getattr(getattr(guards, "TracingContext", None), "try_get", None)
    return try_get if callable(try_get) else None


def thread_compiling_probe() -> Callable[[], bool]:
    """A function that is true where the calling code is compiled: while TorchDynamo traces it
    (``torch.compiler.is_dynamo_compiling``, which Dynamo reads as true and which is false when
    the code runs), or while torch.export captures on this thread (``is_compiling`` with this
    thread's ``torch._guards.TracingContext``). Model calls of other threads meanwhile are
    recorded: ``is_compiling`` alone is true on every thread."""
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    dynamo: Callable[[], bool] | None = getattr(compiler, "is_dynamo_compiling", None)
    try_get = _tracing_context_getter()
    if dynamo is None or try_get is None:
        return compiling_probe()
    process_wide = compiling_probe()

    def compiling() -> bool:
        return dynamo() or (process_wide() and try_get() is not None)

    return compiling


def dynamo_tracing_probe() -> Callable[[], bool] | None:
    """A function that is true while TorchDynamo traces a program (``torch._guards.TracingContext``)
    or torch.export captures one (``torch.compiler.is_compiling``), or None where this torch has
    neither. While it is true, ``nn.Module.__call__`` read from a subclass is torch's own, which
    Dynamo inlines into the graph it builds (the layer level's C function would make it break the
    graph at every submodule call), and read from a module it is ``nn.Module.__call__`` itself;
    calls still go through ours."""
    try_get = _tracing_context_getter()
    if try_get is None:
        return None
    is_compiling = compiling_probe()

    def tracing() -> bool:
        return is_compiling() or try_get() is not None

    return tracing


def fx_node_modules(module: Any) -> dict[str, Any] | None:
    """The op nodes of a GraphModule and the modules each came from, or None where its nodes
    carry no ``nn_module_stack`` (a graph not made by torch.export or Dynamo):
    ``{"modules": [[path, class name, file, line], …], "nodes": [[op name, [module index, …]], …]}``,
    the op name as the profiler names the op (``aten::conv2d``), the modules outermost first
    (the model itself left out), each with the line of model code that called it where the
    first of its nodes' ``stack_trace`` says it (``_module_sites``; else None, None)."""
    modules: list[list[Any]] = []
    index: dict[tuple[str, str], int] = {}
    nodes: list[list[Any]] = []
    seen_stack = False
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(getattr(node.target, "_schema", None), "name", None)
        stack = node.meta.get("nn_module_stack")
        if not isinstance(name, str):
            continue
        chain = []
        for entry in (stack or {}).values():
            path, cls = (entry[0], entry[1]) if isinstance(entry, tuple) and len(entry) >= 2 else ("", "")
            if not path:
                continue
            key = (str(path).removeprefix("L['self']."), _short_class_name(cls))
            if key not in index:
                index[key] = len(modules)
                modules.append([key[0], key[1], None, None])
            chain.append(index[key])
        seen_stack = seen_stack or bool(stack)
        nodes.append([name, chain])
        for at, site in zip(chain, _module_sites(node.meta.get("stack_trace"), len(chain))):
            if modules[at][2] is None and site is not None:
                modules[at][2:] = list(site)
    return {"modules": modules, "nodes": nodes} if seen_stack else None


def _short_class_name(cls: object) -> str:
    """A class as ``nn_module_stack`` names it (a qualified name, or the class in older torch),
    without its module: ``__main__.Net`` → ``Net``."""
    return str(getattr(cls, "__name__", cls)).rsplit(".", 1)[-1]


def exported_class_name(module: Any) -> str | None:
    """The class of the model that ``torch.export`` exported, for a GraphModule it made
    (``ep.module()``): the root entry (path ``""``) that each node's ``nn_module_stack``
    starts with. None where a node's stack starts elsewhere, where the entries name more
    than one class, or where no node carries a stack (``torch.fx.symbolic_trace`` names its
    GraphModule's class after the traced module itself)."""
    names: set[str] = set()
    for node in module.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        root = next(iter(stack.values()))
        if not (isinstance(root, tuple) and len(root) >= 2 and root[0] == ""):
            return None
        names.add(_short_class_name(root[1]))
    return names.pop() if len(names) == 1 else None


#: torch's own modules inside exported programs, as (module, class name): their calls are no
#: layers of the model (``GuardsFn``: the input guards that ``ep.module()``'s graph calls first).
_TORCH_OWN_MODULES = (("torch.export._unlift", "GuardsFn"),)


def torch_own_module_types() -> frozenset[type]:
    """The classes of ``_TORCH_OWN_MODULES`` among the modules imported so far."""
    found = (getattr(sys.modules.get(module), name, None) for module, name in _TORCH_OWN_MODULES)
    return frozenset(cls for cls in found if isinstance(cls, type))


def compiler_graph_type() -> type | None:
    """torch.fx's ``GraphModule``, once AOTAutograd is imported: the class of the graphs that
    ``torch.compile``'s AOT backends (``aot_eager``) call as modules inside a compiled
    ``forward``; None before (a program that compiles nothing through AOTAutograd)."""
    if "torch._functorch.aot_autograd" not in sys.modules:
        return None
    found = getattr(sys.modules.get("torch.fx"), "GraphModule", None)
    return found if isinstance(found, type) else None


def optimized_module_type() -> type | None:
    """torch.compile's module wrapper class (``OptimizedModule``), once TorchDynamo is imported."""
    found = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    return found if isinstance(found, type) else None


class ModelNames:
    """Names the module of an outermost call as its model spans are named (``name``), for the
    tracer and for ``mltrace.bench``'s plain timings alike, so that the two match."""

    def __init__(self, module_cls: Any = ()) -> None:
        #: torch.nn.Module (an empty tuple, which nothing is an instance of, until torch is imported).
        self.module_cls = module_cls
        self._roots: dict[int, tuple[weakref.ref[Any], dict[int, str]]] = {}
        #: A model name → the structure of the first module named so (``_structure``), and that module.
        self._structures: dict[str, tuple[int, int]] = {}
        self._firsts: dict[str, weakref.ref[Any]] = {}

    def root_name(self, root: Any, module: Any) -> str | None:
        """``module``'s path inside ``root`` (``named_modules``' first name), or None."""
        entry = self._roots.get(id(root))
        if entry is None or entry[0]() is not root or id(module) not in entry[1]:
            names: dict[int, str] = {}
            for n, m in root.named_modules(remove_duplicate=False):
                names.setdefault(id(m), n)
            entry = (weakref.ref(root), names)
            self._roots[id(root)] = entry
        return entry[1].get(id(module))

    def name(self, module: Any, frame: Any) -> str:
        """The name of a module's model spans, called from ``frame``: its class's; or, where a
        method of a module that holds it makes the outermost call (a VAE's ``decode`` calling
        ``self.fc3``, a generate loop calling ``self.encoder``), that module's class and the path
        to it there (``VAE.fc3``), so that two such submodules of one class are two models. A
        program that builds a new model per request still has one model. A ``torch.compile``
        wrapper (``OptimizedModule``) is named after the module it compiled (``GPT2LMHeadModel
        (compiled)``): two compiled models are two models, and apart from their eager calls; so
        are a TorchScript module (scripted, traced or frozen: ``MLP (TorchScript)``) and an
        exported program's module (``torch.export``'s ``.module()``: ``Net (exported)``). A module
        named as an earlier one of another structure is told apart (``_apart``)."""
        caller = frame
        for _ in range(_HOLDER_FRAMES):
            if frame is None:
                break
            code = frame.f_code
            holder = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
            if holder is not module and isinstance(holder, self.module_cls):
                path = self.root_name(holder, module)
                if path:
                    return f"{_type_name(holder)}.{path}"
            frame = frame.f_back
        optimized = optimized_module_type()
        if optimized is not None and isinstance(module, optimized):
            inner = getattr(module, "_orig_mod", None)
            if isinstance(inner, self.module_cls):
                return self._apart(f"{_type_name(inner)} (compiled)", module, caller)
        return self._apart(_type_name(module) + _form_suffix(module), module, caller)

    def _apart(self, name: str, module: Any, frame: Any) -> str:
        """``name``, where the first module named so has ``module``'s structure (parameters and
        submodules: a program that builds a new model per request still has one model); else,
        for a submodule of that first module called on its own, ``name`` and its path there
        (``Sequential.1``); else ``name`` and the variable the calling line holds ``module`` in
        (``Sequential (dec)``, an encoder and a decoder built as two ``nn.Sequential``), or its
        parameter count."""
        structure = _structure(module)
        if self._structures.setdefault(name, structure) == structure:
            self._firsts.setdefault(name, weakref.ref(module))
            return name
        first = self._firsts.get(name)
        root = first() if first is not None else None
        path = self.root_name(root, module) if root is not None and root is not module else None
        if path:
            return f"{name}.{path}"
        label = _variable_name(module, frame) or f"{structure[0]:,} parameters"
        return f"{name} ({label})"


def _structure(module: Any) -> tuple[int, int]:
    """A module's parameter count and number of modules (itself included): what tells two
    models of one class apart; (0, 0) where they cannot be read."""
    try:
        return _parameter_count(module), sum(1 for _ in module.modules())
    except Exception:  # noqa: BLE001 - a name, never an error of the program
        return 0, 0


def _variable_name(module: Any, frame: Any) -> str | None:
    """The name the line that called ``module`` holds it in (the innermost frame from ``frame``
    outwards that is model code, not a framework's wrapper such as torch.fx's ``__call__``),
    among its local and then its global variables (the first in sorted order, names without a
    leading ``_`` first); None where it holds it in none."""
    for _ in range(_HOLDER_FRAMES):
        if frame is None or is_model_code(frame.f_code.co_filename):
            break
        frame = frame.f_back
    for scope in (frame.f_locals, frame.f_globals) if frame is not None else ():
        names = sorted((k for k, v in list(scope.items()) if v is module and isinstance(k, str)), key=lambda k: (k.startswith("_"), k))
        if names:
            return names[0]
    return None


def _form_suffix(module: Any) -> str:
    """What a model name adds for a module that runs its model in another form than its eager
    ``forward``: for a TorchScript module (a ``ScriptModule``) `` (TorchScript)`` where
    ``torch.jit.script`` made it, `` (TorchScript, traced)`` where ``torch.jit.trace`` did (a
    ``TracedModule``: one recorded path) and `` (TorchScript, frozen)`` where ``torch.jit.freeze``
    did (its attributes, ``training`` among them, folded into the graph: no ``training`` left);
    `` (exported)`` for an exported program's module (a ``GraphModule`` whose graph names the
    exported class, ``exported_class_name``), `` (fx)`` for a ``GraphModule`` whose class
    ``torch.fx.symbolic_trace`` named after the traced module's (its graph may since have
    been changed: FX passes, quantization); else ``""``. The three TorchScript forms run
    different graphs, so the same class in two of them is two models."""
    jit = sys.modules.get("torch.jit")
    script_module = getattr(jit, "ScriptModule", None)
    if isinstance(script_module, type) and isinstance(module, script_module):
        traced_module = getattr(jit, "TracedModule", None)
        if isinstance(traced_module, type) and isinstance(module, traced_module):
            return " (TorchScript, traced)"
        if not _has_training_attribute(module):
            return " (TorchScript, frozen)"
        return " (TorchScript)"
    graph_module = getattr(sys.modules.get("torch.fx"), "GraphModule", None)
    if isinstance(graph_module, type) and isinstance(module, graph_module):
        if type(module).__name__ == "GraphModule":
            return " (exported)" if exported_class_name(module) else ""
        return " (fx)"  # torch.fx.symbolic_trace names the GraphModule's class after the traced one
    return ""


def _has_training_attribute(module: Any) -> bool:
    """Whether a TorchScript module still has its ``training`` attribute (``torch.jit.freeze``
    folds it away with the others); True where it cannot be told."""
    try:
        return bool(module._c.hasattr("training"))
    except Exception:  # noqa: BLE001 - another torch: say not frozen
        return True


_TRACE_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)', re.MULTILINE)


def _module_sites(stack_trace: object, depth: int) -> list[tuple[str, int] | None]:
    """For a node ``depth`` modules deep, the line of model code that called each module
    (outermost first), from the node's ``stack_trace`` (the frames from the model's
    ``forward`` in, one ``forward`` per module): the innermost model-code frame before the
    module's own ``forward``. None for each where the frames do not show it."""
    if not isinstance(stack_trace, str):
        return [None] * depth
    frames = [(path, int(line), func) for path, line, func in _TRACE_FRAME.findall(stack_trace)]
    forwards = [i for i, (_, _, func) in enumerate(frames) if func == "forward"]
    if len(forwards) != depth + 1:
        return [None] * depth
    sites: list[tuple[str, int] | None] = []
    for j in range(depth):
        before = [(path, line) for path, line, _ in frames[: forwards[j + 1]] if is_model_code(path)]
        sites.append(before[-1] if before else None)
    return sites


#: ``MLTRACE_LAYER_HOT_PATH=python`` keeps the layer level's hot path in Python (the C helper is the default where built).
HOT_PATH_ENV = LAYER_HOT_PATH.name
#: The attribute that says what region of the program a user-level span is; a loss module
#: (``torch.nn.modules.loss._Loss``) called outermost is the ``LOSS_REGION`` of the training step:
#: a user-level span, not a model call (no model of the report, no kinds of call, no cold rule).
REGION_ATTR = "ml.region"
#: The attribute of a model call made while a JIT trace was recorded (``torch.jit.trace``, the
#: TorchScript ONNX exporter): it records a graph, one-time work (``analysis.coldstart``).
JIT_TRACE_ATTR = "ml.jit.trace"
LOSS_REGION = "loss"


# One module call on a thread's stack: a list, indexed by these slots.
# Layer frames are made by the hot path as ``[module, parent, id, start, -1,
# in, None, None, None, None, site]``; the model frame (the outermost call) also holds its
# Span (slot SPAN), has no parent, and its KID is set when it is made. KID (the
# frame's ``_Kid``: path, facts, attributes) and ROOT (the model frame) are
# filled in by the drain (``_place``), never by the traced program. SITE is the
# layer call's call site, ``(code object, instruction offset)`` of the innermost
# Python frame outside the frameworks (``_site_of``), or None.
MODULE, PARENT, ID, START, END, IN, OUT, KID, ROOT, SPAN, SITE = range(11)

#: What the drain caches per (parent module, parent path, child): the child's
#: path, its facts (whose weak reference identifies the child), the attributes
#: every span of it starts from, and the same two encoded for an events.jsonl
#: span row (the path as a JSON string; the attributes as a JSON object without
#: its closing brace), or None where never encoded (the model frame).
_Kid = tuple[str, "_Static", "dict[str, Any]", "str | None", "str | None"]

#: Converted (shape, dtype) pairs kept at most; the cache starts over beyond.
_SHAPE_CACHE_MAX = 4096
#: Code objects whose owner (the program, or a framework) ``_site_of`` remembers, and call sites, at most.
_CODE_CACHE_MAX = 4096
#: The frames outwards of a new model's first call that ``ModelNames.name`` looks at for a module
#: holding it.
_HOLDER_FRAMES = 8
log = logging.getLogger("mltrace")

#: Span templates remembered at most (``_encode_frames``); the cache starts over beyond.
_TEMPLATE_CACHE_MAX = 4096
#: Frames the C encoder takes in one call: it gives up the GIL while it formats each such chunk
#: (``_encode_chunks``), so the program's thread never waits on a whole flush at once.
_ENCODE_CHUNK = 256


def _nothing_with(_: object) -> None:
    """Does nothing with its argument."""


def _nothing() -> None:
    """Does nothing (the Python encoder caches no template ids by address)."""


def _type_name(module: Any) -> str:
    """A module's class name; a TorchScript module's is the scripted or traced class's (torch's
    wrapper class names them all ``RecursiveScriptModule``), and an exported program's
    (``torch.export``'s ``.module()``, a ``GraphModule``) the exported class's where its graph
    names it (``exported_class_name``)."""
    name = type(module).__name__
    if isinstance(getattr(type(module), "original_name", None), property):
        return str(module.original_name or name)
    if name == "GraphModule":
        graph_module = getattr(sys.modules.get("torch.fx"), "GraphModule", None)
        if graph_module is not None and isinstance(module, graph_module):
            return exported_class_name(module) or name
    return name


#: The package of torch.nn's layer classes (``torch.nn.modules.linear``).
_TORCH_NN = "torch.nn.modules."


def torch_nn_base(cls: type) -> str | None:
    """The name of the nearest ``torch.nn`` layer class that ``cls`` derives from, where ``cls``
    is not one of torch.nn's own (``WhisperPositionalEmbedding`` → ``Embedding``, a timm
    ``StdConv2d`` → ``Conv2d``); None where it derives from ``Module`` alone or is torch.nn's."""
    if str(getattr(cls, "__module__", "")).startswith(_TORCH_NN):
        return None
    for base in cls.__mro__[1:]:
        if str(getattr(base, "__module__", "")).startswith(_TORCH_NN) and base.__name__ != "Module":
            return base.__name__
    return None


class _Static:
    """Per-module facts computed once: type, parameters, class source location, and the name
    of its model spans (``model_name``, at its first outermost call)."""

    __slots__ = ("ref", "type_name", "attrs", "kids", "model_name", "loss")

    def __init__(self, module: Any, params: int, file: str | None, line: int | None) -> None:
        self.ref = weakref.ref(module)
        #: (this module's path, id(child)) → the child's cache entry, for calls made from this module.
        self.kids: dict[tuple[str, int], _Kid] = {}
        self.type_name = _type_name(module)
        self.model_name: str | None = None
        #: Whether the module is a loss (``torch.nn.modules.loss._Loss``): called outermost, a
        #: region of the training step (``LOSS_REGION``), not a model.
        self.loss = False
        self.attrs: dict[str, Any] = {
            "ml.framework": "pytorch",
            "ml.layer.type": self.type_name,
            "ml.layer.params": params,
        }
        base = torch_nn_base(type(module))
        if base is not None:
            self.attrs["ml.layer.base_type"] = base
        if file is not None:
            self.attrs["ml.defined.file.path"] = file
            self.attrs["ml.defined.line.number"] = line
            self.attrs["ml.defined.function.name"] = f"{self.type_name}.forward"


class TorchModuleSource(Source):
    """Model and layer spans for PyTorch (``torch.nn.Module``)."""

    name = "torch.modules"
    levels: tuple[Level, ...] = (Level.MODEL, Level.LAYER)

    def __init__(self) -> None:
        self._tls = threading.local()
        self._handles: list[Any] = []
        self._wrapped: tuple[Any, Any, Any] | None = None
        #: The layer level's Python wrapper (installed itself where the C helper is not).
        self.python_call: Any = None
        self._import_hook: PostImportHook | None = None
        self._dynamo_hook: PostImportHook | None = None
        #: torch.compile's module wrapper class (``OptimizedModule``) once TorchDynamo is imported.
        self._optimized: list[type | None] = [None]
        self._session: SessionView | None = None
        self._static: dict[int, _Static] = {}
        self._children: dict[int, tuple[weakref.ref[Any], dict[int, str | None]]] = {}
        self._names = ModelNames()
        self._class_loc: dict[type, tuple[str | None, int | None]] = {}
        self._dtype_names: dict[Any, str] = {}
        self._shape_cache: dict[Any, tuple[list[list[int]], list[str]]] = {}
        self._in_json: dict[Any, str] = {}
        self._out_json: dict[Any, str] = {}
        #: Span templates written so far (``_encode_frames``): (path, attributes, input, output encodings) → id.
        self._templates: dict[tuple[str | None, str | None, str, str, str], int] = {}
        self._template_ids = itertools.count(1)
        self._encode_rows: Callable[..., tuple[bytes, bytes]] | None = None  # the C helper's, where it is used
        self._take_frames: Callable[[deque[Any]], list[Any]] = take_all  # the C helper's take_frames where built
        self._forget_templates: Callable[[], None] = _nothing
        #: ``_finish`` bound once: every model span holds it, and a bound method a call would be
        #: one more object for the program's garbage collector until the span is drained.
        self._finish_span: Callable[[Span], None] = self._finish
        untrack = c_helper("_untrack", SPAN_UNTRACK)
        #: Takes a model call's frame out of the cyclic garbage collector: its layer calls'
        #: frames keep it until the flusher drains them (``_untrack.c``).
        self._untrack_record: Callable[[list[Any]], None] = untrack.untrack_record if untrack is not None else _nothing_with
        self._clear_caches: Callable[[], None] = lambda: None  # the C helper's, where it is used
        #: id(model) → its invocation counter (a model call takes the next number).
        self._invocations: dict[int, Iterator[int]] = {}
        #: Code objects seen by ``_site_of`` → whether they belong to a framework (``framework_dirs``).
        self._internal_code: dict[CodeType, bool] = {}
        #: The same, read by ``_site_of`` without hashing the code object.
        self._owners: CodeKeyed[bool] = CodeKeyed(_CODE_CACHE_MAX)
        #: (code object, instruction offset) of a call site → its file, line and function.
        self._sites: CodeKeyed[tuple[str, int, str]] = CodeKeyed(_CODE_CACHE_MAX)
        #: The same → its ``code.*`` attributes as the tail of a JSON object (``_site_json``).
        self._site_texts: CodeKeyed[str] = CodeKeyed(_CODE_CACHE_MAX)
        #: Module classes ``_note_opaque`` found nothing to say about.
        self._see_through: set[type] = set()
        #: Hugging Face generate() calls as spans; the model calls inside them tagged.
        self._generate = GenerateSpans()
        #: The classes of torch's own modules in exported programs imported so far (``_without_torch_own``).
        self._torch_own: frozenset[type] = frozenset()
        #: Module class → whether its calls are layers, for ``_without_torch_own`` once a compiler
        #: graph may be called (``compiler_graph_type``); False for those graphs' classes.
        self._layer_types: dict[type, bool] = {}
        #: id(GraphModule) → (weak reference, its graph id) for ``_note_fx_graph``.
        self._fx_graphs: dict[int, tuple[weakref.ref[Any], int]] = {}
        self._torch_dir = ""
        self._tensor: Any = object
        self._module_cls: Any = ()  # torch.nn.Module once torch is imported
        self._loss_cls: Any = ()  # torch.nn.modules.loss._Loss once torch is imported
        #: torch.is_grad_enabled once torch is imported (``ml.grad.enabled`` of a model call).
        self._grad_enabled: Callable[[], Any] = _nothing
        #: Whether a JIT trace is being recorded on this thread once torch is imported
        #: (``ml.jit.trace`` of a model call).
        self._jit_tracing: Callable[[], bool] = bool
        self._script_module: type | None = None
        self._lock = threading.Lock()
        #: Completed layer frames, waiting for the recorder's next drain.
        self._frames: deque[list[Any]] = deque()
        #: Every thread's frame stack (by thread ident), for frames still open at stop.
        self._stacks: dict[int, list[list[Any]]] = {}
        #: Frames ended as truncated at stop: their late completion is not recorded twice.
        self._truncated: set[int] = set()
        #: Model frames (by thread ident) of the calls in flight when the layer level ended early,
        #: until each returns: their nested calls still get layer spans (``end_layer_level``).
        self._late: dict[int, list[Any]] = {}
        self._full = False  # the trace is full (``end_recording``)
        #: Outermost module calls on torch.fx proxies (``_call_symbolic``), left out of the run.
        self._symbolic_calls = 0
        #: Whether a call's arguments hold a torch.fx proxy (``fx_proxy_check``, once torch is imported).
        self._holds_proxy: Callable[[tuple[Any, ...], dict[str, Any]], bool] = lambda args, kwargs: False

    def available(self) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed"
        return None

    def start(self, session: SessionView) -> None:
        self._session = session
        self._record_layers = Level.LAYER in session.levels
        self._begin = session.recorder.begin
        self._end = session.recorder.end
        session.recorder.add_producer(self._drain_frames, self._encode_frames)
        session.recorder.set_innermost(self._innermost_id)
        self._import_hook = PostImportHook("torch", self._install)
        self._generate.start(session)

    def _install(self, torch: Any) -> None:
        if self._full:
            return
        from torch.nn.modules import module as module_mod

        self._tensor = torch.Tensor
        self._holds_proxy = fx_proxy_check()
        self._module_cls = self._names.module_cls = torch.nn.Module
        self._loss_cls = getattr(getattr(torch.nn.modules, "loss", None), "_Loss", ())
        self._grad_enabled = torch.is_grad_enabled
        self._jit_tracing = jit_tracing_probe()
        self._torch_dir = os.path.dirname(torch.__file__)
        self._skip_in_dynamo()
        self._script_module = getattr(torch.jit, "ScriptModule", None)
        if TORCH_HOOKS.is_set_to("global"):  # the older mechanism, kept for comparison
            if not self._record_layers:
                self._wrap_call(torch.nn.Module)
                return
            self._handles.append(module_mod.register_module_forward_pre_hook(self._pre))
            self._handles.append(module_mod.register_module_forward_hook(self._post, always_call=True))
            return
        if self._record_layers:
            self._wrap_call_layers(torch.nn.Module)
        else:
            self._wrap_call(torch.nn.Module)

    def _wrap_call_layers(self, module_cls: Any) -> None:
        """Model and layer levels: one span per module call from a ``Module.__call__`` wrapper.

        Torch's global forward hooks would also see every call, but they route
        every module call through torch's slower hooked path (≈ 2 µs a call on
        top of the hooks themselves). The wrapper closes the frame in
        ``finally``, so exceptions and interrupts inside a layer end it too.

        This is the hot path of the layer level (one call per ``nn.Module``
        call, ~80 per inference of a ResNet-18), and inside a model its cost is
        about three times what a tight loop measures, because the convolutions
        in between evict its data from the caches. So a layer call does the
        least it can: one list (the frame) with the module, its parent frame,
        an id, two clock reads and the raw shapes, pushed on the thread's stack
        and handed to a deque when it ends (the C helper's frame is a ``LayerFrame``,
        which reads as the same list, see ``_layercall.c``). No Span object, attribute dict,
        ``current_span`` switch or path lookup: ``_drain_frames`` derives all of
        that in the flusher (benchmarks/overhead.py --mode layer-paired). The
        outermost (model) call goes through ``_model_begin`` and
        ``Recorder.end`` as any span does.
        """
        assert self._session is not None
        original = module_cls.__call__
        direct = calls_impl_directly(module_cls, original)
        tls = self._tls
        new_stack = self._new_stack
        raw_shapes = self._raw_shapes
        model_begin = self._model_begin
        model_ended = self._model_ended
        end = self._end
        tensor = self._tensor
        next_id = self._session.recorder._ids.__next__
        append_frame = self._frames.append
        clock = now_ns
        usage = thread_usage
        site_of = self._site_of
        _getframe = sys._getframe
        compiling = thread_compiling_probe()
        jit_tracing = jit_tracing_probe()
        optimized = self._optimized
        holds_proxy = self._holds_proxy
        call_symbolic = self._call_symbolic

        # Its module is ``self``, as in torch's own __call__: with_stack's Python tracer reads the
        # ``self`` of every frame of ``Module.__call__.__code__`` (it crashed on ``module``).
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 - replaces Module.__call__
            if compiling():  # TorchDynamo inlines this function: it must see torch's own call only
                return original(self, *args, **kwargs)
            try:
                stack = tls.stack
            except AttributeError:
                stack = new_stack()
            if not stack:  # the outermost call on this thread: the model span
                if getattr(tls, "symbolic", False) or holds_proxy(args, kwargs):  # records an fx graph (_call_symbolic)
                    return call_symbolic(original, self, args, kwargs)
                frame = model_begin(self, args, stack, kwargs)
                span = frame[SPAN]
                output = None
                try:
                    output = original(self, *args, **kwargs)
                    return output
                except BaseException as exc:  # a call that raised: marked, as a user span is
                    span.attrs["error.type"] = type(exc).__name__
                    raise
                finally:
                    span.attrs["_cpu1"] = usage()
                    while stack and stack.pop() is not frame:
                        pass
                    if output is not None:
                        span.attrs["_out"] = _untraced(raw_shapes, output)
                    end(span)
                    model_ended(span)
            if type(stack[-1][MODULE]) is optimized[0]:  # torch.compile's wrapper calls its module: one span
                return original(self, *args, **kwargs)
            traced = jit_tracing()  # inside a JIT trace a shape read adds nodes to the program's graph
            if traced:
                shapes_in = _untraced(raw_shapes, args) if args else None
            elif args:
                # One plain tensor is the common case: skip the generic walk and
                # keep the bare (shape, dtype) pair (``_converted`` reads both forms).
                first = args[0]
                try:
                    shapes_in = (first.shape, first.dtype) if type(first) is tensor and len(args) == 1 else raw_shapes(args)
                except RuntimeError:  # a nested tensor has no shape (TransformerEncoder's fast path)
                    shapes_in = None
            else:
                shapes_in = None
            frame = [self, stack[-1], next_id(), clock(), -1, shapes_in, None, None, None, None, site_of(_getframe(1))]
            stack.append(frame)
            output = None
            try:
                if direct and self._compiled_call_impl is None:  # what original would do, a frame less
                    output = self._call_impl(*args, **kwargs)
                else:
                    output = original(self, *args, **kwargs)
                return output
            finally:
                frame[END] = clock()
                # try/finally keeps calls strictly nested: the top frame is ours.
                while stack and stack.pop() is not frame:
                    pass
                if output is not None and traced:
                    frame[OUT] = _untraced(raw_shapes, output)
                elif output is not None:
                    try:
                        frame[OUT] = (output.shape, output.dtype) if type(output) is tensor else raw_shapes(output)
                    except RuntimeError:  # a nested tensor has no shape
                        pass
                append_frame(frame)

        _stands_for(__call__, original)
        self.python_call = __call__  # also what the C helper calls for a thread's outermost call
        native = self._native_call(module_cls, original, __call__, direct)
        installed = __call__ if native is None else native
        self._wrapped = (module_cls, original, installed)
        module_cls.__call__ = installed

    def _native_call(self, module_cls: Any, original: Any, outer: Any, direct: bool) -> Any:
        """The C hot path (``_layercall.LayerCall``) for ``module_cls.__call__``, or None where it
        is not used (``_native_layer_call``). A thread's outermost call goes to ``outer`` (the
        Python wrapper, which opens the model span); nested calls push layer frames."""
        assert self._session is not None
        native = self._native_layer_call()
        if native is None:
            return None
        # The same frames from C for nested calls (14–39 % less layer-level overhead than
        # the Python wrapper in paired runs on the example CNN, PERFORMANCE.md).
        tls = self._tls
        compiling = thread_compiling_probe()
        optimized = self._optimized
        checked = forward_check(module_cls) if direct else None
        self._session.meta.setdefault("sources", {}).setdefault(self.name, {})["layer_forward_direct"] = checked is not None
        native_call: list[Any] = []

        def bound_call(module: Any, *args: Any, **kwargs: Any) -> Any:
            """``module.__call__`` read from an instance (torch.compile keeps it as what it
            compiles): the C hot path, or torch's own while TorchDynamo traces it or when
            torch.compile's wrapper calls it (the compiled call is the wrapper's span)."""
            stack = getattr(tls, "stack", None)
            if compiling() or (stack and type(stack[-1][MODULE]) is optimized[0]):  # compiled: one span
                return original(module, *args, **kwargs)
            return native_call[0](module, *args, **kwargs)

        installed = native(
            tls,
            self._new_stack,
            outer,
            self._raw_shapes,
            self._tensor,
            self._session.recorder._ids.__next__,
            self._frames.append,
            original,
            direct,
            checked,
            self._internal_code,
            self._is_framework_code,
            dynamo_tracing_probe(),
            bound_call,
            module_cls,
            lambda value: _untraced(self._raw_shapes, value),
        )
        native_call.append(installed)
        return installed

    def _native_layer_call(self) -> Any:
        """The C hot path's type (``mltrace._layercall.LayerCall``), or None: not built, or
        ``MLTRACE_LAYER_HOT_PATH=python``. Which one runs is written to run.json; the drain
        encodes rows in C (``encode_rows``) exactly when the hot path is C."""
        info = self._session.meta.setdefault("sources", {}).setdefault(self.name, {}) if self._session else {}
        if (LAYER_HOT_PATH.get() or "").strip().lower() == "python":
            info["layer_hot_path"] = f"python ({HOT_PATH_ENV}=python)"
            return None
        try:
            from mltrace._layercall import LayerCall, clear_caches, encode_rows, forget_templates, take_frames
        except ImportError as exc:
            info["layer_hot_path"] = f"python (the C helper is not built: {exc})"
            return None
        info["layer_hot_path"] = "c"
        info["jit_tracing_check"] = "libtorch" if _bind_libtorch_tracing_state() else "torch._C"
        self._encode_rows = encode_rows
        self._take_frames = take_frames
        self._forget_templates = forget_templates
        self._clear_caches = clear_caches
        clear_caches()  # the encoder's process-wide caches start empty for each session
        return LayerCall

    def _wrap_call(self, module_cls: Any, original: Any = None, layer_call: Any = None) -> None:
        """Model level only: wrap ``Module.__call__`` instead of installing global hooks.

        Global hooks send every module call down torch's slower hooked path
        (+14 % on a MobileNet-style CNN with 231 module calls); the wrapper times
        the outermost call per thread and lets nested calls through untouched.

        Where the layer level ends early, ``original`` is torch's own ``__call__``
        (ours is installed already) and ``layer_call`` the layer level's wrapper:
        nested calls of the model calls still running then (``_late``) go to it,
        so that every model call has all its layer spans or none.
        """
        if original is None:
            original = module_cls.__call__
        direct = calls_impl_directly(module_cls, original)
        tls = self._tls
        new_stack = self._new_stack
        model_begin = self._model_begin
        post = self._post
        late = self._late
        get_ident = threading.get_ident
        compiling = thread_compiling_probe()
        holds_proxy = self._holds_proxy
        call_symbolic = self._call_symbolic

        # Its module is ``self``, as in torch's own __call__: with_stack's Python tracer reads the
        # ``self`` of every frame of ``Module.__call__.__code__`` (it crashed on ``module``).
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 - replaces Module.__call__
            if compiling():  # TorchDynamo inlines this function: it must see torch's own call only
                return original(self, *args, **kwargs)
            try:
                stack = tls.stack
            except AttributeError:
                stack = new_stack()
            if stack:
                if late and stack[0] is late.get(get_ident()):  # a model call from before the layer level's end
                    return layer_call(self, *args, **kwargs)
                if direct and self._compiled_call_impl is None:  # what original would do, a frame less
                    return self._call_impl(*args, **kwargs)
                return original(self, *args, **kwargs)
            if getattr(tls, "symbolic", False) or holds_proxy(args, kwargs):  # records an fx graph (_call_symbolic)
                return call_symbolic(original, self, args, kwargs)
            frame = model_begin(self, args, stack, kwargs)
            output = None
            try:
                output = original(self, *args, **kwargs)
                return output
            except BaseException as exc:  # a call that raised: marked, as a user span is
                frame[SPAN].attrs["error.type"] = type(exc).__name__
                raise
            finally:
                post(self, args, output)

        # Nested calls stay on this Python function, not the C hot path: TorchDynamo reads
        # ``nn.Module.__call__`` from the class dict where a compiled forward names it
        # (``self.sub.__call__(x)``), and it cannot trace the C object there.
        _stands_for(__call__, original)
        self._wrapped = (module_cls, original, __call__)
        module_cls.__call__ = __call__

    def end_recording(self) -> None:
        """The trace is full (``Session.full``): puts torch's own ``Module.__call__`` back, so
        that later model calls are not recorded. Calls running meanwhile finish theirs."""
        self._full = True  # a later ``import torch`` installs nothing
        if self._wrapped is None:
            return
        module_cls, original, ours = self._wrapped
        if module_cls.__call__ is not ours:
            raise RuntimeError("nn.Module.__call__ was re-wrapped by someone else; model calls go on being recorded")
        module_cls.__call__ = original
        self._wrapped = None

    def release_in_forked_child(self) -> None:
        """In a child forked while the session runs (``session._forget_in_forked_child``): puts
        torch's own ``Module.__call__`` (or no hooks) back in this process, where no flusher
        drains what the wrapper would record."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.end_recording()  # as when the trace is full; a later ``import torch`` here installs nothing

    def stop(self) -> list[Event]:
        self._note_threads()
        if self._symbolic_calls and self._session is not None:  # run.json says what was left out
            self._session.meta.setdefault("sources", {}).setdefault(self.name, {})["fx_symbolic_calls"] = self._symbolic_calls
        try:
            truncated = self._truncate_open_frames()
            for handle in self._handles:
                handle.remove()
            if self._wrapped is not None:
                module_cls, original, ours = self._wrapped
                if module_cls.__call__ is ours:
                    module_cls.__call__ = original
                elif self._session is not None:
                    self._session.note_limitation("nn.Module.__call__ was re-wrapped by someone else; mltrace's wrapper left in place")
        finally:
            self._wrapped = None
            self._handles.clear()
            self._clear_caches()  # refilled by the session's last drain at most, and emptied by the next start
            self._layer_types.clear()
            self._generate.stop()
            if self._import_hook is not None:
                self._import_hook.remove()
                self._import_hook = None
            if self._dynamo_hook is not None:
                self._dynamo_hook.remove()
                self._dynamo_hook = None
        return truncated

    def _skip_in_dynamo(self) -> None:
        """Has TorchDynamo run mltrace's own frames on the module-call path as they are, never
        compile them, once it is imported (``skip_code``; ``dynamo_skipped_code``). Compiling
        then starts at the module's ``forward``, as it does without mltrace (torch's own
        ``__call__`` is skipped the same way): a wrapper frame compiled would inline
        ``__call__`` and ``forward``, so a graph break in ``forward`` would count as one more
        break, frame and graph; and the helpers the C hot path calls would count as frames."""

        def skip(eval_frame: Any) -> None:
            self._optimized[0] = optimized_module_type()
            skip_code = getattr(eval_frame, "skip_code", None)
            skip_all = _recursive_skip(eval_frame)
            for code, with_callees in dynamo_skipped_code():
                if with_callees and skip_all is not None:
                    skip_all(code)
                elif callable(skip_code):
                    skip_code(code)

        self._dynamo_hook = PostImportHook("torch._dynamo.eval_frame", skip)

    def _truncate_open_frames(self) -> list[Event]:
        """Spans for layer calls still running at stop (on other threads), marked truncated.

        The model spans around them are open spans of the recorder, which
        ``close_open_spans`` ends. A truncated frame that completes later is
        not recorded a second time.
        """
        at = now_ns()
        spans: list[Event] = []
        for stack in list(self._stacks.values()):
            for frame in self._without_torch_own(list(stack)):
                if frame[PARENT] is None or frame[END] >= 0 or frame[ID] in self._truncated:
                    continue
                self._truncated.add(frame[ID])
                span = self._layer_span(frame)
                span.end_ns = max(at, span.start_ns)
                span.attrs["mltrace.truncated"] = True
                spans.append(span)
        return spans

    # -- frames → spans (the flusher) --------------------------------------

    def _new_stack(self) -> list[list[Any]]:
        stack: list[list[Any]] = []
        self._tls.stack = stack
        self._stacks[threading.get_ident()] = stack
        return stack

    def _innermost_id(self) -> int | None:
        """The id of the calling thread's innermost open module call (``Recorder.set_innermost``)."""
        stack = getattr(self._tls, "stack", None)
        return stack[-1][ID] if stack else None

    def earliest_open_ns(self) -> int | None:
        """The start of the earliest layer call still running on any thread (``HoldsOpenSpans``)."""
        starts = [frame[START] for stack in list(self._stacks.values()) for frame in list(stack[:1])]
        return min(starts, default=None)

    def pending_spans(self) -> int:
        """Layer frames completed and not drained yet (the session's span limit counts them)."""
        return len(self._frames)

    def _drain_frames(self) -> list[Span]:
        """Spans for the layer frames completed since the last drain (``Recorder.add_producer``)."""
        truncated = self._truncated
        spans = []
        for frame in self._without_torch_own(self._take_frames(self._frames)):
            if truncated and frame[ID] in truncated:
                continue
            spans.append(self._layer_span(frame))
        return spans

    def _without_torch_own(self, frames: list[Any]) -> list[Any]:
        """``frames`` less the calls of torch's own modules: those in exported programs
        (``_TORCH_OWN_MODULES``), and the graphs that a compiled ``forward`` calls as modules
        (an AOT backend's ``GraphModule``, which is no module of the model: ``_is_layer``). No
        layers of the model, their time stays in their parent's. Such a module calls no other
        module, so no frame kept has a dropped one as its parent. Costs nothing before torch
        defines one of them (a program that exports and compiles nothing)."""
        own = self._torch_own
        if len(own) < len(_TORCH_OWN_MODULES):
            own = self._torch_own = torch_own_module_types()
        graph = compiler_graph_type()
        if graph is None:
            return [frame for frame in frames if type(frame[MODULE]) not in own] if own else frames
        known = self._layer_types
        out = []
        for frame in frames:
            cls = type(frame[MODULE])
            keep = known.get(cls)
            if keep is None:
                keep = known[cls] = cls not in own and self._is_layer(frame, graph)
            if keep:
                out.append(frame)
        return out

    def _is_layer(self, frame: Any, graph: type) -> bool:
        """Whether a call is a layer of its model, by its module's class: every class but an fx
        ``GraphModule`` that the model does not hold (one that AOTAutograd built and a compiled
        ``forward`` calls; torch.fx gives each graph module a class of its own). A model call
        (no parent) is kept."""
        module = frame[MODULE]
        if frame[PARENT] is None or not isinstance(module, graph):
            return True
        root = frame
        while root[PARENT] is not None:
            root = root[PARENT]
        return self._names.root_name(root[MODULE], module) is not None

    def _encode_frames(self) -> tuple[bytes, bytes, int]:
        """The layer frames completed since the last drain, as encoded rows (``Recorder.add_producer``).

        The same spans ``_drain_frames`` would give, without making them (and their count). What
        every call of a layer shares (path, attributes, shapes) is a span
        template, written once (``store.encode_batch``'s ``span_templates``);
        each call's row holds its ids, times, track and template id (about 57
        bytes, against 540 with the attributes written out). Building Span
        objects, attribute dicts and shape lists for a whole flush interval made
        the cyclic garbage collector promote thousands of objects per flush, and
        the full collections that followed landed in the program's thread. The C
        helper's ``encode_rows`` does this where it is built, in chunks
        (``_encode_chunks``: the drain runs under the GIL, so its cost is the
        program's too); ``_encode_rows_python`` is the same in Python.
        """
        batch = self._without_torch_own(self._take_frames(self._frames))
        if self._truncated:
            batch = [f for f in batch if f[ID] not in self._truncated]
        level = int(Level.LAYER)
        if len(self._templates) >= _TEMPLATE_CACHE_MAX:
            self._templates.clear()  # templates already written stay valid; new ones get new ids
            self._forget_templates()
        if self._encode_rows is None:
            templates, rows = self._encode_rows_python(batch, level)
            return templates, rows, len(batch)
        return self._encode_chunks(batch, level)

    def _encode_chunks(self, batch: list[Any], level: int) -> tuple[bytes, bytes, int]:
        """``batch`` through the C encoder, ``_ENCODE_CHUNK`` frames a call. Each call gives up
        the GIL while it formats its chunk's rows (a thread waiting for it takes it at once), so
        the program's thread runs between two chunks and while rows are formatted.

        A chunk that fails ends the drain there: what the chunks before it encoded is returned
        (their templates are in ``_templates``, so their rows must reach the file), the rest
        of the batch is dropped, and the failure is logged.

        ``batch`` is emptied: each chunk's frames are freed once it is encoded, while they are
        still in the caches, and between two hand-overs of the GIL.
        """
        assert self._encode_rows is not None
        template_parts: list[bytes] = []
        row_parts: list[bytes] = []
        count = 0
        total = len(batch)
        chunks = [batch[i : i + _ENCODE_CHUNK] for i in reversed(range(0, total, _ENCODE_CHUNK))]
        batch.clear()
        while chunks:
            chunk = chunks.pop()  # the first frames first
            try:
                templates, rows = self._encode_rows(
                    chunk,
                    self._place,
                    self._shapes_json,
                    self._in_json,
                    self._out_json,
                    self._templates,
                    self._template_ids.__next__,
                    level,
                    self._site_json,
                )
            except Exception as exc:
                log.warning("mltrace: encoding layer spans failed (%d dropped): %s", total - count, exc)
                break
            if templates:
                template_parts.append(templates)
            row_parts.append(rows)
            count += len(chunk)
            del chunk  # its frames go now
        return b",".join(template_parts), b",".join(row_parts), count

    def _encode_rows_python(self, frames: list[list[Any]], level: int) -> tuple[bytes, bytes]:
        rows = []
        defs = []
        templates = self._templates
        added = []
        try:
            for frame in frames:
                kid = self._place(frame)
                raw_in = frame[IN]
                raw_out = frame[OUT]
                in_text = self._shapes_json(raw_in, self._in_json, "input") if raw_in else ""
                out_text = self._shapes_json(raw_out, self._out_json, "output") if raw_out else ""
                site = frame[SITE]
                site_text = self._site_json(*site) if site is not None else ""
                key = (kid[3], kid[4], site_text, in_text, out_text)
                tid = templates.get(key)
                if tid is None:
                    tid = templates[key] = next(self._template_ids)
                    added.append(key)
                    defs.append(f"[{tid},{kid[3]},{kid[4]}{site_text}{in_text}{out_text}}}]")
                rows.append(
                    f"[{frame[ID]},{frame[PARENT][ID]},{level},null,{frame[START]},{frame[END]},{frame[ROOT][SPAN].track_id},{{}},{tid}]"
                )
        except BaseException:
            for key in added:  # never written: later rows must not refer to them
                templates.pop(key, None)
            raise
        return ",".join(defs).encode(), ",".join(rows).encode()

    def _shapes_json(self, raw: Any, cache: dict[Any, str], kind: str) -> str:
        """``,"ml.<kind>.shapes":…,"ml.<kind>.dtypes":…`` for one raw form; the one-tensor form is cached."""
        if type(raw) is tuple:
            text = cache.get(raw)
            if text is not None:
                return text
        shapes, dtypes = self._converted(raw)
        text = f',"ml.{kind}.shapes":{store.dumps(shapes).decode()},"ml.{kind}.dtypes":{store.dumps(dtypes).decode()}'
        if type(raw) is tuple:
            if len(cache) >= _SHAPE_CACHE_MAX:
                cache.clear()
            cache[raw] = text
        return text

    def _layer_span(self, frame: list[Any]) -> Span:
        kid = self._place(frame)
        attrs = kid[2].copy()
        site = frame[SITE]
        if site is not None:
            attrs.update(self._site_attrs(*site))
        self._add_shapes(attrs, frame[IN], frame[OUT])
        return Span(frame[ID], frame[PARENT][ID], Level.LAYER, kid[0], frame[START], frame[END], frame[ROOT][SPAN].track_id, attrs)

    def _place(self, frame: list[Any]) -> _Kid:
        """The frame's cache entry (path, facts, attributes); fills in KID and ROOT up its parent chain.

        A path depends on the parent module, the parent's path and the module,
        so entries are cached in the parent's facts under (parent path,
        id(module)) and checked against the weak reference in the module's
        facts: a module that reuses a dead one's id gets its own entry.
        """
        kid: _Kid | None = frame[KID]
        if kid is not None:
            return kid
        chain = []
        known = frame
        while known[KID] is None:
            chain.append(known)
            known = known[PARENT]
        root = known if known[PARENT] is None else known[ROOT]
        parent = known
        parent_kid: _Kid = known[KID]
        for f in reversed(chain):
            module = f[MODULE]
            parent_path, parent_facts = parent_kid[0], parent_kid[1]
            key = (parent_path, id(module))
            kid = parent_facts.kids.get(key)
            if kid is None or kid[1].ref() is not module:
                facts = self._static_of(module)
                path = self._path(parent[MODULE], parent_path, module, root[MODULE])
                attrs = {**facts.attrs, "ml.layer.path": path}
                kid = (path, facts, attrs, store.dumps(path).decode(), store.dumps(attrs).decode()[:-1])
                parent_facts.kids[key] = kid
            f[KID] = kid
            f[ROOT] = root
            parent, parent_kid = f, kid
        assert kid is not None
        return kid

    # -- per-module facts ------------------------------------------------

    def _static_of(self, module: Any) -> _Static:
        info = self._static.get(id(module))
        if info is not None and info.ref() is module:
            return info
        cls = type(module)
        loc = self._class_loc.get(cls)
        if loc is None:
            # The forward() code object gives file:line for free; inspect would read the file.
            # Decorators (transformers wraps many forwards) are unwrapped to the function itself.
            code = getattr(unwrapped(getattr(cls, "forward", None)), "__code__", None)
            loc = definition_site(code) if code is not None else (None, None)
            self._class_loc[cls] = loc
        params = _parameter_count(module)
        info = _Static(module, params, loc[0], loc[1])
        try:  # constructor arguments (never weights), so DLBricks can rebuild the layer exactly
            config = layer_config(module)
        except Exception:
            config = None
        if config is not None:
            info.attrs["ml.layer.config"] = config
        info.loss = isinstance(module, self._loss_cls)
        self._static[id(module)] = info
        return info

    def _child_name(self, parent: Any, child: Any) -> str | None:
        entry = self._children.get(id(parent))
        if entry is None or entry[0]() is not parent:
            entry = (weakref.ref(parent), {})
            self._children[id(parent)] = entry
        names = entry[1]
        if id(child) not in names:
            names[id(child)] = next((n for n, m in parent._modules.items() if m is child), None)
        return names[id(child)]

    def _path(self, parent: Any, parent_path: str, module: Any, root: Any) -> str:
        attr = self._child_name(parent, module)
        if attr is not None:
            return f"{parent_path}.{attr}" if parent_path else attr
        full = self._names.root_name(root, module)
        if full:
            return full
        suffix = f"<{type(module).__name__}>"
        return f"{parent_path}.{suffix}" if parent_path else suffix

    def _raw_shapes(self, value: Any) -> list[Any]:
        """Tensor shapes and dtypes as torch objects; converted later, off the hot path.

        Nested tensors (TransformerEncoder's fast path makes them) have no
        shape: they are left out.
        """
        tensor = self._tensor
        if isinstance(value, tensor):
            return [] if value.is_nested else [(value.shape, value.dtype)]
        out: list[Any] = []
        items: Any
        if isinstance(value, (tuple, list)):
            items = value
        elif isinstance(value, dict):
            items = value.values()
        else:
            return out
        for v in items:
            if isinstance(v, tensor):
                if not v.is_nested:
                    out.append((v.shape, v.dtype))
            elif isinstance(v, (tuple, list)):
                out.extend((w.shape, w.dtype) for w in v if isinstance(w, tensor) and not w.is_nested)
        return out

    def _keyword_shapes(self, kwargs: dict[str, Any]) -> tuple[list[Any], list[str]]:
        """The raw shapes of a call's tensor keyword arguments (``_raw_shapes`` of each value, in
        call order) and the keyword of each: a keyword whose value holds several tensors is
        named once per tensor."""
        shapes: list[Any] = []
        keywords: list[str] = []
        for keyword, value in kwargs.items():
            found = self._raw_shapes(value)
            shapes.extend(found)
            keywords.extend([keyword] * len(found))
        return shapes, keywords

    def _finish(self, span: Span) -> None:
        """Completes a model span's attributes when the recorder drains it (flusher thread): shapes,
        the keywords of its keyword tensors (``ml.input.keywords``), and the calling thread's CPU
        time and minor page faults over the call (``ml.thread.cpu_ns``, ``ml.thread.minor_faults``)."""
        attrs = span.attrs
        self._add_shapes(attrs, attrs.pop("_in", None), attrs.pop("_out", None))
        keywords = attrs.pop("_kw", None)
        if keywords:
            attrs["ml.input.keywords"] = keywords
        u0, u1 = attrs.pop("_cpu0", None), attrs.pop("_cpu1", None)
        if u0 is not None and u1 is not None:  # none for a call the end of the run truncated
            attrs["ml.thread.cpu_ns"] = u1[0] - u0[0]
            if u0[1] >= 0:
                attrs["ml.thread.minor_faults"] = u1[1] - u0[1]

    def _add_shapes(self, attrs: dict[str, Any], raw_in: Any, raw_out: Any) -> None:
        """Input and output shapes and dtypes from what the hot path kept (torch objects).

        Runs in the flusher, once per span, under the GIL, so it costs the
        traced program too. The layer wrapper stores one tensor as a bare
        ``(shape, dtype)`` pair, several (and model spans) as a list of pairs.
        """
        if raw_in:
            converted = self._converted(raw_in)
            attrs["ml.input.shapes"], attrs["ml.input.dtypes"] = converted
        if raw_out:
            converted = self._converted(raw_out)
            attrs["ml.output.shapes"], attrs["ml.output.dtypes"] = converted

    def _converted(self, raw: Any) -> tuple[list[list[int]], list[str]]:
        """JSON-ready shapes and dtype names of one raw form, cached.

        Spans of one layer (or model) see the same few shapes again and again, so
        they share the converted lists (attribute values are never modified). The
        one-tensor form is its own key; a list of pairs (several tensors, and every
        model span) is keyed by its tuple, where hashable.
        """
        cache = self._shape_cache
        if type(raw) is tuple:
            key = raw
        elif type(raw) is list:
            key = tuple(raw)
        else:
            return self._shapes_dtypes(raw)
        try:
            converted = cache.get(key)
        except TypeError:  # an entry that cannot be hashed
            return self._shapes_dtypes(raw)
        if converted is None:
            if len(cache) >= _SHAPE_CACHE_MAX:
                cache.clear()
            if key is raw:
                shape, dt = raw
                converted = ([self._dims(shape)], [self._dtype_names.get(dt) or self._dtype_name(dt)])
            else:
                converted = self._shapes_dtypes(raw)
            cache[key] = converted
        return converted

    def _shapes_dtypes(self, raw: list[Any]) -> tuple[list[list[int]], list[str]]:
        """Shapes and dtype names from a list of ``(shape, dtype)`` pairs."""
        names = self._dtype_names
        shapes = []
        dtypes = []
        for shape, dt in raw:
            shapes.append(self._dims(shape))
            dtypes.append(names.get(dt) or self._dtype_name(dt))
        return shapes, dtypes

    def _dims(self, shape: Any) -> list[Any]:
        """A shape's dimensions as ints. Under tracing (``torch.jit.trace``, the ONNX
        exporter's) a size is a 0-dim tensor: its value is taken; anything else that is not an
        int (a symbolic size) is kept as it is and written as text."""
        dims = [*shape]
        if all(type(d) is int for d in dims):
            return dims
        tensor = self._tensor
        return [int(d) if isinstance(d, tensor) and d.dim() == 0 else d for d in dims]

    def _dtype_name(self, dtype: Any) -> str:
        name = self._dtype_names[dtype] = str(dtype).removeprefix("torch.")
        return name

    def _is_framework_code(self, code: CodeType) -> bool:
        """Whether ``code`` is a framework's (torch, TensorFlow/Keras, ONNX Runtime, the standard
        library, mltrace) and so never a call site; remembered in ``_internal_code``, which the C
        hot path reads too."""
        internal = self._internal_code
        if len(internal) >= _CODE_CACHE_MAX:
            internal.clear()
        inside = internal[code] = not is_model_code(code.co_filename)
        return inside

    def _site_of(self, frame: Any) -> tuple[CodeType, int] | None:
        """The call site from ``frame`` outwards: ``(code, instruction offset)`` of the innermost
        Python frame that is not a framework's, or None. Model libraries (transformers,
        torchvision) are model code. Runs on every module call of the Python hot path."""
        owners = self._owners
        while frame is not None:
            code = frame.f_code
            inside = owners.get(code)
            if inside is None:
                remembered = self._internal_code.get(code)
                inside = owners.put(code, 0, self._is_framework_code(code) if remembered is None else remembered)
            if not inside:
                return code, frame.f_lasti
            frame = frame.f_back
        return None

    def _site_fields(self, code: CodeType, lasti: int) -> tuple[str, int, str]:
        """File, line and function name of a call site (the line table is decoded once per site)."""
        fields = self._sites.get(code, lasti)
        if fields is None:
            fields = self._sites.put(code, lasti, (code.co_filename, line_of(code, lasti), getattr(code, "co_qualname", code.co_name)))
        return fields

    def _site_attrs(self, code: CodeType, lasti: int) -> dict[str, Any]:
        """A call site's ``code.*`` attributes (OpenTelemetry's names)."""
        file, line, function = self._site_fields(code, lasti)
        return {"code.file.path": file, "code.line.number": line, "code.function.name": function}

    def _site_json(self, code: CodeType, lasti: int) -> str:
        """``,"code.file.path":…,"code.line.number":…,"code.function.name":…`` for a span template."""
        text = self._site_texts.get(code, lasti)
        if text is None:
            text = self._site_texts.put(code, lasti, "," + store.dumps(self._site_attrs(code, lasti)).decode()[1:-1])
        return text

    # -- hooks (hot path) ------------------------------------------------

    def _pre(self, module: Any, args: tuple[Any, ...]) -> None:
        """Global forward pre-hook (``MLTRACE_TORCH_HOOKS=global``): a frame as the wrapper makes it
        (torch's global pre-hooks see no keyword arguments: a model span's shapes are its
        positional tensors' only)."""
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._new_stack()
        if not stack:
            if getattr(self._tls, "symbolic", False):  # inside a call on fx proxies (below)
                return
            if not self._holds_proxy(args, {}):
                self._model_begin(module, args, stack)
                return
            self._tls.symbolic, self._tls.symbolic_root = True, module  # as _call_symbolic, until _post
            self._symbolic_calls += 1
            return
        assert self._session is not None
        shapes_in = _untraced(self._raw_shapes, args) if args else None
        site = self._site_of(sys._getframe(1))
        stack.append([module, stack[-1], self._session.new_id(), now_ns(), -1, shapes_in, None, None, None, None, site])

    def _call_symbolic(self, original: Any, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Calls ``module`` as torch would, with no model or layer span: a call on torch.fx
        proxies records a graph, it runs no inference. The module calls inside it, on proxies
        or on tensors the model makes meanwhile, are part of it and get no span either."""
        tls = self._tls
        inside = getattr(tls, "symbolic", False)
        if not inside:
            self._symbolic_calls += 1
        tls.symbolic = True
        try:
            return original(module, *args, **kwargs)
        finally:
            tls.symbolic = inside

    def _model_begin(self, module: Any, args: tuple[Any, ...], stack: list[Any], kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Opens the model span of an outermost module call and pushes its frame; returns the frame.

        Its input shapes are those of the tensors passed positionally, then of those passed by
        keyword (``model(**batch)``), whose keywords it keeps apart (``ml.input.keywords``).
        Layer calls keep their positional tensors' shapes only (the hot path).
        """
        static = self._static_of(module)
        name = static.model_name
        if name is None:
            name = static.model_name = self._names.name(module, sys._getframe(2))
        attrs = dict(static.attrs)
        counter = self._invocations.get(id(module))
        if counter is None:
            with self._lock:
                counter = self._invocations.setdefault(id(module), itertools.count(1))
        attrs["ml.model.invocation"] = next(counter)  # one step of a C iterator: atomic under the GIL
        training = getattr(module, "training", None)  # its kind of call (analysis.coldstart.call_kinds)
        if type(training) is bool:
            attrs["ml.model.training"] = training
        grad = self._grad_enabled()
        if type(grad) is bool:
            attrs["ml.grad.enabled"] = grad
        if self._jit_tracing():  # torch.jit.trace (or the TorchScript ONNX exporter) records a graph
            attrs[JIT_TRACE_ATTR] = True
        if not _has_children(module):  # the model is its own only layer: its ops are in no other
            attrs["ml.model.leaf"] = True
        self._note_fx_graph(module, attrs)
        generate_site = self._generate.tag(attrs, module)
        if generate_site is None:  # the program's line, past the libraries that called the model for it
            caller = sys._getframe(2)
            site = program_site(caller) or self._site_of(caller)
            if site is not None:
                attrs.update(self._site_attrs(*site))
        else:  # the user's line that called generate(), not the decode loop's inside transformers
            attrs.update(generate_site)
        if "code.file.path" in attrs:
            attrs["ml.call.file.path"], attrs["ml.call.line.number"] = attrs["code.file.path"], attrs.get("code.line.number")
        attrs["_in"] = _untraced(self._raw_shapes, args)
        if kwargs:
            shapes, keywords = _untraced(self._keyword_shapes, kwargs)
            if keywords:
                attrs["_in"] = [*attrs["_in"], *shapes]
                attrs["_kw"] = keywords
        if "opentelemetry.trace" in sys.modules:  # a serving request's span becomes the model's parent
            from mltrace.tracer.otel_context import OTEL_PARENT_ATTR, capture_otel_parent

            otel = capture_otel_parent()
            if otel is not None:
                attrs[OTEL_PARENT_ATTR] = f"{otel[0]:032x}-{otel[1]:016x}"
        self._note_opaque(module)
        if static.loss:
            attrs[REGION_ATTR] = LOSS_REGION
        span = self._begin(name, Level.USER if static.loss else Level.MODEL, attrs)
        span._fin = self._finish_span
        span.attrs["_cpu0"] = thread_usage()  # ml.thread.cpu_ns and .minor_faults, with "_cpu1" at the end (_finish)
        frame = [module, None, span.id, span.start_ns, -1, None, None, ("", static, static.attrs, None, None), None, span]
        self._untrack_record(frame)
        stack.append(frame)
        return frame

    def _model_ended(self, span: Span) -> None:
        """After an outermost call: where the op and layer levels may end (``tracer/windows.py``);
        a loss's call (a user-level span) is no model call for them."""
        session = self._session
        if session is None:
            return
        if self._late:  # this thread's model call from before the layer level's end has returned
            self._late.pop(threading.get_ident(), None)
        if span.level is Level.MODEL:
            session.model_call_ended("pytorch")

    def end_layer_level(self) -> bool:
        """Stops recording layer spans; outermost calls go on as model spans (``tracer/windows.py``).

        Puts the model level's wrapper in place of the layer level's. Model calls
        running on other threads meanwhile finish with all their layer spans: the new
        wrapper hands their nested calls to the layer level's wrapper until they return.

        Returns:
            Whether it had recorded layer spans (a program that never calls a torch model
            has none).

        Raises:
            RuntimeError: where ours cannot be taken out (someone else has wrapped
                ``Module.__call__`` since, or the global hooks of
                ``MLTRACE_TORCH_HOOKS=global`` are in use); the layer level goes on.
        """
        if self._handles:
            raise RuntimeError("the layer level records through global forward hooks here, which do not end early")
        if self._wrapped is None:  # torch not imported yet: if it is later, the model level's wrapper goes in
            self._record_layers = False
            return False
        module_cls, original, ours = self._wrapped
        if module_cls.__call__ is not ours:
            raise RuntimeError("nn.Module.__call__ was re-wrapped by someone else; the layer level goes on")
        for ident, stack in list(self._stacks.items()):
            head = stack[:1]  # another thread may empty its stack meanwhile
            if head and ident != threading.get_ident():
                self._late[ident] = head[0]
        self._wrap_call(module_cls, original, layer_call=ours)
        return bool(self._static or self._frames)  # modules described by the drain, or frames waiting for it

    def _note_threads(self) -> None:
        """run.json's ``threads.torch``: torch's intra-op threads at the end of the run (the
        roofline scales the CPU's peaks to them), where torch was imported."""
        torch = sys.modules.get("torch")
        get = getattr(torch, "get_num_threads", None)
        if self._session is None or get is None:
            return
        try:
            self._session.meta.setdefault("threads", {})["torch"] = int(get())
        except Exception:  # noqa: BLE001 - a fact for the report, never an error of the run
            pass

    def _note_fx_graph(self, module: Any, attrs: dict[str, Any]) -> None:
        """For a ``torch.fx.GraphModule`` model (``torch.export``'s ``.module()``, FX passes):
        its graph id on every call (``ml.fx.graph``) and, on the first call, which module each
        op node came from (``ml.fx.nodes``), from which ``passes/fx_layers.py`` makes its layers."""
        fx = sys.modules.get("torch.fx")
        graph_module = getattr(fx, "GraphModule", None)
        if graph_module is None or not isinstance(module, graph_module):
            return
        known = self._fx_graphs.get(id(module))
        if known is not None and known[0]() is module:
            attrs["ml.fx.graph"] = known[1]
            return
        nodes = fx_node_modules(module)
        if nodes is None:
            return
        graph_id = len(self._fx_graphs) + 1
        self._fx_graphs[id(module)] = (weakref.ref(module), graph_id)
        attrs["ml.fx.graph"] = graph_id
        attrs["ml.fx.nodes"] = store.dumps(nodes).decode()

    def _note_opaque(self, module: Any) -> None:
        session = self._session
        if session is None or type(module) in self._see_through:
            return
        cls = type(module).__name__
        if self._script_module is not None and isinstance(module, self._script_module):
            # Noted per call, not remembered: the note names the instance's model.
            session.note_limitation(
                f"torch.jit.ScriptModule {getattr(module, 'original_name', cls)}: its submodules run inside "
                "TorchScript, so only the model span is recorded (no layer spans)"
            )
            return
        if cls == "OptimizedModule":
            session.note_limitation(
                "torch.compile model: code compiled by TorchDynamo runs without nn.Module hooks, "
                "so only the model span (and layers that fall back to eager) are recorded"
            )
        self._see_through.add(type(module))

    def _post(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        """Global forward hook, and the end of the model-only wrapper's outermost call."""
        stack = getattr(self._tls, "stack", None)
        if not stack:
            if getattr(self._tls, "symbolic_root", None) is module:  # the end of a call on fx proxies (_pre)
                self._tls.symbolic, self._tls.symbolic_root = False, None
            return
        frame = stack.pop()
        if frame[MODULE] is not module:  # a post-hook was skipped below us: unwind to this module
            while stack and frame[MODULE] is not module:
                frame = stack.pop()
            if frame[MODULE] is not module:
                return
        if frame[PARENT] is None:  # the model frame
            span: Span = frame[SPAN]
            span.attrs["_cpu1"] = thread_usage()
            if output is not None:
                span.attrs["_out"] = _untraced(self._raw_shapes, output)
            self._end(span)
            self._model_ended(span)
            return
        frame[END] = now_ns()
        if output is not None:
            frame[OUT] = _untraced(self._raw_shapes, output)
        self._frames.append(frame)
