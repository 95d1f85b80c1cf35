"""PyTorch op level (and, with CUDA, kernel level) from ``torch.profiler``.

Kineto runs with CPU activity and ``record_shapes`` (FLOPs are counted from the shapes,
``aten_flops``), plus CUDA activity (runtime calls, kernels, memcpys, memsets) when the kernel
level is on and torch sees a GPU. With CUDA activity it is ``torch.profiler.profile``; without,
the ``torch.autograd.profiler.profile`` underneath (``_CpuProfile``), whose start does not
import ``torch._inductor``. torch is never imported here: the profiler starts right after the
program's ``import torch`` (a post-import hook).

Cycles (``MLTRACE_OP_CYCLE_S``, where no kernels are recorded and without ``--memory``): at the return of a
model call once a cycle's seconds have passed, the program's thread stops the profiler,
exports the stopped cycle's Chrome trace to the run directory and starts the next
(``_next_cycle``; run.json ``torch_profiler.pauses`` keeps each switch's interval); a converter
thread has the converter process (``formats/kineto_serve.py``) convert it and append its events
to events.jsonl (``MLTRACE_OP_CONVERTER=0``, or a failed process:
the thread converts in this process). Memory stays about one cycle's, the op level needs no
early end, and a killed run keeps the cycles converted before (a trace file left in the run
directory is one being converted: ``mltrace import`` reads it). A cycle waits while another
thread has a span open, since the all-threads profiler's stop drops the ops running
elsewhere, and while a torch range may be open (``torch_open_ranges``: a range spanning a stop
and the next start crashes a later stop); a ``record_function`` range's end tries again, and
run.json ``torch_profiler.switches_deferred`` counts the waits. While every model call, span
and range came from the main thread, the cycles after the first record it alone
(``_one_thread_ok``): the all-threads profiler's stop races with ops that other threads run
outside every span. Where kernels are recorded
(Kineto's CUDA activity, or cupti-python's path, whose CUPTI callbacks each profiler start
would replace) the profiler runs whole and is converted at ``stop()``. The memory budget counts
what the running cycle's stop would add (``stop_bytes``).

Placement and clock: Kineto's thread ids are OS thread ids, so ops land on the thread tracks
of the live model and layer spans, where the finish nests them (``nest_by_containment``); all
threads are profiled where torch supports it (PyTorch ≥ 2.6), else run.json says so.
``ts * 1000 + baseTimeNanoseconds`` is Unix-epoch ns, converted with the session's anchor
(``tests/tracer/test_torch_ops.py`` checks that ``record_function`` ranges land inside the
``time.monotonic_ns()`` readings around them).

Ending early (``tracer/windows.py``): without CUDA activity the profiler may stop between two
model calls; one that records only the thread that started it stops only there
(``thread_ident``). With ``--memory`` it also records allocations (``profile_memory``), on
the starting thread only (torch records none in its all-threads mode). Kineto allows one
profiler per process: where the program starts ``torch.profiler`` itself, mltrace's op level
ends first (``_guard_program_profiler``), and a session that starts while the program's runs
does not start its own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue
import re
import shutil
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from mltrace.formats.kineto import KinetoEvents, KinetoStats, kineto_to_events, load_kineto_json
from mltrace.run.events import Event
from mltrace.run.gcpause import gc_paused
from mltrace.run.jsoncodec import dumps, loads
from mltrace.run.levels import Level
from mltrace.run.metadata import distribution_versions
from mltrace.run.store import EVENTS_FILE, track_row
from mltrace.settings import OP_CONVERTER, OP_CYCLE_S
from mltrace.tracer import c_environ
from mltrace.tracer.clock import now_ns
from mltrace.tracer.deferred_signals import signals_held
from mltrace.tracer.helper_env import end_helper, forget_helper, start_helper
from mltrace.tracer.memwatch import process_rss, release_free_memory
from mltrace.tracer.sources._imports import PostImportHook
from mltrace.tracer.sources.base import Source
from mltrace.tracer.sources.torch_open_ranges import RecordFunctionDepth, range_frame_on_stack

if TYPE_CHECKING:
    from types import ModuleType

    from mltrace.tracer.sources.base import SessionView

#: torch.profiler's Chrome trace in the run directory, between its export and its conversion
#: (a cycle's: ``torch-profiler-<n>.json``).
EXPORT_FILE = "torch-profiler.json"
#: How long a cycle of the profiler records before it is converted (s; ``MLTRACE_OP_CYCLE_S``,
#: 0: one cycle, converted at the end). Each stop pauses the program's thread for the whole
#: cycle's ops, and a thread that starts while the profiler switches cycles can go unrecorded
#: (seen with a thread-per-request server); held whole, the profiler pays the same stop after
#: the program, holds every op in memory and ends early on a long run. Short cycles keep what
#: is left to stop, convert and finish at the program's end small (docs/PERFORMANCE.md, "Long
#: runs").
CYCLE_S = 0.1
#: The ops a running cycle may hold while the converter is still busy with the one before
#: (estimated from the model calls): past it, the program waits for the converter between two
#: model calls, so that a program quicker than the conversion holds a bounded cycle (its stop
#: takes about 3 KB an op) instead of one that grows with the run.
CYCLE_OPS_MAX = 25_000
#: How long the program may wait for a *starved* converter in all without it counting against
#: its run (s), and the share of the op level's time past which it no longer waits for one: the
#: running cycle then stops, and no op is recorded until the converter has caught up
#: (``_pause_cycles``). A converter that the machine's other work starves (it runs at a lower
#: priority) would otherwise make the program wait for it again and again. A converter that
#: gets a core (``STARVED_CPU_SHARE``) is waited for as long as it takes: the program outrunning
#: it would outrun the streamed finish too and leave the run's end to do the rest.
BACKLOG_WAIT_FREE_S = 1.0
BACKLOG_WAIT_SHARE = 0.1
#: Below this share of one core (its CPU time over the wait's wall time) the converter process
#: counts as starved while the program waits for it, judged over a wait of at least
#: ``STARVED_WINDOW_S`` (its CPU time is read to the clock tick).
STARVED_CPU_SHARE = 0.5
STARVED_WINDOW_S = 0.2
#: What torch.profiler's stop adds to the process for each op it holds (bytes; measured +47 MB
#: for a cycle of 15,200 ops, docs/PERFORMANCE.md "Long runs"), where recording them took
#: +10 MB: the memory budget counts it ahead (``stop_bytes``).
STOP_BYTES_PER_OP = 3_000
#: The same against the process's growth while a cycle recorded (47 MB against 10 MB there;
#: 3.1 GiB against 0.8 GiB for a cycle that LBFGS's step held): where no cycle has said its ops
#: per call yet, a held cycle's stop is estimated from the growth since it began.
STOP_BYTES_PER_GROWN_BYTE = 4
#: The holds of the program's thread (cycle switches, waits for the converter) whose intervals
#: run.json keeps (``torch_profiler.pauses``); later ones are counted only.
PAUSES_KEPT = 10_000
#: The longest the op level's early end waits for the spans open on other threads to end before
#: it stops the all-threads profiler (s; ``_with_others_quiet``), new spans there held meanwhile.
END_WAIT_S = 2.0
#: The same at the session's stop, where other threads may be stuck in spans for good.
STOP_WAIT_S = 0.5
#: The counter track of the switches in the trace: 1 from a switch's begin to its end, else 0.
PAUSED_TRACK = "mltrace.paused"


def cycle_seconds() -> float:
    """The cycle length: ``MLTRACE_OP_CYCLE_S`` where it is a number of seconds ≥ 0, else ``CYCLE_S``."""
    text = OP_CYCLE_S.get() or ""
    try:
        value = float(text)
    except ValueError:
        return CYCLE_S
    return value if value >= 0 else CYCLE_S


def _cuda_possible() -> bool:
    """Whether torch may see a GPU here, without importing torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            return bool(torch.cuda.is_available())
        except Exception:
            return False
    version = distribution_versions(("torch",)).get("torch")
    if version is None:
        return False
    if "+cpu" in version:
        return False
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd"))


