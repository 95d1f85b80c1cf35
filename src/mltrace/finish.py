"""The end of a run, above the tracer, the exporters, the analysis and the viewers.

Once a session's sources stop, ``finalize_run`` correlates every event and rewrites the run's
files (events.jsonl, trace.pftrace, spans.bin, run.json with its summary); ``print_summary``
then prints the summary. ``import mltrace`` makes ``RunFinish`` the finish of every session
(``tracer.session.use_finish``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mltrace.run import store
from mltrace.run.store import Run


def finalize_run(
    run_dir: Path, meta: dict[str, Any], phase: Callable[[str], None] | None = None, extend: Callable[[Run], Run] | None = None
) -> Run:
    """Loads the streamed events, runs the correlator passes, writes the final files.

    events.jsonl and trace.pftrace are replaced atomically; run.json gets the
    summary and ``complete: true`` last, so a crash during finalization leaves
    the streamed files and ``complete: false``.

    Args:
        run_dir: the run directory.
        meta: the metadata to write (updated in place).
        phase: told each step as it begins (``StopProgress.phase``).
        extend: given the loaded run, returns it with more events (the followed children's,
            ``mltrace/follow/collect.py``), before the correlator passes.

    Returns:
        The correlated run.
    """
    from mltrace.analysis.summary import summarize
    from mltrace.run.perfetto import export_perfetto
    from mltrace.tracer.passes import correlate

    say = phase or (lambda step: None)
    say("loading the recorded events")
    run = store.load_run(run_dir)
    run.meta = meta
    if extend is not None:
        run = extend(run)
    n = len(run.spans)
    spans = f"{n:,} span" if n == 1 else f"{n:,} spans"
    say(f"correlating {spans}")
    run = correlate(run)
    if run.meta is not meta:  # a pass may have returned fresh metadata
        meta.update(run.meta)
        run.meta = meta
    say(f"rewriting {store.EVENTS_FILE}")
    store.write_events_atomically(run_dir / store.EVENTS_FILE, run)
    say("writing the span table")
    table = None
    try:
        table = store.write_table(run_dir, run)
    except Exception as exc:  # noqa: BLE001 - a cache: the run is complete without it
        from mltrace.tracer.messages import warn

        warn(f"could not write the span table ({exc}); reports will read events.jsonl")
    say(f"writing {store.TRACE_FILE} ({spans})")
    export_perfetto(run, run_dir / store.TRACE_FILE)
    say("summarizing")
    meta["summary"] = summarize(run, table=table)
    meta["complete"] = True
    store.write_meta(run_dir, meta)
    return run


def print_summary(run_dir: Path) -> None:
    """Prints the finished run's short summary on stderr (``viewers/terminal.py``)."""
    from mltrace.viewers.terminal import print_run_summary

    print_run_summary(run_dir)


class RunFinish:
    """The finish the tracer's sessions are given (``tracer.session.Finish``): this module's
    ``finalize_run`` and ``print_summary``."""

    def finalize(self, run_dir: Path, meta: dict[str, Any], phase: Callable[[str], None]) -> object:
        """Correlates the run's events and rewrites its files (``finalize_run``)."""
        return finalize_run(run_dir, meta, phase)

    def print_summary(self, run_dir: Path) -> None:
        """Prints the finished run's summary (``print_summary``)."""
        print_summary(run_dir)
