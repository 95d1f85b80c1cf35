"""TensorFlow / Keras at the model, layer and op levels.

Nothing in the user's code changes. When the program imports ``keras`` (``tf.keras`` is
Keras 3 and imports it too), ``TensorFlowSource`` wraps ``Layer.__call__`` (eager model and
layer spans: ``_layer_call``) and ``predict``, ``evaluate``, ``predict_on_batch``,
``test_on_batch`` (one model span each: ``_graph_wrapper``). When it imports ``tensorflow``
with the layer or op level on, the TensorFlow profiler runs (``_start_profiler``) and every
graph-function call is kept (``_patch_function_calls``); at ``stop()`` the profiler's
``xplane.pb`` is converted by ``xspace.xspace_to_events``: graph ops become op spans nested in
layer spans rebuilt from their Keras name scopes, eager ops op spans under the live layer
spans. For the library level it sets ``ONEDNN_VERBOSE`` (``_maybe_onednn``).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mltrace.run.events import Event, Span
from mltrace.run.levels import Level
from mltrace.tracer import c_environ
from mltrace.tracer.callsite import defined_attrs, frame_site, model_call_site
from mltrace.tracer.clock import now_ns
from mltrace.tracer.sources._imports import PostImportHook
from mltrace.tracer.sources.base import FrameworkSource
from mltrace.tracer.sources.tf_layer_records import LayerRecords

if TYPE_CHECKING:
    from mltrace.formats.tf_flops import (
        FlopTable,
        graph_work,
        keras_attention_flops,
        keras_layer_flops,
        keras_layer_kind,
        top_scopes,
    )
    from mltrace.formats.xspace import (
        FunctionCall,
        KerasModelInfo,
        LiveModelSpan,
        find_xplane_files,
        host_profile,
        read_xspace,
        std_thread_hash,
        xspace_to_events,
    )
    from mltrace.tracer.sources.base import SessionView

_GRAPH_METHODS = ("predict", "evaluate", "predict_on_batch", "test_on_batch")
_ONEDNN_ENV = "ONEDNN_VERBOSE"
#: Layers whose attributes ``_layer_facts`` keeps at most; the cache starts over beyond.
_LAYER_FACTS_KEPT = 4096


def keras_layer_paths(model: Any) -> dict[str, str]:
    """Every layer inside ``model`` by path (``"head/fc1"``) → its class name.

    Paths join layer names from the model down, the way Keras nests name
    scopes when a layer calls the layers it holds.
    """
    out: dict[str, str] = {}
    seen: set[int] = set()

    def walk(layer: Any, prefix: str, depth: int) -> None:
        if depth > 32 or id(layer) in seen:
            return
        seen.add(id(layer))
        try:
            children = layer._flatten_layers(include_self=False, recursive=False)
        except Exception:
            children = getattr(layer, "layers", [])
        for child in children:
            path = f"{prefix}{child.name}"
            out.setdefault(path, type(child).__name__)
            walk(child, f"{path}/", depth + 1)

    walk(model, "", 0)
    return out


def _shape_key(x: Any) -> tuple[tuple[int, ...], str] | None:
    """A tensor's dimensions (-1 for an unknown one) and dtype name, or None where it has no
    shape (``_shapes`` writes the same as attributes)."""
    shape = getattr(x, "shape", None)
    if shape is None:
        return None
    try:
        dims = tuple([-1 if d is None else int(d) for d in tuple(shape)])
    except (TypeError, ValueError):
        return None
    dtype = getattr(x, "dtype", None)
    return dims, str(getattr(dtype, "name", dtype))


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0] if args else next(iter(kwargs.values()), None)
    for _ in range(3):
        if isinstance(x, (list, tuple)):
            x = x[0] if x else None
        elif isinstance(x, dict):
            x = next(iter(x.values()), None)
        else:
            break
    return x


def _attention_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A MultiHeadAttention call's ``query`` and ``value``, and its ``key`` where one is given."""
    query = args[0] if args else kwargs.get("query")
    value = args[1] if len(args) > 1 else kwargs.get("value")
    key = args[2] if len(args) > 2 else kwargs.get("key")
    return (query, value) if key is None else (query, value, key)


def _plain_attention(cls: type) -> bool:
    """Whether a MultiHeadAttention class runs the layer's own ``call`` and ``_compute_attention``
    (a subclass with a cache or an attention of its own does other work than its inputs say)."""
    methods = (getattr(cls, m, None) for m in ("call", "_compute_attention"))
    return all(str(getattr(m, "__qualname__", "")).startswith("MultiHeadAttention.") for m in methods)