class TorchOpSource(Source):
    """Op spans (and CUDA kernels) for PyTorch, recorded by ``torch.profiler``.

    Attributes:
        name: "torch.profiler".
        levels: ``(Level.OP,)``, plus ``Level.KERNEL`` where torch may see a GPU.
        stats: the conversion stats of the last ``stop()`` (None before).
        export_ns: how long the Chrome-trace export and the conversion took (ns); in cycles,
            the conversions only (each cycle's export is part of its switch, ``switch_ns``).
        thread_ident: the thread that must stop the profiler early: the one that started a
            profiler recording that thread alone; None before the start and for the
            all-threads profiler, which any thread may stop.
    """

    name = "torch.profiler"
    #: the ``ml.framework`` whose model calls count toward this op level's end (``--op-inferences``)
    framework = "pytorch"

    def __init__(self) -> None:
        self.levels: tuple[Level, ...] = (Level.OP, Level.KERNEL) if _cuda_possible() else (Level.OP,)
        self._session: SessionView | None = None
        self._hook: PostImportHook | None = None
        self._prof: Any = None
        self.record_kernels = False
        self._cupti_kernels = False  # the kernel level's kernels come from cupti-python (set by start)
        self.stats: KinetoStats | None = None
        self.export_ns = 0
        self._stats_lock = threading.Lock()  # stats and export_ns: the converter thread's and the stop's
        self.thread_ident: int | None = None
        self._tmp: str | None = None  # a temporary directory holding the exported trace, if one was made
        self._exported: Path | None = None
        self._cuda_activity = False  # may record CUDA activity (before start), or does
        self._around_start: list[tuple[Callable[[], None], Callable[[], None]]] = []
        self._ended = False  # the op level ended early: a later ``import torch`` starts nothing
        self.cycle_s = cycle_seconds()
        self._kwargs: dict[str, Any] = {}  # the profiler's arguments, for the next cycle's
        self._cycle_began = 0.0  # time.monotonic() at the running cycle's start
        self._cycle_rss = 0  # the process's resident size then (bytes)
        self._cycle_calls = 0  # model calls that returned in the running cycle
        self._cycles: _Converter | None = None
        self._cycling_thread: int | None = None  # the thread of the first model call that returned
        #: The profiler's arguments for a cycle of the cycling thread alone (``_one_thread_ok``),
        #: None where torch cannot record all threads anyway.
        self._one_thread_kwargs: dict[str, Any] | None = None
        #: Cycles that recorded the cycling thread alone, and whether the running one does.
        self.one_thread_cycles = 0
        self._one_thread = False
        self._unrecorded_said = False  # the limitation of other threads' ops a one-thread cycle missed
        self._forked = False  # the program forked from the main thread: cycles record every thread
        #: Why the cycles stopped and the profiler runs on whole ("" while they go on).
        self.cycles_stopped = ""
        #: Cycle switches so far, and the program's time in them (stop, export, restart).
        self.switches = 0
        self.switch_ns = 0
        #: The switches' intervals: (native thread id, session begin ns, session end ns).
        self.pauses: list[tuple[int, int, int]] = []
        #: Switches put off, by what held them (``_held_by``: a span open on another thread, a
        #: torch range that may be open); the next model call's return or a range's end tries
        #: again.
        self.switches_deferred: dict[str, int] = {}
        self._held = False  # the running cycle's switch was put off
        #: While no cycle runs because the converter fell behind (``_pause_cycles``): the
        #: session time the last cycle stopped, else None.
        self._gap_began: int | None = None
        #: The intervals without a cycle so far (session ns: begin, end), and the model calls
        #: that returned in them.
        self.unrecorded: list[tuple[int, int]] = []
        self.unrecorded_calls = 0
        self._began_at = 0.0  # time.monotonic() at the first cycle's start
        self._ranges = RecordFunctionDepth(self._range_closed)
        #: Takes ``_guard_program_profiler``'s wrapper off torch again.
        self._unguard: Callable[[], None] = lambda: None

    @property
    def profiling(self) -> bool:
        """Whether torch.profiler is running (it waits for the program's ``import torch``)."""
        return self._prof is not None

    @property
    def recording_ops(self) -> bool:
        """Its ops are recorded while torch.profiler runs, and again after a pause while the
        converter catches up (``_pause_cycles``), which counts as recording."""
        return self._prof is not None or (self._gap_began is not None and not self._ended)

    @property
    def holds_run_events(self) -> bool:
        """Whether the profiler holds every op until it stops: held whole (no cycles, or cycles
        stopped for good); a running cycle's cost is ``stop_bytes``."""
        return self._prof is not None and (self._cycles is None or bool(self.cycles_stopped))

    @property
    def can_end_early(self) -> bool:
        """Whether the session may stop this source before it ends: not with CUDA activity,
        whose hand-over between Kineto and cupti-python is only done at the session's end."""
        return not self._cuda_activity

    def around_profiler_start(self, before: Callable[[], None], after: Callable[[], None]) -> None:
        """Calls ``before`` right before torch.profiler starts and ``after`` right after
        (CuptiSource hands CUPTI over to Kineto and takes it back; the session arms the op
        level's memory budget); where it has started already (the program imported torch
        before the session began), ``after`` now. Failures are recorded."""
        if self._prof is not None:
            self._call_hooks([(before, after)], 1)
        else:
            self._around_start.append((before, after))

    def available(self) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed"
        return None

    def start(self, session: SessionView) -> None:
        self._session = session
        # With MLTRACE_KERNEL_PATH=cupti-python, CUDA activity stays out from the start: the
        # profiler may start right now (torch already imported), before CuptiSource runs.
        cupti = False
        if Level.KERNEL in session.levels:  # the cupti source's module is imported for the kernel level only
            from mltrace.tracer.sources.cupti import requested_kernel_path

            cupti = requested_kernel_path() == "cupti-python"
        self.record_kernels = Level.KERNEL in session.levels and not cupti
        self._cuda_activity = self.record_kernels and Level.KERNEL in self.levels
        self._cupti_kernels = Level.KERNEL in session.levels and cupti  # cupti-python records them
        self._hook = PostImportHook("torch", self._begin)

    def _begin(self, torch: ModuleType) -> None:
        """Starts the profiler (now, or right after the program's ``import torch``)."""
        session = self._session
        if session is None or self._prof is not None or self._ended:  # an op level that ended before torch came
            return
        if profiler_running(torch):
            self._ended = True
            session.note_limitation("op level: the program's own torch.profiler was running, so mltrace's did not start (no ops)")
            return
        try:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if self.record_kernels:
                if torch.cuda.is_available():
                    activities.append(ProfilerActivity.CUDA)
                else:
                    self._cuda_activity = False
                    session.note_limitation("kernel level: torch sees no CUDA device, so no kernels were recorded")
            # No with_flops: counting while the program runs cost it ≈ 4 % on the example CNN;
            # kineto_to_events counts the same FLOPs from the recorded shapes (aten_flops).
            kwargs: dict[str, Any] = {"activities": activities, "record_shapes": True}
            memory = session.options.memory
            config = None if memory else _all_threads_config(trace_only=True)
            if memory:
                kwargs["profile_memory"] = True
                session.note_limitation(
                    "op level: with --memory, torch.profiler records ops and allocations only on the thread "
                    "that started profiling (torch records no memory events when profiling all threads)"
                )
            elif config is not None:
                kwargs["experimental_config"] = config
            else:
                session.note_limitation("op level: this torch.profiler records ops only on the thread that started profiling")
            prof = _new_profiler(profile, kwargs)
            self._kwargs = kwargs
            if config is not None:
                self._one_thread_kwargs = {**kwargs, "experimental_config": _one_thread_config()}
            self._call_around(0)
            from mltrace.tracer.cuda_exit import keep_primary_contexts_at_exit

            keep_primary_contexts_at_exit()  # Kineto's CUPTI callbacks must not run during C++ teardown
            cupti_source = sys.modules.get("mltrace.tracer.sources.cupti")  # not imported: none of its buffers exist
            if cupti_source is not None:
                cupti_source.hand_back_buffers()  # Kineto takes CUPTI's buffer callbacks now: none of cupti-python's may be in flight
            try:
                with _kineto_quiet():
                    _start_quietly(prof)
                self._cycle_started(prof)
                if config is None:  # torch stops a one-thread profiler only where it started
                    self.thread_ident = threading.get_ident()
            finally:
                self._call_around(1)
            # With --memory the profiler runs whole: on the CPU, torch's allocation totals count
            # from the profiler's start, so each cycle would start them again. So it does where
            # kernels are recorded, on either kernel path: each start of a profiler registers
            # Kineto's CUPTI buffer callbacks in place of cupti-python's (which then records
            # nothing), and CUDA activity is handed between the two only around the first start.
            if self.cycle_s and not self._records_kernels_here() and not memory:
                self._began_at = time.monotonic()
                self._cycles = _Converter(self, session)
                if not _in_forked_child(session):  # there the first hand-over starts it (_Converter.start_process)
                    self._cycles.start_process()  # its interpreter starts now, not inside the program's next model call
                self._ranges.install(torch)
                session.add_model_call_listener(self._model_call_ended)
                _switch_before_forks(self)
            self._guard_program_profiler()
        except Exception as exc:  # never into the user's program
            session.errors.append(f"{self.name}: could not start torch.profiler: {exc}")
            session.note_limitation(f"op level: torch.profiler did not start ({exc})")

    def _guard_program_profiler(self) -> None:
        """Lets the program run torch's profiler itself. Kineto keeps one profiling session per
        process: the program's start took mltrace's over, and mltrace's stop then found none
        and its export crashed the process. ``_prepare_profiler`` and ``_enable_profiler``,
        which every torch profiler start calls (``torch.profiler.profile``,
        ``torch.autograd.profiler.profile``), are wrapped for the session: a call that is not
        mltrace's own (``_own_call``) ends mltrace's op level first (``_yield_to_program``).
        ``stop()`` puts them back."""
        module = sys.modules.get("torch.autograd.profiler")
        if module is None:
            return
        source = self
        wrapped: list[tuple[str, Any, Any]] = []
        for name in ("_prepare_profiler", "_enable_profiler"):
            original = getattr(module, name, None)
            if original is None:
                continue

            def call(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if not getattr(_own, "active", False):
                    source._yield_to_program()
                return _original(*args, **kwargs)

            setattr(module, name, call)
            wrapped.append((name, original, call))

        def unguard() -> None:
            for name, original, call in wrapped:
                if getattr(module, name, None) is call:
                    setattr(module, name, original)

        self._unguard = unguard

    def _yield_to_program(self) -> None:
        """The program starts a torch profiler of its own: ends mltrace's op level now (its ops
        so far are kept), through the session's op window where it has one. Never raises."""
        session = self._session
        if (self._prof is None and self._gap_began is None) or self._ended or session is None:
            return
        reason = "the program started torch.profiler itself"
        try:
            if not session.end_op_level_now(self.framework, reason):
                self.end_early()
                session.note_limitation(f"op level: {reason}; mltrace's op level ended there (the ops before it are kept)")
        except Exception as exc:  # never into the user's program
            session.errors.append(f"{self.name}: ending the op level for the program's own profiler failed: {exc}")

    def _records_kernels_here(self) -> bool:
        """Whether this session records kernels while torch.profiler runs: through Kineto (CUDA
        activity), or through cupti-python (``MLTRACE_KERNEL_PATH=cupti-python`` at the kernel
        level)."""
        return self._cuda_activity or self._cupti_kernels

    def _call_around(self, which: int) -> None:
        self._call_hooks(self._around_start, which)

    def _call_hooks(self, pairs: list[tuple[Callable[[], None], Callable[[], None]]], which: int) -> None:
        """Calls each pair's ``before`` (``which`` 0) or ``after`` (1) hook."""
        for pair in pairs:
            try:
                pair[which]()
            except Exception as exc:  # a hook's failure stops neither the profiler nor the program
                if self._session is not None:
                    self._session.errors.append(f"{self.name}: {'before' if which == 0 else 'after'}-start hook failed: {exc}")

    def pending_spans(self) -> int:
        """Ops recorded and not yet handed to the session (the session's span limit counts them):
        the ops the converter process wrote, those of the stopped cycles not yet converted
        (counted in their files), and the running cycle's model calls times the ops per call of
        the last stopped cycle (see ``_Converter.spans_per_call``)."""
        cycles = self._cycles
        if cycles is None:
            return 0
        return cycles.spans_written + cycles.queued_spans + int(self._cycle_calls * cycles.spans_per_call)

    def stop_bytes(self) -> int:
        """About how much memory stopping the running cycle would take now (bytes): its model
        calls times the ops per call of the last stopped cycle, ``STOP_BYTES_PER_OP`` each; for
        a cycle whose switch was put off (a range over many calls: LBFGS's ``Optimizer.step``),
        at least ``STOP_BYTES_PER_GROWN_BYTE`` times the process's growth since it began (the
        first cycles know no ops per call yet). 0 without cycles or profiler."""
        cycles = self._cycles
        if cycles is None or self._prof is None:
            return 0
        by_calls = int(self._cycle_calls * cycles.spans_per_call) * STOP_BYTES_PER_OP
        if not self._held:
            return by_calls
        return max(by_calls, STOP_BYTES_PER_GROWN_BYTE * max(0, process_rss() - self._cycle_rss))

    def _model_call_ended(self, framework: str | None) -> None:
        """After every outermost model call (``Session.add_model_call_listener``): counts the
        call and ends the running cycle where it is due (``_switch_if_due``)."""
        if framework != self.framework:
            return
        if self._gap_began is not None:
            self.unrecorded_calls += 1
            self._one_model_thread()  # a second model thread stops the cycles: the next start is held whole
            self._resume_if_caught_up()
            return
        if self._prof is None:
            return
        self._cycle_calls += 1
        if self._cycles is not None and not self._one_model_thread():
            self._widen_if_owner()
            return
        self._switch_if_due()

    def _switch_if_due(self) -> None:
        """Ends the running cycle where it is due (the first two at the first two calls' returns:
        the first holds the program's set-up, the second one call, whose ops per call the span
        limit counts by), the converter has finished the cycle before it (else the running one
        goes on, up to ``CYCLE_OPS_MAX``: the converter's backlog stays one cycle), this thread
        may stop the profiler, and nothing holds it (``_held_by``)."""
        cycles = self._cycles
        if cycles is None:
            return
        first = cycles.handed < 2
        widen = self._one_thread and self._others_traced()  # their ops are wanted from now
        if widen:
            self._note_unrecorded("spans or record_function ranges")
        if not first and not widen and time.monotonic() - self._cycle_began < self.cycle_s:
            return
        backlog = not first and cycles.cycles < cycles.handed
        if backlog and self._cycle_calls * cycles.spans_per_call < CYCLE_OPS_MAX:
            return
        if self.thread_ident is not None and threading.get_ident() != self.thread_ident:
            return
        if backlog:
            if self._deferred():
                return
            waited_from = now_ns()
            caught_up = cycles.wait_converted(self._wait_left_s(cycles))
            self._note_hold(waited_from)
            if not caught_up:
                self._pause_cycles()
                return
        self._switch_holding_new_spans()

    def _wait_left_s(self, cycles: _Converter) -> float:
        """How long the program may still wait for the converter (s): ``BACKLOG_WAIT_FREE_S``
        in all, and ``BACKLOG_WAIT_SHARE`` of the time since the first cycle began."""
        allowed = max(BACKLOG_WAIT_FREE_S, BACKLOG_WAIT_SHARE * (time.monotonic() - self._began_at))
        return max(0.0, allowed - cycles.waited_ns / 1e9)

    def _pause_cycles(self) -> None:
        """The converter is behind and the program may wait no longer: stops the running cycle
        and hands it over, and starts none until the converter has caught up
        (``_resume_if_caught_up``); the model calls meanwhile run without the op level, and the
        interval is kept (``unrecorded``, run.json ``torch_profiler.unrecorded``)."""
        self._switch_holding_new_spans_then(restart=False)
        if self._prof is None and not self._ended:
            self._gap_began = now_ns()

    def _resume_if_caught_up(self) -> None:
        """After a model call's return in a pause (``_pause_cycles``): starts the next cycle once
        the converter has converted every cycle handed to it, unless a range holds the start
        (``_held_by``) or the op level ended meanwhile."""
        cycles = self._cycles
        if cycles is None or self._gap_began is None or self._ended:
            return
        if cycles.cycles < cycles.handed or self._held_by() is not None:
            return
        self._close_gap()
        self._restart()

    def _close_gap(self) -> None:
        """Ends a pause (``_pause_cycles``) now, keeping its interval."""
        if self._gap_began is not None:
            self.unrecorded.append((self._gap_began, now_ns()))
            self._gap_began = None

    def _switch_holding_new_spans(self) -> None:
        """Switches the cycle unless something holds it (``_deferred``), with spans begun on other
        threads meanwhile made to wait for its end (``Recorder.holding_new_spans``): a request
        that begins during the switch would run its first ops while no profiler records them."""
        self._switch_holding_new_spans_then(restart=True)

    def _switch_holding_new_spans_then(self, restart: bool) -> None:
        """``_switch_holding_new_spans``, starting the next cycle where ``restart``."""
        session = self._session
        gate = session is not None and not self._one_thread  # a one-thread cycle records no other thread
        release = session.recorder.holding_new_spans() if gate and session is not None else None
        try:
            if not self._deferred():
                self._next_cycle(restart=restart)
        finally:
            if release is not None:
                release()

    def _deferred(self) -> bool:
        """Whether something holds the due switch (``_held_by``); counts it if so. The next model
        call's return or a range's end tries again."""
        held_by = self._held_by()
        if held_by is None:
            return False
        self.switches_deferred[held_by] = self.switches_deferred.get(held_by, 0) + 1
        self._held = True
        return True

    def _held_by(self) -> str | None:
        """What a switch now must wait for (counted in ``switches_deferred``), or None: a span
        open on another thread (the all-threads profiler's stop drops the ops in flight there:
        a request, a model call), or a torch range that may be open (``torch_open_ranges``: a
        ``record_function`` on any thread, or one torch opened around this thread's Python
        code), which a switch would leave open across the next start, crashing a later stop."""
        if not self._one_thread and self._session is not None and self._session.recorder.open_on_other_threads():
            return "span open on another thread"
        if self._ranges.open_here():
            return "record_function"
        if not self._one_thread and self._ranges.open_elsewhere():
            return "record_function on another thread"
        return range_frame_on_stack()

    def _range_closed(self) -> None:
        """A thread's last open ``record_function`` range ended: on the cycling thread outside a
        model call (a range inside ``forward`` ends in the middle of one, whose ops a switch
        would split), a switch put off may happen now."""
        session = self._session
        if (
            self._held
            and self._prof is not None
            and session is not None
            and not self.cycles_stopped
            and threading.get_ident() == self._cycling_thread
            and not session.recorder.open_here(Level.MODEL)
        ):
            self._switch_if_due()

    def _one_model_thread(self) -> bool:
        """Whether model calls have come from one thread only. At the first call from a second
        thread the cycles stop for good and the profiler runs on whole: a cycle's stop and
        restart drop the ops that other threads run meanwhile, and where several threads call
        models (a thread-per-request service), a request may begin on another thread at any
        time. The first cycle may have ended already: where another thread had a span open
        then, it waited."""
        if self.cycles_stopped:
            return False
        ident = threading.get_ident()
        if self._cycling_thread is None:
            self._cycling_thread = ident
        elif ident != self._cycling_thread:
            self.cycles_stopped = "model calls on more than one thread: torch.profiler runs on whole from here"
            return False
        return True

    def _next_cycle(self, restart: bool) -> None:
        """Stops the running profiler and hands it to the converter; with ``restart``, starts
        the next cycle's at once. A profiler that fails to restart ends the op level here.
        SIGINT and SIGTERM wait until it is done (``signals_held``): their handlers raise in
        the program's thread, and one raised between the stop and the hand-over would lose
        the stopped cycle and every later one."""
        with signals_held():
            self._switch_cycle(restart)

    def _switch_cycle(self, restart: bool) -> None:
        """``_next_cycle``'s steps."""
        prof, self._prof = self._prof, None
        cycles = self._cycles
        if prof is None or cycles is None:
            return
        self._held = False
        stopped_ns = now_ns()  # every op of the cycle ended by now
        t0 = time.perf_counter_ns()
        if not self._stop_cycle(prof, cycles.handed + 1):
            return
        try:
            path = self._export_cycle(prof, cycles.handed + 1)
        except Exception as exc:  # the cycle lost (a full disk), never the program or the next cycle
            if self._session is not None:
                self._session.errors.append(f"{self.name}: exporting cycle {cycles.handed + 1} failed: {exc}")
        else:
            cycles.hand(path, self._cycle_calls, stopped_ns, _complete_events(path))
        del prof
        self._cycle_calls = 0  # a stop without restart ends the op level: no cycle runs
        if restart:
            self._restart()
        self._note_pause(stopped_ns, t0)

    def _stop_cycle(self, prof: Any, number: int) -> bool:
        """Stops a cycle's profiler; False where it cannot be (a one-thread cycle stopped from
        another thread: torch finds no profiler there), the cycle then lost and said."""
        try:
            with _own_call():
                prof.stop()
        except Exception as exc:  # never into the user's program
            if self._session is not None:
                self._session.errors.append(f"{self.name}: stopping cycle {number} failed: {exc}")
                self._session.note_limitation(f"op level: cycle {number} could not be stopped ({exc}); its ops are not in the run")
            return False
        return True

    def _restart(self) -> None:
        """Starts the next cycle's profiler; one that fails to start ends the op level here."""
        one_thread = self._one_thread_ok()
        try:
            from torch.profiler import profile

            prof = _new_profiler(profile, self._one_thread_kwargs if one_thread and self._one_thread_kwargs else self._kwargs)
            _start_quietly(prof)
        except Exception as exc:  # never into the user's program
            self._ended = True
            if self._session is not None:
                self._session.errors.append(f"{self.name}: could not start the next cycle: {exc}")
                self._session.note_limitation(f"op level: torch.profiler did not restart ({exc}); later ops are not recorded")
            return
        self._one_thread = one_thread
        self.thread_ident = threading.get_ident() if one_thread else None
        self.one_thread_cycles += one_thread
        self._cycle_started(prof)

    def _one_thread_ok(self) -> bool:
        """Whether the next cycle may record the cycling thread alone: while every model call,
        span and ``record_function`` range came from the program's main thread (which lives
        until the session stops it; ``_others_traced``). Stopped while another thread runs
        torch ops, the all-threads profiler reads that thread's records as it writes them
        (heap corruption, a crash every few hundred to few thousand switches in a stress
        test); a one-thread profiler records no other thread, and the other threads' ops
        outside model calls are no load on the converter."""
        return (
            self._one_thread_kwargs is not None
            and not self.cycles_stopped
            and not self._forked
            and self._cycling_thread == threading.get_ident() == threading.main_thread().ident
            and not self._others_traced()
        )

    def _others_traced(self) -> bool:
        """Whether a thread other than the main one began a span (a user or OpenTelemetry span,
        a model call) or a ``record_function`` range: its ops are wanted, so cycles record
        every thread from then on."""
        main = threading.main_thread().ident
        session = self._session
        if session is not None:
            recorder = session.recorder
            if any(ident != main for ident in list(recorder.thread_idents)) or recorder.open_on_other_threads():
                return True
        return main is not None and self._ranges.seen_elsewhere(main)

    def _widen_if_owner(self) -> None:
        """After model calls came from a second thread (``_one_model_thread``): on the thread
        whose one-thread cycle runs, stops that cycle and starts an all-threads profiler, held
        whole from here; the second thread's ops until then were not recorded (said once). A
        range open here would span the stop and the start: the next model call tries again."""
        if not self._one_thread or self._prof is None or self._session is None:
            return
        if threading.get_ident() != self.thread_ident:
            self._note_unrecorded("model calls")
            return
        if self._held_by() is None:  # in a one-thread cycle: a range open here alone holds it
            self._next_cycle(restart=True)

    def _note_unrecorded(self, what: str) -> None:
        """Says once that ``what`` began on another thread while a one-thread cycle ran."""
        if self._unrecorded_said or self._session is None:
            return
        self._unrecorded_said = True
        self._session.note_limitation(
            f"op level: {what} on another thread began while torch.profiler recorded the main thread alone; "
            "their ops until the main thread's next model call returned were not recorded"
        )

    def _before_fork(self) -> None:
        """Before the program forks from the main thread (a DataLoader's workers, a fork of its
        own): a one-thread cycle's profiler would be the child's main thread's, where the child's
        own session could start none; the cycle switches to one of every thread, and every later
        cycle records every thread. Never raises."""
        if self._ended or not self._one_thread or self._prof is None or threading.get_ident() != self.thread_ident:
            return
        self._forked = True
        try:
            if self._held_by() is None:
                self._next_cycle(restart=True)
        except Exception as exc:  # noqa: BLE001 - nothing may fail the program's fork
            if self._session is not None:
                self._session.errors.append(f"{self.name}: switching cycles before a fork failed: {exc}")

    def _cycle_started(self, prof: Any) -> None:
        """Keeps ``prof`` as the running cycle's profiler, started now: its start time and the
        process's size then (``stop_bytes``), no model call yet."""
        self._prof = prof
        self._cycle_began, self._cycle_calls, self._cycle_rss = time.monotonic(), 0, process_rss()

    def _note_pause(self, began_ns: int, began_perf_ns: int) -> None:
        """Counts a cycle switch that held the program's thread from session time ``began_ns``
        (``time.perf_counter_ns()`` ``began_perf_ns``) until now, and keeps it (``_note_hold``)."""
        self.switches += 1
        self.switch_ns += time.perf_counter_ns() - began_perf_ns
        self._note_hold(began_ns)

    def _note_hold(self, began_ns: int) -> None:
        """Keeps a time the op level held the program's thread (a cycle switch, a wait for the
        converter), from session time ``began_ns`` until now: its interval (up to
        ``PAUSES_KEPT``) for run.json, and a step on the trace's counter track."""
        ended_ns = now_ns()
        if len(self.pauses) < PAUSES_KEPT:
            self.pauses.append((threading.get_native_id(), began_ns, ended_ns))
        session = self._session
        if session is not None:  # a step in the trace: 1 while the program's thread was held
            track = session.tracks.counter(PAUSED_TRACK)
            session.recorder.counter(track, 1, began_ns)
            session.recorder.counter(track, 0, ended_ns)

    def _export_cycle(self, prof: Any, number: int) -> Path:
        """Writes a stopped cycle's Chrome trace to the run directory (``torch-profiler-<number>.json``)
        and frees what torch held, on the program's thread between two model calls: both hold
        the GIL throughout, so on the converter thread they would stall the program's thread
        inside its next model call instead, where the stall would count as the model's time."""
        path = self._export_dir() / f"torch-profiler-{number}.json"
        with gc_paused():
            prof.export_chrome_trace(str(path))
            _release(prof)
        return path

    def end_early(self) -> None:
        """Stops the profiler now (``tracer/windows.py``): in cycles, its last cycle goes to the
        converter; otherwise its trace is kept on disk for ``stop()`` to convert. Either way
        what torch held is freed, and the program is paused only for torch's own stop (and,
        without cycles, its export)."""
        self._ended = True
        self._close_gap()
        if self._cycles is not None:
            self._with_others_quiet(lambda: self._next_cycle(restart=False), END_WAIT_S)
        else:
            self._with_others_quiet(self._export, END_WAIT_S)

    def _with_others_quiet(self, stop: Callable[[], None], wait_s: float) -> None:
        """Runs ``stop``, a last stop of the profiler: for the all-threads profiler, with spans
        begun on other threads held (``Recorder.holding_new_spans``) and once the spans open there
        have ended, for at most ``wait_s``. Stopped beside another thread's running ops, the
        all-threads profiler reads their records as they are written, which corrupts the heap
        (``_one_thread_ok``); a request's model call in flight there then ends first. A profiler
        of one thread stops at once."""
        session = self._session
        if session is None or self.thread_ident is not None or self._prof is None:
            stop()
            return
        recorder = session.recorder
        release = recorder.holding_new_spans()
        try:
            deadline = time.monotonic() + wait_s
            while recorder.open_on_other_threads() and time.monotonic() < deadline:
                time.sleep(0.001)
            stop()
        finally:
            release()

    def _export(self) -> None:
        """Stops the profiler (if running) and writes its Chrome trace to the run directory
        (``EXPORT_FILE``; ``stop()`` removes it once converted, and a process killed in between
        leaves it there for ``mltrace import``), or to a temporary directory without one."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        with _own_call():
            prof.stop()
        t0 = time.perf_counter_ns()
        path = self._export_dir() / EXPORT_FILE
        prof.export_chrome_trace(str(path))
        self._exported = path
        self.export_ns += time.perf_counter_ns() - t0

    def _export_dir(self) -> Path:
        """The run directory, or a temporary directory where the session has none."""
        run_dir = self._session.run_dir if self._session is not None else None
        if run_dir is not None:
            return run_dir
        if self._tmp is None:
            self._tmp = tempfile.mkdtemp(prefix="mltrace-kineto-")
        return Path(self._tmp)

    def convert(self, path: Path) -> KinetoEvents:
        """Converts the Chrome trace at ``path`` into the session's events, adding its stats."""
        session = self._session
        assert session is not None
        trace = load_kineto_json(path)
        result = kineto_to_events(trace, session.tracks, session.new_id, session.anchor.epoch_to_session, external_ids=False)
        self.add_stats(result.stats)
        return result

    def add_stats(self, stats: KinetoStats) -> None:
        """Adds a cycle's conversion stats to the source's (from the converter thread, and from
        the stopping thread at the end: ``_Converter.finish``)."""
        with self._stats_lock:
            if self.stats is None:
                self.stats = stats
            else:
                self.stats.merge(stats)

    def add_export_ns(self, ns: int) -> None:
        """Adds time spent converting cycles (``export_ns``), from either thread."""
        with self._stats_lock:
            self.export_ns += ns

    def sealed_until_ns(self) -> int | None:
        """In cycles, the stop of the last cycle whose ops are written (``_Converter.sealed_ns``:
        0 before the first), None once the profiler ended and its last cycle is converted;
        held whole, 0 once the profiler started; None before."""
        cycles = self._cycles
        if cycles is not None:
            if self._ended and cycles.cycles >= cycles.handed:
                return None  # ended early: nothing more comes (between two cycles, one is on its way)
            return cycles.sealed_ns
        return 0 if self._prof is not None or self._exported is not None else None

    def stop(self) -> list[Event]:
        """Stops the profiler (unless it ended early) and returns its ops, API calls, kernels and
        flows; in cycles, the last cycle is converted and every cycle's events were handed to
        the session already."""
        try:
            cycles = self._cycles
            if cycles is not None:
                self._with_others_quiet(lambda: self._next_cycle(restart=False), STOP_WAIT_S)
                cycles.finish()
                self._note_stats(cycles.cycles)
                return []
            self._with_others_quiet(self._export, STOP_WAIT_S)
            if self._exported is None:
                return []
            t0 = time.perf_counter_ns()
            result = self.convert(self._exported)
            self.export_ns += time.perf_counter_ns() - t0
            self._note_stats(1)
            # Tracks are left out: the session's registry already queued them.
            return result.events(with_tracks=False)
        finally:
            if self._exported is not None:
                self._exported.unlink(missing_ok=True)
                self._exported = None
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None
            self._around_start.clear()
            self._unguard()
            self._ranges.uninstall()
            if self._hook is not None:
                self._hook.remove()
                self._hook = None

    def _note_stats(self, cycles: int) -> None:
        """run.json's ``torch_profiler``: the conversion stats, the export's time and the cycles."""
        if self.stats is None or self._session is None:
            return
        stats = self.stats.as_dict()
        stats["export_ns"] = self.export_ns
        stats["cycles"] = cycles
        if self._cycles is not None:
            stats["cycle_s"] = self.cycle_s
            stats["switches"] = self.switches
            stats["switch_s"] = round(self.switch_ns / 1e9, 6)
            stats["pauses"] = [list(p) for p in self.pauses]
            stats["one_thread_cycles"] = self.one_thread_cycles
            if self.cycles_stopped:
                stats["cycles_stopped"] = self.cycles_stopped
            if self.switches_deferred:
                stats["switches_deferred"] = dict(self.switches_deferred)
            if self._cycles.spans_written:
                stats["converter_process"] = {"spans": self._cycles.spans_written, "peak_rss_kb": self._cycles.converter_peak_rss_kb}
            if self._cycles.waited_ns:
                waited = self._cycles.waited_ns / 1e9
                stats["waited_for_conversion_s"] = round(waited, 3)
                self._session.note_limitation(
                    f"op level: the program ran quicker than its ops were converted, so it waited {waited:.2f} s in all "
                    f"between model calls, a running cycle holding at most {CYCLE_OPS_MAX:,} ops"
                )
            self._note_unrecorded_gaps(stats)
        self._session.meta["torch_profiler"] = stats

    def _note_unrecorded_gaps(self, stats: dict[str, Any]) -> None:
        """run.json's ``torch_profiler.unrecorded`` (the intervals without a cycle while the
        converter caught up, one left open at the stop closed there) and the limitation."""
        self._close_gap()
        if not self.unrecorded or self._session is None:
            return
        stats["unrecorded"] = [list(gap) for gap in self.unrecorded]
        stats["unrecorded_calls"] = self.unrecorded_calls
        seconds = sum(end - begin for begin, end in self.unrecorded) / 1e9
        self._session.note_limitation(
            f"op level: its converter fell behind the program; rather than make the program wait past "
            f"{BACKLOG_WAIT_FREE_S:g} s or {BACKLOG_WAIT_SHARE:.0%} of the run, it paused: no ops were recorded in "
            f"{len(self.unrecorded)} interval(s) ({seconds:.2f} s, {self.unrecorded_calls} model calls) while it caught up"
        )


class _Converter:
    """Converts the stopped cycles of a ``TorchOpSource``'s profiler on a thread of its own, in
    order, and hands their events to the session.

    Attributes:
        handed: cycles handed so far.
        cycles: cycles converted (or failed) so far.
        queued_spans: the ops of the cycles handed and not yet converted, counted in their files.
        spans_per_call: the ops per model call of the last cycle handed that had calls, the first
            left out: it ends at the first model call's return and holds everything the program
            ran before it (building a data set, tokenising: a set-up of 100,000 ops counted
            every later call as 100,000 ops); the second holds one call.
        spans_written: spans the converter process wrote to the run (the session counts them).
        converter_peak_rss_kb: the converter process's peak resident memory, once it ended.
        use_process: cycles go to the converter process (``MLTRACE_OP_CONVERTER``, default on).
        process_waits: in a forked child, the converter process waits for a cycle with a model
            call after the first (``hand``): a child that makes one model call (a fork-per-request
            service's) converts its cycles here and starts no interpreter for them.
        sealed_ns: the session time at which the last converted cycle stopped (0 before the
            first): every op that ended by then is written or queued.
        waited_ns: how long the program waited for conversions in all (``wait_converted``).
    """

    def __init__(self, source: TorchOpSource, session: SessionView) -> None:
        self._source = source
        self._session = session
        self._queue: queue.SimpleQueue[tuple[Path, int, int] | None] = queue.SimpleQueue()  # path, stop, ops
        self._thread: threading.Thread | None = None
        self.handed = 0
        self.cycles = 0
        self.queued_spans = 0
        self.spans_per_call = 0.0
        self.spans_written = 0
        self.converter_peak_rss_kb = 0
        self.sealed_ns = 0
        self.waited_ns = 0
        self._converted = threading.Condition()
        self.use_process = converter_process_wanted()
        self.process_waits = self.use_process and _in_forked_child(session)
        self._process: _ConverterProcess | None = None

    def hand(self, path: Path, calls: int, stopped_ns: int, spans: int) -> None:
        """Queues a stopped cycle's exported trace (of ``calls`` model calls and about ``spans``
        ops, stopped at session time ``stopped_ns``) for conversion."""
        self.handed += 1
        self.queued_spans += spans
        if calls and self.handed > 1:
            self.spans_per_call = spans / calls
            self.process_waits = False  # a later model call's cycle: the program goes on calling
        self._queue.put((path, stopped_ns, spans))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mltrace-torch-ops", daemon=True)
            self._thread.start()

    def wait_converted(self, allowance_s: float) -> bool:
        """Waits until every cycle handed is converted (the program's thread, between two model
        calls: ``CYCLE_OPS_MAX``), adding the wait to ``waited_ns``; whether they are. Past
        ``allowance_s`` it gives up where the converter process is starved (``_starved``):
        while it gets a core, the wait goes on."""
        t0 = time.perf_counter_ns()
        began = time.monotonic()
        cpu0 = self._process.cpu_ns() if self._process is not None else None
        with self._converted:
            while self.cycles < self.handed and self._thread is not None:
                waited = time.monotonic() - began
                judged = max(allowance_s, STARVED_WINDOW_S)
                if waited >= judged and self._starved(cpu0, waited):
                    break
                self._converted.wait(max(0.01, min(judged - waited, 0.25)) if waited < judged else 0.25)
            caught_up = self.cycles >= self.handed or self._thread is None
        self.waited_ns += time.perf_counter_ns() - t0
        return caught_up

    def _starved(self, cpu0: int | None, waited_s: float) -> bool:
        """Whether the converter process got less than ``STARVED_CPU_SHARE`` of a core over a
        wait of ``waited_s`` that began at its CPU time ``cpu0``; a converter on a thread of
        this process (or one whose CPU time cannot be read) is not (the program's own waits
        give it the GIL, at the program's priority)."""
        if cpu0 is None or self._process is None or waited_s <= 0:
            return False
        cpu1 = self._process.cpu_ns()
        return cpu1 is not None and (cpu1 - cpu0) / 1e9 < STARVED_CPU_SHARE * waited_s

    def finish(self) -> None:
        """Waits until every cycle handed is converted (those the converter thread has not begun
        here meanwhile: ``_convert_queued_here``), then ends the converter process."""
        try:
            if self._thread is not None:
                self._convert_queued_here()
                self._queue.put(None)
                self._thread.join()
                self._thread = None
        finally:
            if self._process is not None:
                self.converter_peak_rss_kb = self._process.peak_rss_kb
                self._process.close()
                self._process = None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            path, stopped_ns, counted = item
            try:
                self._convert(path)
                self.sealed_ns = stopped_ns
                self._session.flush_soon()  # the finish may take the cycle now
            except Exception as exc:  # a cycle lost, never the program
                self._session.errors.append(f"torch.profiler: converting cycle {self.cycles + 1} failed: {exc}")
            finally:
                self.queued_spans -= counted
                with self._converted:
                    self.cycles += 1
                    self._converted.notify_all()
            # What the cycle's stop, export, load and conversion freed goes back to the system
            # (glibc keeps it otherwise).
            release_free_memory()

    def _convert(self, path: Path) -> None:
        """Converts the cycle at ``path``: in the converter process where there is one, else here."""
        source = self._source
        t0 = time.perf_counter_ns()
        if self._process is None and self.use_process and not self.process_waits:
            self.start_process()
        if self._convert_elsewhere(path) is None:
            self._convert_here(path)
        source.add_export_ns(time.perf_counter_ns() - t0)

    def _convert_here(self, path: Path) -> None:
        """Converts the cycle at ``path`` in this process and hands its events to the session."""
        try:
            # The cyclic collector is paused meanwhile, process-wide: the load and conversion
            # build many objects and no cycles, and full collections of a process with torch
            # loaded, again and again, made them several times slower.
            with gc_paused():
                result = self._source.convert(path)
        finally:
            path.unlink(missing_ok=True)
        self._session.add_events(result.events(with_tracks=False))

    def _convert_queued_here(self) -> None:
        """At the session's stop: converts in this process, beside the converter thread, the
        cycles it has not begun (the program is done with its model calls). A converter that
        fell behind, or that the machine's other work starves at its lower priority, leaves
        only the cycle it converts to the end of the run."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:  # no thread takes items any more
                self._queue.put(None)
                return
            path, _stopped_ns, counted = item
            t0 = time.perf_counter_ns()
            try:
                self._convert_here(path)
            except Exception as exc:  # a cycle lost, never the program
                self._session.errors.append(f"torch.profiler: converting a cycle at the stop failed: {exc}")
            finally:
                self._source.add_export_ns(time.perf_counter_ns() - t0)
                self.queued_spans -= counted
                with self._converted:
                    self.cycles += 1
                    self._converted.notify_all()

    def start_process(self) -> None:
        """Starts the converter process where it is wanted and the session has a run directory:
        when the profiler starts (the program is importing torch or building its model), so
        that the process's own start (an interpreter and mltrace's imports, about 0.1 s of a
        core) does not take cores from the model call after the first cycle; the first
        conversion starts it where this did not: in a forked child, whose start is followed by
        the model call it was forked for (``_in_forked_child``), the first conversion of a cycle
        with a later model call does (``process_waits``)."""
        if self._process is not None or not self.use_process or self._session.run_dir is None:
            return
        try:
            self._process = _ConverterProcess(self._session)
        except _ConverterGone as exc:
            self.use_process = False
            self._session.errors.append(f"torch.profiler: the converter process failed ({exc}); cycles are converted here")

    def _convert_elsewhere(self, path: Path) -> int | None:
        """Has the converter process convert the trace at ``path`` and append its events to the
        run's events.jsonl; the number of spans written, or None where this process must
        convert it (no run directory, no converter process, or it failed to start or died)."""
        run_dir = self._session.run_dir
        if run_dir is None or self._process is None:
            return None
        try:
            spans, stats = self._process.convert(path, run_dir / EVENTS_FILE)
        except _ConverterGone as exc:
            self._process.close(timeout_s=1.0)
            self._process = None
            self.use_process = False
            self._session.errors.append(f"torch.profiler: the converter process failed ({exc}); cycles are converted here")
            return None
        self.spans_written += spans
        self._source.add_stats(stats)
        return spans


def _complete_events(path: Path) -> int:
    """How many complete events (``"ph": "X"``, as Kineto writes them) a Chrome trace holds:
    about the spans its conversion makes, counted without parsing it."""
    try:
        return path.read_bytes().count(b'"ph": "X"')
    except OSError:
        return 0


def _in_forked_child(session: SessionView) -> bool:
    """Whether ``session`` is a forked child's (run.json ``process.start``: ``fork``): it starts
    with the program's model built and, in a fork-per-request service or a pool's worker, the
    model call it was forked for coming next."""
    process = session.meta.get("process")
    return isinstance(process, dict) and process.get("start") == "fork"


def converter_process_wanted() -> bool:
    """Whether cycles are converted in a process of their own (``MLTRACE_OP_CONVERTER``: ``0``
    converts them on a thread of the traced process)."""
    return (OP_CONVERTER.get() or "1").strip() != "0"


class _ConverterGone(Exception):
    """The converter process could not start, died, or failed a cycle."""


class _ConverterProcess:
    """The converter process of a session's op level (``formats/kineto_serve.py``): one child,
    started with the profiler (``_Converter.start_process``), with no torch in it, as a helper
    (``helper_env.start_helper``: a process group of its own, below the program's CPU
    priority). It asks this process for tracks and ids while it converts;
    ``close`` ends it (the end of its input) and reaps it."""

    def __init__(self, session: SessionView) -> None:
        self._session = session
        self.peak_rss_kb = 0  # the process's peak resident memory, as it last said
        try:
            self._proc = start_helper("mltrace.formats.kineto_serve")
        except OSError as exc:
            raise _ConverterGone(f"could not start: {exc}") from None
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_in_child(ref))

    @property
    def pid(self) -> int:
        return self._proc.pid

    def cpu_ns(self) -> int | None:
        """The process's CPU time so far (ns, to the clock tick), from ``/proc``; None where it
        cannot be read."""
        try:
            fields = Path(f"/proc/{self._proc.pid}/stat").read_text().rpartition(")")[2].split()
            return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def forget(self) -> None:
        """In a forked child of the traced process: closes its copies of the pipes (the process
        then sees the end of its input when the traced process closes its own), touching
        nothing else."""
        forget_helper(self._proc)

    def convert(self, path: Path, events: Path) -> tuple[int, KinetoStats]:
        """Has the process convert one cycle's trace; (spans written, conversion stats)."""
        anchor = self._session.anchor
        self._send({"path": str(path), "events": str(events), "epoch_ns": anchor.epoch_ns, "monotonic_ns": anchor.monotonic_ns})
        while True:
            answer = self._read()
            if "done" in answer:
                done = answer["done"]
                self.peak_rss_kb = max(self.peak_rss_kb, int(done.get("peak_rss_kb", 0)))
                return int(done["spans"]), KinetoStats.from_dict(done["stats"])
            if "error" in answer:
                raise _ConverterGone(str(answer["error"]))
            if "track" in answer:
                self._send({"row": track_row(self._track(answer["track"]))})
            elif "ids" in answer:
                new_id = self._session.new_id
                self._send({"ids": [new_id() for _ in range(int(answer["ids"]))]})

    def _track(self, key: list[Any]) -> Any:
        tracks = self._session.tracks
        kind = key[0]
        if kind == "thread":
            return tracks.thread(key[1], key[2], pid=key[3])
        if kind == "gpu_stream":
            return tracks.gpu_stream(key[1], key[2], pid=key[3])
        return tracks.counter(key[1], key[2], key[3])

    def _send(self, obj: Any) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        try:
            stdin.write(dumps(obj) + b"\n")
            stdin.flush()
        except OSError as exc:
            raise _ConverterGone(f"it exited ({exc})") from None

    def _read(self) -> dict[str, Any]:
        stdout = self._proc.stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            raise _ConverterGone(f"it exited (status {self._proc.wait()})")
        answer = loads(line)
        if not isinstance(answer, dict):
            raise _ConverterGone("an answer that is not an object")
        return answer

    def close(self, timeout_s: float = 5.0) -> None:
        """Ends the process (its input closed: it finishes the cycle it converts, if any) and
        reaps it; one that does not end in ``timeout_s`` is killed."""
        end_helper(self._proc, timeout_s)


