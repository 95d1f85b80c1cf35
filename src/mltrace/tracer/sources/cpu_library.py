"""The library level on CPU: oneDNN primitives and oneMKL calls from their verbose logs.

``CpuLibrarySource`` switches the libraries' verbose output on (through torch's runtime
switches once the program imports torch, or through the environment for TensorFlow:
``use_env``), reads the lines from fd 1 with ``FdTap`` and turns them into LIBRARY spans
(``LibrarySpanMaker``), handed to the session while the program runs (``drain_events``, before
every flush, as compact records the recorder's drain writes: ``library_records``) and the rest
at ``stop()``. While MKL's verbose mode is on, its timer reads the vDSO clock
(``_redirect_mkl_timer``). Where the user's environment turned a library's verbose output on
(``_users_verbose``), its lines are the program's output: the tap forwards them as well, and
mltrace leaves that library's verbosity as the user set it. The lines carry no thread id, so
spans are put on the track of the thread that started the source; the ``attach_library_calls`` pass (``tracer.passes.library``)
moves each to the thread of the op that issued it and sets its parent.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any

from mltrace.formats.verbose_logs import (
    MKL_PREFIX,
    ONEDNN_PREFIXES,
    POINTER_FIELD,
    MklCall,
    OneDnnCall,
    gemm_flops,
    mkl_call_key,
    onednn_flops,
    parse_mkl_line,
    parse_onednn_line,
    split_mkl_line,
)
from mltrace.native import c_helper
from mltrace.run.events import Event, Span
from mltrace.run.levels import Level
from mltrace.settings import MKL_PARSER, MKL_TIMER
from mltrace.tracer import c_environ
from mltrace.tracer.clock import now_ns
from mltrace.tracer.fdtap import FdTap, TappedLine
from mltrace.tracer.sources._imports import PostImportHook
from mltrace.tracer.sources.base import Source
from mltrace.tracer.sources.library_records import ABSENT, FIELDS, LibraryRecords, LibraryTemplate, new_template

if TYPE_CHECKING:
    from types import ModuleType

    from mltrace.tracer.sources.base import SessionView

_TIMESTAMP_ENV = "ONEDNN_VERBOSE_TIMESTAMP"
_READ_BATCH_S = 0.1
_ENV_SWITCHES = {"ONEDNN_VERBOSE": "profile_exec", "MKL_VERBOSE": "1"}
#: oneDNN's verbose values (``ONEDNN_VERBOSE``, ``DNNL_VERBOSE``) that print execution lines.
_ONEDNN_EXEC_VALUES = frozenset({"all", "profile", "profile_exec"})


def _users_verbose(environ: Mapping[str, str]) -> tuple[bool, bool]:
    """Whether the user's environment turns (oneDNN, MKL) verbose output on, whose lines a
    plain run prints: a positive level, or for oneDNN a value that prints execution lines."""
    onednn = environ.get("ONEDNN_VERBOSE", environ.get("DNNL_VERBOSE", "")).strip().lower()
    mkl = environ.get("MKL_VERBOSE", "").strip()
    onednn_on = (onednn.isdigit() and int(onednn) > 0) or bool(_ONEDNN_EXEC_VALUES & set(onednn.split(",")))
    return onednn_on, mkl.isdigit() and int(mkl) > 0


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


def _mkl_desc(call: MklCall) -> str:
    """An MKL call's arguments, each pointer as ``*``: pointers change every call and say
    nothing, so this keeps its sizes, flags and strides, and names the call's template."""
    return POINTER_FIELD.sub("*", ",".join(call.args))


def _mkl_attrs(call: MklCall) -> dict[str, Any]:
    """The attributes of an MKL call but its thread fields (``_mkl_thread_attrs``)."""
    return {"ml.library.name": "MKL", "ml.library.kind": call.function, "ml.library.desc": _mkl_desc(call)}


