"""A followed child's own session: started at the child's start-up (``start_from_env``, from
``bootstrap/sitecustomize.py``) or right after a fork (``os.register_at_fork``), streaming into
``procs/<pid>/`` of the parent's run, and finished without correlating (the parent merges and
correlates every process's events at its own finish)."""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from mltrace.follow import IDLE_PREFIX, PROCS_DIR, UNFOLLOWED_PREFIX

if TYPE_CHECKING:
    from mltrace.run.levels import Level

#: The follow spec of this process (the run, the level, the trace context): set in the parent
#: by ``parent.enable`` and in every followed child; None where nothing is followed.
_spec: dict[str, Any] | None = None
#: The process the spec was set in: a fork handler running in another pid is in a child.
_spec_pid = 0
_fork_handler_registered = False
#: The parent's trace context for its forks (``context.ChildContext.traceparent``), set by
#: ``parent.enable``; a forked child takes it once and forgets it (its own forks inherit its spec).
_context: Callable[[], str | None] | None = None

#: Python children that are multiprocessing's own helpers, not the program's: their forks are
#: followed, they themselves are not traced (they live as long as the parent).
_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker", "multiprocessing.semaphore_tracker")
#: The command line of a child that multiprocessing's spawn start method started.
_SPAWNED = "from multiprocessing.spawn import spawn_main"


def set_spec(spec: dict[str, Any]) -> None:
    """Makes ``spec`` this process's follow spec and follows its forks from now on."""
    global _spec, _spec_pid, _fork_handler_registered
    _spec, _spec_pid = spec, os.getpid()
    if not _fork_handler_registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork)
        _fork_handler_registered = True


def current_spec() -> dict[str, Any] | None:
    """This process's follow spec (``set_spec``), None where nothing is followed."""
    return _spec


def clear_spec() -> None:
    """Stops following this process's forks (the parent's session has stopped)."""
    global _spec, _context
    _spec = _context = None


def set_context(context: Callable[[], str | None] | None) -> None:
    """Gives this process's forks their parent span: ``context()``, called in the forked child
    (on its copy of the forking thread's state), returns the ``traceparent`` it starts in."""
    global _context
    _context = context


def start_from_env(text: str, forked: bool = False) -> None:
    """In a child started from an interpreter, at its first import of a framework
    (``bootstrap/sitecustomize.py``): starts its session from the ``MLTRACE_FOLLOW`` spec.
    ``forked``: the import is in a process forked from that child (a forkserver's child).
    Never raises."""
    try:
        spec = json.loads(text)
        if not isinstance(spec, dict) or not isinstance(spec.get("run"), str):
            return
    except ValueError:
        return
    set_spec(spec)
    argv = " ".join(getattr(sys, "orig_argv", sys.argv))
    if not forked and any(f"from {helper} import" in argv for helper in _HELPERS):
        return
    own = _own_session()
    if own is not None:
        note_process(Path(spec["run"]), f"traced by its own mltrace session, into {Path(own.run_dir).resolve()}")
        return
    if forked or _SPAWNED in argv:  # its environment is its parent's, torchrun's variables too
        from mltrace.follow.ranks import inherit

        inherit()
    session = start_child(spec, "fork" if forked else "exec")
    if session is not None:
        _cap_at_bootstrap(session)


def _own_session() -> Any:
    """The mltrace session the child runs or starts itself (``mltrace python`` run by the
    program, its own ``mltrace.profile()``), or None. Its start looks for the frameworks, which
    the bootstrap takes for their first import."""
    from mltrace.tracer.session import session_in_process

    return session_in_process()


def _after_fork() -> None:
    """In a forked child of a followed process: starts the child's own session."""
    global _context
    spec = _spec
    if spec is None or os.getpid() == _spec_pid:
        return
    from mltrace.follow.ranks import forget

    context, _context = _context, None
    forget()
    start_child(_as_worker(_in_context(spec, context)), "fork")


#: Where a DataLoader starts its workers (``_MultiProcessingDataLoaderIter.__init__``).
_DATALOADER_FILE = os.path.join("torch", "utils", "data", "dataloader.py")