def _forget_in_child(ref: weakref.ref[_ConverterProcess]) -> None:
    """After a fork: the child's copy of a converter process, if still alive, lets go of it."""
    process = ref()
    if process is not None:
        process.forget()


class _CpuProfile:
    """Kineto's CPU profiler through ``torch.autograd.profiler.profile``, the object that
    ``torch.profiler.profile`` runs underneath, with the same ``start``, ``stop`` and
    ``export_chrome_trace``. ``torch.profiler.profile.start`` imports ``torch._inductor`` (its
    CUDA graphs setting: ``hasattr(torch, "_inductor")`` imports the lazy module) in a program
    that never compiled anything, which this skips; it also adds the trace's
    ``record_shapes``/``profile_memory`` metadata, which the conversion does not read."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        from torch.autograd.profiler import profile

        self.profiler = profile(
            use_cpu=True,
            use_kineto=True,
            record_shapes=bool(kwargs.get("record_shapes")),
            profile_memory=bool(kwargs.get("profile_memory")),
            experimental_config=kwargs.get("experimental_config"),
        )

    def start(self) -> None:
        """Starts recording (``_prepare_trace`` and ``_start_trace``, as ``__enter__``)."""
        self.profiler.__enter__()

    def stop(self) -> None:
        """Stops recording: Kineto builds its result (``_disable_profiler``)."""
        self.profiler.__exit__(None, None, None)

    def export_chrome_trace(self, path: str) -> None:
        """Writes Kineto's Chrome trace to ``path``."""
        self.profiler.export_chrome_trace(path)


