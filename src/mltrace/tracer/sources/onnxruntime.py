"""ONNX Runtime at the model, layer (graph node) and op (node kernel) levels.

Nothing in the user's code changes. When the program imports ``onnxruntime`` (now, if it
already has), ``OrtSource`` wraps ``InferenceSession.__init__`` (ORT's own profiler on for each
new session: ``_init``), ``Session.run`` and its variants (one model span per call:
``_run_wrapper``) and ``Session.end_profiling`` (``_end_profiling``). At ``stop()`` each
profile is converted by ``ort_profile.ort_profile_to_events``: node spans (``Level.LAYER``)
under the matching model span and kernel spans (``Level.OP``) under their node, on the
threads ORT ran them on.
"""

from __future__ import annotations

import glob
import importlib.util
import itertools
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mltrace.run.events import Event
from mltrace.run.levels import Level
from mltrace.tracer.callsite import model_call_site
from mltrace.tracer.sources._imports import PostImportHook
from mltrace.tracer.sources.base import FrameworkSource

if TYPE_CHECKING:
    from mltrace.formats.ort_profile import LiveRun, OnnxGraph
    from mltrace.tracer.sources.base import SessionView

_RUN_METHODS = ("run", "run_with_iobinding", "run_with_ort_values")


@dataclass
class _OrtSession:
    """What mltrace knows about one ``InferenceSession``."""

    index: int
    model_name: str
    attrs: dict[str, Any]
    ref: weakref.ref[Any] | None = None
    prefix: str | None = None  # profile file prefix when mltrace turned profiling on
    user_profiling: bool = False  # the program turned profiling on itself
    start_ns: int = 0  # get_profiling_start_time_ns()
    clock: str = "epoch"
    graph: OnnxGraph | None = None
    gpu_device: int = 0
    calls: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    runs: list[LiveRun] = field(default_factory=list)
    profiles: list[str] = field(default_factory=list)  # files the program's end_profiling() returned


def _model_name(path: str | None, graph: OnnxGraph | None, meta_graph_name: str | None) -> str:
    """The model span's name: the exported torch class, else the file's stem, else the graph's name."""
    if graph is not None and graph.from_pytorch:
        root = graph.torch_root_class()
        if root:
            return root
    if path:
        stem = os.path.basename(path)
        return stem[: -len(".onnx")] if stem.endswith(".onnx") else stem
    return meta_graph_name or (graph.graph_name if graph is not None else "") or "onnxruntime"


def _start_clock(value: int) -> str:
    """Which clock ``get_profiling_start_time_ns()`` counts on (the nearer of the two)."""
    return "epoch" if abs(value - time.time_ns()) < abs(value - time.monotonic_ns()) else "monotonic"


def _input_shapes(feed: Any) -> tuple[list[list[int]], list[str]]:
    shapes: list[list[int]] = []
    dtypes: list[str] = []
    if not isinstance(feed, dict):
        return shapes, dtypes
    for value in feed.values():
        shape = getattr(value, "shape", None)
        if callable(shape):  # OrtValue.shape()
            try:
                shape = shape()
                dtype = str(value.data_type()).removeprefix("tensor(").removesuffix(")")
            except Exception:
                continue
            dtype = {"float": "float32", "double": "float64"}.get(dtype, dtype)
        else:
            dtype = str(getattr(getattr(value, "dtype", None), "name", "")) or type(value).__name__
        if isinstance(shape, (tuple, list)):
            shapes.append([int(d) for d in shape])
            dtypes.append(dtype)
    return shapes, dtypes


