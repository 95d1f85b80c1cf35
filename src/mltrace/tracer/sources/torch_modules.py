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
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

from mltrace.analysis.bricks import layer_config
from mltrace.tracer.clock import now_ns
from mltrace.tracer.levels import Level
from mltrace.tracer.model import Event, Span
from mltrace.tracer.recorder import current_span
from mltrace.tracer.sources._imports import PostImportHook

if TYPE_CHECKING:
    from mltrace.tracer.session import Session


def _calls_impl_directly(module_cls: Any, original: Any) -> bool:
    """Whether a wrapper may call ``module._call_impl`` itself instead of ``original``.

    Torch's own ``Module.__call__`` (``_wrapped_call_impl``) does nothing but
    pick ``_compiled_call_impl`` (set by ``Module.compile()``) or
    ``_call_impl``; a wrapper that makes that choice itself saves a Python
    frame per module call (≈ 0.3 µs). Only when ``__call__`` is still torch's.
    """
    return original is getattr(module_cls, "_wrapped_call_impl", None)


_MLTRACE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


#: What the layer wrapper caches per (parent, path, child): the child's facts, its path, its own kids.
_Kid = tuple["_Static", str, "dict[int, _Kid]"]


class _Static:
    """Per-module facts computed once: type, parameters, class source location."""

    __slots__ = ("ref", "type_name", "attrs", "paths", "kids")

    def __init__(self, module: Any, params: int, file: str | None, line: int | None) -> None:
        self.ref = weakref.ref(module)
        self.paths: dict[str, str] = {}  # parent path → this module's path under it
        # This module's path → its children's (_Static, path, kids) by id(child): the layer
        # wrapper's one-lookup cache of what _static_of and paths give.
        self.kids: dict[str, dict[int, _Kid]] = {}
        self.type_name = type(module).__name__
        self.attrs: dict[str, Any] = {
            "ml.framework": "pytorch",
            "ml.layer.type": self.type_name,
            "ml.layer.params": params,
        }
        if file is not None:
            self.attrs["code.file.path"] = file
            self.attrs["code.line.number"] = line
            self.attrs["code.function.name"] = f"{self.type_name}.forward"