def _mkl_thread_attrs(call: MklCall, attrs: dict[str, Any]) -> None:
    """Adds an MKL call's ``TID`` and ``NThr`` to ``attrs``."""
    if call.tid is not None:
        attrs["ml.library.mkl_tid"] = call.tid
    if call.nthr is not None:
        attrs["ml.library.nthr"] = call.nthr


_Template = tuple[str, dict[str, Any], "int | None"]  # a call's span name, leading attributes, FLOPs


def _onednn_template(call: OneDnnCall) -> _Template:
    return f"oneDNN {call.kind} {call.impl}", _onednn_attrs(call), onednn_flops(call)


def _mkl_template(call: MklCall) -> _Template:
    return f"MKL {call.function}", _mkl_attrs(call), gemm_flops(call)


#: Templates a ``LibrarySpanMaker`` keeps (one per distinct call: primitive and problem, or MKL
#: function and arguments); it starts over once this many are kept (MKL arguments hold pointers).
_TEMPLATES_KEPT = 4096


#: Verbose lines parsed between two hand-overs of the GIL on the flusher thread
#: (``_parse_in_chunks``): a few hundred microseconds of parsing.
PARSE_CHUNK = 64

#: What ``mltrace._mklscan.scan`` says of a line that is not an MKL call it read: no call,
#: counted unparsed; no call, not counted (MKL's header, an info line); Python is to read it.
_UNPARSED, _QUIET, _UNDECIDED = 0, 1, 2
_LineScan = Callable[[Sequence[TappedLine]], tuple[list[str | int], list[int]]]


def _line_scanner() -> _LineScan | None:
    """``mltrace._mklscan.scan``, which reads MKL lines in C without the GIL, or None: not
    built, or ``MLTRACE_MKL_PARSER=python`` (the lines are then read in Python, the same way)."""
    helper = c_helper("_mklscan", MKL_PARSER)
    return None if helper is None else helper.scan


def _parse_in_chunks(maker: LibrarySpanMaker, lines: list[TappedLine], records: LibraryRecords | None = None) -> list[Span]:
    """``maker.add(lines)``, ``PARSE_CHUNK`` lines at a time, the GIL given up between two
    chunks; with ``records``, the calls go there (``add_records``) and no span is returned.
    Parsing holds the GIL; a program thread that wants it back after a torch op waits
    until the holder drops it, up to the interpreter's switch interval (5 ms) each time, so a
    flush's parsing in one piece stretched the model call it overlapped by many such waits."""
    into = LibraryRecords() if records is None else records
    for i in range(0, len(lines), PARSE_CHUNK):
        if i:
            time.sleep(0)  # a thread waiting for the GIL takes it now
        maker.add_records(lines[i : i + PARSE_CHUNK], into)
    return into.spans() if records is None else []


