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
from mltrace.tracer.levels import Level
from mltrace.tracer.model import Event, Span
from mltrace.tracer.sources._imports import PostImportHook

if TYPE_CHECKING:
    from mltrace.tracer.session import Session

_SHAPE_KEYS = (("_in", "ml.input.shapes", "ml.input.dtypes"), ("_out", "ml.output.shapes", "ml.output.dtypes"))
_MLTRACE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Static:
    """Per-module facts computed once: type, parameters, class source location."""

    __slots__ = ("ref", "type_name", "attrs", "paths")

    def __init__(self, module: Any, params: int, file: str | None, line: int | None) -> None:
        self.ref = weakref.ref(module)
        self.paths: dict[str, str] = {}  # parent path → this module's path under it
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
        """
        original = module_cls.__call__
        tls = self._tls
        statics = self._static
        static_of = self._static_of
        path_of = self._path
        raw_shapes = self._raw_shapes
        finish = self._finish
        model_begin = self._model_begin
        begin = self._begin
        end = self._end
        layer = Level.LAYER

        # The hot path of the layer level: one call per nn.Module call, inlined.
        def __call__(module: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 - replaces Module.__call__
            try:
                stack = tls.stack
            except AttributeError:
                stack = tls.stack = []
            if stack:
                parent, _, parent_path, root = stack[-1]
                static = statics.get(id(module))
                if static is None or static.ref() is not module:
                    static = static_of(module)
                path = static.paths.get(parent_path)
                if path is None:
                    path = static.paths[parent_path] = path_of(parent, parent_path, module, root)
                attrs: dict[str, Any] = {"ml.layer.path": path, "_static": static.attrs}
                if args:
                    attrs["_in"] = raw_shapes(args)
                span = begin(path, layer, attrs)
                span._fin = finish
                stack.append((module, span, path, root))
            else:
                model_begin(module, args, stack)
                span = stack[-1][1]
            output = None
            try:
                output = original(module, *args, **kwargs)
                return output
            finally:
                # try/finally keeps calls strictly nested: the top frame is ours.
                while stack and stack.pop()[1] is not span:
                    pass
                if output is not None:
                    span.attrs["_out"] = raw_shapes(output)
                end(span)

        self._wrapped = (module_cls, original, __call__)
        module_cls.__call__ = __call__

    def _wrap_call(self, module_cls: Any) -> None:
        """Model level only: wrap ``Module.__call__`` instead of installing global hooks.

        Global hooks send every module call down torch's slower hooked path
        (+14 % on a MobileNet-style CNN with 231 module calls); the wrapper times
        the outermost call per thread and lets nested calls through untouched.
        """
        original = module_cls.__call__
        tls = self._tls
        model_begin = self._model_begin
        post = self._post

        def __call__(module: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 - replaces Module.__call__
            try:
                stack = tls.stack
            except AttributeError:
                stack = tls.stack = []
            if stack:
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
        """Completes a span's attributes when the recorder drains it (flusher thread)."""
        attrs = span.attrs
        static = attrs.pop("_static", None)
        names = self._dtype_names
        for raw_key, shapes_key, dtypes_key in _SHAPE_KEYS:
            raw = attrs.pop(raw_key, None)
            if raw:
                attrs[shapes_key] = [list(shape) for shape, _ in raw]
                dtypes = []
                for _, dt in raw:
                    name = names.get(dt)
                    if name is None:
                        name = names[dt] = str(dt).removeprefix("torch.")
                    dtypes.append(name)
                attrs[dtypes_key] = dtypes
        if static is not None:
            span.attrs = {**static, **attrs}

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
        parent, _, parent_path, root = stack[-1]
        if not self._record_layers:
            stack.append((module, None, parent_path, root))
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
        stack.append((module, span, path, root))

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
        stack.append((module, span, "", module))

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
