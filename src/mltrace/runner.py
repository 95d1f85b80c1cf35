"""Runs the user's script or module in this process, as Python would.

The script runs as ``__main__`` (also registered as ``__mp_main__`` so
multiprocessing's spawn workers can unpickle its objects) with its own
``sys.argv`` and ``sys.path[0]``. ``run_target`` returns the exit status Python
would have given: the ``SystemExit`` code, 1 after an uncaught exception
(printed through ``sys.excepthook``, as Python does), and −2 after Ctrl-C or −15 after
SIGTERM, as ``subprocess`` reports a process killed by that signal: Python itself ends by
SIGINT after an uncaught ``KeyboardInterrupt``, and SIGTERM's default action kills it.
``leave`` ends the process with such a status once the trace is finished. After a program
that ended through SIGINT or SIGTERM, further ones are ignored until then: only the trace's
finish is left, and it has its own guard (``tracer/finishguard.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import pkgutil
import runpy
import signal
import sys
import threading
import traceback
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

from mltrace.errors import UsageError
from mltrace.tracer.callsite import is_stdlib

_RUNNER_FILE = os.path.abspath(__file__)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


@dataclass(frozen=True)
class Target:
    """What to run: a script path or a module name, and its arguments."""

    script: str | None
    module: str | None
    args: list[str]

    @property
    def stem(self) -> str:
        """A short name for the run directory."""
        if self.module:
            return self.module.rsplit(".", 1)[-1]
        assert self.script is not None
        return os.path.splitext(os.path.basename(self.script))[0] or "script"


def check_target(target: Target) -> None:
    """Fails early, before tracing starts, if the target cannot run.

    Raises:
        UsageError: missing script, or module whose top-level package cannot be found.
    """
    if target.script is not None:
        if not os.path.exists(target.script):
            raise UsageError(f"can't open file {target.script!r}: no such file")
        if not _has_main_module(_main_importer(target.script)):
            raise UsageError(f"can't find '__main__' module in {target.script!r}")
    else:
        assert target.module is not None
        _check_top_level_module(target.module)


def _check_top_level_module(name: str) -> None:
    """Fails where the top-level package (or module) of ``-m NAME`` is nowhere Python would
    look for it (the working directory first). Only that name is looked for, which imports
    nothing: the parent packages of a submodule are imported at run time by runpy, inside the
    program with its own ``sys.argv``, as Python does, which there reports an error in them or a
    missing submodule as it does (a traceback, or one line, and exit 1).

    Raises:
        UsageError: the top-level name is not found, or is no module name.
    """
    top = name.partition(".")[0]
    if not top:
        raise UsageError(f"cannot import module {name!r}: a relative or empty module name")
    safe = _safe_path()  # -P: Python does not look in the working directory either
    if not safe:
        sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError) as exc:
        raise UsageError(f"cannot import module {name!r}: {exc}") from None
    finally:
        if not safe:
            sys.path.pop(0)
    if spec is None:
        of_name = f" (the top-level package of {name!r})" if top != name else ""
        raise UsageError(f"no module named {top!r}{of_name}")


class _Terminated(SystemExit):
    """Raised in the main thread by SIGTERM so the trace is finished."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated(128 + signum)


def _default_sigterm_in_child() -> None:
    """In a forked child of the program (a multiprocessing worker): SIGTERM goes back to its
    default action where it was the runner's, so ``terminate()`` kills the child as it would
    without mltrace (a followed child then puts in its own handler, ``follow/child.py``).
    Registered before any session's fork handler: ``after_in_child`` handlers run in the order
    they were registered."""
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_default_sigterm_in_child)


def leave(status: int) -> NoReturn:
    """Ends the process with ``run_target``'s status. A negative one, −N, ends it by signal N
    as plain Python would have ended: after SIGINT (an uncaught ``KeyboardInterrupt``) the
    non-daemon threads are joined and the ``atexit`` handlers run first; after SIGTERM nothing
    more runs (its default action kills the process where it stands). Either way the standard
    streams are flushed, and the interpreter's teardown is skipped."""
    if status >= 0:
        sys.exit(status)
    signum = -status
    if signum == signal.SIGINT:
        try:  # another Ctrl-C stops the wait for the threads, as in plain Python
            signal.signal(signal.SIGINT, signal.default_int_handler)
        except (ValueError, OSError):
            pass
        _join_threads()
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        os.kill(os.getpid(), signum)
    except (ValueError, OSError):
        pass
    os._exit(128 + signum)  # where the signal could not be delivered