def _load_formats() -> None:
    """Binds this module's names from ``formats.tf_flops`` and ``formats.xspace`` once the
    program imports TensorFlow or Keras (``_install_tf``, ``_install_keras``), not at the
    session's start: a program without them never has their objects for its garbage
    collections to scan."""
    global FlopTable, graph_work, keras_attention_flops, keras_layer_flops, keras_layer_kind, top_scopes
    global FunctionCall, KerasModelInfo, LiveModelSpan, find_xplane_files, host_profile, read_xspace
    global std_thread_hash, xspace_to_events
    from mltrace.formats.tf_flops import (
        FlopTable,
        graph_work,
        keras_attention_flops,
        keras_layer_flops,
        keras_layer_kind,
        top_scopes,
    )
    from mltrace.formats.xspace import (
        FunctionCall,
        KerasModelInfo,
        LiveModelSpan,
        find_xplane_files,
        host_profile,
        read_xspace,
        std_thread_hash,
        xspace_to_events,
    )


class TensorFlowSource(FrameworkSource):
    """Model, layer and op spans for Keras 3 / TensorFlow."""

    name = "tensorflow"
    #: the ``ml.framework`` whose model calls count toward this op level's end (``--op-inferences``)
    framework = "tensorflow"
    levels: tuple[Level, ...] = (Level.MODEL, Level.LAYER, Level.OP)

    def __init__(self) -> None:
        super().__init__()
        self._session: SessionView | None = None
        self._hooks: list[PostImportHook] = []
        self._tls = threading.local()
        self._active = False
        self._profile = False
        self._record_layers = False
        self._tf: Any = None
        self._logdirs: list[str] = []
        self._profiling = False
        self._profiled = False
        self._user_profiler = False
        self._orig_start: Callable[..., Any] | None = None
        self._orig_stop: Callable[..., Any] | None = None
        self._live: list[LiveModelSpan] = []
        self._models: dict[str, KerasModelInfo] = {}
        self._model_seen: weakref.WeakSet[Any] = weakref.WeakSet()
        self._invocations: dict[int, itertools.count[int]] = {}
        self._threads: dict[int, tuple[int, str]] = {}  # TSL line id → (OS thread id, name)
        self._idents: set[int] = set()
        self._lock = threading.Lock()
        self._eager: Callable[[], bool] = lambda: True
        self._symbolic: type | None = None
        self._model_cls: type | None = None
        self._set_onednn = False
        self._ended_early = False  # the op level ended before the session (``end_early``)
        self._recorded_layers = False  # any eager layer span so far
        self._after_start: list[Callable[[], None]] = []
        self._function_calls: list[FunctionCall] = []
        self._function_graphs: dict[str, Any] = {}  # runtime function name → its FuncGraph
        self._signatures: dict[str, str] = {}  # a loaded SavedModel's signature function name → its key
        self._work_kinds: dict[type, str | None] = {}  # a Keras layer class → its kind of work (tf_flops.keras_layer_kind)
        #: Eager layer calls since the last flush, as compact records (``tf_layer_records``).
        self._layer_records = LayerRecords()
        #: (id(layer), model name, path) → (weak reference to the layer, its facts' number, its
        #: attributes that do not change from call to call): ``_layer_facts``.
        self._layer_facts: dict[tuple[int, str, str], tuple[weakref.ref[Any], int, dict[str, Any]]] = {}
        self._fact_numbers = itertools.count()

    def available(self) -> str | None:
        if importlib.util.find_spec("keras") is None and importlib.util.find_spec("tensorflow") is None:
            return "neither keras nor tensorflow is installed"
        return None

    def start(self, session: SessionView) -> None:
        self._session = session
        self._active = True
        self._profile = Level.LAYER in session.levels or Level.OP in session.levels
        self._record_layers = Level.LAYER in session.levels
        self._begin = session.recorder.begin
        self._end = session.recorder.end
        self._close = session.recorder.close
        session.recorder.add_producer(self._layer_records.spans, self._layer_records.encode)
        try:
            self._hooks.append(PostImportHook("tensorflow", self._install_tf))
            self._hooks.append(PostImportHook("keras", self._install_keras))
        except BaseException:
            self._remove_hooks()
            raise

    # -- ending early (tracer/windows.py) -------------------------------------------------

    @property
    def profiling(self) -> bool:
        """Whether mltrace's TensorFlow profiler is running."""
        return self._profiling

    @property
    def recording_ops(self) -> bool:
        """Its ops are recorded while its profiler runs."""
        return self.profiling

    @property
    def can_end_early(self) -> bool:
        """Whether the op level (the TensorFlow profiler) can end before the session does."""
        return self._profile

    def around_profiler_start(self, before: Callable[[], None], after: Callable[[], None]) -> None:
        """Calls ``after`` once the profiler has started (now, if it has): the op level's memory
        budget counts from there, not from the program's ``import tensorflow``."""
        if self._profiling:
            after()
        else:
            self._after_start.append(after)

    def end_early(self) -> None:
        """Stops the TensorFlow profiler now; ``stop()`` converts what it wrote. Its graph-mode
        layer spans (``predict``, ``evaluate``) end with it; eager layer spans go on."""
        self._ended_early = True
        self._stop_profiler()

    def end_layer_level(self) -> bool:
        """Stops recording eager layer spans; outermost calls go on as model spans. A model call
        running meanwhile keeps its layers (each model frame holds whether layers were on).
        Returns whether it had recorded layer spans."""
        self._record_layers = False
        return self._recorded_layers

    def release_in_forked_child(self) -> None:
        """In a child forked while the session runs: the wrappers call straight through here
        (as once the trace is full), and the profilers are left to the parent."""
        self._active = False

    def end_recording(self) -> None:
        """The trace is full (``Session.full``): no more model or layer spans, and the profiler
        ends; the wrappers stay until ``stop()`` and call straight through."""
        self._active = False
        self.end_early()

    # -- installation ----------------------------------------------------------------

    def _install_tf(self, tf: Any) -> None:
        if not self._active:
            return
        _load_formats()
        self._tf = tf
        try:
            from tensorflow.python.eager import context

            self._eager = context.executing_eagerly
        except Exception:
            pass
        self._maybe_onednn()
        if not self._profile or self._ended_early:  # an op level that ended before tensorflow came does not start
            return
        try:
            from tensorflow.python.profiler import profiler_v2

            self._orig_start, self._orig_stop = profiler_v2.start, profiler_v2.stop
            self._patch_profiler_api(profiler_v2)
            self._start_profiler()
            self._patch_function_calls()
            self._patch_saved_model_load()
        except Exception as exc:
            self._warn(f"could not start the TensorFlow profiler ({exc}); only model and eager layer spans are recorded")

    def _install_keras(self, keras: Any) -> None:
        if not self._active:
            return
        _load_formats()
        try:
            from keras.src.backend.common.keras_tensor import KerasTensor
            from keras.src.layers.layer import Layer
            from keras.src.models.model import Model
        except Exception as exc:
            self._warn(f"this keras is not supported ({exc}); no Keras spans")
            return
        self._symbolic = KerasTensor
        self._model_cls = Model
        try:
            backend = keras.backend.backend()
        except Exception:
            backend = "tensorflow"
        if backend == "jax":
            self._note("Keras runs on JAX here: calls traced by jax.jit are recorded as they are traced, not as they run")
        orig_call = Layer.__dict__["__call__"]
        source = self

        def __call__(layer: Any, *args: Any, **kwargs: Any) -> Any:
            return source._layer_call(orig_call, layer, args, kwargs)

        __call__.__wrapped__ = orig_call  # type: ignore[attr-defined]
        self._patch(Layer, "__call__", __call__)
        for method in _GRAPH_METHODS:
            owner = next((c for c in Model.__mro__ if method in c.__dict__), None)
            if owner is not None:
                self._patch(owner, method, self._graph_wrapper(owner.__dict__[method], method))

    def _remove_hooks(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()

    # -- the TensorFlow profiler --------------------------------------------------------

    def _start_profiler(self) -> None:
        """Starts ``tf.profiler.experimental`` into a private temporary directory (host tracer
        level 2, no Python tracer)."""
        assert self._orig_start is not None and self._tf is not None
        logdir = tempfile.mkdtemp(prefix="mltrace-tf-")
        self._logdirs.append(logdir)
        # No options: the defaults are what is wanted (host tracer level 2, device 1, no Python tracer), and
        # TensorFlow 2.21 passes explicit ProfilerOptions with the wrong type (it warns and ignores them).
        self._orig_start(logdir)
        self._profiling = True
        self._profiled = True
        while self._after_start:
            self._after_start.pop(0)()

    def _stop_profiler(self) -> None:
        if self._profiling and self._orig_stop is not None:
            self._profiling = False
            self._orig_stop()

    def _patch_profiler_api(self, profiler_v2: Any) -> None:
        """Lets the program's own profiler run: only one TensorFlow profiler can run in a process,
        so when the program starts one (directly, or through ``tf.profiler.experimental.Profile``
        or Keras's TensorBoard callback), mltrace's pauses until the program's stops, and says so."""
        source = self
        orig_start, orig_stop = profiler_v2.start, profiler_v2.stop

        def start(*args: Any, **kwargs: Any) -> Any:
            if source._profiling:
                try:
                    source._stop_profiler()
                except Exception:
                    pass
                source._user_profiler = True
                source._note("the program ran the TensorFlow profiler itself; mltrace's was paused meanwhile (no layers or ops then)")
            return orig_start(*args, **kwargs)

        def stop(*args: Any, **kwargs: Any) -> Any:
            try:
                return orig_stop(*args, **kwargs)
            finally:
                if source._user_profiler and source._active and not source._ended_early:
                    source._user_profiler = False
                    try:
                        source._start_profiler()
                    except Exception as exc:
                        source._warn(f"could not restart the TensorFlow profiler: {exc}")

        start.__wrapped__ = orig_start  # type: ignore[attr-defined]
        stop.__wrapped__ = orig_stop  # type: ignore[attr-defined]
        for module in list(sys.modules.values()):
            if module is None or not getattr(module, "__name__", "").startswith("tensorflow"):
                continue
            if getattr(module, "start", None) is orig_start:
                self._patch(module, "start", start)
            if getattr(module, "stop", None) is orig_stop:
                self._patch(module, "stop", stop)

    def _patch_function_calls(self) -> None:
        """Records each graph-function call's name, times and batch size, and its function's graph (for
        FLOPs, ``tf_flops``): every ``tf.function`` and SavedModel call runs ``ConcreteFunction._call_flat``.

        Calls outside the wrappers' model spans become model spans from the profiler
        (``xspace.py``), named by the model (a model traced into a graph is known from then on,
        even if it never runs eagerly) or ``<model>:<signature>``; an XLA-compiled call is a
        model span without layers."""
        try:
            from tensorflow.python.eager.polymorphic_function.concrete_function import ConcreteFunction
        except Exception as exc:
            self._note(f"graph-function calls cannot be followed in this TensorFlow ({exc}): no FLOPs for graph ops")
            return
        orig = ConcreteFunction.__dict__["_call_flat"]
        source = self

        def _call_flat(fn: Any, *args: Any, **kwargs: Any) -> Any:
            if not source._profiling:
                return orig(fn, *args, **kwargs)
            start = now_ns()
            try:
                return orig(fn, *args, **kwargs)
            finally:
                source._function_called(fn, args, start, now_ns())

        _call_flat.__wrapped__ = orig  # type: ignore[attr-defined]
        self._patch(ConcreteFunction, "_call_flat", _call_flat)

    def _patch_saved_model_load(self) -> None:
        """Wraps ``tf.saved_model.load`` to keep the signature key of each loaded signature function
        (``model.export``'s ``serve`` and ``serving_default`` both run ``signature_wrapper___call___…``)."""
        try:
            from tensorflow.python.saved_model import load as load_module
        except Exception:
            return
        orig = load_module.load
        source = self

        def load(*args: Any, **kwargs: Any) -> Any:
            loaded = orig(*args, **kwargs)
            source._loaded(loaded)
            return loaded

        load.__wrapped__ = orig  # type: ignore[attr-defined]
        load.__doc__ = orig.__doc__
        for module in list(sys.modules.values()):
            if module is not None and getattr(module, "__name__", "").startswith("tensorflow") and getattr(module, "load", None) is orig:
                self._patch(module, "load", load)

    def _loaded(self, loaded: Any) -> None:
        """Keeps the signature keys of a loaded SavedModel by function name (never raises)."""
        try:
            for key, fn in loaded.signatures.items():
                raw = fn.name
                self._signatures[raw.decode() if isinstance(raw, bytes) else str(raw)] = str(key)
        except Exception:
            pass

    def _function_called(self, fn: Any, args: tuple[Any, ...], start: int, end: int) -> None:
        """Keeps one graph-function call (never raises into the program)."""
        try:
            raw = fn.name
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            if name not in self._function_graphs:
                self._function_graphs[name] = fn.graph
            batch = None
            for t in args[0] if args and isinstance(args[0], (list, tuple)) else ():
                shape = getattr(t, "shape", None)
                if shape is not None and len(shape) >= 1 and shape[0] is not None:
                    batch = int(shape[0])
                    break
            site = model_call_site(sys._getframe(3))  # past this, the wrapper and its caller
            self._function_calls.append(FunctionCall(start, end, name, batch, site or None))
        except Exception:
            pass

    def _function_flops(self) -> dict[str, FlopTable]:
        """The counted ops of each graph function that ran (``tf_flops.graph_work``); none without the op level."""
        tables: dict[str, FlopTable] = {}
        if self._session is None or Level.OP not in self._session.levels:
            return tables
        for name, graph in self._function_graphs.items():
            try:
                tables[name] = graph_work(graph)
            except Exception as exc:
                self._note(f"could not count the FLOPs of {name}: {exc}")
        return tables

    def _function_model_names(self) -> dict[str, str]:
        """The known Keras model each graph function that ran runs most ops of, by function name."""
        names: dict[str, str] = {}
        for name, graph in self._function_graphs.items():
            try:
                counts = top_scopes(graph)
            except Exception:
                continue
            mine = [(n, model) for model, n in counts.items() if model in self._models]
            if mine:
                names[name] = max(mine)[1]
        return names

    def _maybe_onednn(self) -> None:
        """Turns TensorFlow's oneDNN verbose output on for the cpu.library source, when it can be.

        TensorFlow's oneDNN prints verbose lines when ``ONEDNN_VERBOSE`` is set before its first
        primitive runs, and exports no switch to turn that off again: so only for whole-program
        runs (``mltrace python …``, whose session ends with the program)."""
        session = self._session
        if session is None or Level.LIBRARY not in session.levels:
            return
        if not any(getattr(s, "name", "") == "cpu.library" for s in session.started):
            return
        if session.options.command is None:
            session.note_limitation(
                "TensorFlow oneDNN calls (library level) are recorded only for whole-program runs (mltrace python …): "
                "TensorFlow cannot switch oneDNN's verbose output off again"
            )
            return
        if os.environ.get(_ONEDNN_ENV):
            return  # the program's own setting
        c_environ.put(_ONEDNN_ENV, "1")  # for oneDNN's getenv, not the program's os.environ
        self._set_onednn = True

    # -- wrappers (hot path; they never raise into the program on mltrace's account) -----

    def _stack(self) -> list[Any]:
        try:
            return self._tls.stack  # type: ignore[no-any-return]
        except AttributeError:
            self._tls.stack = []
            return self._tls.stack  # type: ignore[no-any-return]

    def _layer_call(self, orig: Callable[..., Any], layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``Layer.__call__``: an eager call of the outermost layer (usually a ``keras.Model``) is a
        model span; eager calls of the layers inside it are layer spans named by their path
        (``Conv1``, ``head/fc1``: the layer names joined the way Keras nests its name scopes).
        Symbolic calls (building a functional model on ``KerasTensor``s) and calls while a
        ``tf.function`` is being traced are not spans: nothing runs then."""
        if not self._active:
            return orig(layer, *args, **kwargs)
        try:
            frame = self._enter_layer(layer, args, kwargs)
        except Exception:
            frame = None
        if frame is None:
            return orig(layer, *args, **kwargs)
        stack = self._stack()
        stack.append(frame)
        output = None
        try:
            output = orig(layer, *args, **kwargs)
            return output
        finally:
            self._exit(stack, frame, output)

    def _enter_layer(self, layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
        x = _first_tensor(args, kwargs)
        if self._symbolic is not None and isinstance(x, self._symbolic):
            return None  # building a functional model: nothing runs
        if not self._eager():
            self._graph_traced(layer)
            return None  # a tf.function is being traced: its ops run later, in the graph
        stack = self._stack()
        if not stack:
            return self._model_frame(layer, "__call__", args, kwargs, eager=True)
        parent = stack[-1]
        if parent[0] is layer or not stack[0][5]:
            # Re-entry (predict → model.__call__), or a model call begun while layers were off.
            return [layer, None, parent[2], parent[3], False, False]
        path = f"{parent[2]}/{layer.name}" if parent[2] else str(layer.name)
        number, attrs = self._layer_facts_of(layer, parent[3], path)
        site = frame_site(sys._getframe(1))
        self._recorded_layers = True
        # The span's attributes while it is open (those of a call still running at stop); its
        # end gives it its template's (``_layer_ended``), shapes included.
        span = self._begin(path, Level.LAYER, {**attrs, **site})
        shapes_in: tuple[Any, ...] = (_shape_key(x),)
        if self._work_kind(type(layer)) == "attention":
            shapes_in = tuple(_shape_key(t) for t in _attention_inputs(args, kwargs))
        return [layer, span, path, parent[3], False, True, (number, tuple(site.values()), shapes_in)]

    def _layer_facts_of(self, layer: Any, model: str, path: str) -> tuple[int, dict[str, Any]]:
        """The number and the unchanging attributes of a layer at a path in a model: the same
        for each of its calls, and new for another layer object (checked by weak reference,
        so that one that reuses a dead layer's id is not taken for it)."""
        key = (id(layer), model, path)
        facts = self._layer_facts.get(key)
        if facts is not None and facts[0]() is layer:
            return facts[1], facts[2]
        attrs: dict[str, Any] = {
            "ml.framework": "tensorflow",
            "ml.layer.path": path,
            "ml.layer.type": type(layer).__name__,
            "ml.tf.mode": "eager",
        }
        self._class_location(layer, attrs)
        if len(self._layer_facts) >= _LAYER_FACTS_KEPT:
            self._layer_facts.clear()
        number = next(self._fact_numbers)
        self._layer_facts[key] = (weakref.ref(layer), number, attrs)
        return number, attrs

    def _model_info(self, model: Any, name: str) -> KerasModelInfo:
        """A Keras model's layer paths, and where its ``call`` is defined."""
        return KerasModelInfo(
            name, keras_layer_paths(model), defined=defined_attrs(getattr(type(model), "call", None), f"{type(model).__name__}.call")
        )

    def _graph_traced(self, layer: Any) -> None:
        """A Keras model traced into a graph (a ``tf.function``, a SavedModel being saved): its layer
        paths are kept, so that the profiler's graph ops of its calls are read as its layers even when
        it never runs eagerly. Models nested in a known model are its layers, not models."""
        if self._model_cls is None or not isinstance(layer, self._model_cls) or layer in self._model_seen:
            return
        name = str(getattr(layer, "name", type(layer).__name__))
        with self._lock:
            self._model_seen.add(layer)
            if any(name in info.layers for info in self._models.values()):
                return
            self._models.setdefault(name, self._model_info(layer, name))
        if not self._profile:
            self._note(
                f"Keras model {name} runs inside a tf.function (or a SavedModel): its calls are read from the "
                "TensorFlow profiler, which runs at the layer and op levels only, so they are not recorded at this level"
            )

    def _model_frame(self, model: Any, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], eager: bool) -> list[Any]:
        name = str(getattr(model, "name", type(model).__name__))
        attrs: dict[str, Any] = {"ml.framework": "tensorflow", "ml.layer.type": type(model).__name__, "ml.keras.method": method}
        with self._lock:
            counter = self._invocations.setdefault(id(model), itertools.count(1))
            attrs["ml.model.invocation"] = next(counter)
            if model not in self._model_seen:
                self._model_seen.add(model)
                self._models[name] = self._model_info(model, name)
            ident = threading.get_ident()
            if ident not in self._idents:
                self._idents.add(ident)
                self._threads[std_thread_hash(ident)] = (threading.get_native_id(), threading.current_thread().name)
        self._class_location(model, attrs)
        site = model_call_site(sys._getframe(1))
        if site:
            attrs.update(site)
            attrs["ml.call.file.path"], attrs["ml.call.line.number"] = site["code.file.path"], site["code.line.number"]
        self._shapes(_first_tensor(args, kwargs), attrs, "input")
        # A frame: layer or model, its span (None: none), path, model name, eager, layers on
        # (a model call records layers if they were on when it began).
        return [model, self._begin(name, Level.MODEL, attrs), "", name, eager, self._record_layers]

    def _exit(self, stack: list[Any], frame: list[Any], output: Any) -> None:
        while stack:
            if stack.pop() is frame:
                break
        span: Span | None = frame[1]
        if span is None:
            return
        if span.level == Level.LAYER:
            self._layer_ended(frame, span, output)
            return
        self._end(span)
        if span.level == Level.MODEL:
            self._live.append(LiveModelSpan(span.id, span.start_ns, span.end_ns, threading.get_native_id(), frame[3], frame[4]))
            if self._session is not None:
                self._session.model_call_ended("tensorflow")

    def _layer_ended(self, frame: list[Any], span: Span, output: Any) -> None:
        """Ends an eager layer call's span and records the call as a compact record
        (``tf_layer_records``): its attributes are a template that every call of the layer from
        the same call site with the same input and output shapes shares, built at the first."""
        self._close(span)
        number, site, shapes_in = frame[6]
        shapes_out = None
        if output is not None:
            try:
                shapes_out = _shape_key(_first_tensor((output,), {}))
            except Exception:
                pass
        key = (number, site, shapes_in, shapes_out)
        records = self._layer_records
        if records.add(span.id, span.parent_id, span.start_ns, span.end_ns, span.track_id, key):
            return
        attrs = dict(span.attrs)
        try:
            for which, shapes in (("input", shapes_in), ("output", (shapes_out,))):
                known = [k for k in shapes if k is not None]
                if len(known) == len(shapes):  # one per tensor (a MultiHeadAttention's query, value, key)
                    attrs[f"ml.{which}.shapes"] = [list(k[0]) for k in known]
                    attrs[f"ml.{which}.dtypes"] = [k[1] for k in known]
            self._eager_flops(frame[0], attrs)
        except Exception:
            pass
        records.add_new(span.id, span.parent_id, span.start_ns, span.end_ns, span.track_id, key, span.name, attrs)

    def pending_spans(self) -> int:
        """Eager layer calls recorded and not flushed yet (the session's span limit counts them)."""
        return len(self._layer_records)

    def _work_kind(self, cls: type) -> str | None:
        """A Keras layer class's kind of work (``tf_flops.keras_layer_kind``), kept per class; None
        for a MultiHeadAttention subclass with a ``call`` or an attention of its own."""
        kind = self._work_kinds.get(cls, "")
        if kind == "":
            kind = keras_layer_kind(c.__name__ for c in cls.__mro__)
            if kind == "attention" and not _plain_attention(cls):
                kind = None
            self._work_kinds[cls] = kind
        return kind

    def _eager_flops(self, layer: Any, attrs: dict[str, Any]) -> None:
        """Sets ``ml.flops`` of an eager call of a Dense, EinsumDense, (depthwise) convolution or
        MultiHeadAttention layer from its input and output shapes and its settings
        (``tf_flops.keras_layer_flops``, ``keras_attention_flops``; no weight is read, so nothing
        runs): the profiler records no shapes for eager ops, so without it only the layer's graph
        calls (predict(), tf.function) would have FLOPs, while all its calls count in its time."""
        kind = self._work_kind(type(layer))
        inputs, outputs = attrs.get("ml.input.shapes"), attrs.get("ml.output.shapes")
        if kind is None or not inputs or not outputs:
            return
        if kind == "attention":
            self._attention_flops(layer, inputs, outputs[0], attrs)
            return
        kernel_size = getattr(layer, "kernel_size", ())
        flops = keras_layer_flops(
            kind,
            inputs[0],
            outputs[0],
            kernel_size=tuple(kernel_size) if isinstance(kernel_size, (tuple, list)) else (),
            groups=int(getattr(layer, "groups", 1) or 1),
            channels_first=getattr(layer, "data_format", None) == "channels_first",
            equation=getattr(layer, "equation", None),
        )
        if flops is not None:
            attrs["ml.flops"] = flops

    @staticmethod
    def _attention_flops(layer: Any, inputs: list[Any], output: Any, attrs: dict[str, Any]) -> None:
        """Sets ``ml.flops`` of an eager MultiHeadAttention call (inputs: query, value, and key
        where given): its projections and its two attention products, the whole layer's work, so
        that its row counts the products its eager einsums carry none for, and its EinsumDense
        children's FLOPs once (an explicit ``ml.flops`` is a layer's, its children's not added)."""
        if len(inputs) < 2:
            return
        # Keras 3 has them as properties; tf_keras only as the private attributes they return.
        heads, key_dim, value_dim, axes = (
            getattr(layer, name, None) or getattr(layer, f"_{name}", None)
            for name in ("num_heads", "key_dim", "value_dim", "attention_axes")
        )
        value_dim = value_dim or key_dim
        if not (isinstance(heads, int) and isinstance(key_dim, int) and isinstance(value_dim, int)):
            return
        if min(heads, key_dim, value_dim) <= 0:
            return
        flops = keras_attention_flops(
            inputs[0],
            inputs[1],
            inputs[2] if len(inputs) > 2 else inputs[1],
            output,
            num_heads=heads,
            key_dim=key_dim,
            value_dim=value_dim,
            attention_axes=tuple(axes) if isinstance(axes, (tuple, list)) else None,
        )
        if flops is not None:
            attrs["ml.flops"] = flops

    def _graph_wrapper(self, orig: Callable[..., Any], method: str) -> Callable[..., Any]:
        """Wraps ``predict``, ``evaluate``…: one model span per call. They run the model as a graph
        function, so its layers and ops come from the profiler, one layer span per layer per batch."""
        source = self

        def wrapper(model: Any, *args: Any, **kwargs: Any) -> Any:
            if not source._active:
                return orig(model, *args, **kwargs)
            try:
                frame = source._model_frame(model, method, args, kwargs, eager=False)
            except Exception:
                return orig(model, *args, **kwargs)
            stack = source._stack()
            stack.append(frame)
            try:
                return orig(model, *args, **kwargs)
            finally:
                source._exit(stack, frame, None)

        wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        wrapper.__name__ = method
        wrapper.__doc__ = orig.__doc__
        return wrapper

    def _class_location(self, layer: Any, attrs: dict[str, Any]) -> None:
        attrs.update(defined_attrs(getattr(type(layer), "call", None), f"{type(layer).__name__}.call"))

    def _shapes(self, x: Any, attrs: dict[str, Any], which: str) -> None:
        shape = getattr(x, "shape", None)
        if shape is None:
            return
        try:
            dims = [-1 if d is None else int(d) for d in tuple(shape)]
        except (TypeError, ValueError):
            return
        attrs[f"ml.{which}.shapes"] = [dims]
        dtype = getattr(x, "dtype", None)
        attrs[f"ml.{which}.dtypes"] = [str(getattr(dtype, "name", dtype))]

    # -- stop ------------------------------------------------------------------------

    def sealed_until_ns(self) -> int | None:
        """0 once its profiler has run: its ops come from the XSpace at ``stop()``."""
        return 0 if self._profiled else None

    def stop(self) -> list[Event]:
        self._active = False
        try:
            try:
                self._stop_profiler()
            except Exception as exc:
                self._warn(f"stopping the TensorFlow profiler failed: {exc}")
        finally:
            try:
                self._unpatch()
            finally:
                self._remove_hooks()
                if self._set_onednn:
                    # TensorFlow's oneDNN has read it already; taking it back keeps child processes as they were.
                    c_environ.take_back(_ONEDNN_ENV)
                    self._set_onednn = False
        session = self._session
        events: list[Event] = []
        try:
            if session is not None:
                events = self._collect(session)
        finally:
            for logdir in self._logdirs:
                shutil.rmtree(logdir, ignore_errors=True)
            self._logdirs.clear()
            self._function_graphs.clear()
        return events

    def _collect(self, session: SessionView) -> list[Event]:
        events: list[Event] = []
        info: dict[str, Any] = {"model_spans": len(self._live), "models": sorted(self._models), "profiles": []}
        threads = dict(self._threads)
        if self._logdirs:  # profiles to read: their formats are needed (bound already where TensorFlow was imported)
            _load_formats()
            for t in threading.enumerate():
                if t.ident is not None and t.native_id is not None:
                    threads.setdefault(std_thread_hash(t.ident), (t.native_id, t.name))
        flops = self._function_flops()
        model_names = self._function_model_names()
        for logdir in self._logdirs:
            for path in find_xplane_files(logdir):
                try:
                    profile = host_profile(read_xspace(path))
                except (OSError, ValueError, ImportError) as exc:
                    self._warn(f"could not read {path.name}: {exc}")
                    continue
                if profile.start_ns == 0 and profile.clock == "relative":
                    self._warn(f"{path.name} has no profile start time; its events cannot be placed")
                    continue
                converted = xspace_to_events(
                    profile,
                    to_session_ns=session.anchor.epoch_to_session,
                    tracks=session.tracks,
                    new_id=session.new_id,
                    levels=session.levels,
                    live_models=self._live,
                    models=self._models,
                    python_threads=threads,
                    function_calls=self._function_calls,
                    function_flops=flops,
                    function_model_names=model_names,
                    signatures=self._signatures,
                )
                events.extend(converted.events())
                info["profiles"].append(converted.stats.as_dict())
        xla = sum(p["xla_calls"] for p in info["profiles"])
        if xla:
            self._note(
                f"{xla} XLA-compiled call(s) (jit_compile=True) are model spans without layers or ops: "
                "XLA runs the whole function as one compiled op"
            )
        unmatched = sum(p["function_calls_unmatched"] for p in info["profiles"])
        if unmatched:
            self._note(
                f"{unmatched} graph-function call(s) (tf.function, SavedModel) ran ops under no known Keras model's "
                "name scope: they are not model calls, their ops are left out"
            )
        if self._live or self._logdirs:
            session.meta.setdefault("sources_info", {})[self.name] = {**info, "problems": list(self._problems)}
        self._note_problems(session)
        return events
