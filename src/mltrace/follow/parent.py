"""The traced program's side of following: hands its children the run and the level through the
environment, follows its forks, and at its finish merges the children's events into the run."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from mltrace.follow import PROCS_DIR
from mltrace.follow.child import clear_spec, set_context, set_spec
from mltrace.follow.context import ChildContext, with_bootstrap
from mltrace.settings import FOLLOW
from mltrace.tracer import c_environ


class Following:
    """Children followed into ``session``'s run: ``enable`` sets it up, ``disable`` (before the
    session stops) puts the environment back. The follow variables are set in the C environment
    alone (``tracer/c_environ.py``): the program's ``os.environ`` stays as it was, and the
    children it starts through ``subprocess`` or multiprocessing get them from the wrapper of
    ``context.ChildContext``."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self._context: ChildContext | None = None

    def enable(self) -> Following:
        """Puts the bootstrap on ``PYTHONPATH`` and the spec in ``MLTRACE_FOLLOW`` for every
        child (in the C environment), follows forks, and makes the session's finish merge the children."""
        from mltrace.follow.collect import finish_parent
        from mltrace.follow.ranks import watch_ranks

        session = self.session
        run: Path = session.run_dir
        (run / PROCS_DIR).mkdir(exist_ok=True)
        self._context = ChildContext(session, FOLLOW.name)
        spec = self.spec()
        import json

        c_environ.put(FOLLOW.name, json.dumps(spec))
        c_environ.put("PYTHONPATH", with_bootstrap(os.environ.get("PYTHONPATH")))
        set_spec(spec)
        set_context(self._context.traceparent)
        self._context.install()
        session.finish = functools.partial(finish_parent, redact=session.options.redact)
        session.meta["process"] = {"pid": os.getpid(), "role": "main"}
        session.tracks.current_thread()  # the process has a track even where it records nothing
        watch_ranks(session)
        return self

    def spec(self) -> dict[str, Any]:
        """What a child needs to record as the parent does: the run, the options, the trace
        context (W3C ``traceparent``: the span current in the parent, ``context.ChildContext``;
        a child started later gets the one current then)."""
        opts = self.session.options
        return {
            "run": str(Path(self.session.run_dir).resolve()),
            "name": opts.name,
            "level": opts.level.label if opts.level is not None else None,
            "flush_interval_s": opts.flush_interval_s,
            "op_inferences": opts.op_inferences,
            "max_spans": opts.max_spans,
            "memory": opts.memory or None,
            "traceparent": self._context.traceparent() if self._context is not None else None,
            "parent_pid": os.getpid(),
        }

    def disable(self) -> None:
        """Puts ``PYTHONPATH`` and ``MLTRACE_FOLLOW`` back and stops following forks."""
        for name in (FOLLOW.name, "PYTHONPATH"):
            c_environ.take_back(name)
        clear_spec()
        if self._context is not None:
            self._context.uninstall()
