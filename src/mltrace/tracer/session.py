"""A profiling session: run directory, recorder, sources, and the hand-over to the finish.

``Session.start()`` creates the run directory, starts the streaming flusher
and every enabled, available source. ``Session.stop()`` stops the sources (each
in its own ``try``), closes what was left open, and hands the run to its finish
(``Finish``, which the layer above gives: ``mltrace/finish.py`` correlates every
event and rewrites the run's files atomically). Failures of mltrace's own
parts are warned about and recorded in run.json; they never raise into the
user's program once it is running.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, Protocol

from mltrace.config import ProfileOptions
from mltrace.errors import UsageError
from mltrace.run import store
from mltrace.run.events import Event
from mltrace.run.gcpause import gc_paused
from mltrace.run.levels import HIERARCHY, Level, levels_down_to
from mltrace.run.metadata import base_metadata
from mltrace.tracer.clock import ClockAnchor, boot_id, now_ns
from mltrace.tracer.finishguard import FinishGuard, FinishInterrupted
from mltrace.tracer.memwatch import (
    FINALIZE_BYTES_PER_SPAN,
    MemoryWatch,
    default_budget,
    default_span_limit,
    read_meminfo,
    release_free_memory,
)
from mltrace.tracer.messages import say, warn
from mltrace.tracer.recorder import Flusher, Recorder, events_of
from mltrace.tracer.sources.base import (
    CostsMemoryToStop,
    CountsPendingSpans,
    EndsEarly,
    EndsLayerLevel,
    EndsRecording,
    HandsOverEvents,
    HoldsOpenSpans,
    ReleasesInForkedChild,
    Source,
    StartsAProfiler,
)
from mltrace.tracer.tracks import TrackRegistry
from mltrace.tracer.windows import LevelWindow, can_end_early

log = logging.getLogger("mltrace")

_active: Session | None = None
#: The session whose ``start()`` is under way in this process.
_starting: Session | None = None


def active_session() -> Session | None:
    """The running session, if any."""
    return _active


def session_in_process() -> Session | None:
    """The running session, else the one whose ``start()`` is under way, else None."""
    return _active or _starting


class Finish(Protocol):
    """The end of a run, which the layer above the tracer gives (``mltrace/finish.py``:
    ``import mltrace`` sets it with ``use_finish``). It may also have
    ``seal(run_dir, sealed_ns, open_ns)``, told at each flush that every event ending by
    ``sealed_ns`` is written and that no span running began before ``open_ns`` (None: none
    runs): it may then finish that part while the program runs."""

    def finalize(self, run_dir: Path, meta: dict[str, Any], phase: Callable[[str], None]) -> object:
        """Correlates the streamed events and rewrites the run's files (``phase`` is told each step)."""
        ...

    def print_summary(self, run_dir: Path) -> None:
        """Prints a finished run's summary."""
        ...


_finish: Finish | None = None


def use_finish(finish: Finish) -> None:
    """Makes ``finish`` end every session from now on."""
    global _finish
    _finish = finish


def finish_in_use() -> Finish:
    """The finish that ``use_finish`` set.

    Raises:
        RuntimeError: if none was set.
    """
    if _finish is None:
        raise RuntimeError("no finish was set (mltrace.tracer.session.use_finish)")
    return _finish


def _forget_in_forked_child() -> None:
    """After ``os.fork()``, in the child: the running session is the parent's. The child has a
    copy of it but none of its threads (the flusher, the readers), so it records nothing more:
    the session stops being active here, the sources that hook the program in-process take
    their hooks out (``release_in_forked_child``), and its ``stop()`` writes nothing. The
    parent's run goes on as before."""
    global _active
    session, _active = _active, None
    if _traced_here:
        _skip_native_teardown()
    if session is None:
        return
    session.forked_copy = True
    for source in session.started:
        if isinstance(source, ReleasesInForkedChild):
            try:
                source.release_in_forked_child()
            except Exception:  # noqa: BLE001 - nothing may fail the user's fork
                pass


#: A session has run in this process: a child forked from now on must not run the native
#: libraries' exit-time teardown (``_skip_native_teardown``).
_traced_here = False
#: libc's ``on_exit``, ``__cxa_atexit``, ``_exit`` and ``fflush``, looked up when the first
#: session starts (None where libc lacks them), so the fork handler does no imports.
_libc_exit: tuple[Any, Any, int, int] | None = None


def _prepare_native_teardown_skip() -> None:
    """Looks up the libc functions ``_skip_native_teardown`` registers (glibc only)."""
    global _traced_here, _libc_exit
    _traced_here = True
    if _libc_exit is not None or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        on_exit, cxa_atexit = libc.on_exit, libc.__cxa_atexit
        on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        cxa_atexit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        exit_now = ctypes.cast(libc._exit, ctypes.c_void_p).value
        flush_all = ctypes.cast(libc.fflush, ctypes.c_void_p).value
    except (OSError, AttributeError, ImportError):
        return
    if exit_now and flush_all:
        _libc_exit = (on_exit, cxa_atexit, exit_now, flush_all)


def _skip_native_teardown() -> None:
    """In a forked child: makes C ``exit()`` flush C stdio and end the process with its status
    before the native libraries' exit handlers and C++ static destructors registered in the
    parent run.

    Those are the parent's state, copied without its threads. torch.profiler's Kineto keeps a
    configuration thread waiting on a condition variable; in the child its destructor
    (``libkineto::ConfigLoader::~ConfigLoader`` → ``pthread_cond_destroy``) waits for that
    waiter forever, so a child that ends through ``sys.exit`` or by returning would hang.
    Python's own finalization (``atexit``, flushing ``sys.stdout``) still runs first, and the
    exit status is the child's: glibc calls an ``on_exit`` function with it, and handlers run
    last-registered first, so ``fflush(NULL)`` (``__cxa_atexit`` passes its argument first) runs,
    then ``_exit(status)``. Handlers the child registers itself still run before both.
    """
    hooks = _libc_exit
    if hooks is None:
        return
    on_exit, cxa_atexit, exit_now, flush_all = hooks
    try:
        if on_exit(exit_now, None) == 0:
            cxa_atexit(flush_all, None, None)
    except Exception:  # noqa: BLE001 - nothing may fail the user's fork
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_forked_child)


