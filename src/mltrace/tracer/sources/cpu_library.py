"""The library level on CPU: oneDNN primitives and oneMKL calls from their verbose logs.

``CpuLibrarySource`` switches the libraries' verbose output on (through torch's runtime
switches once the program imports torch, or through the environment for TensorFlow:
``use_env``), reads the lines from fd 1 with ``FdTap`` and turns them into LIBRARY spans
(``library_spans``). While MKL's verbose mode is on, its timer reads the vDSO clock
(``_redirect_mkl_timer``). The lines carry no thread id, so spans are put on the track of the
thread that started the source; the ``attach_library_calls`` pass (``tracer.passes.library``)
moves each to the thread of the op that issued it and sets its parent.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mltrace.formats.verbose_logs import (
    MklCall,
    OneDnnCall,
    gemm_flops,
    onednn_flops,
    parse_mkl_line,
    parse_onednn_line,
)
from mltrace.run.events import Event, Span
from mltrace.run.levels import Level
from mltrace.settings import MKL_TIMER
from mltrace.tracer.fdtap import FdTap, TappedLine
from mltrace.tracer.sources._imports import PostImportHook
from mltrace.tracer.sources.base import Source

if TYPE_CHECKING:
    from types import ModuleType

    from mltrace.tracer.sources.base import SessionView

_TIMESTAMP_ENV = "ONEDNN_VERBOSE_TIMESTAMP"
_READ_BATCH_S = 0.1
_ENV_SWITCHES = {"ONEDNN_VERBOSE": "profile_exec", "MKL_VERBOSE": "1"}
_POINTER = re.compile(r"0x[0-9a-fA-F]+\Z")


def _onednn_attrs(call: OneDnnCall) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "ml.library.name": "oneDNN",
        "ml.library.kind": call.kind,
        "ml.library.impl": call.impl,
        "ml.library.prop": call.prop,
        "ml.library.desc": call.desc,
        "ml.library.memory": call.memory,
    }
    if call.aux:
        attrs["ml.library.aux"] = call.aux
    if call.attrs:
        attrs["ml.library.attrs"] = call.attrs
    return attrs


def _mkl_attrs(call: MklCall) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "ml.library.name": "MKL",
        "ml.library.kind": call.function,
        # pointers change every run and say nothing: keep sizes, flags and strides
        "ml.library.desc": ",".join("*" if _POINTER.match(a) else a for a in call.args),
    }
    if call.tid is not None:
        attrs["ml.library.mkl_tid"] = call.tid
    if call.nthr is not None:
        attrs["ml.library.nthr"] = call.nthr
    return attrs


def library_spans(
    lines: list[TappedLine],
    epoch_to_session: Callable[[int], int],
    track_id: int,
    new_id: Callable[[], int],
    framework: str | None = None,
) -> tuple[list[Span], dict[str, int]]:
    """Turns captured verbose lines into LIBRARY spans (a pure function).

    Each oneDNN ``exec`` line and each MKL call becomes one span, in arrival
    order, with ``ml.library.seq`` its index. A oneDNN line with a timestamp
    is placed at its own start and duration (converted with
    ``epoch_to_session``). A line without one (every MKL line) ends at its
    receive time and lasts its reported duration, and gets
    ``ml.library.untimed = True``: the call ended at or before it was
    received, so this is an estimate that a later pass refines.

    Args:
        lines: captured lines (receive time in session ns, text).
        epoch_to_session: converts Unix-epoch ns to session ns.
        track_id: the track to put every span on.
        new_id: returns a fresh span id per call.
        framework: value for ``ml.framework``, if known.

    Returns:
        The spans and counts (``onednn``, ``mkl``, ``untimed``, ``unparsed``,
        ``late`` = timed calls whose end is after their receipt by over 2 µs,
        a sign of clock misalignment; with timed calls also
        ``receive_lag_ns_median`` and ``receive_lag_ns_max``, the delay (ns)
        from a call's end to its line's receipt, which bounds how well
        untimed calls can be placed).
    """
    spans: list[Span] = []
    counts = {"onednn": 0, "mkl": 0, "untimed": 0, "unparsed": 0, "late": 0}
    lags: list[int] = []  # receipt minus end of timed calls (ns): the reader's delay
    for receive_ns, text in lines:
        attrs: dict[str, Any] = {"mltrace.level": Level.LIBRARY.label}
        if framework:
            attrs["ml.framework"] = framework
        dnn = parse_onednn_line(text)
        start_epoch: int | None = None
        if dnn is not None:
            if not dnn.is_exec:
                continue  # creation lines (verbose level 2) are not calls to trace
            counts["onednn"] += 1
            name = f"oneDNN {dnn.kind} {dnn.impl}"
            attrs.update(_onednn_attrs(dnn))
            flops = onednn_flops(dnn)
            start_epoch, duration = dnn.start_epoch_ns, dnn.duration_ns
        else:
            blas = parse_mkl_line(text)
            if blas is None:
                if not text.startswith("MKL_VERBOSE oneMKL") and ",info," not in text:
                    counts["unparsed"] += 1
                continue
            counts["mkl"] += 1
            name = f"MKL {blas.function}"
            attrs.update(_mkl_attrs(blas))
            flops, duration = gemm_flops(blas), blas.duration_ns
        attrs["ml.library.exec_ns"] = duration
        attrs["ml.library.seq"] = len(spans)
        if flops is not None:
            attrs["ml.flops"] = flops
        if start_epoch is not None:
            start = epoch_to_session(start_epoch)
            end = start + duration
            if end > receive_ns + 2_000:
                counts["late"] += 1
            lags.append(receive_ns - end)
        else:
            counts["untimed"] += 1
            attrs["ml.library.untimed"] = True
            attrs["ml.library.receive_ns"] = receive_ns
            end = receive_ns
            start = end - duration
        spans.append(Span(new_id(), None, Level.LIBRARY, name, start, end, track_id, attrs))
    if lags:
        lags.sort()
        counts["receive_lag_ns_median"] = lags[len(lags) // 2]
        counts["receive_lag_ns_max"] = lags[-1]
    return spans, counts


class CpuLibrarySource(Source):
    """oneDNN and oneMKL calls (LIBRARY level) from their verbose output on fd 1.

    Args:
        use_env: also set ``ONEDNN_VERBOSE=profile_exec`` and ``MKL_VERBOSE=1``
            in ``os.environ`` at start, for frameworks without a runtime
            switch (TensorFlow 2.21 reads them at its first oneDNN call, so
            setting them after ``import tensorflow`` works). They cannot be
            switched off again: such a framework keeps printing verbose lines
            to stdout after ``stop()``. Child processes started meanwhile
            inherit them, and their lines are captured as this process's.
    """

    name = "cpu.library"
    levels: tuple[Level, ...] = (Level.LIBRARY,)

    def __init__(self, use_env: bool = False) -> None:
        self.use_env = use_env
        self._session: SessionView | None = None
        self._tap: FdTap | None = None
        self._warmup_lines = 0
        self._hook: PostImportHook | None = None
        self._torch: ModuleType | None = None
        self._track_id = 0
        self._saved_env: dict[str, str | None] = {}
        self._problems: list[str] = []
        self._early_lines: list[TappedLine] = []
        self._mkl_timer: ModuleType | None = None  # the C helper while it redirects MKL's timer
        self._mkl_timer_used = "none"  # for run.json: which clock MKL's verbose lines were timed with

    @property
    def can_end_early(self) -> bool:
        """Whether the session may stop this source before it ends: only where torch's runtime
        switches turned verbose output on (the environment's stay on)."""
        return not self.use_env

    def available(self) -> str | None:
        if os.name != "posix":
            return "needs POSIX file descriptors"
        if not self.use_env and importlib.util.find_spec("torch") is None:
            return "torch is not installed (its runtime switches turn oneDNN/MKL verbose output on)"
        return None

    def start(self, session: SessionView) -> None:
        """Sets ``ONEDNN_VERBOSE_TIMESTAMP``, starts the fd tap, and switches verbosity on once
        torch is imported (now, if it already is; this source never imports torch itself).

        oneDNN reads ``ONEDNN_VERBOSE_TIMESTAMP`` once, when it first prints verbose output,
        so lines carry their start time; if the program printed oneDNN verbose output earlier
        without it, lines come without timestamps and are handled like MKL's.
        """
        self._session = session
        self._problems = []
        self._mkl_timer_used = "none"
        self._track_id = session.tracks.current_thread().id
        settings = {_TIMESTAMP_ENV: "1"}
        if self.use_env:
            settings.update(_ENV_SWITCHES)
            self._problems.append("verbose output switched on through the environment stays on after the session (TensorFlow)")
        self._saved_env = {k: os.environ.get(k) for k in settings}
        os.environ.update(settings)
        # Read every line in batches: waking the reader once per line took the
        # GIL from the program 80 times a ResNet-18 inference (+9 % against +5 %),
        # and on a machine whose cores the program fills each wake-up still
        # displaces one of its threads (every 10 ms: +1–2 % on the CNN, every
        # 100 ms: within the noise of verbose output to /dev/null; see FdTap's
        # batch_s and PERFORMANCE.md). oneDNN lines carry their own timestamps;
        # MKL calls are placed by issue order and room in their ops, their
        # receipt time only bounding the search (passes/library.py).
        self._tap = FdTap(batch_s=_READ_BATCH_S)
        try:
            self._tap.start()
            self._hook = PostImportHook("torch", self._switch_on)
        except BaseException:
            self._restore()
            raise

    def _switch_on(self, torch: ModuleType) -> None:
        """Turns oneDNN and MKL verbose output on through torch (called once torch is imported).

        torch exposes the libraries' runtime switches, ``torch._C._verbose.mkldnn_set_verbose``
        and ``mkl_set_verbose`` (behind ``torch.backends.mkldnn.verbose`` and
        ``torch.backends.mkl.verbose``). They work before or after oneDNN and MKL were first
        used, and switch off again, so no environment variable has to be set before torch loads.
        """
        verbose = getattr(getattr(torch, "_C", None), "_verbose", None)
        if verbose is None:
            self._problems.append("this torch has no runtime verbose switches")
            return
        self._torch = torch
        # Level 1 = executions only; 2 would add creation lines.
        if torch.backends.mkldnn.is_available() and not verbose.mkldnn_set_verbose(1):
            self._problems.append("torch could not switch oneDNN verbose output on")
        if torch.backends.mkl.is_available():
            self._redirect_mkl_timer()
            if not verbose.mkl_set_verbose(1):
                self._problems.append("torch could not switch MKL verbose output on")
            else:
                self._warm_up_mkl(torch)

    def _redirect_mkl_timer(self) -> None:
        """Points MKL's verbose timer at the vDSO clock until ``_switch_off``.

        MKL reads its clock around every call through a routine that executes CPUID, which a
        hypervisor traps; the C helper ``_mkltimer`` points that routine's dynamic-linker slots
        at ``clock_gettime`` (ARCHITECTURE.md). ``MLTRACE_MKL_TIMER=mkl`` keeps MKL's own timer;
        run.json's ``sources_info["cpu.library"]["mkl_timer"]`` says which one ran.
        """
        if MKL_TIMER.is_set_to("mkl"):
            self._mkl_timer_used = f"mkl ({MKL_TIMER.name}=mkl)"
            return
        try:
            from mltrace import _mkltimer
        except ImportError:
            self._mkl_timer_used = "mkl (mltrace's C helper _mkltimer is not built)"
            return
        try:
            slots = _mkltimer.install()
        except Exception as exc:  # never let the redirect stop the program
            self._mkl_timer_used = f"mkl (redirect failed: {exc})"
            return
        if slots:
            self._mkl_timer = _mkltimer
            self._mkl_timer_used = f"clock_gettime ({slots} slots redirected)"
        else:
            self._mkl_timer_used = "mkl (no loaded library imports its timer)"

    def _warm_up_mkl(self, torch: ModuleType) -> None:
        """Pays MKL's one-time verbose start-up now, not inside the program's first inference.

        MKL's first call in verbose mode prints its header and measures the CPU
        clock, which took 0.1–0.7 s here; the program's first matmul would carry it.
        Lines received before the warm-up ends are mltrace's own and are dropped.
        """
        try:
            x = torch.ones(8, 8)
            torch.mm(x, x)
        except Exception as exc:
            self._problems.append(f"MKL warm-up failed: {exc}")
        # Wait (briefly) for the reader thread to receive the warm-up's line, then
        # remember how many lines are mltrace's own.
        deadline = time.monotonic() + 1.0
        while self._tap is not None and time.monotonic() < deadline:
            if any("SGEMM" in ln.text for ln in self._tap.lines()):
                break
            time.sleep(0.001)
        if self._tap is not None:
            self._warmup_lines = len(self._tap.lines())

    def _switch_off(self) -> None:
        """Switches verbosity off (and MKL's timer back), and no later ``import torch`` turns it on."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        torch, self._torch = self._torch, None
        if torch is None:
            return
        verbose = torch._C._verbose
        if torch.backends.mkldnn.is_available():
            verbose.mkldnn_set_verbose(0)
        if torch.backends.mkl.is_available():
            try:
                verbose.mkl_set_verbose(0)
            finally:
                helper, self._mkl_timer = self._mkl_timer, None
                if helper is not None:
                    helper.remove()

    def _restore(self) -> list[TappedLine]:
        """Switches verbosity off, then restores fd 1 and the environment, whatever fails."""
        lines: list[TappedLine] = []
        try:
            self._switch_off()
        finally:
            try:
                if self._tap is not None:
                    lines = self._tap.stop()
                    if self._tap.detached:
                        self._problems.append("a child process kept stdout open; its later output was not traced")
                    if self._tap.reader_error is not None:
                        self._problems.append(f"the fd tap's reader stopped early: {self._tap.reader_error}")
                    self._tap = None
            finally:
                self._restore_env()
        return lines

    def _restore_env(self) -> None:
        """Puts back the environment variables ``start()`` set."""
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}

    def release_in_forked_child(self) -> None:
        """In a child forked while the source runs: the child's oneDNN/MKL verbose output off
        (and MKL's own timer back), its fd 1 back on the original, its environment restored;
        the parent's capture goes on."""
        try:
            self._switch_off()
        finally:
            if self._tap is not None:
                self._tap.release_in_forked_child()
                self._tap = None
            self._restore_env()

    def pending_spans(self) -> int:
        """Library calls held until ``stop()`` (the session's span limit counts them): the
        verbose lines captured so far, the warm-up's left out."""
        tap = self._tap
        held = len(self._early_lines) if tap is None else tap.captured_count
        return max(0, held - self._warmup_lines)

    def end_early(self) -> None:
        """Switches verbose output off and restores fd 1 now; ``stop()`` turns the lines into spans."""
        self._early_lines = self._restore()

    def stop(self) -> list[Event]:
        session = self._session
        lines, self._early_lines = self._early_lines + self._restore(), []
        if session is None:
            return []
        framework = None  # set from the issuing op by the attach pass (torch and TF share oneDNN)
        lines = lines[self._warmup_lines :]
        spans, counts = library_spans(lines, session.anchor.epoch_to_session, self._track_id, session.new_id, framework)
        session.meta.setdefault("sources_info", {})[self.name] = {"lines": len(lines), **counts, "mkl_timer": self._mkl_timer_used}
        if counts["untimed"]:
            session.note_limitation(
                f"{counts['untimed']} library calls (MKL) carry no timestamp: placed in their ops by issue order, "
                "shapes and duration (times estimated)"
            )
        for problem in self._problems:
            session.note_limitation(f"{self.name}: {problem}")
        return list(spans)
