"""Run by Python at start-up in every child of a program that mltrace traces (this folder is on
the child's ``PYTHONPATH``, and ``MLTRACE_FOLLOW`` holds the run): runs the ``sitecustomize``
module that this one hides, if there is one, then waits, at no cost, for the child to import a
framework. The child's own mltrace session (``mltrace.follow.child``) starts right before the
first import of torch, TensorFlow, Keras or ONNX Runtime, so a child's start is not delayed, and
a child that never imports one is only named in the run (``procs/process-<pid>.json``, at its
exit).

It takes its folder back off ``sys.path`` first, so the program sees the path it would have.
A child that cannot import mltrace (another interpreter) writes a note into the run's
``procs/`` folder, so the run names it.
"""

import os
import sys

#: The top-level modules whose first import starts the child's session.
_FRAMEWORKS = frozenset({"torch", "tensorflow", "keras", "onnxruntime"})
#: multiprocessing's own helper processes: not the program's, never named.
_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker", "multiprocessing.semaphore_tracker")


class _Gate:
    """A ``sys.meta_path`` finder that starts the session at the first import of a framework,
    then steps aside and finds the module as Python would (through the session's import hooks)."""

    def __init__(self, spec):
        self.spec = spec
        self.pid = os.getpid()  # a child forked before the gate opens inherits it

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _FRAMEWORKS or self.spec is None:
            return None
        spec, self.spec = self.spec, None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        _start(spec, os.getpid() != self.pid)
        import importlib.util

        return importlib.util.find_spec(fullname)


def _start(spec, forked):
    try:
        from mltrace.follow.child import start_from_env
    except Exception as exc:  # noqa: BLE001 - another interpreter, without mltrace
        _note(spec, "unfollowed", f"cannot import mltrace: {type(exc).__name__}: {exc}")
    else:
        start_from_env(spec, forked)


def _at_exit(gate):
    if gate.spec is not None and gate in sys.meta_path:  # the child never imported a framework
        _note(gate.spec, "process", "no framework imported: nothing recorded")


def _note(spec, kind, reason):
    try:
        import json

        run = json.loads(spec)["run"]
        note = {"pid": os.getpid(), "ppid": os.getppid(), "argv": list(getattr(sys, "orig_argv", sys.argv)), "reason": reason}
        with open(os.path.join(run, "procs", f"{kind}-{os.getpid()}.json"), "w", encoding="utf-8") as f:
            json.dump(note, f)
    except Exception:  # noqa: BLE001 - never fail the child
        pass


def _chain():
    """Runs the next ``sitecustomize`` on ``sys.path``, as Python would have without this one
    (``importlib.util`` is not imported: it would cost the child several milliseconds)."""
    from importlib import _bootstrap, machinery

    found = machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if found is None or found.loader is None:
        return
    module = _bootstrap.module_from_spec(found)
    sys.modules["sitecustomize"] = module
    found.loader.exec_module(module)


def _mltrace_follow():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if not p or os.path.abspath(p) != here]
    try:
        _chain()
    finally:  # a failing sitecustomize is reported by site as it would be, the child still followed
        spec = os.environ.get("MLTRACE_FOLLOW")  # mltrace.settings.FOLLOW
        if spec:
            gate = _Gate(spec)
            sys.meta_path.insert(0, gate)
            argv = " ".join(getattr(sys, "orig_argv", sys.argv))
            if not any(f"from {helper} import" in argv for helper in _HELPERS):
                import atexit

                atexit.register(_at_exit, gate)


_mltrace_follow()