class OrtSource(FrameworkSource):
    """Model, node and kernel spans for ONNX Runtime, from wrappers and ORT's profiler."""

    name = "onnxruntime"
    #: the ``ml.framework`` whose model calls count toward this op level's end (``--op-inferences``)
    framework = "onnxruntime"
    levels: tuple[Level, ...] = (Level.MODEL, Level.LAYER, Level.OP)

    def __init__(self) -> None:
        super().__init__()
        self._session: SessionView | None = None
        self._hook: PostImportHook | None = None
        self._infos: weakref.WeakKeyDictionary[Any, _OrtSession] = weakref.WeakKeyDictionary()
        self._all: list[_OrtSession] = []
        self._indices = itertools.count(1)
        self._lock = threading.Lock()
        self._tmp: str | None = None
        self._profile = False
        self._thread_names: dict[int, str] = {}
        self._active = False
        self._ended_early = False  # profiling ended before the session (``end_early``)
        self._after_start: list[Callable[[], None]] = []

    def available(self) -> str | None:
        if importlib.util.find_spec("onnxruntime") is None:
            return "onnxruntime is not installed"
        return None

    def start(self, session: SessionView) -> None:
        self._session = session
        self._profile = Level.LAYER in session.levels or Level.OP in session.levels
        self._begin = session.recorder.begin
        self._end = session.recorder.end
        self._active = True
        self._hook = PostImportHook("onnxruntime", self._install)

    # -- ending early (tracer/windows.py) -------------------------------------------------

    @property
    def can_end_early(self) -> bool:
        """Whether the op and layer levels (ORT's profiler) can end before the session does."""
        return self._profile

    @property
    def profiling(self) -> bool:
        """Whether a session is being profiled by mltrace now."""
        return not self._ended_early and any(info.prefix is not None for info in self._all)

    @property
    def recording_ops(self) -> bool:
        """Its nodes and kernels are recorded while its profiler runs."""
        return self.profiling

    def around_profiler_start(self, before: Callable[[], None], after: Callable[[], None]) -> None:
        """Calls ``after`` once the first session mltrace profiles exists (now, if one does): the
        op level's memory budget counts from there, not from the program's imports."""
        if self.profiling:
            after()
        else:
            self._after_start.append(after)

    def end_early(self) -> None:
        """Ends the profiling mltrace turned on, in every live session, keeping the files for
        ``stop()``; sessions created later are not profiled. Node and kernel spans come from
        that profile, so the layer and op levels end together. A second call does nothing
        (ORT would warn on the program's stderr for each session)."""
        if self._ended_early:
            return
        self._ended_early = True
        for info in list(self._all):
            sess = info.ref() if info.ref is not None else None
            if info.prefix is None or sess is None:
                continue
            try:
                path = sess._sess.end_profiling()  # the C session: the program's end_profiling is not called
            except Exception as exc:
                self._warn(f"end_profiling failed for session {info.index}: {exc}")
                continue
            if path:
                info.profiles.append(str(path))

    def release_in_forked_child(self) -> None:
        """In a child forked while the session runs: the wrappers call straight through here
        (as once the trace is full), and the profilers are left to the parent."""
        self._active = False

    def end_recording(self) -> None:
        """The trace is full (``Session.fill``): no more model spans; profiling ends."""
        self._active = False
        self.end_early()

    # -- patching ------------------------------------------------------------

    def _install(self, ort: Any) -> None:
        try:
            from onnxruntime.capi import onnxruntime_inference_collection as oic
        except Exception as exc:  # a broken install: the program will see it too
            self._problems.append(f"could not hook onnxruntime: {exc}")
            return
        source = self
        base, inference = oic.Session, oic.InferenceSession
        orig_init = inference.__dict__["__init__"]

        def __init__(sess: Any, *args: Any, **kwargs: Any) -> None:
            source._init(orig_init, sess, args, kwargs)

        __init__.__wrapped__ = orig_init  # type: ignore[attr-defined]
        self._patch(inference, "__init__", __init__)
        for method in _RUN_METHODS:
            orig = base.__dict__.get(method)
            if orig is not None:
                self._patch(base, method, self._run_wrapper(orig))
        orig_end = base.__dict__.get("end_profiling")
        if orig_end is not None:

            def end_profiling(sess: Any) -> Any:
                return source._end_profiling(orig_end, sess)

            end_profiling.__wrapped__ = orig_end  # type: ignore[attr-defined]
            self._patch(base, "end_profiling", end_profiling)

    # -- wrappers (they never raise into the program on mltrace's account) -----

    def _init(self, orig: Callable[..., None], sess: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``InferenceSession.__init__``: with the layer or op level on, turns ORT's profiler on
        for the new session (``enable_profiling`` and a file prefix in a private temporary
        directory) and restores the caller's ``SessionOptions`` right after, so the object they
        passed is unchanged; ``_register`` reads the model's graph (node and value names and
        the ``torch.onnx`` metadata, no weights) to map nodes to PyTorch modules.

        ONNX Runtime 1.31's Python ``RunOptions`` has no per-run profiling switch (the C API
        gained one), so a session is profiled from its creation; its profiler stops recording
        after 1,000,000 events, which is detected and reported. A session whose profiling the
        program turned on itself is left alone: its profile is read only if the program calls
        ``end_profiling()`` while tracing.
        """
        if not self._active:
            orig(sess, *args, **kwargs)
            return
        path_or_bytes = args[0] if args else kwargs.get("path_or_bytes")
        options = args[1] if len(args) > 1 else kwargs.get("sess_options")
        restore: tuple[Any, bool, str] | None = None
        info: _OrtSession | None = None
        try:
            index = next(self._indices)  # atomic: concurrent constructors get distinct profile prefixes
            info = _OrtSession(index, "onnxruntime", {})
            if self._profile and not self._ended_early:
                if options is None:
                    import onnxruntime

                    options = onnxruntime.SessionOptions()
                    if len(args) > 1:
                        args = (args[0], options, *args[2:])
                    else:
                        kwargs = {**kwargs, "sess_options": options}
                if options.enable_profiling:
                    info.user_profiling = True
                else:
                    restore = (options, options.enable_profiling, options.profile_file_prefix)
                    if self._tmp is None:
                        self._tmp = tempfile.mkdtemp(prefix="mltrace-ort-")
                    info.prefix = os.path.join(self._tmp, f"s{index}")
                    options.enable_profiling = True
                    options.profile_file_prefix = info.prefix
        except Exception as exc:
            self._warn(f"could not enable ONNX Runtime profiling: {exc}")
        try:
            orig(sess, *args, **kwargs)
        finally:
            if restore is not None:
                try:
                    restore[0].enable_profiling = restore[1]
                    restore[0].profile_file_prefix = restore[2]
                except Exception:
                    pass
        if info is not None:
            try:
                self._register(sess, info, path_or_bytes)
            except Exception as exc:
                self._warn(f"could not inspect an InferenceSession: {exc}")
            while info.prefix is not None and self._after_start:
                self._after_start.pop(0)()

    def _register(self, sess: Any, info: _OrtSession, path_or_bytes: Any) -> None:
        from mltrace.formats.ort_profile import read_onnx_graph  # once onnxruntime is used: not at the session's start

        path = os.fspath(path_or_bytes) if isinstance(path_or_bytes, (str, os.PathLike)) else None
        graph: OnnxGraph | None = None
        if isinstance(path_or_bytes, (str, os.PathLike, bytes)) and (info.prefix is not None or info.user_profiling):
            try:
                graph = read_onnx_graph(path_or_bytes)
            except (OSError, ValueError):
                graph = None  # an .ort model or an unreadable file: nodes keep ORT's names only
        info.graph = graph
        meta_name: str | None = None
        try:
            meta_name = sess.get_modelmeta().graph_name
        except Exception:
            pass
        info.model_name = _model_name(path, graph, meta_name)
        providers: list[str] = []
        try:
            providers = list(sess.get_providers())
            cuda = sess.get_provider_options().get("CUDAExecutionProvider", {})
            info.gpu_device = int(cuda.get("device_id", 0) or 0)
        except Exception:
            pass
        attrs: dict[str, Any] = {"ml.framework": "onnxruntime", "ml.layer.type": "InferenceSession", "ml.ort.session": info.index}
        if providers:
            attrs["ml.ort.provider"] = providers[0]
            attrs["ml.ort.providers"] = providers
        if path:
            attrs["ml.ort.model.path"] = os.path.abspath(path)
        if graph is not None:
            attrs["ml.ort.graph"] = graph.graph_name
            if graph.producer_name:
                attrs["ml.ort.producer"] = f"{graph.producer_name} {graph.producer_version}".strip()
        try:
            level = sess.get_session_options().graph_optimization_level
            attrs["ml.ort.graph_optimization_level"] = str(getattr(level, "name", level))
        except Exception:
            pass
        info.attrs = attrs
        if info.prefix is not None or info.user_profiling:
            try:
                info.start_ns = int(sess.get_profiling_start_time_ns())
                info.clock = _start_clock(info.start_ns)
            except Exception:
                info.start_ns = 0
        info.ref = weakref.ref(sess)
        with self._lock:
            self._all.append(info)
            self._infos[sess] = info

    def _info_of(self, sess: Any) -> _OrtSession | None:
        info = self._infos.get(sess)
        if info is None and self._active:
            # A session made before tracing started: model spans only.
            try:
                info = _OrtSession(next(self._indices), "onnxruntime", {})
                self._register(sess, info, getattr(sess, "_model_path", None))
            except Exception:
                return None
        return info

    def _run_wrapper(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        """Wraps ``Session.run``, ``run_with_iobinding`` or ``run_with_ort_values``: one model
        span per call, on the calling thread, through the live recorder."""
        from mltrace.formats.ort_profile import LiveRun  # once onnxruntime is used: not at the session's start

        source = self

        def run(sess: Any, *args: Any, **kwargs: Any) -> Any:
            if not source._active:
                return orig(sess, *args, **kwargs)
            span = None
            info = None
            try:
                info = source._info_of(sess)
                if info is not None:
                    span = source._run_begin(info, orig.__name__, args, kwargs)
            except Exception:
                span = None
            try:
                return orig(sess, *args, **kwargs)
            finally:
                if span is not None and info is not None:
                    source._end(span)
                    info.runs.append(LiveRun(span.id, span.start_ns, span.end_ns, threading.get_native_id()))
                    if source._session is not None:
                        source._session.model_call_ended("onnxruntime")

        run.__wrapped__ = orig  # type: ignore[attr-defined]
        run.__name__ = orig.__name__
        run.__doc__ = orig.__doc__
        return run

    def _run_begin(self, info: _OrtSession, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        attrs = dict(info.attrs)
        attrs["ml.model.invocation"] = next(info.calls)
        attrs["ml.ort.method"] = method
        if method == "run":
            feed = args[1] if len(args) > 1 else kwargs.get("input_feed")
            shapes, dtypes = _input_shapes(feed)
            if shapes:
                attrs["ml.input.shapes"] = shapes
                attrs["ml.input.dtypes"] = dtypes
        site = model_call_site(sys._getframe(1))
        if site:
            attrs.update(site)
            attrs["ml.call.file.path"], attrs["ml.call.line.number"] = site["code.file.path"], site["code.line.number"]
        tid = threading.get_native_id()
        if tid not in self._thread_names:
            self._thread_names[tid] = threading.current_thread().name
        return self._begin(info.model_name, Level.MODEL, attrs)

    def _end_profiling(self, orig: Callable[[Any], Any], sess: Any) -> Any:
        """``Session.end_profiling``: for a session whose profiling mltrace turned on, keeps the
        file and returns ``""`` as a plain run would."""
        path = orig(sess)
        info = self._infos.get(sess)
        if info is None:
            return path
        if info.prefix is not None:
            if path:
                info.profiles.append(str(path))
            return ""  # as in a plain run, where profiling was off
        if info.user_profiling and path:
            info.profiles.append(str(path))
        return path

    # -- stop -------------------------------------------------------------------

    def sealed_until_ns(self) -> int | None:
        """0 once a session is profiled: its nodes come from the profile files at ``stop()``."""
        return 0 if self._all else None

    def stop(self) -> list[Event]:
        """Takes the wrappers and the import hook off, then ends profiling on sessions still
        alive (ORT writes the file of a session destroyed earlier itself) and converts each
        profile (``_collect``)."""
        self._active = False
        try:
            self._unpatch()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
        session = self._session
        events: list[Event] = []
        try:
            if session is not None:
                events = self._collect(session)
        finally:
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None
        return events

    def _ops_end_ns(self, meta: dict[str, Any]) -> int | None:
        """When this source's op level ended early (session ns), as the analysis reads it from
        run.json's ``op_window`` (its framework's entry, else the window's own), or None."""
        window = meta.get("op_window")
        if not isinstance(window, dict):
            return None
        frameworks = window.get("frameworks")
        entry = frameworks.get(self.framework) if isinstance(frameworks, dict) and frameworks else window
        ended = entry.get("ended_ns") if isinstance(entry, dict) else None
        return ended if isinstance(ended, int) and not isinstance(ended, bool) else None

    def _collect(self, session: SessionView) -> list[Event]:
        if not self._all:  # no ONNX Runtime session ran: no profile, and the converter's import is not paid at every stop
            self._note_problems(session)
            return []
        from mltrace.formats.ort_profile import TorchModuleMapper, iter_ort_profile, ort_profile_to_events

        events: list[Event] = []
        infos: list[dict[str, Any]] = []
        for info in self._all:
            files = list(info.profiles)
            if info.prefix is not None:
                sess = info.ref() if info.ref is not None else None
                if sess is not None and not self._ended_early:
                    try:
                        path = sess._sess.end_profiling()  # the C session: our wrapper is already off
                        if path:
                            files.append(str(path))
                    except Exception as exc:
                        self._warn(f"end_profiling failed for session {info.index}: {exc}")
                # Sessions destroyed earlier wrote their file themselves.
                files += [f for f in sorted(glob.glob(glob.escape(info.prefix) + "_*.json")) if f not in files]
            elif info.user_profiling and not files:
                session.note_limitation(
                    f"onnxruntime session {info.index} ({info.model_name}): the program enabled ONNX Runtime "
                    "profiling itself and did not call end_profiling() while tracing, so only model spans are recorded"
                )
            summary: dict[str, Any] = {"session": info.index, "model": info.model_name, "runs": len(info.runs), "profiles": len(files)}
            for n, path in enumerate(files):
                if n > 0 and info.prefix is not None:
                    # A second file comes from a session rebuilt by set_providers(): its start time is unknown.
                    session.note_limitation(
                        f"onnxruntime session {info.index}: profile {os.path.basename(path)} could not be aligned and is skipped"
                    )
                    continue
                raw = iter_ort_profile(path)
                to_session: Callable[[int], int]
                if info.clock == "epoch":
                    to_session = session.anchor.epoch_to_session
                else:

                    def to_session(ns: int) -> int:
                        return ns

                try:
                    converted = ort_profile_to_events(
                        raw,
                        start_ns=info.start_ns,
                        to_session_ns=to_session,
                        tracks=session.tracks,
                        new_id=session.new_id,
                        levels=session.levels,
                        live_runs=info.runs,
                        mapper=TorchModuleMapper(info.graph) if info.graph is not None else None,
                        model_name=info.model_name,
                        model_attrs=info.attrs,
                        thread_names=self._thread_names,
                        gpu_device=info.gpu_device,
                        clock=info.clock,
                        ops_end_ns=self._ops_end_ns(session.meta),
                    )
                except (OSError, ValueError) as exc:
                    self._warn(f"could not read profile {path}: {exc}")
                    continue
                events.extend(converted.events())
                st = converted.stats
                summary.update(st.as_dict())
                if st.truncated:
                    session.note_limitation(
                        f"onnxruntime session {info.index} ({info.model_name}): ONNX Runtime's profiler stopped at its "
                        f"cap of 1,000,000 events; {st.runs_without_nodes} of {len(info.runs)} runs have no node spans"
                    )
                if st.alignment_slack_ns is not None and st.alignment_slack_ns < 0:
                    session.note_limitation(
                        f"onnxruntime session {info.index}: ORT's clock disagreed with mltrace's by up to "
                        f"{-st.alignment_slack_ns} ns; its events were shifted by {st.shift_ns} ns"
                    )
                if st.torch_unmapped:
                    session.note_limitation(
                        f"onnxruntime session {info.index} ({info.model_name}): {st.torch_unmapped} node spans could not "
                        f"be mapped to a PyTorch module (e.g. {', '.join(st.unmapped_examples[:3])})"
                    )
            infos.append(summary)
        if self._all:
            session.meta.setdefault("sources_info", {})[self.name] = {"sessions": infos, "problems": list(self._problems)}
        self._note_problems(session)
        return events
