"""The trace context a followed child starts in: the span current in the parent when it starts.

When the traced program starts a child, the span current in the starting thread or task (an
``mltrace.span``, a model call) or, where the program opened one inside it, the program's own
current OpenTelemetry span is handed to the child as a W3C ``traceparent`` in its follow spec;
the child records it as ``process.parent_span`` and the OTLP export puts the child's spans that
have no other parent under that span, in its trace (``exporters/otlp.TraceRule``). The ids are
the ones the export gives the parent's span (``TraceRule.place`` over the chain of open spans),
so the parent's live export and the export at the end agree. With nothing current it is the
session's OpenTelemetry parent, else there is none (the child's spans then go where the parent's
would: a model call in a trace of its own, other work in its process's program trace).

- A forked child takes it from its copy of the forking thread's state (``child._after_fork``).
- A child started from an interpreter (spawn, ``subprocess``, torchrun) gets it through its
  environment: ``install`` wraps ``_posixsubprocess.fork_exec`` (which multiprocessing's spawn
  and ``subprocess`` call) so that the child's environment holds the follow variable, with the
  context of the calling thread, and the bootstrap on ``PYTHONPATH``, whatever environment the
  program gave it (the program's ``os.environ`` holds neither: ``parent.Following``). Children
  started otherwise (``os.posix_spawn``, ``os.exec*``, ``os.system``, a forkserver's children)
  inherit the C environment's follow spec, with its context; one the program gives an
  environment of its own there is not followed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mltrace.follow import BOOTSTRAP_DIR
from mltrace.tracer.c_environ import children_environ, starting_own_child


class ChildContext:
    """The trace context of ``session``'s children (see the module docstring).

    Args:
        session: the parent's started session (its run id and OpenTelemetry parent give the ids).
        variable: the environment variable holding the follow spec (``MLTRACE_FOLLOW``).
    """

    def __init__(self, session: Any, variable: str) -> None:
        self._meta = dict(session.meta)  # as the session started: the ids' run key
        self._parent: tuple[int, int] | None = None
        if self._meta.get("otel_parent") is not None:
            from mltrace.exporters.otlp import parse_otel_parent

            self._parent = parse_otel_parent(self._meta["otel_parent"])
        self._rule: Any = None  # the export's TraceRule, made for the first open span (``_place``)
        self._prefix = variable.encode() + b"="
        self._patched: list[tuple[Any, str, Any, Any]] = []

    def _place(self, span: Any, outer: Any) -> Any:
        """Where the OTLP export puts ``span`` inside ``outer`` (``TraceRule.place``). The
        exporter is imported here, at the first child started inside an open span, not at the
        session's start: the program's garbage collections would scan its objects."""
        if self._rule is None:
            from mltrace.exporters.otlp import TraceRule, run_key
            from mltrace.run.store import Run

            self._rule = TraceRule(run_key(Run(Path("."), self._meta)), "invocation", self._parent, {})
        return self._rule.place(span, outer)

    def traceparent(self) -> str | None:
        """The W3C ``traceparent`` of the span current in the calling thread or task, else of
        the session's OpenTelemetry parent; None where there is neither."""
        from mltrace.tracer.otel_context import capture_otel_parent
        from mltrace.tracer.recorder import current_span

        chain = []
        span = current_span.get()
        while span is not None:
            chain.append(span)
            span = span._up
        place = None
        for open_span in reversed(chain):  # the outermost first, as the export places them
            place = self._place(open_span, place)
        otel = capture_otel_parent()
        if otel is not None and (place is None or otel[1] != place.context):
            ids = otel  # the program's own span, opened inside the innermost open span
        elif place is not None:
            ids = (place.trace_id, place.span_id)
        elif self._parent is not None:
            ids = self._parent
        else:
            return None
        return f"00-{ids[0]:032x}-{ids[1]:016x}-01"

    def environment(self, env: Any) -> list[bytes] | None:
        """The environment of a child that ``fork_exec`` starts with ``env`` (a list of
        ``NAME=value`` entries; None: this process's), with the follow spec, its ``traceparent``
        the calling thread's (``traceparent``), and the bootstrap folder first on ``PYTHONPATH``.
        None: ``env`` as it is (the child is one of mltrace's own, ``c_environ.own_child``; or
        ``env`` holds a follow variable that is no spec; or nothing could be read). Never raises.

        The follow variables are in the C environment alone (``parent.Following``), so an
        environment the program built from ``os.environ`` has none; a child started from this
        process's own environment gets it as the program would have it
        (``c_environ.children_environ``: without the variables mltrace set for the libraries)."""
        if starting_own_child():
            return None
        try:
            items = [bytes(item) for item in env] if env is not None else children_environ()
            spec: Any = None
            pythonpath: str | None = None
            kept: list[bytes] = []
            for item in items:
                if item.startswith(self._prefix):
                    spec = json.loads(item[len(self._prefix) :])
                    if not isinstance(spec, dict):
                        return None
                elif item.startswith(b"PYTHONPATH="):
                    pythonpath = os.fsdecode(item[len(b"PYTHONPATH=") :])
                else:
                    kept.append(item)
            if spec is None:
                spec = self._spec()
                if spec is None:
                    return None
            spec["traceparent"] = self.traceparent()
            kept.append(self._prefix + json.dumps(spec).encode())
            kept.append(b"PYTHONPATH=" + os.fsencode(with_bootstrap(pythonpath)))
            return kept
        except Exception:  # noqa: BLE001 - the program's child starts as it would
            return None

    def _spec(self) -> dict[str, Any] | None:
        """This process's follow spec (a copy), None where nothing is followed."""
        from mltrace.follow.child import current_spec

        spec = current_spec()
        return dict(spec) if spec is not None else None

    def install(self) -> None:
        """Wraps ``_posixsubprocess.fork_exec`` (and ``subprocess``'s copy of it) so that every
        child started through it gets the calling thread's context (``environment``)."""
        import _posixsubprocess
        import subprocess

        for owner, name in ((_posixsubprocess, "fork_exec"), (subprocess, "_fork_exec")):
            original = getattr(owner, name, None)
            if callable(original):
                wrapper = self._wrap(original)
                setattr(owner, name, wrapper)
                self._patched.append((owner, name, original, wrapper))

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def fork_exec(*args: Any, **kwargs: Any) -> Any:
            if len(args) > 5:  # (args, executable_list, close_fds, pass_fds, cwd, env, …)
                env = self.environment(args[5])
                if env is not None:
                    args = (*args[:5], env, *args[6:])
            return original(*args, **kwargs)

        return fork_exec

    def uninstall(self) -> None:
        """Puts back what ``install`` wrapped (where nothing wrapped it again since)."""
        for owner, name, original, wrapper in reversed(self._patched):
            if getattr(owner, name, None) is wrapper:
                setattr(owner, name, original)
        self._patched.clear()


def with_bootstrap(pythonpath: str | None) -> str:
    """``pythonpath`` (a ``PYTHONPATH`` value, None: unset) with the bootstrap folder first."""
    entries = [p for p in pythonpath.split(os.pathsep) if p != str(BOOTSTRAP_DIR)] if pythonpath else []
    return os.pathsep.join([str(BOOTSTRAP_DIR), *entries])
