"""The run directory: the canonical, streamed, reloadable product of a run."""

from mltrace.run.store import EVENTS_FILE, META_FILE, TRACE_FILE, Run, RunError, load_run

__all__ = ["EVENTS_FILE", "META_FILE", "TRACE_FILE", "Run", "RunError", "load_run"]
