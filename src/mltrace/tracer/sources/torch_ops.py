"""PyTorch op level (and, with CUDA, kernel level) from ``torch.profiler``.

The source runs ``torch.profiler.profile`` (Kineto) for the whole session:
CPU activity with ``record_shapes`` (FLOPs are counted from the shapes
afterwards, ``aten_flops``), plus CUDA activity (runtime calls, kernels,
memcpys, memsets) when the kernel level is enabled and torch sees a GPU. At
``stop()`` it exports Kineto's Chrome trace to the run directory
(``EXPORT_FILE``, removed once converted) and converts it with ``kineto_to_events``; it is a post-hoc source: ops reach the run
directory only when the session stops.

Placement. Kineto's thread ids are OS thread ids, so ops land on the same
thread tracks as the live model and layer spans of the ``torch.modules``
source, where ``nest_by_containment`` makes each op a child of the
innermost layer around it. Ops on other threads (intra-op workers, user
threads, the autograd engine) keep their own tracks. All threads are
profiled when torch supports it (``_ExperimentalConfig(profile_all_threads=
True)``, PyTorch ≥ 2.6); older versions see only the thread that started
the profiler, which run.json records as a limitation.

Clock. ``ts * 1000 + baseTimeNanoseconds`` is Unix-epoch ns (Kineto reads
the system clock); ``session.anchor.epoch_to_session`` converts it. Measured
on this project's 2-core CPU machine under load (PyTorch 2.13): 200 of 200
``record_function`` ranges, each entered and left between two
``time.monotonic_ns()`` readings, landed inside their window after
conversion, with smallest margins of 9.6 µs before and 1.5 µs after; so the
conversion error lies between −9.6 µs and +1.5 µs (anchor uncertainty
61 ns). That is below the gap between a layer hook's timestamp and the first
op of its forward, which is what nesting needs;
``tests/tracer/test_torch_ops.py`` checks the bracketing on every run.

Start. torch is never imported by mltrace: if the program has not imported
torch when the session starts, the profiler starts right after its
``import torch`` finishes (a post-import hook), so ops run before that
import are none anyway.

Ending early. Without CUDA activity the profiler may be stopped between two
model calls (``can_end_early``, ``end_early``, ``tracer/windows.py``). The
all-threads profiler stops from any thread; one that records only the thread
that started it also stops only there (elsewhere torch warns and records on), so
that thread is named in ``thread_ident``. The trace then waits in the run
directory until ``stop()`` converts it.

Memory (``--memory``, ``ProfileOptions.memory``). The profiler also runs with
``profile_memory=True``: every allocation and free becomes a ``[memory]`` event
(``kineto_to_events``), attributed to ops and layers by ``passes.memory``. torch
(2.13) records no memory events in its all-threads mode, so with ``--memory`` the
profiler records the thread that started it only (ops on other threads are not
recorded, and run.json says so); the allocations of the program's main thread,
where the model runs, are what the memory numbers need.

Limits. Kineto keeps every event in memory until ``stop()`` and allows one
profiler per process: a program that runs its own ``torch.profiler`` while
this source is on gets an error from torch, so use ``--level layer`` there.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mltrace.run.events import Event
from mltrace.run.levels import Level
from mltrace.tracer.sources._imports import PostImportHook
from mltrace.tracer.sources.kineto import KinetoStats, kineto_to_events, load_kineto_json

if TYPE_CHECKING:
    from types import ModuleType

    from mltrace.tracer.sources.base import SessionView

#: torch.profiler's Chrome trace in the run directory, between its export and its conversion.
EXPORT_FILE = "torch-profiler.json"


def _cuda_possible() -> bool:
    """Whether torch may see a GPU here, without importing torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            return bool(torch.cuda.is_available())
        except Exception:
            return False
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False
    if "+cpu" in version:
        return False
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd"))