class TorchModuleSource:
    """Model and layer spans for PyTorch (``torch.nn.Module``)."""

    name = "torch.modules"
    levels: tuple[Level, ...] = (Level.MODEL, Level.LAYER)

    def __init__(self) -> None:
        self._tls = threading.local()
        self._handles: list[Any] = []
        self._wrapped: tuple[Any, Any, Any] | None = None
        self._import_hook: PostImportHook | None = None
        self._session: Session | None = None
        self._static: dict[int, _Static] = {}
        self._children: dict[int, tuple[weakref.ref[Any], dict[int, str | None]]] = {}
        self._roots: dict[int, tuple[weakref.ref[Any], dict[int, str]]] = {}
        self._class_loc: dict[type, tuple[str | None, int | None]] = {}
        self._dtype_names: dict[Any, str] = {}
        self._invocations: dict[int, int] = {}
        self._torch_dir = ""
        self._tensor: Any = object
        self._script_module: type | None = None
        self._lock = threading.Lock()

    def available(self) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed"
        return None

    def start(self, session: Session) -> None:
        self._session = session
        self._record_layers = Level.LAYER in session.levels
        self._begin = session.recorder.begin
        self._end = session.recorder.end
        self._import_hook = PostImportHook("torch", self._install)

    def _install(self, torch: Any) -> None:
        from torch.nn.modules import module as module_mod

        self._tensor = torch.Tensor
        self._torch_dir = os.path.dirname(torch.__file__)
        self._script_module = getattr(torch.jit, "ScriptModule", None)
        if os.environ.get("MLTRACE_TORCH_HOOKS") == "global":  # the older mechanism, kept for comparison
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
        top of the hooks themselves). The wrapper closes the span in ``finally``,
        so exceptions and interrupts inside a layer end its span too.

        This is the hot path of the layer level (one call per ``nn.Module``
        call, ~70 per inference of a ResNet-18), so ``Recorder.begin``/``end``
        are inlined here rather than called: every Python call, attribute
        lookup and throw-away object costs ~0.05–0.3 µs, which added up to
        ≈ 4 µs a module call (≈ 2.5 µs now, benchmarks/span_cost.py). Keep the
        two in step: the same id counter, clock, ``current_span`` get/set,
        open-span dict (for ``close_open_spans``) and ``done`` deque. The
        outermost (model) call still goes through ``_model_begin`` and
        ``Recorder.end``. Paths and per-module facts come from one cache lookup
        in the parent frame (``_Static.kids``).
        """
        assert self._session is not None
        original = module_cls.__call__
        direct = _calls_impl_directly(module_cls, original)
        tls = self._tls
        kid_of = self._kid
        raw_shapes = self._raw_shapes
        finish = self._finish
        model_begin = self._model_begin
        end = self._end
        tensor = self._tensor
        # Recorder internals, bound once (see Recorder.begin/end).
        recorder = self._session.recorder
        next_id = recorder._ids.__next__
        open_spans = recorder._open
        pop_open = open_spans.pop
        append_done = recorder.done.append
        get_current = current_span.get
        set_current = current_span.set
        clock = now_ns
        new_span = Span
        layer = Level.LAYER

        def __call__(module: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 - replaces Module.__call__
            try:
                stack = tls.stack
            except AttributeError:
                stack = tls.stack = []
            if not stack:  # the outermost call on this thread: the model span
                model_begin(module, args, stack)
                span = stack[-1][1]
                output = None
                try:
                    output = original(module, *args, **kwargs)
                    return output
                finally:
                    while stack and stack.pop()[1] is not span:
                        pass
                    if output is not None:
                        span.attrs["_out"] = raw_shapes(output)
                    end(span)

            parent, parent_span, parent_path, root, kids = stack[-1]
            kid = kids.get(id(module))
            if kid is None or kid[0].ref() is not module:  # first call from here (or an id reused)
                kid = kids[id(module)] = kid_of(parent, parent_path, module, root)
            static, path, child_kids = kid
            if args:
                # One plain tensor is the common case: skip the generic walk and
                # keep the bare (shape, dtype) pair (``_finish`` reads both forms).
                first = args[0]
                shapes_in = (first.shape, first.dtype) if type(first) is tensor and len(args) == 1 else raw_shapes(args)
                attrs = {"ml.layer.path": path, "_static": static.attrs, "_in": shapes_in}
            else:
                attrs = {"ml.layer.path": path, "_static": static.attrs}
            # Recorder.begin, inlined. The thread's track is the parent frame's:
            # the stack is per thread and its root span was begun on this thread.
            up = get_current()
            span_id = next_id()
            span = new_span(span_id, None if up is None else up.id, layer, path, clock(), -1, parent_span.track_id, attrs)
            span._fin = finish
            set_current(span)
            open_spans[span_id] = span
            stack.append((module, span, path, root, child_kids))
            output = None
            try:
                if direct and module._compiled_call_impl is None:  # what original would do, a frame less
                    output = module._call_impl(*args, **kwargs)
                else:
                    output = original(module, *args, **kwargs)
                return output
            finally:
                # try/finally keeps calls strictly nested: the top frame is ours.
                while stack and stack.pop()[1] is not span:
                    pass
                if output is not None:
                    attrs["_out"] = (output.shape, output.dtype) if type(output) is tensor else raw_shapes(output)
                # Recorder.end, inlined. ``up`` stays in this frame instead of span._up.
                span.end_ns = clock()
                set_current(up)
                pop_open(span_id, None)
                append_done(span)
                recorder.span_count += 1

        self._wrapped = (module_cls, original, __call__)
        module_cls.__call__ = __call__

    def _wrap_call(self, module_cls: Any) -> None:
        """Model level only: wrap ``Module.__call__`` instead of installing global hooks.

        Global hooks send every module call down torch's slower hooked path
        (+14 % on a MobileNet-style CNN with 231 module calls); the wrapper times
        the outermost call per thread and lets nested calls through untouched.
        """
        original = module_cls.__call__
        direct = _calls_impl_directly(module_cls, original)
        tls = self._tls
        model_begin = self._model_begin
        post = self._post

        def __call__(module: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 - replaces Module.__call__
            try:
                stack = tls.stack
            except AttributeError:
                stack = tls.stack = []
            if stack:
                if direct and module._compiled_call_impl is None:  # what original would do, a frame less
                    return module._call_impl(*args, **kwargs)
                return original(module, *args, **kwargs)
            model_begin(module, args, stack)
            output = None
            try:
                output = original(module, *args, **kwargs)
                return output
            finally:
                post(module, args, output)

        self._wrapped = (module_cls, original, __call__)
        module_cls.__call__ = __call__

    def stop(self) -> list[Event]:
        try:
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
            if self._import_hook is not None:
                self._import_hook.remove()
                self._import_hook = None
        return []

    # -- per-module facts ------------------------------------------------

    def _static_of(self, module: Any) -> _Static:
        info = self._static.get(id(module))
        if info is not None and info.ref() is module:
            return info
        cls = type(module)
        loc = self._class_loc.get(cls)
        if loc is None:
            # The forward() code object gives file:line for free; inspect would read the file.
            code = getattr(getattr(cls, "forward", None), "__code__", None)
            loc = (code.co_filename, code.co_firstlineno) if code is not None else (None, None)
            self._class_loc[cls] = loc
        try:
            params = sum(int(p.numel()) for p in module.parameters())
        except Exception:
            params = 0
        info = _Static(module, params, loc[0], loc[1])
        try:  # constructor arguments (never weights), so DLBricks can rebuild the layer exactly
            config = layer_config(module)
        except Exception:
            config = None
        if config is not None:
            info.attrs["ml.layer.config"] = config
        self._static[id(module)] = info
        return info

    def _kid(self, parent: Any, parent_path: str, module: Any, root: Any) -> _Kid:
        """The layer wrapper's cache entry for ``module`` called from ``parent`` at ``parent_path``."""
        static = self._static_of(module)
        path = static.paths.get(parent_path)
        if path is None:
            path = static.paths[parent_path] = self._path(parent, parent_path, module, root)
        return static, path, static.kids.setdefault(path, {})

    def _child_name(self, parent: Any, child: Any) -> str | None:
        entry = self._children.get(id(parent))
        if entry is None or entry[0]() is not parent:
            entry = (weakref.ref(parent), {})
            self._children[id(parent)] = entry
        names = entry[1]
        if id(child) not in names:
            names[id(child)] = next((n for n, m in parent._modules.items() if m is child), None)
        return names[id(child)]

    def _root_name(self, root: Any, module: Any) -> str | None:
        entry = self._roots.get(id(root))
        if entry is None or entry[0]() is not root or id(module) not in entry[1]:
            names: dict[int, str] = {}
            for n, m in root.named_modules(remove_duplicate=False):
                names.setdefault(id(m), n)
            entry = (weakref.ref(root), names)
            self._roots[id(root)] = entry
        return entry[1].get(id(module))

    def _path(self, parent: Any, parent_path: str, module: Any, root: Any) -> str:
        attr = self._child_name(parent, module)
        if attr is not None:
            return f"{parent_path}.{attr}" if parent_path else attr
        full = self._root_name(root, module)
        if full:
            return full
        suffix = f"<{type(module).__name__}>"
        return f"{parent_path}.{suffix}" if parent_path else suffix

    def _raw_shapes(self, value: Any) -> list[Any]:
        """Tensor shapes and dtypes as torch objects; converted later, off the hot path."""
        tensor = self._tensor
        if isinstance(value, tensor):
            return [(value.shape, value.dtype)]
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
                out.append((v.shape, v.dtype))
            elif isinstance(v, (tuple, list)):
                out.extend((w.shape, w.dtype) for w in v if isinstance(w, tensor))
        return out

    def _finish(self, span: Span) -> None:
        """Completes a span's attributes when the recorder drains it (flusher thread).

        Runs once per span under the GIL, so it costs the traced program too:
        the one-tensor form ``(shape, dtype)`` that the layer wrapper stores is
        handled inline, lists of pairs (several tensors, model spans) by
        ``_shapes_dtypes``.
        """
        attrs = span.attrs
        static = attrs.pop("_static", None)
        raw_in = attrs.pop("_in", None)
        raw_out = attrs.pop("_out", None)
        if static is not None:  # the module's facts first, then the call's
            span.attrs = attrs = {**static, **attrs}
        names = self._dtype_names
        if raw_in:
            if type(raw_in) is tuple:
                shape, dt = raw_in
                attrs["ml.input.shapes"] = [[*shape]]
                attrs["ml.input.dtypes"] = [names.get(dt) or self._dtype_name(dt)]
            else:
                attrs["ml.input.shapes"], attrs["ml.input.dtypes"] = self._shapes_dtypes(raw_in)
        if raw_out:
            if type(raw_out) is tuple:
                shape, dt = raw_out
                attrs["ml.output.shapes"] = [[*shape]]
                attrs["ml.output.dtypes"] = [names.get(dt) or self._dtype_name(dt)]
            else:
                attrs["ml.output.shapes"], attrs["ml.output.dtypes"] = self._shapes_dtypes(raw_out)

    def _shapes_dtypes(self, raw: list[Any]) -> tuple[list[list[int]], list[str]]:
        """Shapes and dtype names from a list of ``(shape, dtype)`` pairs."""
        names = self._dtype_names
        shapes = []
        dtypes = []
        for shape, dt in raw:
            shapes.append([*shape])
            dtypes.append(names.get(dt) or self._dtype_name(dt))
        return shapes, dtypes

    def _dtype_name(self, dtype: Any) -> str:
        name = self._dtype_names[dtype] = str(dtype).removeprefix("torch.")
        return name

    def _call_site(self) -> tuple[str, int] | None:
        frame = sys._getframe(2)
        while frame is not None:
            fn = frame.f_code.co_filename
            if not (fn.startswith(self._torch_dir) or fn.startswith(_MLTRACE_DIR)):
                return fn, frame.f_lineno
            frame = frame.f_back  # type: ignore[assignment]
        return None

    # -- hooks (hot path) ------------------------------------------------

    def _pre(self, module: Any, args: tuple[Any, ...]) -> None:
        tls = self._tls
        try:
            stack = tls.stack
        except AttributeError:
            stack = tls.stack = []
        if not stack:
            self._model_begin(module, args, stack)
            return
        parent, _, parent_path, root, _ = stack[-1]
        if not self._record_layers:
            stack.append((module, None, parent_path, root, None))
            return
        static = self._static.get(id(module))
        if static is None or static.ref() is not module:
            static = self._static_of(module)
        path = static.paths.get(parent_path)
        if path is None:
            path = static.paths[parent_path] = self._path(parent, parent_path, module, root)
        attrs: dict[str, Any] = {"ml.layer.path": path, "_static": static.attrs}
        if args:
            attrs["_in"] = self._raw_shapes(args)
        span = self._begin(path, Level.LAYER, attrs)
        span._fin = self._finish
        stack.append((module, span, path, root, None))

    def _model_begin(self, module: Any, args: tuple[Any, ...], stack: list[Any]) -> None:
        static = self._static_of(module)
        name = static.type_name
        attrs = dict(static.attrs)
        with self._lock:
            n = self._invocations.get(id(module), 0) + 1
            self._invocations[id(module)] = n
        attrs["ml.model.invocation"] = n
        site = self._call_site()
        if site is not None:
            attrs["ml.call.file.path"], attrs["ml.call.line.number"] = site
        attrs["_in"] = self._raw_shapes(args)
        if "opentelemetry.trace" in sys.modules:  # a serving request's span becomes the model's parent
            from mltrace.exporters.otlp import OTEL_PARENT_ATTR, capture_otel_parent

            otel = capture_otel_parent()
            if otel is not None:
                attrs[OTEL_PARENT_ATTR] = f"{otel[0]:032x}-{otel[1]:016x}"
        self._note_opaque(module)
        span = self._begin(name, Level.MODEL, attrs)
        span._fin = self._finish
        stack.append((module, span, "", module, static.kids.setdefault("", {})))

    def _note_opaque(self, module: Any) -> None:
        session = self._session
        if session is None:
            return
        cls = type(module).__name__
        if self._script_module is not None and isinstance(module, self._script_module):
            session.note_limitation(
                f"torch.jit.ScriptModule {getattr(module, 'original_name', cls)}: its submodules run inside "
                "TorchScript, so only the model span is recorded (no layer spans)"
            )
        elif cls == "OptimizedModule":
            session.note_limitation(
                "torch.compile model: code compiled by TorchDynamo runs without nn.Module hooks, "
                "so only the model span (and layers that fall back to eager) are recorded"
            )

    def _post(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        stack = getattr(self._tls, "stack", None)
        if not stack:
            return
        frame = stack.pop()
        if frame[0] is not module:  # a post-hook was skipped below us: unwind to this module
            while stack and frame[0] is not module:
                frame = stack.pop()
            if frame[0] is not module:
                return
        span: Span | None = frame[1]
        if span is None:
            return
        if output is not None:
            span.attrs["_out"] = self._raw_shapes(output)
        self._end(span)