#: Seconds a stop may take before the user is told the trace is still being written.
FINISHING_NOTICE_S = 2.0
#: The longest the session's stop waits for an op level's end that another thread is making
#: (its profilers stopping and writing what they held: seconds, on a large run).
OP_LEVEL_END_WAIT_S = 120.0


class StopProgress:
    """What the end of a session is doing, said on stderr only once it has taken a while.

    ``stop()`` calls ``phase`` at each step; after ``FINISHING_NOTICE_S`` a timer calls
    ``notice``, which says where the trace goes and the current step, and every later
    step is said as it begins. A quick stop says nothing.
    """

    def __init__(self, run_dir: Path | None) -> None:
        self._run_dir = run_dir
        self._step = "stopping the sources"
        self._loud = False
        self._lock = threading.Lock()

    def notice(self) -> None:
        with self._lock:
            self._loud = True
            say(f"writing the trace to {self._run_dir}: {self._step}…")

    @property
    def step(self) -> str:
        """What the finish is doing now."""
        return self._step

    def phase(self, step: str) -> None:
        with self._lock:
            self._step = step
            if self._loud:
                say(f"… {step}")


def default_run_dir(name: str, base: Path | None = None, *, create: bool = False) -> Path:
    """``./mltrace-runs/<name>-<YYYYmmdd-HHMMSS>`` (with a suffix if taken). With ``create`` the
    directory is made here, atomically, so that processes started in the same second (the ranks
    of ``torchrun --no-python … mltrace python``) each get their own."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "run"
    root = (base or Path.cwd()) / "mltrace-runs"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate = root / f"{safe}-{stamp}"
    n = 2
    while not _takes(candidate, create):
        candidate = root / f"{safe}-{stamp}-{n}"
        n += 1
    return candidate


def _takes(candidate: Path, create: bool) -> bool:
    """Whether ``default_run_dir`` may use ``candidate``: absent (``create``: made here, by this
    process only); one that cannot be made is taken too, for ``prepare_run_dir`` to say why."""
    if not create:
        return not candidate.exists()
    try:
        candidate.mkdir(parents=True)
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


#: The file a session's run directory holds from ``prepare_run_dir(claim=True)`` until its
#: run.json is written (``release_run_dir``).
CLAIM_FILE = ".mltrace-claim"


def prepare_run_dir(path: Path, *, claim: bool = False) -> Path:
    """Creates ``path`` for a new run; refuses a non-empty or unwritable one. With ``claim`` the
    directory is taken atomically: it holds ``CLAIM_FILE`` (created exclusively) until the
    session releases it, so a second process given the same directory at the same time (each
    rank of ``torchrun --no-python … mltrace python -o DIR``) is refused instead of writing into
    the same run.

    Raises:
        UsageError: if the directory cannot be used.
    """
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"output {path} exists and is not a directory")
        _refuse_taken(path, [p.name for p in path.iterdir()])
    probe = path / (CLAIM_FILE if claim else f".mltrace-write-test-{os.getpid()}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        _refuse_taken(path, [CLAIM_FILE])
    except OSError as exc:
        raise UsageError(f"cannot write output directory {path}: {exc.strerror or exc}") from None
    if claim:
        others = [p.name for p in path.iterdir() if p.name != CLAIM_FILE]
        if others:  # another session claimed it, wrote its run.json and released it meanwhile
            probe.unlink(missing_ok=True)
            _refuse_taken(path, others)
    else:
        probe.unlink(missing_ok=True)
    return path


def _refuse_taken(path: Path, entries: list[str]) -> None:
    """Raises the usage error for a run directory holding ``entries`` (none: returns)."""
    if entries == [CLAIM_FILE]:
        raise UsageError(f"output directory {path} is in use by another mltrace run (choose a new one)")
    if entries:
        raise UsageError(f"output directory {path} is not empty (choose a new one)")


def release_run_dir(path: Path) -> None:
    """Removes ``prepare_run_dir``'s claim: the run's own files hold the directory from now on."""
    (path / CLAIM_FILE).unlink(missing_ok=True)


class Session:
    """One recording, from ``start()`` to ``stop()``.

    Attributes:
        options: the options it was started with.
        run_dir: the run directory (set by ``start``).
        levels: the levels enabled in this session.
        anchor: the clock anchor (monotonic ↔ epoch).
        tracks: the track registry.
        recorder: the live recorder.
        meta: run metadata being built (written to run.json).
        op_windows: when the op level ends, per framework (``LevelWindow.framework``; one
            window keyed None, counting every model call, where no op source names its
            framework); empty where no source of the op level can end early.
        layer_window: when the layer level ends (None where it cannot end early).
        span_limit: ``--max-spans``: spans recorded (every level) at which the deepest levels
            start to end; at twice as many the trace is full (0: no limit).
        full: the trace is full: nothing more is recorded (``fill``).
    """

    def __init__(self, options: ProfileOptions | None = None, sources: list[Source] | None = None) -> None:
        self.options = options or ProfileOptions()
        self._sources_override = sources
        self.run_dir: Path | None = None
        self.levels: frozenset[Level] = frozenset()
        self.anchor = ClockAnchor.take()
        self.tracks = TrackRegistry()
        self._ids = itertools.count(1)
        self.recorder = Recorder(self.tracks, self._ids)
        self.meta: dict[str, Any] = {}
        self.started: list[Source] = []
        self._flusher: Flusher | None = None
        self._writer: store.EventWriter | None = None
        self._pftrace: Any = None
        self._stream_failed = False
        self._streams_closed = False
        self._flush_lock = threading.Lock()
        #: Called by the flusher with each events.jsonl line it wrote (bytes), on its thread;
        #: a sink must return at once (the live OTLP export queues the line and sends it from
        #: its own thread). A sink that raises is removed, with one warning.
        self.batch_sinks: list[Callable[[bytes], None]] = []
        self._stopped = False
        #: Held while an op level ends (``end_op_level``), which ``stop()`` waits for: a stop
        #: begun meanwhile on another thread (SIGTERM) would take the sources from under it.
        self._op_level_ending = threading.RLock()
        self.limitations: list[str] = []
        self.errors: list[str] = []
        self._memory_watch: MemoryWatch | None = None
        self.op_windows: dict[str | None, LevelWindow] = {}
        self._op_sources: dict[str | None, list[EndsEarly]] = {}  # endable op sources by framework (None: shared)
        self._op_end_all: str | None = None  # why the whole op level ends (memory budget, span limit, full trace)
        self._op_sources_ended: list[EndsEarly] = []
        self.layer_window: LevelWindow | None = None
        self.span_limit = 0
        #: What the span limit does at which count of recorded spans, in order (``_watch_span_count``).
        self._span_stages: list[tuple[int, str]] = []
        self._span_next = 0  # the count of the next stage (0: none left, or no limit)
        self._span_lock = threading.Lock()
        self._pending_counts: list[Callable[[], int]] = []  # sources' ``pending_spans``
        #: Sources' ``stop_bytes``: what their stop would add, which the memory budget counts ahead.
        self._stop_costs: list[Callable[[], int]] = []
        #: The sources the op level's memory budget ends (``_watch_op_level``): the process's
        #: growth counts toward it only while one of them holds every event until it stops.
        self._budget_sources: list[EndsEarly] = []
        self._model_call_listeners: list[Callable[[str | None], None]] = []
        self._endless_layers: list[str] = []  # sources whose layer level the span limit cannot end
        self.full = False
        #: True in a child forked from the process running this session: it writes nothing.
        self.forked_copy = False
        #: True where the session traces the whole program (``mltrace python``, a followed child):
        #: the program's own ``mltrace.profile()`` then records its region into this session.
        self.whole_program = False
        #: Writes the run at the end in place of ``finalize_run`` (same arguments): a followed
        #: child's session leaves its events to the parent's finish (``mltrace/follow/``).
        self.finish: Callable[[Path, dict[str, Any], Callable[[str], None]], object] | None = None
        #: Whether the finish may correlate and write the run a part at a time while it runs
        #: (``Finish.seal``): not where another process's finish takes its events.
        self.seals = True
        #: Entries that run.json holds from the start, put in before its first write: a followed
        #: child's ``process`` facts, listed even where the child is killed before its finish.
        self.start_meta: dict[str, Any] = {}
        self._os_exit: tuple[Callable[[int], NoReturn], Callable[[int], NoReturn]] | None = None

    # -- lifecycle -------------------------------------------------------

    def start(self) -> Session:
        """Creates the run directory and starts recording.

        Raises:
            UsageError: for an unusable output directory or a second session (one running, or
                one whose start is under way: its sources look for the frameworks, which a
                followed child's bootstrap takes for their first import).
        """
        global _starting
        if _active is not None or _starting is not None:
            raise UsageError("an mltrace session is already running in this process")
        _starting = self
        try:
            return self._start()
        finally:
            _starting = None

    def _start(self) -> Session:
        """``start``'s work, once no other session runs or starts."""
        global _active
        opts = self.options
        name = opts.name or "profile"
        self.run_dir = prepare_run_dir(opts.output if opts.output is not None else default_run_dir(name, create=True), claim=True)
        self.meta = base_metadata(opts.command, name, redact=opts.redact)
        self.meta.update(self.start_meta)
        self.recorder.redact = opts.redact
        self.meta["run_id"] = uuid.uuid4().hex
        from mltrace.tracer.otel_context import capture_otel_parent, otel_parent_meta

        otel_parent = capture_otel_parent()
        if otel_parent is not None:
            self.meta["otel_parent"] = otel_parent_meta(otel_parent)
        self.meta["clock"] = {
            "domain": "CLOCK_MONOTONIC",
            "unit": "ns",
            "anchor_monotonic_ns": self.anchor.monotonic_ns,
            "anchor_epoch_ns": self.anchor.epoch_ns,
            "anchor_uncertainty_ns": self.anchor.uncertainty_ns,
            "boot_id": boot_id(),
        }
        wanted = set(levels_down_to(opts.level)) if opts.level is not None else set(HIERARCHY)
        self.levels = frozenset(wanted | {Level.USER})
        level_status: dict[str, dict[str, Any]] = {
            lv.label: {"requested": lv in wanted, "recorded": False, "sources": [], "reason": None} for lv in HIERARCHY
        }
        sources = self._sources_override if self._sources_override is not None else _default_sources(opts)
        for source in sources:
            wanted_here = [lv for lv in source.levels if lv in wanted]
            if not wanted_here and source.levels:
                continue
            try:
                reason = source.available()
            except Exception as exc:
                reason = f"availability check failed: {exc}"
            if reason is None:
                try:
                    source.start(self)
                except Exception as exc:
                    reason = f"failed to start: {exc}"
                    warn(f"source {source.name} {reason}")
                else:
                    self.started.append(source)
                    for lv in wanted_here:
                        level_status[lv.label]["recorded"] = True
                        level_status[lv.label]["sources"].append(source.name)
                    continue
            if not source.levels:
                warn(f"{source.name} unavailable: {reason}")
                self.meta.setdefault("sources", {})[source.name] = {"unavailable": reason}
            for lv in wanted_here:
                level_status[lv.label].setdefault("unavailable", {})[source.name] = reason
        for lv in HIERARCHY:
            st = level_status[lv.label]
            if not st["requested"]:
                st["reason"] = f"not requested (--level {opts.level.label})" if opts.level else "not requested"
            elif not st["recorded"]:
                why = st.get("unavailable")
                st["reason"] = "; ".join(f"{k}: {v}" for k, v in why.items()) if why else "no source for this level"
                if opts.level is not None and lv == opts.level:
                    # Asked for by name: say once why it will be missing; the other levels go on.
                    warn(f"{lv.label} level unavailable: {st['reason']}")
        self.meta["levels"] = level_status
        op_level = level_status[Level.OP.label]
        if op_level["recorded"]:  # its profilers hold their events until they stop
            self._watch_op_level(op_level["sources"])
        elif opts.op_inferences is not None:
            self._no_effect(f"--op-inferences {opts.op_inferences} has no effect: the op level is not recorded")
        self._watch_span_count(level_status[Level.LAYER.label]["recorded"])  # the end of a run loads every span
        self.meta["started_at_epoch_ns"] = self.anchor.epoch_ns
        try:
            store.write_meta(self.run_dir, self.meta)
            release_run_dir(self.run_dir)
            self._open_streams()
        except BaseException:
            release_run_dir(self.run_dir)
            # The run cannot be written: take every hook back out before failing.
            for source in reversed(self.started):
                try:
                    source.stop()
                except Exception as exc:
                    warn(f"source {source.name} failed to stop cleanly: {exc}")
            self.started.clear()
            raise
        self._flusher = Flusher(self.flush, opts.flush_interval_s)
        self._flusher.start()
        _prepare_native_teardown_skip()
        _active = self
        self._patch_os_exit()
        return self

    def _patch_os_exit(self) -> None:
        """Puts a wrapper in place of ``os._exit`` that finishes this session's trace before the
        process ends (``os._exit`` runs no ``finally`` and no ``atexit``); ``stop()`` takes it out.
        In a forked child, or once the session has stopped, the wrapper only calls the original."""
        original = os._exit

        def _exit(status: int) -> NoReturn:
            if _active is self and not self._stopped:
                self.meta["exit_status"] = status
                self.meta["exit_via"] = "os._exit"
                fdtap = sys.modules.get("mltrace.tracer.fdtap")  # not imported: no fd tap runs
                if fdtap is not None:  # os._exit drops the stdio buffers: the tap must not flush them
                    fdtap.exiting_without_flush()
                try:
                    self.stop()
                except BaseException:  # noqa: BLE001 - the program asked to leave now, with its status
                    pass
            original(status)

        _exit.__wrapped__ = original  # type: ignore[attr-defined]
        self._os_exit = (original, _exit)
        os._exit = _exit

    def _unpatch_os_exit(self) -> None:
        """Puts ``os._exit`` back, unless something else replaced the wrapper since."""
        if self._os_exit is not None:
            original, wrapper = self._os_exit
            if os._exit is wrapper:
                os._exit = original  # type: ignore[assignment]  # the function it was
            self._os_exit = None

    def _watch_op_level(self, names: list[str]) -> None:
        """Sets up the op level's end: after ``--op-inferences`` model calls or past the memory
        budget where its sources can end early (``LevelWindow``), else a low-memory warning."""
        endable = [s for s in self.started if can_end_early(s)]
        holding = f"the op level ({', '.join(names)})"
        if not endable:
            self._memory_watch = MemoryWatch(holding)
            if self.options.op_inferences is not None:
                self._no_effect(
                    f"--op-inferences {self.options.op_inferences} has no effect: only torch.profiler's (without "
                    "CUDA kernels), TensorFlow's and ONNX Runtime's op levels can end before the run does"
                )
            return
        info = read_meminfo()
        budget = default_budget(info[0] if info else None, self.options.op_memory_gib)
        watch = self._memory_watch = MemoryWatch(f"the op level ({', '.join(s.name for s in endable)})")
        self._stop_costs = [s.stop_bytes for s in endable if isinstance(s, CostsMemoryToStop)]
        self._budget_sources = endable
        for source in endable:  # the budget counts from the profilers' start, not the frameworks' imports
            if isinstance(source, StartsAProfiler):
                source.around_profiler_start(lambda: None, lambda: watch.arm(budget))
            else:
                watch.arm(budget)
        self.meta["op_window"] = {"limit": self.options.op_inferences, "memory_budget_bytes": budget}
        for source in endable:
            self._op_sources.setdefault(source.framework, []).append(source)
        frameworks: list[str | None] = [*sorted(f for f in self._op_sources if f is not None)]
        for framework in frameworks or [None]:
            # A torch.profiler that records only the thread that started it stops only there
            # (``thread_ident``); every other profiler, the all-threads torch.profiler
            # included, stops from any thread.
            owners = self._op_sources.get(framework, endable)
            self.op_windows[framework] = LevelWindow(
                self.end_op_level, self.options.op_inferences, "--op-inferences", _owner_of(owners), framework
            )

    def _end_whole_op_level(self, reason: str) -> None:
        """Asks every framework's op level to end at the next model call's return (any
        framework's): the memory budget, the span limit."""
        if self._op_end_all is None:
            self._op_end_all = reason
        for window in self.op_windows.values():
            window.request(reason)

    def _watch_span_count(self, layers: bool) -> None:
        """Sets up the span limit (``_check_span_count``). Every span counts, whatever its level,
        as soon as it is recorded: what was streamed, what waits for the next flush, and what the
        sources hold (``pending_spans()``: layer frames, ops of the profiler's current cycle).
        The deepest levels end first: at ``--max-spans`` N the op level (with the library and
        kernel levels that end with it), then the layer level at 1.5 N (at N where no op level
        can end), each at the next model call's return; at 2 N the trace is full (``fill``)."""
        given = self.options.max_spans
        if given is None:
            info = read_meminfo()
            self.span_limit = default_span_limit(info[0] if info else None)
        else:
            self.span_limit = given
        self.meta["max_spans"] = self.span_limit
        limit = self.span_limit
        if not limit:
            return
        self._pending_counts = [s.pending_spans for s in self.started if isinstance(s, CountsPendingSpans)]
        stages: list[tuple[int, str]] = []
        if self.op_windows:
            stages.append((limit, "op"))
        if layers:
            recording = [s for s in self.started if Level.LAYER in s.levels]
            live = [s for s in recording if isinstance(s, EndsLayerLevel)]
            if live:
                self.layer_window = LevelWindow(self.end_layer_level)
            # Layers from a profiler (ONNX Runtime's nodes) end with the op level's window.
            self._endless_layers = [s.name for s in recording if s not in live and not can_end_early(s)]
            if live or self._endless_layers:
                stages.append((limit + limit // 2 if stages else limit, "layer"))
            if given and self._endless_layers:
                self.note_limitation(
                    f"--max-spans {given:,}: the layer level of {', '.join(self._endless_layers)} cannot end before the "
                    f"run does; it goes on until the trace is full ({2 * given:,} spans)"
                )
        stages.append((2 * limit, "full"))
        self._span_stages = stages
        self._span_next = stages[0][0]

    def _no_effect(self, text: str) -> None:
        warn(text)
        self.note_limitation(text)

    def model_call_ended(self, framework: str | None = None) -> None:
        """Called by the framework sources after every outermost model call, on its thread,
        with their ``ml.framework``: where the op and layer levels may end
        (``tracer/windows.py``). Never raises."""
        if self._span_next:
            try:
                self._check_span_count()
            except Exception as exc:  # never into the user's program
                self.errors.append(f"checking the span limit failed: {exc}")
        windows, layer = self.op_windows, self.layer_window
        op = windows.get(framework) or windows.get(None) if windows else None
        try:
            if op is not None and op.ended_ns is None:
                op.model_ended()
            elif self._op_end_all is not None:  # any model call's return ends the whole op level
                left = next((w for w in windows.values() if w.ended_ns is None), None)
                if left is not None:
                    left.end_now(self._op_end_all)
        except Exception as exc:  # never into the user's program
            self.errors.append(f"ending the op level failed: {exc}")
        if layer is not None:
            try:
                layer.model_ended()
            except Exception as exc:
                self.errors.append(f"ending the layer level failed: {exc}")
        for listener in self._model_call_listeners:
            try:
                listener(framework)
            except Exception as exc:
                self.errors.append(f"a model call's listener failed: {exc}")

    def end_op_level_now(self, framework: str | None, reason: str) -> bool:
        """Ends ``framework``'s op level now, on this thread (a program that takes its profiler
        over); False where it has no window that this thread may end."""
        window = self.op_windows.get(framework) or self.op_windows.get(None)
        return window is not None and window.end_now(reason)

    def add_model_call_listener(self, listener: Callable[[str | None], None]) -> None:
        """Calls ``listener(framework)`` after every outermost model call, on its thread, once the
        level windows have had it (torch.profiler's cycles end there). It must not raise."""
        self._model_call_listeners.append(listener)

    def end_op_level(self, window: LevelWindow) -> None:
        """Ends the op level of ``window``'s framework (``LevelWindow``): its sources that can
        end early; ``stop()`` converts their events. The shared sources (the library level)
        end with it once every framework that made model calls has ended its op level, or the
        whole op level ends (memory budget, span limit, full trace: the other frameworks'
        windows end here too, where this thread may end them).

        Runs on the program's thread between two model calls, which waits while the profilers
        stop and write what they held (stderr says so when that takes a while). The session's
        stop waits for it (``_wait_for_op_level_end``); once the stop has begun it ends nothing.
        """
        with self._op_level_ending:
            if not self._stopped:
                self._end_op_level(window)

    def _end_op_level(self, window: LevelWindow) -> None:
        framework = window.framework
        t0 = time.perf_counter()
        notice = None
        if self.options.summary:
            text = f"ending {_op_level_of(framework)} ({window.reason}): the profilers are writing their events…"
            notice = threading.Timer(FINISHING_NOTICE_S, say, (text,))
            notice.daemon = True
            notice.start()

        def end_early(source: EndsEarly) -> bool:
            recording = source.recording_ops  # a profiler that never started ends too,
            source.end_early()  # so that it does not start later
            return recording

        windows = list(self.op_windows.values())
        if self._op_end_all is not None:
            for other in windows:
                if other is not window and other.ended_ns is None:
                    other.end_now(self._op_end_all)  # ends its own sources (this method, for it)
        done_with_models = all(w.ended_ns is not None or w.calls == 0 for w in windows)
        ending = list(self._op_sources.get(framework, []))
        # The shared sources (the library level) end with the last framework that made model
        # calls (or with any, where none made one), never with one that made none.
        shares = window.calls > 0 or not any(w.calls for w in windows)
        if framework is not None and shares and (done_with_models or self._op_end_all is not None):
            ending += self._op_sources.get(None, [])
        started = {id(s): i for i, s in enumerate(self.started)}  # ended in the reverse of their start
        ending = sorted((s for s in ending if s not in self._op_sources_ended), key=lambda s: -started.get(id(s), -1))
        self._op_sources_ended.extend(ending)
        try:
            with gc_paused():
                ended = self._end_each(ending, end_early, "ending early", "end early")
            # What torch held is freed only with the profiler object, which sits in a reference
            # cycle; then glibc keeps the freed pages unless asked (1.1 → 0.44 GB, PERFORMANCE.md).
            gc.collect()
            release_free_memory()
        finally:
            if notice is not None:
                notice.cancel()
        took = time.perf_counter() - t0
        if all(s in self._op_sources_ended for group in self._op_sources.values() for s in group):
            self._memory_watch = None
        if window.calls == 0 and (not ended or any(w.calls for w in windows)):
            return  # a framework that never ran a model (while another did): nothing to file under its name
        top = self.meta.setdefault("op_window", {})
        entry = top if framework is None else top.setdefault("frameworks", {}).setdefault(framework, {})
        entry["reason"] = window.reason
        if not ended:  # no profiler was recording, or none could stop: no end for the analysis to count
            return
        entry.update(
            {
                "ended_after_model_calls": window.calls,
                "ended_ns": window.ended_ns,
                "sources": ended,
                "pause_s": round(took, 3),
                "thread": threading.get_native_id(),  # the thread the end paused
            }
        )
        if entry is not top and done_with_models and "ended_ns" not in top:
            # Every framework that made model calls has ended: the op level's end as a whole
            # (the analysis reads each framework's own end).
            top.update({k: v for k, v in entry.items() if k != "sources"})
            top["sources"] = [n for e in top["frameworks"].values() for n in e.get("sources", [])]
        several = sum(1 for w in windows if w.calls) > 1  # frameworks named where more than one ran models
        levels = ("the op and library levels" if "cpu.library" in ended else "the op level") + (f" of {framework}" if several else "")
        calls = (f"{window.calls} of its model calls" if window.calls != 1 else "1 of its model calls") if several else _calls(window.calls)
        from_profiler = [x for x, name in (("TensorFlow's graph-mode", "tensorflow"), ("ONNX Runtime's", "onnxruntime")) if name in ended]
        later = "model and layer spans only"
        if from_profiler:
            later = (
                f"model spans, and layer spans where they are recorded live ({' and '.join(from_profiler)} layer "
                "spans come from the profiler and ended with it)"
            )
        self.note_limitation(f"{levels} ended after {calls} ({window.reason}); later model calls have {later}")
        if self.options.summary:
            say(f"{levels} ended after {calls} ({window.reason}; the program waited {took:.1f} s); model and layer spans go on")

    def end_layer_level(self, window: LevelWindow) -> None:
        """Ends the layer level (``LevelWindow``); model spans go on. Runs on the thread whose
        model call just returned; swapping a wrapper takes no time worth saying."""
        if self._stopped:
            return
        layered = [s for s in self.started if isinstance(s, EndsLayerLevel)]
        ended = self._end_each(layered, lambda s: bool(s.end_layer_level()), "ending the layer level", "end the layer level")
        # After the swap: every model call that began before this time has its layer spans
        # (those in flight finish theirs), and none that began after it has any.
        window.ended_ns = now_ns()
        entry = self.meta.setdefault("layer_window", {})
        entry["reason"] = window.reason
        if not ended:  # nothing recorded layers, or they could not end: no end for the analysis to count
            return
        entry.update({"ended_after_model_calls": window.calls, "ended_ns": window.ended_ns, "sources": ended})
        ops = self.meta.get("levels", {}).get(Level.OP.label, {}).get("recorded", False)
        ops_go_on = ops and (not self.op_windows or any(w.reason is None for w in self.op_windows.values()))
        tail = "; their op spans lie directly in their model spans" if ops_go_on else ""
        self.note_limitation(
            f"the layer level ended after {_calls(window.calls)} ({window.reason}); later model calls have model spans only{tail}"
        )
        if self.options.summary:
            say(f"the layer level ended after {_calls(window.calls)} ({window.reason}); model spans go on (--max-spans sets the limit)")

    def _end_each(self, sources: list[Any], end: Callable[[Any], bool], doing: str, to: str) -> list[str]:
        """Calls ``end`` on each source, each failure recorded and warned about on its own
        (``doing``/``to`` word them); returns the names of those for which it returned true."""
        ended: list[str] = []
        for source in sources:
            try:
                recorded = end(source)
            except Exception as exc:
                self.errors.append(f"{source.name}: {doing} failed: {exc}")
                warn(f"source {source.name} failed to {to}: {exc}")
                continue
            if recorded:
                ended.append(source.name)
        return ended

    def spans_recorded(self) -> int:
        """Spans recorded so far, at every level: streamed, waiting for the next flush, and held
        by the sources that say so (``pending_spans()``). A source that fails to say counts 0."""
        recorder = self.recorder
        return recorder.spans_drained + len(recorder.done) + _sum_said(self._pending_counts)

    def _check_span_count(self) -> None:
        """Takes the span limit's stages that the count of recorded spans has reached
        (``_watch_span_count``): called after every model call and at every flush."""
        if not self._span_next or self.full:
            return
        count = self.spans_recorded()
        if count < self._span_next:
            return
        with self._span_lock:  # the flusher and the program's threads
            stages = self._span_stages
            while stages and count >= stages[0][0] and not self.full:
                what = stages.pop(0)[1]
                if what == "op" and not self._op_level_running() and stages and stages[0][1] == "layer":
                    what = stages.pop(0)[1]  # nothing of the op level left to end: the layer level is the deepest
                self._span_stage(what, count)
            self._span_next = stages[0][0] if stages and not self.full else 0

    def _op_level_running(self) -> bool:
        """Whether some framework's op level still records (a window not ended with a source
        that records, ``recording_ops``)."""
        return any(
            w.ended_ns is None and any(s.recording_ops for s in self._op_sources.get(w.framework, [])) for w in self.op_windows.values()
        )

    def _span_stage(self, what: str, count: int) -> None:
        """One stage of the span limit at ``count`` recorded spans: the op level, or the layer
        level, ends at the next model call's return (where the layer level cannot, says what the
        end of the run will need); ``full``: nothing more is recorded."""
        limit = self.span_limit
        if what == "full":
            self.fill(count)
            return
        reason = f"{count:,} spans recorded, --max-spans {limit:,}"
        if what == "op":
            self._end_whole_op_level(reason)
            return
        if self.layer_window is not None:
            self.layer_window.request(reason)
        if not self._endless_layers:
            return
        need = count * FINALIZE_BYTES_PER_SPAN / (1 << 30)
        message = (
            f"{count:,} spans recorded (--max-spans {limit:,}) and the layer level of "
            f"{', '.join(self._endless_layers)} cannot end early: "
            f"the end of the run loads every span (≈ {need:.1f} GiB so far); the trace is full at {2 * limit:,}"
        )
        warn(message)
        self.note_limitation(message)

    def fill(self, recorded: int) -> None:
        """The trace is full: mltrace records nothing more (the model level's wrappers come out,
        user spans are no-ops, the profilers that can end early end) and the program goes on.
        This bounds what the end of the run loads when model or user spans alone keep coming,
        past twice ``--max-spans`` (``recorded``: the spans recorded by then, every level)."""
        self.full = True
        if self.op_windows:
            # Without a model call returning (they may run on threads whose wrappers come out
            # below), the op level would record until the session ends: it ends here, even
            # mid-call (the analysis counts ops only in calls that ended before it).
            self._end_whole_op_level("the trace is full")
            for window in list(self.op_windows.values()):
                if window.ended_ns is None:
                    window.end_now("the trace is full")

        def end_recording(source: Any) -> bool:
            source.end_recording()
            return True

        recorders = [s for s in self.started if isinstance(s, EndsRecording)]
        self._end_each(recorders, end_recording, "ending the recording", "stop recording")
        self.meta["trace_full"] = {"spans": recorded, "at_ns": now_ns()}
        message = (
            f"the trace is full ({recorded:,} spans recorded, twice --max-spans {self.span_limit:,}): mltrace records "
            "nothing more, the program goes on"
        )
        warn(message)
        self.note_limitation(message)

    def _open_streams(self) -> None:
        assert self.run_dir is not None
        self._writer = store.EventWriter(self.run_dir / store.EVENTS_FILE)
        if not self.options.stream_perfetto:
            return
        try:
            from mltrace.run.perfetto import PerfettoStreamWriter

            self._pftrace = PerfettoStreamWriter.open(self.run_dir / store.TRACE_FILE, self.meta)
        except Exception as exc:
            self._pftrace = None
            warn(f"Perfetto streaming disabled: {exc}")

    def flush(self) -> None:
        """Streams every completed event to the run directory (called by the flusher), then
        tells the finish how far the run is written (``Finish.seal``)."""
        drained_ns = now_ns()
        self._take_handed_events()
        sealed = self._sealed_until(drained_ns)
        open_ns = self._earliest_open()
        with self._flush_lock:
            self._flush_locked()
        if sealed and not self._stream_failed and not self._streams_closed:
            self._seal(sealed, open_ns)
        self._check_span_count()
        watch = self._memory_watch
        if watch is not None:
            growth = not self._budget_sources or any(s.holds_run_events for s in self._budget_sources)
            message = watch.check(_sum_said(self._stop_costs), growth)
            if message is None:
                return
            profiling = any(can_end_early(s) and s.profiling for s in self.started)
            if any(w.ended_ns is None for w in self.op_windows.values()) and profiling:
                self._end_whole_op_level("memory budget")
                warn(f"{message}; it ends when the current model call returns, and model and layer spans go on")
                return  # the end itself is written to run.json
            message += " — for a long run use --level layer, or trace a window with mltrace.profile()"
            warn(message)
            self.note_limitation(message)

    def _sealed_until(self, drained_ns: int) -> int:
        """The session time by which every event that ended is queued or written: the
        recorder's drain, or the earliest that a source says (``Source.sealed_until_ns``)."""
        sealed = drained_ns
        for source in list(self.started):
            until = getattr(source, "sealed_until_ns", None)
            value = until() if until is not None else None
            if value is not None:
                sealed = min(sealed, value)
        return sealed

    def _earliest_open(self) -> int | None:
        """The start of the earliest span still running (the recorder's, or a source's), or None."""
        starts = [self.recorder.earliest_open_ns()]
        for source in list(self.started):
            if isinstance(source, HoldsOpenSpans):
                starts.append(source.earliest_open_ns())
        return min((s for s in starts if s is not None), default=None)

    def _seal(self, sealed_ns: int, open_ns: int | None) -> None:
        """Tells the finish in use that the run is written up to ``sealed_ns`` and that no span
        running now began before ``open_ns`` (None: none runs); a finish that does not finish
        runs a part at a time is told nothing."""
        seal = getattr(_finish, "seal", None)
        if seal is None or self.run_dir is None or self.forked_copy or not self.seals:
            return
        try:
            seal(self.run_dir, sealed_ns, open_ns)
        except Exception as exc:  # noqa: BLE001 - the run is then finished whole
            self.errors.append(f"sealing the streamed finish failed: {exc}")

    def _take_handed_events(self) -> None:
        """Queues what the sources that hand over events while the program runs have made."""
        for source in list(self.started):
            if not isinstance(source, HandsOverEvents):
                continue
            try:
                events = source.drain_events()
            except Exception as exc:  # noqa: BLE001 - one source's failure, never the program
                self.errors.append(f"{source.name}: handing over events failed: {exc}")
                continue
            if events:
                self.add_events(events)

    def _flush_locked(self) -> None:
        # Perfetto streaming needs Span objects; events.jsonl alone takes encoded rows.
        batch = self.recorder.drain(encoded=self._pftrace is None)
        if not any(batch.values()) or self._stream_failed or self._streams_closed:
            return
        try:
            assert self._writer is not None
            line = self._writer.write(**batch)
            self._writer.flush()
            if self._pftrace is not None:
                self._pftrace.write(**batch)
                self._pftrace.flush()
        except Exception as exc:
            self._stream_failed = True
            warn(f"could not stream events to {self.run_dir}: {exc}")
            return
        for sink in list(self.batch_sinks):
            try:
                sink(line)
            except Exception as exc:  # a sink's failure must not stop the stream
                self.batch_sinks.remove(sink)
                warn(f"a batch sink failed and was removed: {exc}")

    def flush_soon(self) -> None:
        """Has the flusher run its next flush now (``SessionView.flush_soon``)."""
        flusher = self._flusher
        if flusher is not None:
            flusher.wake()

    def add_events(self, events: list[Event]) -> None:
        """Queues post-hoc events (from a source's ``stop``) for the next flush."""
        parts = events_of(events)
        self.recorder.tracks.pending.extend(parts["tracks"])
        self.recorder.done.extend(parts["spans"])
        self.recorder.instants.extend(parts["instants"])
        self.recorder.counters.extend(parts["counters"])
        self.recorder.flows.extend(parts["flows"])

    def new_id(self) -> int:
        """A fresh event id for post-hoc sources."""
        return next(self._ids)

    def note_limitation(self, text: str) -> None:
        """Records something the run could not see (written to run.json once)."""
        if text not in self.limitations:
            self.limitations.append(text)

    def stop(self) -> Path:
        """Stops every source, finalizes the run directory and returns its path.

        The cyclic garbage collector is paused meanwhile: converting a profiler's
        events and finalizing build millions of objects and no cycles (300 CNN
        inferences at the op level: 6.2 of 14 s went to collections).
        """
        global _active
        if self._stopped or self.forked_copy:  # a forked child leaves the run to its parent
            self._stopped = True
            assert self.run_dir is not None
            return self.run_dir
        self._stopped = True
        if _active is self:
            _active = None
        self._unpatch_os_exit()
        notice = None
        progress = StopProgress(self.run_dir)
        if self.options.summary:  # a quiet session stays quiet
            notice = threading.Timer(FINISHING_NOTICE_S, progress.notice)
            notice.daemon = True
            try:
                notice.start()
            except RuntimeError:  # no new threads (interpreter shutting down): no notice
                notice = None
        guard = FinishGuard()
        try:
            with guard:
                try:
                    with gc_paused():
                        return self._stop_and_finalize(progress)
                except FinishInterrupted:
                    guard.cut()
                    return self._cut_short(guard, progress.step)
                finally:
                    self._after_signal(guard)
        except FinishInterrupted:  # the grace ran out as the guard was left: the run is as written
            assert self.run_dir is not None
            return self.run_dir
        finally:
            if notice is not None:
                notice.cancel()

    def _after_signal(self, guard: FinishGuard) -> None:
        """After a finish that a signal reached: no OTLP send (the user asked to leave), said once."""
        if guard.signum is None:
            return
        if self.options.otlp is not None:
            self.options.otlp = None
            say(f"{guard.signal_name} during the finish: the run is not sent over OTLP (mltrace export --otlp sends it)")

    def _cut_short(self, guard: FinishGuard, step: str) -> Path:
        """Ends a finish that a signal cut short (``tracer/finishguard.py``): writes what the
        recorder still holds, removes the finish's temporary files, and marks run.json as not
        complete and ``stopped_early``, so the run loads with what was streamed. The summary is
        not printed (it would load the whole run)."""
        assert self.run_dir is not None
        name = guard.signal_name or "a signal"
        self.meta["stopped_early"] = {"signal": name, "during": step}
        self.note_limitation(f"the finish was cut short by {name} while {step}: the run holds what was written before")
        if self._flusher is not None:
            self._flusher.stop(timeout_s=0.2)
        if self._flush_lock.acquire(timeout=0.5):
            try:
                self._close_streams(quiet=True)  # what is on disk stays
            finally:
                self._flush_lock.release()
        for leftover in self.run_dir.glob("*.tmp"):
            leftover.unlink(missing_ok=True)
        self.meta.update(complete=False, limitations=self.limitations, errors=self.errors)
        try:
            store.write_meta(self.run_dir, self.meta)
        except OSError as exc:
            warn(f"could not write {store.META_FILE}: {exc}")
        self.options.summary = False
        say(f"{name} during the finish: stopped early; {self.run_dir} keeps what was written")
        return self.run_dir

    def _close_streams(self, quiet: bool) -> None:
        """Flushes what is left and closes the streamed files (holding ``_flush_lock``); a
        stream that fails to close is warned about, or passed over when ``quiet``."""
        self._flush_locked()
        self._streams_closed = True
        for closer in (self._writer, self._pftrace):
            if closer is not None:
                try:
                    closer.close()
                except Exception as exc:  # noqa: BLE001 - what is on disk stays
                    if not quiet:
                        warn(f"closing a stream failed: {exc}")

    def _wait_for_op_level_end(self, progress: StopProgress) -> None:
        """Waits (up to ``OP_LEVEL_END_WAIT_S``) while another thread ends an op level, so that
        the sources stop once their early end has handed over what the profilers held."""
        if self._op_level_ending.acquire(blocking=False):
            self._op_level_ending.release()
            return
        progress.phase("waiting for the op level's end on another thread")
        if self._op_level_ending.acquire(timeout=OP_LEVEL_END_WAIT_S):
            self._op_level_ending.release()
        else:
            self.errors.append(f"the op level's end on another thread went on past {OP_LEVEL_END_WAIT_S:.0f} s: its events may be missing")

    def _stop_and_finalize(self, progress: StopProgress) -> Path:
        self._wait_for_op_level_end(progress)
        stop_ns = now_ns()
        # Converting what the sources held (torch.profiler's export and load) grows the process
        # too: that is not the recording's growth, and nothing is left to end early.
        self._memory_watch = None
        for op_window in self.op_windows.values():
            sources = self._op_sources.get(op_window.framework, [])
            if op_window.reason is None or op_window.ended_ns is not None or not any(s.recording_ops for s in sources):
                continue  # ended, or nothing of it recorded (a framework the program never imported)
            owned = any(s.thread_ident is not None for s in sources)
            where = " on the thread that started torch.profiler (only it can stop a profiler of that thread alone)"
            self.note_limitation(
                f"{_op_level_of(op_window.framework)} was to end ({op_window.reason}) but no model call returned afterwards"
                f"{where if owned else ''}: it ran to the end"
            )
        window = self.layer_window
        if window is not None and window.reason is not None and window.ended_ns is None:
            self.note_limitation(f"the layer level was to end ({window.reason}) but no model call returned afterwards")
        # The streamed finish's process takes what is written so far while the sources stop
        # (torch.profiler's last cycle is exported and converted then).
        self.flush_soon()
        for source in reversed(self.started):
            progress.phase(f"stopping {source.name}")
            try:
                events = source.stop()
            except Exception as exc:
                self.errors.append(f"{source.name}: stop failed: {exc}")
                warn(f"source {source.name} failed to stop cleanly: {exc}")
                continue
            if events:
                self.add_events(events)
        truncated = self.recorder.close_open_spans(stop_ns)
        if self._flusher is not None:
            self._flusher.stop()
            self.meta["flushes"] = self._flusher.summary()
        with self._flush_lock:  # a flusher still busy (join timed out) finishes first
            self._close_streams(quiet=False)
        self.meta["stopped_at_epoch_ns"] = self.anchor.session_to_epoch(now_ns())
        self.meta["duration_ns"] = stop_ns - self.anchor.monotonic_ns
        self.meta["limitations"] = self.limitations
        self.meta["errors"] = self.errors
        if truncated:
            self.meta["truncated_spans"] = truncated
        assert self.run_dir is not None
        try:
            (self.finish or finish_in_use().finalize)(self.run_dir, self.meta, progress.phase)
        except Exception as exc:  # the streamed files stay as they are
            self.meta["errors"].append(f"finalize failed: {exc}")
            warn(f"could not finalize the run ({exc}); the streamed trace in {self.run_dir} is kept")
            try:
                store.write_meta(self.run_dir, self.meta)
            except OSError:
                pass
        return self.run_dir


def _calls(n: int) -> str:
    return f"{n} model call" if n == 1 else f"{n} model calls"


def _op_level_of(framework: str | None) -> str:
    return "the op level" if framework is None else f"the op level of {framework}"


def _owner_of(sources: list[EndsEarly]) -> Callable[[], int | None]:
    """The ident of the thread that must end these sources (``LevelWindow.owner_thread``):
    the first that names one (a one-thread torch.profiler), else None (any thread)."""

    def owner_thread() -> int | None:
        for source in sources:
            if source.thread_ident is not None:
                return source.thread_ident
        return None

    return owner_thread


def _default_sources(options: ProfileOptions) -> list[Source]:
    from mltrace.tracer.sources import default_sources

    return default_sources(options)


def _sum_said(getters: list[Callable[[], int]]) -> int:
    """The sum of what each of the sources' ``getters`` says now; one that fails to say counts 0
    (a count or an estimate, never an error of the run)."""
    total = 0
    for said in getters:
        try:
            total += said()
        except Exception:  # noqa: BLE001 - see above
            pass
    return total