def _new_profiler(profile: Any, kwargs: dict[str, Any]) -> Any:
    """A profiler for ``kwargs`` (``torch.profiler.profile``'s): ``_CpuProfile`` where only CPU
    activity is recorded, else ``profile(**kwargs)``."""
    from torch.profiler import ProfilerActivity

    if list(kwargs.get("activities", ())) == [ProfilerActivity.CPU]:
        return _CpuProfile(kwargs)
    return profile(**kwargs)


#: What torch 2.10 and 2.11 warn at every ``torch.profiler.profile`` start, a schedule or not
#: (fixed in torch by pytorch/pytorch#180387): mltrace's profiler must not print it on the
#: program's stderr.
CYCLE_WARNING = r"Warning: Profiler clears events at the end of each cycle"


def profiler_running(torch: ModuleType) -> bool:
    """Whether a torch profiler runs in this process (Kineto keeps one profiling session per
    process, and a second start would take it over). Never raises."""
    try:
        return bool(torch._C._autograd._profiler_enabled())
    except Exception:  # a torch without it
        return False


#: The filter that ignores ``CYCLE_WARNING`` while mltrace's profiler starts (as
#: ``warnings.filterwarnings`` would compile it).
_QUIET_CYCLE = ("ignore", re.compile(CYCLE_WARNING, re.I), UserWarning, None, 0)