def _as_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` for this forked child: in a DataLoader worker, its level no deeper than
    ``MLTRACE_WORKER_LEVEL`` (``layer`` by default). A worker makes no model call, so the op
    level would hold every op of the worker's life in one torch.profiler cycle and convert it
    as the worker exits, while the DataLoader waits for it (docs/PERFORMANCE.md, "A
    DataLoader's workers"); the program's own process keeps its level."""
    if not _forked_by_dataloader():
        return spec
    from mltrace.run.levels import HIERARCHY, Level

    level = min(Level.parse(spec["level"]) if spec.get("level") else HIERARCHY[-1], _worker_cap())
    return {**spec, "level": level.label, "worker_level": level.label}


def _worker_cap() -> Level:
    """``MLTRACE_WORKER_LEVEL`` as a level (``layer`` where it is unset or not a level)."""
    from mltrace.run.levels import Level
    from mltrace.settings import WORKER_LEVEL

    try:
        return Level.parse(WORKER_LEVEL.get() or "layer")
    except ValueError:
        return Level.LAYER


def _worker_note(level: Level, after: str = "") -> str:
    """run.json ``processes[].level`` of a DataLoader worker recording down to ``level``
    (``after``: from when)."""
    return f"{level.label}: a DataLoader worker records no deeper than MLTRACE_WORKER_LEVEL{after}"


def _cap_at_bootstrap(session: Any) -> None:
    """In a child started by spawn or a forkserver, whose session started before it knew what
    it would run: when multiprocessing runs the child's process object, and its target is a
    DataLoader's worker loop, ends there the levels below ``MLTRACE_WORKER_LEVEL`` that can end
    (``tracer/windows.py``: the op level, and the layer level where it has a window), as a
    forked worker never starts them. Acts once, in this process only."""
    from multiprocessing import process

    original = process.BaseProcess._bootstrap  # type: ignore[attr-defined]
    pid = os.getpid()  # a process forked from this one has a session of its own

    def bootstrap(self: Any, *args: Any, **kwargs: Any) -> Any:
        process.BaseProcess._bootstrap = original  # type: ignore[attr-defined]
        target = getattr(self, "_target", None)
        worker = getattr(target, "__module__", None) == _WORKER_MODULE and getattr(target, "__name__", None) == "_worker_loop"
        if worker and os.getpid() == pid:
            _end_below_cap(session)
        return original(self, *args, **kwargs)

    process.BaseProcess._bootstrap = bootstrap  # type: ignore[attr-defined]


def _end_below_cap(session: Any) -> None:
    """Ends ``session``'s levels below ``MLTRACE_WORKER_LEVEL`` and notes what it records."""
    from mltrace.run.levels import HIERARCHY, Level

    cap = _worker_cap()
    recorded = min(session.options.level or HIERARCHY[-1], cap)
    reason = f"a DataLoader worker records no deeper than MLTRACE_WORKER_LEVEL ({cap.label})"
    if cap < Level.OP:
        for window in list(session.op_windows.values()):
            window.end_now(reason)
    if cap < Level.LAYER:
        if session.layer_window is not None:
            session.layer_window.end_now(reason)
        else:
            recorded = min(session.options.level or HIERARCHY[-1], Level.LAYER)
    session.meta["process"]["level"] = _worker_note(recorded, " from the start of its loop (what its start-up recorded is kept)")


#: The module of a DataLoader's worker loop (a spawned worker's process target).
_WORKER_MODULE = "torch.utils.data._utils.worker"


def _forked_by_dataloader() -> bool:
    """Whether this fork was made by a DataLoader starting its workers (the forking thread's
    Python stack, which the child keeps, passes through ``dataloader.py``'s ``__init__``)."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(64):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "__init__" and code.co_filename.endswith(_DATALOADER_FILE):
            return True
        frame = frame.f_back
    return False


def _in_context(spec: dict[str, Any], context: Callable[[], str | None] | None) -> dict[str, Any]:
    """``spec`` with the ``traceparent`` that ``context`` gives (the span current at the fork)."""
    try:
        traceparent = context() if context is not None else spec.get("traceparent")
    except Exception:  # noqa: BLE001 - the child is followed without it
        traceparent = spec.get("traceparent")
    return {**spec, "traceparent": traceparent}


def _proc_dir(run: Path) -> Path:
    """``procs/<pid>`` of the run (``<pid>-2``… where a process of that pid already wrote one)."""
    base = run / PROCS_DIR / str(os.getpid())
    candidate, n = base, 2
    while candidate.exists():
        candidate = base.with_name(f"{base.name}-{n}")
        n += 1
    return candidate


def start_child(spec: dict[str, Any], how: str) -> Any:
    """Starts this child's session (``how``: ``exec`` or ``fork``) and returns it; where it
    cannot start, writes an ``unfollowed`` note with the reason and returns None. Never raises."""
    global _spec_pid
    _spec_pid = os.getpid()
    try:
        session = _start_session(spec, how)
    except BaseException as exc:  # noqa: BLE001 - nothing may fail the program's child
        note_unfollowed(Path(spec["run"]), f"{type(exc).__name__}: {exc}")
        return None
    atexit.register(_stop, session)
    _stop_on_sigterm(session)
    return session


def _start_session(spec: dict[str, Any], how: str) -> Any:
    from mltrace.config import ProfileOptions
    from mltrace.follow.ranks import watch_ranks
    from mltrace.tracer.session import Session

    run = Path(spec["run"])
    kwargs: dict[str, Any] = {
        k: spec[k] for k in ("level", "flush_interval_s", "op_inferences", "max_spans", "memory") if spec.get(k) is not None
    }
    options = ProfileOptions.build(
        output=_proc_dir(run), name=spec.get("name") or "child", summary=False, command=list(getattr(sys, "orig_argv", sys.argv)), **kwargs
    )
    session = Session(options)
    session.finish = finish_child
    session.seals = False  # the parent's finish merges and correlates its events
    session.whole_program = True
    process: dict[str, Any] = {"pid": os.getpid(), "ppid": os.getppid(), "start": how, "parent_span": spec.get("traceparent")}
    if spec.get("worker_level"):
        from mltrace.run.levels import Level

        process["level"] = _worker_note(Level.parse(spec["worker_level"]))
    session.start_meta = {"process": process}  # in run.json from its start: a child killed before its finish keeps them
    session.start()
    session.tracks.current_thread()  # the process has a track even where it records nothing
    watch_ranks(session)
    return session


def _stop(session: Any) -> None:
    try:
        session.stop()
    except BaseException:  # noqa: BLE001 - the child's exit must go on
        pass


def _stop_on_sigterm(session: Any) -> None:
    """Where SIGTERM would end the child at once (the default: a pool's ``terminate()``,
    torchrun stopping its ranks), finishes the child's trace first, then ends the process by
    the same signal, so its exit status is what it would have been."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
            return

        def on_sigterm(signum: int, frame: Any) -> None:
            session.meta["exit_status"] = -signum
            _stop(session)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, on_sigterm)
    except (ValueError, OSError):
        pass


def finish_child(run_dir: Path, meta: dict[str, Any], phase: Any = None) -> None:
    """A child session's finish (``Session.finish``): names the process (``describe``) and
    writes run.json, marked finished; the events stay as streamed, for the parent to merge."""
    from mltrace.run import store

    process = meta.setdefault("process", {"pid": os.getpid()})
    process.update(describe())
    meta["follow"] = {"finished": True}
    store.write_meta(run_dir, meta)


def describe() -> dict[str, Any]:
    """What this process is to the program: its role (``rank 1``, ``DataLoader worker 0``, the
    multiprocessing name), its rank facts where torch.distributed ran. Imports nothing."""
    from mltrace.follow.ranks import captured

    out: dict[str, Any] = {}
    dist = captured()
    if dist:
        out["distributed"] = dist
    worker = sys.modules.get("torch.utils.data._utils.worker")
    info = getattr(worker, "_worker_info", None) if worker is not None else None
    mp = sys.modules.get("multiprocessing.process")
    name = mp.current_process().name if mp is not None else "MainProcess"
    if name != "MainProcess":
        out["mp_name"] = name
    if dist and "rank" in dist:
        out["role"] = f"rank {dist['rank']}"
    elif info is not None and isinstance(getattr(info, "id", None), int):
        out["role"] = f"DataLoader worker {info.id}"
    elif name != "MainProcess":
        out["role"] = name
    return out


def note_unfollowed(run: Path, reason: str) -> None:
    """Writes ``procs/unfollowed-<pid>.json``: this process, its command line and why it is not traced."""
    _write_note(run, UNFOLLOWED_PREFIX, reason)


def note_process(run: Path, reason: str) -> None:
    """Writes ``procs/process-<pid>.json``: this process, its command line and why the run
    records nothing of it (the run lists it with the reason)."""
    _write_note(run, IDLE_PREFIX, reason)


def _write_note(run: Path, prefix: str, reason: str) -> None:
    note = {"pid": os.getpid(), "ppid": os.getppid(), "argv": list(getattr(sys, "orig_argv", sys.argv)), "reason": reason}
    try:
        (run / PROCS_DIR / f"{prefix}{os.getpid()}.json").write_text(json.dumps(note), encoding="utf-8")
    except OSError:
        pass