class LibrarySpanMaker:
    """Turns captured verbose lines into LIBRARY spans, batch by batch, exactly as one
    ``library_spans`` call over all of them would: ``ml.library.seq`` and the counts go on
    across batches (the library level hands its spans over while the program runs).

    Args:
        epoch_to_session: converts Unix-epoch ns to session ns.
        track_id: the track to put every span on.
        new_id: returns a fresh span id per call.
        framework: value for ``ml.framework``, if known.

    Attributes:
        lines: the lines added so far.
        counts: ``onednn``, ``mkl``, ``untimed``, ``unparsed`` and ``late`` so far
            (``library_spans``).
    """

    def __init__(
        self, epoch_to_session: Callable[[int], int], track_id: int, new_id: Callable[[], int], framework: str | None = None
    ) -> None:
        self._epoch_to_session = epoch_to_session
        self._track_id = track_id
        self._new_id = new_id
        self._framework = framework
        self.lines = 0
        self.counts = {"onednn": 0, "mkl": 0, "untimed": 0, "unparsed": 0, "late": 0}
        self._lags = array("q")  # receipt minus end of timed calls (ns): the reader's delay
        self._seq = 0
        # The name, leading attributes and FLOPs of each distinct call seen (``_template``): a
        # loop repeats the same calls, whose attributes and FLOPs cost more than their parse.
        self._templates: dict[tuple[Any, ...], LibraryTemplate] = {}
        # Per MKL call as printed (``mkl_call_key``: pointers masked), its template and thread
        # fields (``_known_mkl_call``): a parse of the line's parts instead of all of it.
        self._mkl_calls: dict[str, tuple[LibraryTemplate, int, int]] = {}
        self._scan = _line_scanner()

    def _template(self, key: tuple[Any, ...], make: Callable[[Any], _Template], call: Any) -> LibraryTemplate:
        """The span name, leading attributes (to copy) and FLOPs of the call ``key`` names
        (``make(call)``'s, the first time), as a template with its own id."""
        template = self._templates.get(key)
        if template is None:
            if len(self._templates) >= _TEMPLATES_KEPT:
                self._templates.clear()  # the templates of waiting records stay with them
                self._mkl_calls.clear()
            name, attrs, flops = make(call)
            head: dict[str, Any] = {"mltrace.level": Level.LIBRARY.label}
            if self._framework:
                head["ml.framework"] = self._framework
            head.update(attrs)
            template = self._templates[key] = new_template(name, head, flops)
        return template

    def _mkl_call(self, text: str) -> tuple[LibraryTemplate, int, int, int] | None:
        """An MKL line's template, duration (ns), ``TID`` and ``NThr`` (``ABSENT`` where not
        printed); None for a line that is no call. A loop repeats the same few calls: a line
        like one seen before (pointers aside) is split, not parsed whole."""
        parts = split_mkl_line(text)
        if parts is None:
            return None
        function, args, duration, rest = parts
        known = self._known_mkl_call(mkl_call_key(function, args, rest), text)
        return None if known is None else (known[0], duration, known[1], known[2])

    def _known_mkl_call(self, key: str, text: str) -> tuple[LibraryTemplate, int, int] | None:
        """The template, ``TID`` and ``NThr`` of the MKL call ``key`` (``mkl_call_key``), whose
        line ``text`` is parsed whole the first time; None where ``text`` is no call."""
        known = self._mkl_calls.get(key)
        if known is None:
            call = parse_mkl_line(text)
            if call is None:
                return None
            template = self._template((call.function, _mkl_desc(call)), _mkl_template, call)
            tid = ABSENT if call.tid is None else call.tid
            nthr = ABSENT if call.nthr is None else call.nthr
            if len(self._mkl_calls) >= _TEMPLATES_KEPT:
                self._mkl_calls.clear()
            known = self._mkl_calls[key] = (template, tid, nthr)
        return known

    def _read_line(self, text: str, scanned: str | int, scanned_ns: int) -> tuple[str, LibraryTemplate, int | None, int, int, int] | None:
        """A line's kind (``onednn``, ``mkl``), template, start (epoch ns, None where the line
        has none), duration (ns), ``TID`` and ``NThr`` (``ABSENT`` where not printed); None for
        a line that is no call to trace (counted ``unparsed`` where it is no known other line).
        ``scanned`` and ``scanned_ns`` are what ``_mklscan.scan`` said of it (a call's key and
        duration; ``_UNDECIDED`` where it did not run)."""
        if isinstance(scanned, str):
            known = self._known_mkl_call(scanned, text)
            if known is not None:
                return "mkl", known[0], None, scanned_ns, known[1], known[2]
        elif scanned == _QUIET:
            return None
        elif scanned == _UNDECIDED:
            dnn = parse_onednn_line(text)
            if dnn is not None:
                if not dnn.is_exec:
                    return None  # creation lines (verbose level 2) are not calls to trace
                problem = (dnn.kind, dnn.impl, dnn.prop, dnn.memory, dnn.attrs, dnn.aux, dnn.desc)
                return "onednn", self._template(problem, _onednn_template, dnn), dnn.start_epoch_ns, dnn.duration_ns, ABSENT, ABSENT
            blas = self._mkl_call(text)
            if blas is not None:
                return "mkl", blas[0], None, blas[1], blas[2], blas[3]
        if not text.startswith("MKL_VERBOSE oneMKL") and ",info," not in text:
            self.counts["unparsed"] += 1
        return None

    def add(self, lines: list[TappedLine]) -> list[Span]:
        """The spans of ``lines`` (the lines that follow those added before), in arrival order."""
        records = LibraryRecords()
        self.add_records(lines, records)
        return records.spans()

    def add_records(self, lines: list[TappedLine], records: LibraryRecords) -> None:
        """Appends the calls of ``lines`` (the lines that follow those added before) to
        ``records``, in arrival order: ``library_records.FIELDS`` integers a call, no object."""
        out = array("q")
        used: dict[int, LibraryTemplate] = {}
        counts, lags, track_id, new_id, epoch_to_session = self.counts, self._lags, self._track_id, self._new_id, self._epoch_to_session
        mkl_calls, read_line, seq = self._mkl_calls, self._read_line, self._seq
        # Each line as the C helper read it (without the GIL), or for Python to read.
        what: Sequence[str | int] | repeat[int] = repeat(_UNDECIDED)
        durations: Sequence[int] | repeat[int] = repeat(0)
        if self._scan is not None:
            what, durations = self._scan(lines)
        untimed_mkl = 0  # the calls of the first branch, counted at the end
        for (receive_ns, text), seen, duration in zip(lines, what, durations):
            known = mkl_calls.get(seen) if isinstance(seen, str) else None
            if known is not None:  # an MKL call seen before, read in C: most lines of a loop
                template, tid, nthr = known
                try:
                    out.extend((new_id(), receive_ns - duration, receive_ns, track_id, template.id, duration, seq, tid, nthr, receive_ns))
                except OverflowError:  # a receipt before the duration's length: no call
                    del out[len(out) - len(out) % FIELDS :]
                    counts["unparsed"] += 1
                    continue
                untimed_mkl += 1
                seq += 1
                used[template.id] = template
                continue
            call = read_line(text, seen, duration)
            if call is None:
                continue
            kind, template, start_epoch, duration, tid, nthr = call
            if start_epoch is not None:
                start = epoch_to_session(start_epoch)
                end = start + duration
                received = ABSENT
            else:
                end = received = receive_ns
                start = end - duration
            try:
                out.extend((new_id(), start, end, track_id, template.id, duration, seq, tid, nthr, received))
            except OverflowError:  # a number past 64 bits: no call a library makes
                del out[len(out) - len(out) % FIELDS :]  # the numbers extend appended before it
                counts["unparsed"] += 1
                continue
            counts[kind] += 1
            seq += 1
            used[template.id] = template
            if start_epoch is not None:
                if end > receive_ns + 2_000:
                    counts["late"] += 1
                lags.append(receive_ns - end)
            else:
                counts["untimed"] += 1
        counts["mkl"] += untimed_mkl
        counts["untimed"] += untimed_mkl
        self._seq = seq
        self.lines += len(lines)
        records.add(out, used)

    def summary(self) -> dict[str, int]:
        """The counts so far, with ``receive_lag_ns_median`` and ``receive_lag_ns_max`` over
        every timed call where there was one (``library_spans``)."""
        out = dict(self.counts)
        if self._lags:
            lags = sorted(self._lags)
            out["receive_lag_ns_median"] = lags[len(lags) // 2]
            out["receive_lag_ns_max"] = lags[-1]
        return out


def library_spans(
    lines: list[TappedLine],
    epoch_to_session: Callable[[int], int],
    track_id: int,
    new_id: Callable[[], int],
    framework: str | None = None,
) -> tuple[list[Span], dict[str, int]]:
    """Turns captured verbose lines into LIBRARY spans (a pure function; ``LibrarySpanMaker``
    does it batch by batch).

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
    maker = LibrarySpanMaker(epoch_to_session, track_id, new_id, framework)
    spans = maker.add(lines)
    return spans, maker.summary()


class CpuLibrarySource(Source):
    """oneDNN and oneMKL calls (LIBRARY level) from their verbose output on fd 1.

    Args:
        use_env: also set ``ONEDNN_VERBOSE=profile_exec`` and ``MKL_VERBOSE=1``
            in the C environment at start (``c_environ``), for frameworks without a runtime
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
        self._hook: PostImportHook | None = None
        self._torch: ModuleType | None = None
        self._track_id = 0
        self._saved_env: dict[str, str] = {}  # the variables start() put in the C environment
        self._problems: list[str] = []
        # drain_events (on the session's flusher thread), the warm-up, end_early and stop take
        # the tap's lines under this lock, so that each line is turned into a span once, in order.
        self._lock = threading.Lock()
        self._maker: LibrarySpanMaker | None = None  # from start() to stop()
        #: Where ``drain_events`` puts the calls for the recorder's next drain (a producer of the
        #: session's recorder, ``library_records``); None without a recorder: it returns spans.
        self._records: LibraryRecords | None = None
        self._tap_open = False  # lines may be taken from the tap (cleared before it is stopped)
        self._taken = 0  # lines taken from the tap: handed over, held, or the warm-up's
        self._held: list[TappedLine] = []  # lines restoring the tap returned, not handed over yet
        self._ended = False  # the tap is stopped and its last lines are held (or handed over)
        self._warming = False  # MKL's warm-up runs: the lines captured until it ends are mltrace's
        self._sealed_ns = 0  # sealed_until_ns()
        self._mkl_timer: ModuleType | None = None  # the C helper while it redirects MKL's timer
        self._mkl_timer_used = "none"  # for run.json: which clock MKL's verbose lines were timed with
        #: The libraries whose verbose output the user's environment turned on (``_users_verbose``):
        #: their lines are forwarded as well, and mltrace neither switches them nor warms MKL up.
        self._users_onednn = self._users_mkl = False

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
        """Sets ``ONEDNN_VERBOSE_TIMESTAMP`` in the C environment (``c_environ``: the program's
        ``os.environ`` does not show it), starts the fd tap, and switches verbosity on once
        torch is imported (now, if it already is; this source never imports torch itself).

        oneDNN reads ``ONEDNN_VERBOSE_TIMESTAMP`` once, when it first prints verbose output,
        so lines carry their start time; if the program printed oneDNN verbose output earlier
        without it, lines come without timestamps and are handled like MKL's.
        """
        self._session = session
        self._problems = []
        self._mkl_timer_used = "none"
        self._track_id = session.tracks.current_thread().id
        self._users_onednn, self._users_mkl = _users_verbose(os.environ)
        settings = {_TIMESTAMP_ENV: "1"}
        if self._users_onednn and _TIMESTAMP_ENV not in os.environ:
            settings = {}  # the user's lines as a plain run prints them: no timestamp field
        if self.use_env:
            settings.update(_ENV_SWITCHES)
            if self._users_onednn:
                del settings["ONEDNN_VERBOSE"]
            if self._users_mkl:
                del settings["MKL_VERBOSE"]
            self._problems.append("verbose output switched on through the environment stays on after the session (TensorFlow)")
        self._saved_env = settings
        for name, value in settings.items():  # for the libraries' getenv, not the program's os.environ
            c_environ.put(name, value)
        # Read every line in batches: waking the reader once per line took the
        # GIL from the program 80 times a ResNet-18 inference (+9 % against +5 %),
        # and on a machine whose cores the program fills each wake-up still
        # displaces one of its threads (every 10 ms: +1–2 % on the CNN, every
        # 100 ms: within the noise of verbose output to /dev/null; see FdTap's
        # batch_s and PERFORMANCE.md). oneDNN lines carry their own timestamps;
        # MKL calls are placed by issue order and room in their ops, their
        # receipt time only bounding the search (passes/library.py).
        echo = (ONEDNN_PREFIXES if self._users_onednn else ()) + ((MKL_PREFIX,) if self._users_mkl else ())
        self._tap = FdTap(batch_s=_READ_BATCH_S, echo=echo)
        with self._lock:
            # No ml.framework: set from the issuing op by the attach pass (torch and TF share oneDNN).
            self._maker = LibrarySpanMaker(session.anchor.epoch_to_session, self._track_id, session.new_id)
            self._records = None
            recorder = getattr(session, "recorder", None)
            if recorder is not None:  # the calls wait for the flush as records, not spans
                self._records = LibraryRecords()
                recorder.add_producer(self._records.spans, self._records.encode)
            self._taken, self._held, self._ended, self._sealed_ns = 0, [], False, 0
        try:
            self._tap.start()
            self._tap_open = True
            self._hook = PostImportHook("torch", self._switch_on)
        except BaseException:
            self._tap_open, self._maker = False, None
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
        # Level 1 = executions only; 2 would add creation lines. A library the user's environment
        # switched on prints at the user's level: left alone.
        if torch.backends.mkldnn.is_available() and not self._users_onednn and not verbose.mkldnn_set_verbose(1):
            self._problems.append("torch could not switch oneDNN verbose output on")
        if torch.backends.mkl.is_available():
            self._redirect_mkl_timer()
            if self._users_mkl:
                return  # no warm-up either: its lines would be printed, and a plain run pays the start-up too
            if not verbose.mkl_set_verbose(1):
                self._problems.append("torch could not switch MKL verbose output on")
            elif not self._programs_profiler_runs(torch):  # whose trace would show the warm-up's ops
                self._warm_up_mkl(torch)

    def _programs_profiler_runs(self, torch: ModuleType) -> bool:
        """Whether a torch profiler that is not this session's records now (the program's own).
        Never raises (it runs in the program's ``import torch``)."""
        from mltrace.tracer.sources.torch_ops import profiler_running

        if not profiler_running(torch):
            return False
        started = getattr(self._session, "started", ())
        return not any(s.name == "torch.profiler" and s.profiling for s in started)

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
        Lines received before the warm-up ends and not handed over yet are mltrace's own
        and are dropped; ``drain_events`` hands nothing over meanwhile.
        """
        with self._lock:
            self._warming = True
        try:
            try:
                x = torch.ones(8, 8)
                torch.mm(x, x)
            except Exception as exc:
                self._problems.append(f"MKL warm-up failed: {exc}")
            # Wait (briefly) for the reader thread to receive the warm-up's line.
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                with self._lock:
                    if not self._tap_open or any("SGEMM" in ln.text for ln in self._take_from_tap()):
                        break
                time.sleep(0.001)
        finally:
            with self._lock:
                self._take_from_tap()  # dropped with the warm-up's
                self._warming = False

    def _switch_off(self) -> None:
        """Switches verbosity off (and MKL's timer back), and no later ``import torch`` turns it on."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        torch, self._torch = self._torch, None
        if torch is None:
            return
        verbose = torch._C._verbose
        if torch.backends.mkldnn.is_available() and not self._users_onednn:
            verbose.mkldnn_set_verbose(0)
        if torch.backends.mkl.is_available():
            try:
                if not self._users_mkl:
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
                    if self._tap.detached and not self._tap.held_by_helpers:  # those print no verbose lines
                        self._problems.append("a child process kept stdout open; its later output was not traced")
                    if self._tap.reader_error is not None:
                        self._problems.append(f"the fd tap's reader stopped early: {self._tap.reader_error}")
                    self._tap = None
            finally:
                self._restore_env()
        return lines

    def _restore_env(self) -> None:
        """Puts back the environment variables ``start()`` set (as the program sees them)."""
        for name in self._saved_env:
            c_environ.take_back(name)
        self._saved_env = {}

    def release_in_forked_child(self) -> None:
        """In a child forked while the source runs: the child's oneDNN/MKL verbose output off
        (and MKL's own timer back), its fd 1 back on the original, its environment restored;
        the parent's capture goes on; the child hands no lines over (its session is the parent's)."""
        self._lock = threading.Lock()  # the parent's flusher may have held it at the fork
        self._tap_open, self._maker, self._held = False, None, []
        try:
            self._switch_off()
        finally:
            if self._tap is not None:
                self._tap.release_in_forked_child()
                self._tap = None
            self._restore_env()

    def _take_from_tap(self) -> list[TappedLine]:
        """The lines the tap captured since the last take, none once it is being stopped
        (holding ``_lock``)."""
        tap = self._tap
        if tap is None or not self._tap_open:
            return []
        lines = tap.take_lines()
        self._taken += len(lines)
        return lines

    def drain_events(self) -> list[Event]:
        """The LIBRARY spans of the lines captured since the last call (the session calls it on
        its flusher thread before every flush), none while MKL's warm-up runs.

        With a session recorder, the calls go to the recorder's next drain as records instead
        (``library_records``: no object per call) and none is returned. ``ml.library.seq`` and
        the counts go on across calls (``LibrarySpanMaker``); ``stop()`` returns only the spans
        not handed over yet. Costs the new lines only.
        """
        with self._lock:
            maker = self._maker
            if maker is None or self._warming:
                return []
            checked_ns = now_ns()
            emptied = self._tap_open and self._tap is not None and self._tap.pipe_empty()
            lines, self._held = self._held, []
            lines += self._take_from_tap()
            if lines:
                self._sealed_ns = max(self._sealed_ns, lines[-1].receive_ns)
            if emptied:
                self._sealed_ns = max(self._sealed_ns, checked_ns)
            return list(_parse_in_chunks(maker, lines, self._records))

    def sealed_until_ns(self) -> int | None:
        """The session time up to which every library call that ended then or earlier has been
        handed over (``drain_events``); 0 before the first drain, None once the source is stopped
        (or never started) and holds nothing.

        A call's line reaches the pipe as the call ends, and is received in a later read: the
        receive time of the last line handed over bounds the calls handed over; where the pipe
        was empty when a drain began (``FdTap.pipe_empty``), that drain's start does. No margin
        is taken off (a line a library wrote in two pieces is the exception the caller's margin
        covers).
        """
        if self._maker is None or (self._ended and not self._held):
            return None
        return self._sealed_ns

    def pending_spans(self) -> int:
        """Library calls held and not handed over yet (the session's span limit counts them):
        the verbose lines captured and not taken, and those taken at ``end_early`` and not
        handed over; the warm-up's are left out."""
        held = len(self._held)
        tap = self._tap
        if tap is None:
            return held
        return held + max(0, tap.captured_count - self._taken)

    def end_early(self) -> None:
        """Switches verbose output off and restores fd 1 now; the next ``drain_events`` (or
        ``stop()``) turns the last lines into spans."""
        with self._lock:
            self._tap_open = False  # the restore takes what is left
        lines = self._restore()
        with self._lock:
            self._held += lines
            self._ended = True

    def stop(self) -> list[Event]:
        """Restores everything and returns the spans not handed over yet; writes run.json's
        ``sources_info["cpu.library"]`` (counts over the whole run) and the limitations."""
        with self._lock:
            self._tap_open = False
        lines = self._restore()
        with self._lock:
            maker, self._maker = self._maker, None
            lines, self._held = self._held + lines, []
            self._ended = True
        session = self._session
        if session is None or maker is None:
            return []
        spans = maker.add(lines)
        counts = maker.summary()
        session.meta.setdefault("sources_info", {})[self.name] = {"lines": maker.lines, **counts, "mkl_timer": self._mkl_timer_used}
        if counts["untimed"]:
            session.note_limitation(
                f"{counts['untimed']} library calls (MKL) carry no timestamp: their ops are found by issue order, "
                "shapes and duration (times estimated; the report counts those that no op could be shown to have issued)"
            )
        for problem in self._problems:
            session.note_limitation(f"{self.name}: {problem}")
        return list(spans)