def _ignore_further() -> None:
    """After a program that ended through SIGINT or SIGTERM: ignores both for the rest of the
    process. The program has no code left to interrupt; the process only finishes its trace
    (where ``tracer/finishguard.py`` cuts the finish short) and leaves with the program's status,
    without a traceback of mltrace's. ``SIG_IGN``, not a Python handler, because Python puts a
    Python handler back to the default at finalization, and a signal during the rest of the
    teardown would then end the process with the signal's status."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (ValueError, OSError):
            pass


def _exit_status(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF  # as the OS reports it
    try:
        sys.stderr.write(f"{code}\n")
    except Exception:
        pass
    return 1


def _user_traceback(exc: BaseException) -> types.TracebackType | None:
    """The program's traceback as plain Python would show it, as far as mltrace can tell:

    - without mltrace's frames above the program's (the runner's);
    - without mltrace's frames between two of the program's (the ``Module.__call__`` wrapper's,
      where torch's own ``__call__`` would be);
    - for a Ctrl-C, without the frames below the program's last one where the frame after it
      is mltrace's (a Ctrl-C held through a cycle switch is raised again inside mltrace's code,
      on leaving a ``contextlib`` context).

    An error that mltrace's API raises at the program (a bad argument) keeps its frames, as
    plain Python shows a library's."""
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) == _RUNNER_FILE:
        tb = tb.tb_next
    entries: list[types.TracebackType] = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    paths = [os.path.abspath(t.tb_frame.f_code.co_filename) for t in entries]
    own = [p.startswith(_PACKAGE_DIR) for p in paths]
    programs = [i for i, p in enumerate(paths) if not own[i] and not is_stdlib(p)]
    if not programs:
        return entries[0] if entries else None
    last = programs[-1]
    tail = entries[last + 1 :]
    if isinstance(exc, KeyboardInterrupt) and tail and own[last + 1]:
        tail = []
    kept = [t for i, t in enumerate(entries[: last + 1]) if not own[i]] + tail
    for before, after in zip(kept, [*kept[1:], None]):
        before.tb_next = after
    return kept[0]


def _report(exc: BaseException) -> None:
    # Python's own hook prints exc.__traceback__, so trim mltrace's frames off it first.
    tb = _user_traceback(exc)
    exc.with_traceback(tb)
    try:
        sys.excepthook(type(exc), exc, tb)
    except Exception:
        pass


def _main_filename(path: str) -> str:
    """The script's ``__file__`` and code file name as Python 3.9+ gives them: joined to the
    working directory when relative, not normalized (``python ./x.py``: ``/cwd/./x.py``);
    ``sys.argv[0]`` keeps the path as typed."""
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def _main_importer(path: str) -> Any:
    """The importer Python finds for the path it is given to run, through ``sys.path_hooks`` as
    Python does before it runs the program: a directory's finder, a zip file's ``zipimporter``
    (a zip application, whatever its name: the hook reads the file's content); None for a
    script, which Python compiles and runs as source. Finding it executes none of the program."""
    return pkgutil.get_importer(_main_filename(path))


def _has_main_module(importer: Any) -> bool:
    """Whether ``python PATH`` finds something to run: a script (no importer) always, a
    directory or zip file where its importer finds a ``__main__`` module (an importer without
    ``find_spec`` is left to Python's own error at run time)."""
    find_spec = getattr(importer, "find_spec", None)
    return importer is None or find_spec is None or find_spec("__main__") is not None