#: Kineto's log level while mltrace's profiler first starts: none of its lines.
_KINETO_LEVEL = ("KINETO_LOG_LEVEL", "99")


@contextlib.contextmanager
def _kineto_quiet() -> Iterator[None]:
    """Around the first start of mltrace's profiler: Kineto prints "STAGE:"/"USDT:" lines on
    the program's stderr at every start and stop (two a cycle), at the level it reads from
    ``KINETO_LOG_LEVEL`` when it first starts. The variable is set for that start where the
    program has none and taken out again, so the program and its children never see it (the
    level stays Kineto's for the process: a profiler the program starts later prints none of
    those lines either)."""
    name, quiet = _KINETO_LEVEL
    if name in os.environ or c_environ.is_put(name):  # the user's own setting wins
        yield
        return
    c_environ.put(name, quiet)  # for Kineto's getenv, not the program's os.environ
    try:
        yield
    finally:
        c_environ.take_back(name)


def _start_quietly(prof: Any) -> None:
    """Starts ``prof`` with torch's ``CYCLE_WARNING`` ignored, the program's warning filters as
    they were before and after.

    The filter goes into the list and out again by hand: ``warnings.filterwarnings`` and
    ``catch_warnings`` count as a change of the filters, which empties every module's record
    of the warnings it has shown, so a warning the program shows once per place would show
    again after each cycle's start."""
    filters = cast("list[Any]", warnings.filters)  # the list itself, which the checks read
    filters.insert(0, _QUIET_CYCLE)
    try:
        with _own_call():
            prof.start()
    finally:
        for i, f in enumerate(filters):
            if f is _QUIET_CYCLE:
                del filters[i]
                break