class TorchOpSource:
    """Op spans (and CUDA kernels) for PyTorch, recorded by ``torch.profiler``.

    Attributes:
        name: "torch.profiler".
        levels: ``(Level.OP,)``, plus ``Level.KERNEL`` where torch may see a GPU.
        stats: the conversion stats of the last ``stop()`` (None before).
        export_ns: how long the last Chrome-trace export and conversion took (ns).
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
        self.stats: KinetoStats | None = None
        self.export_ns = 0
        self.thread_ident: int | None = None
        self._tmp: str | None = None  # a temporary directory holding the exported trace, if one was made
        self._exported: Path | None = None
        self._cuda_activity = False  # may record CUDA activity (before start), or does
        self._around_start: list[tuple[Callable[[], None], Callable[[], None]]] = []
        self._ended = False  # the op level ended early: a later ``import torch`` starts nothing

    @property
    def profiling(self) -> bool:
        """Whether torch.profiler is running (it waits for the program's ``import torch``)."""
        return self._prof is not None

    @property
    def can_end_early(self) -> bool:
        """Whether the session may stop this source before it ends: not with CUDA activity,
        whose hand-over between Kineto and cupti-python is only done at the session's end."""
        return not self._cuda_activity

    def around_profiler_start(self, before: Callable[[], None], after: Callable[[], None]) -> None:
        """Calls ``before`` right before torch.profiler starts and ``after`` right after
        (CuptiSource hands CUPTI over to Kineto and takes it back). Failures are recorded."""
        self._around_start.append((before, after))

    def available(self) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed"
        return None

    def start(self, session: SessionView) -> None:
        self._session = session
        from mltrace.tracer.sources.cupti import requested_kernel_path

        # With MLTRACE_KERNEL_PATH=cupti-python, CUDA activity stays out from the start: the
        # profiler may start right now (torch already imported), before CuptiSource runs.
        self.record_kernels = Level.KERNEL in session.levels and requested_kernel_path() != "cupti-python"
        self._cuda_activity = self.record_kernels and Level.KERNEL in self.levels
        # Kineto prints "STAGE:"/"USDT:" lines on the program's stderr at every start and
        # stop; it reads this level when the profiler first starts. The user's own setting wins.
        os.environ.setdefault("KINETO_LOG_LEVEL", "99")
        self._hook = PostImportHook("torch", self._begin)

    def _begin(self, torch: ModuleType) -> None:
        """Starts the profiler (now, or right after the program's ``import torch``)."""
        session = self._session
        if session is None or self._prof is not None or self._ended:  # an op level that ended before torch came
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
            config = None if memory else _all_threads_config()
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
            prof = profile(**kwargs)
            self._call_around(0)
            from mltrace.tracer.cuda_exit import keep_primary_contexts_at_exit
            from mltrace.tracer.sources.cupti import hand_back_buffers

            keep_primary_contexts_at_exit()  # Kineto's CUPTI callbacks must not run during C++ teardown
            hand_back_buffers()  # Kineto takes CUPTI's buffer callbacks now: none of cupti-python's may be in flight
            try:
                prof.start()
                self._prof = prof
                if config is None:  # torch stops a one-thread profiler only where it started
                    self.thread_ident = threading.get_ident()
            finally:
                self._call_around(1)
        except Exception as exc:  # never into the user's program
            session.errors.append(f"{self.name}: could not start torch.profiler: {exc}")
            session.note_limitation(f"op level: torch.profiler did not start ({exc})")

    def _call_around(self, which: int) -> None:
        for pair in self._around_start:
            try:
                pair[which]()
            except Exception as exc:  # a hook's failure stops neither the profiler nor the program
                if self._session is not None:
                    self._session.errors.append(f"{self.name}: {'before' if which == 0 else 'after'}-start hook failed: {exc}")

    def end_early(self) -> None:
        """Stops the profiler now and keeps its trace on disk for ``stop()`` to convert
        (``tracer/windows.py``): what torch held is freed, and the program is paused only
        for torch's own stop and export."""
        self._ended = True
        self._export()

    def _export(self) -> None:
        """Stops the profiler (if running) and writes its Chrome trace to the run directory
        (``EXPORT_FILE``; ``stop()`` removes it once converted, and a process killed in between
        leaves it there for ``mltrace import``), or to a temporary directory without one."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        prof.stop()
        t0 = time.perf_counter_ns()
        run_dir = self._session.run_dir if self._session is not None else None
        if run_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="mltrace-kineto-")
            run_dir = Path(self._tmp)
        path = run_dir / EXPORT_FILE
        prof.export_chrome_trace(str(path))
        self._exported = path
        self.export_ns += time.perf_counter_ns() - t0

    def stop(self) -> list[Event]:
        """Stops the profiler (unless it ended early) and returns its ops, API calls, kernels and flows."""
        try:
            self._export()
            if self._exported is None:
                return []
            t0 = time.perf_counter_ns()
            trace = load_kineto_json(self._exported)
            session = self._session
            assert session is not None
            result = kineto_to_events(trace, session.tracks, session.new_id, session.anchor.epoch_to_session, external_ids=False)
            self.stats = result.stats
            self.export_ns += time.perf_counter_ns() - t0
            stats = result.stats.as_dict()
            stats["export_ns"] = self.export_ns
            session.meta["torch_profiler"] = stats
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
            if self._hook is not None:
                self._hook.remove()
                self._hook = None


def _all_threads_config() -> Any:
    """Kineto's config for profiling every thread, or None where torch lacks it."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None