def _exec_script(path: str, args: list[str]) -> None:
    if _main_importer(path) is not None:  # a directory or a zip file: its __main__ module runs
        sys.argv = [path, *args]
        _set_program_path(_main_filename(path))
        _run_as_main("__main__", alter_argv=False)
        return
    with open(path, "rb") as f:
        source = f.read()
    sys.argv = [path, *args]
    _set_program_path(os.path.dirname(os.path.realpath(path)))
    filename = _main_filename(path)
    code = compile(source, filename, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update({"__file__": filename, "__builtins__": __builtins__, "__cached__": None})
    saved_main = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    sys.modules["__mp_main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        # Leave the script's module in place: objects it created may still refer to it.
        del saved_main


def _run_as_main(name: str, alter_argv: bool) -> None:
    """Runs a module as ``__main__`` through the function of ``runpy`` that Python itself calls
    for ``python -m NAME``, ``python DIRECTORY`` and ``python ZIPFILE``, in a new ``__main__``
    module that stays in place after the run, as Python's does. The traceback of an uncaught error so shows runpy's
    frames as plain Python shows them (``_run_module_as_main``, ``_run_code``), where
    ``runpy.run_module`` and ``runpy.run_path`` add frames of their own. ``alter_argv``: the
    module's file replaces ``sys.argv[0]`` once the module is found (``-m``)."""
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    runpy._run_module_as_main(name, alter_argv=alter_argv)  # type: ignore[attr-defined]


def _exec_module(name: str, args: list[str]) -> None:
    sys.argv = ["-m", *args]  # as Python's while the module is looked for
    cwd = os.getcwd()
    _set_program_path(cwd)
    shadowed = shadowed_package(name, cwd)
    if shadowed is not None:
        from mltrace.tracer.messages import warn

        warn(
            f"the program's package {shadowed!r} ({os.path.join(cwd, shadowed)}) cannot run: "
            f"mltrace imported the {shadowed!r} of {_module_home(shadowed)} before it, which Python uses instead"
        )
    _run_as_main(name, alter_argv=True)


def shadowed_package(name: str, directory: str) -> str | None:
    """The top-level package of ``-m NAME`` where ``directory`` (the program's ``sys.path[0]``)
    holds it but this process imported another before the program ran (mltrace's own import):
    Python then takes the copy already in ``sys.modules``, where plain ``python -m`` takes the
    directory's. None where there is no such clash. Never raises."""
    top = name.partition(".")[0]
    module = sys.modules.get(top)
    if module is None:
        return None
    try:
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(top, [directory])
    except Exception:  # noqa: BLE001 - an unreadable directory: Python would find nothing there either
        return None
    if spec is None or (spec.origin is None and spec.loader is None):  # nothing, or a namespace portion
        return None
    loaded = getattr(module, "__file__", None)
    if loaded is not None and os.path.realpath(loaded) == os.path.realpath(spec.origin or ""):
        return None
    return top


def _module_home(name: str) -> str:
    """Where the imported module ``name`` comes from, in words: the standard library, or its folder."""
    path = getattr(sys.modules.get(name), "__file__", None) or ""
    if is_stdlib(path):
        return "the standard library"
    return os.path.dirname(path) or "elsewhere"


#: The program's ``sys.path[0]`` (``_set_program_path``) and the entry it replaced (mltrace's).
_program_path: tuple[str, str] | None = None


def _set_program_path(entry: str) -> None:
    """Makes ``entry`` ``sys.path[0]``, as Python does for the program, remembering mltrace's
    own first entry for the finish (``mltrace_first``). Under ``-P`` or ``PYTHONSAFEPATH``
    Python adds no such entry, and neither did it for mltrace: the path is left as it is."""
    global _program_path
    if _safe_path():
        return
    _program_path = (entry, sys.path[0])
    sys.path[0] = entry


def _safe_path() -> bool:
    """Whether the interpreter runs with ``-P`` or ``PYTHONSAFEPATH`` (or ``-I``): no script
    folder or working directory at the head of ``sys.path``."""
    return bool(getattr(sys.flags, "safe_path", False))


@contextlib.contextmanager
def mltrace_first() -> Iterator[None]:
    """Around mltrace's work after the program (the finish): the imports it makes find
    mltrace's modules, not a program's of the same name. ``sys.path[0]`` is mltrace's own entry
    again (the program's folder holds a ``numpy`` package, say), and the modules the program
    imported from its folder are out of ``sys.modules``; both are put back after, and the
    modules imported meanwhile under those names are taken out again."""
    if _program_path is None:
        yield
        return
    entry, own = _program_path
    index = next((i for i, p in enumerate(sys.path) if p == entry), None)
    if index is not None:
        sys.path[index] = own
    programs = {name: m for name, m in list(sys.modules.items()) if name not in ("__main__", "__mp_main__") and _under(m, entry)}
    for name in programs:
        del sys.modules[name]
    tops = {name.partition(".")[0] for name in programs}
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n.partition(".")[0] in tops]:
            del sys.modules[name]
        sys.modules.update(programs)
        if index is not None and index < len(sys.path) and sys.path[index] == own:
            sys.path[index] = entry


def _under(module: Any, folder: str) -> bool:
    """Whether ``module`` was loaded from a file in ``folder`` or below it, as found through the
    ``sys.path`` entry ``folder`` (its ``__file__`` starts with it)."""
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and bool(folder) and path.startswith(folder.rstrip(os.sep) + os.sep)


#: The flags concurrent.futures' exit hooks set (module, attribute): once set, no executor
#: takes new work.
_EXECUTOR_SHUTDOWN_FLAGS = (("concurrent.futures.thread", "_shutdown"), ("concurrent.futures.process", "_global_shutdown"))


def _join_threads() -> None:
    """Waits for the program's non-daemon threads, as Python does before it exits, so that
    their spans land. First, as Python does, runs threading's own exit hooks: they tell the
    workers of the program's ``ThreadPoolExecutor``s to stop, which otherwise wait for work
    forever. Then executors take work again (mltrace's finish sends OTLP through gRPC's); the
    hooks stay registered, and the interpreter's exit runs them once more for those."""
    hooks = getattr(threading, "_threading_atexits", None)
    for hook in reversed(list(hooks) if isinstance(hooks, list) else []):
        try:
            hook()
        except Exception:  # as Python reports an exception in its threading shutdown
            traceback.print_exc()
    try:
        for t in threading.enumerate():
            if t is not threading.current_thread() and not t.daemon:
                t.join()
    except KeyboardInterrupt:
        pass
    finally:
        for module_name, flag in _EXECUTOR_SHUTDOWN_FLAGS:
            module = sys.modules.get(module_name)
            if module is not None and getattr(module, flag, None) is True:
                setattr(module, flag, False)


def run_target(target: Target, outcome: dict[str, str] | None = None) -> int:
    """Runs the target and returns its exit status (never raises for the script's errors).
    Where it did not return normally, ``outcome["cause"]`` says why: ``uncaught NAME`` (an
    exception), ``KeyboardInterrupt``, ``SIGTERM`` or ``SystemExit(CODE)``."""
    installed_sigterm = False
    if threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                signal.signal(signal.SIGTERM, _on_sigterm)
                installed_sigterm = True
        except (ValueError, OSError):
            pass
    if not sys.path:
        sys.path.append("")
    status = 0
    by_signal = False
    cause = ""
    try:
        try:
            if target.module is not None:
                _exec_module(target.module, target.args)
            else:
                assert target.script is not None
                _exec_script(target.script, target.args)
            _join_threads()
        except _Terminated:
            status = -signal.SIGTERM
            by_signal = True
            cause = "SIGTERM"
        except SystemExit as exc:
            status = _exit_status(exc)
            cause = f"SystemExit({exc.code!r})"
        except KeyboardInterrupt as exc:
            _report(exc)
            status = -signal.SIGINT
            by_signal = True
            cause = "KeyboardInterrupt"
        except BaseException as exc:  # noqa: BLE001 - the user's error, reported as Python would
            _report(exc)
            status = 1
            cause = f"uncaught {type(exc).__name__}"
    finally:
        if installed_sigterm:
            try:
                if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
            except (ValueError, OSError):
                pass
        if by_signal:
            _ignore_further()
        if outcome is not None and cause:
            outcome["cause"] = cause
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    return status