#: Set on a thread while mltrace's own profiler starts or stops there (``_own_call``): the
#: profiler starts that ``TorchOpSource._guard_program_profiler`` sees without it are the program's.
_own = threading.local()


@contextlib.contextmanager
def _own_call() -> Iterator[None]:
    """Marks what runs inside as mltrace's own profiler start or stop."""
    _own.active = True
    try:
        yield
    finally:
        _own.active = False


def _release(prof: Any) -> None:
    """Drops what a stopped profiler holds (Kineto's result), which otherwise lives until the
    cyclic garbage collector finds the profiler object's reference cycle."""
    inner = getattr(prof, "profiler", None)
    if inner is not None:
        for name in ("kineto_results", "_function_events", "_old_function_events"):
            if hasattr(inner, name):
                setattr(inner, name, None)


def _switch_before_forks(source: TorchOpSource) -> None:
    """Has ``source._before_fork`` run before every ``os.fork()`` of the process while the
    source lives (``os.register_at_fork`` keeps its handlers for good: a weak reference)."""
    if not hasattr(os, "register_at_fork"):
        return
    ref = weakref.ref(source)

    def before() -> None:
        alive = ref()
        if alive is not None:
            alive._before_fork()

    os.register_at_fork(before=before)


def _one_thread_config() -> Any:
    """Kineto's config for a profiler of the starting thread alone that builds the trace alone
    at its stop (``trace_only``), or None where torch lacks it."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(trace_only=True)
    except (ImportError, TypeError):
        return None


def _all_threads_config(trace_only: bool = False) -> Any:
    """Kineto's config for profiling every thread, or None where torch lacks it. With
    ``trace_only``, where torch has it, the stop builds the trace alone and not the list of
    events that ``events()`` would read (mltrace reads the exported trace, which is the same;
    docs/PERFORMANCE.md, "Long runs")."""
    try:
        from torch._C._profiler import _ExperimentalConfig
    except ImportError:
        return None
    if trace_only:
        try:
            return _ExperimentalConfig(profile_all_threads=True, trace_only=True)
        except TypeError:  # a torch without trace_only
            pass
    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return None
