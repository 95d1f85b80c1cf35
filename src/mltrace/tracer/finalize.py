"""The end of a run: correlate every event and rewrite the run's files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mltrace.run import store
from mltrace.run.store import Run
from mltrace.tracer.passes import correlate


def finalize_run(run_dir: Path, meta: dict[str, Any], phase: Callable[[str], None] | None = None) -> Run:
    """Loads the streamed events, runs the correlator passes, writes the final files.

    events.jsonl and trace.pftrace are replaced atomically; run.json gets the
    summary and ``complete: true`` last, so a crash during finalization leaves
    the streamed files and ``complete: false``.

    Args:
        run_dir: the run directory.
        meta: the metadata to write (updated in place).
        phase: told each step as it begins (``StopProgress.phase``).

    Returns:
        The correlated run.
    """
    from mltrace.analysis.summary import summarize
    from mltrace.run.perfetto import export_perfetto

    say = phase or (lambda step: None)
    say("loading the recorded events")
    run = store.load_run(run_dir)
    run.meta = meta
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
