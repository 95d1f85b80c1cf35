"""The end of a run, above the tracer, the exporters, the analysis and the viewers.

Once a session's sources stop, ``finalize_run`` correlates every event and rewrites the run's
files (events.jsonl, trace.pftrace, spans.bin, run.json with its summary); ``print_summary``
then prints the summary. ``import mltrace`` makes ``RunFinish`` the finish of every session
(``tracer.session.use_finish``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mltrace.run import store
from mltrace.run.store import Run


def finalize_run(
    run_dir: Path,
    meta: dict[str, Any],
    phase: Callable[[str], None] | None = None,
    extend: Callable[[Run], Run] | None = None,
    describe: Callable[[Run], None] | None = None,
) -> Run:
    """Loads the streamed events, runs the correlator passes, writes the final files.

    events.jsonl and trace.pftrace are replaced atomically; run.json gets the
    summary and ``complete: true`` last, so a crash during finalization leaves
    the streamed files and ``complete: false``. Where the run was finished a part at a time
    while it ran (``RunFinish.seal``, ``finish_stream.py``) and nothing extends it, the
    finisher process writes the rest instead.

    Args:
        run_dir: the run directory.
        meta: the metadata to write (updated in place).
        phase: told each step as it begins (``StopProgress.phase``).
        extend: given the loaded run, returns it with more events (the followed children's,
            ``mltrace/follow/collect.py``), before the correlator passes.
        describe: given the run, adds to ``meta`` what it says of it (the span count).

    Returns:
        The correlated run.
    """
    stream = _streams.pop(run_dir, None)
    if stream is not None:
        if extend is None:
            done = stream.finalize(meta, phase)
            if done is not None:
                return _described(done, describe)
        else:
            stream.discard()
            meta["finish"] = {"streamed": False, "why": "the events of followed processes are merged in at the end"}
    elif run_dir in _unstreamed:
        meta["finish"] = {"streamed": False, "why": _unstreamed.pop(run_dir)}
    return _finalize_whole(run_dir, meta, phase, extend, describe)


def _described(run: Run, describe: Callable[[Run], None] | None) -> Run:
    """``run`` after ``describe`` added to its run.json."""
    if describe is not None:
        describe(run)
        store.write_meta(run.path, run.meta)
    return run


def _finalize_whole(
    run_dir: Path,
    meta: dict[str, Any],
    phase: Callable[[str], None] | None,
    extend: Callable[[Run], Run] | None,
    describe: Callable[[Run], None] | None,
) -> Run:
    """``finalize_run`` of every event at once."""
    from mltrace.analysis.summary import summarize
    from mltrace.run.perfetto import export_perfetto
    from mltrace.tracer.passes import correlate

    say = phase or (lambda step: None)
    say("loading the recorded events")
    run = store.load_run(run_dir)
    run.meta = meta
    if extend is not None:
        run = extend(run)
    if describe is not None:
        describe(run)
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


#: How large events.jsonl grows before the run is finished a part at a time while it runs
#: (bytes): a shorter run's finish is quick and needs no process of its own.
STREAM_FROM_BYTES = 4 << 20

#: How long the finisher process may say nothing at the end before it is given up (s): each
#: step it begins is said, and the longest is the last part of the run.
SILENCE_S = 120.0

#: The finisher process of each run being finished a part at a time.
_streams: dict[Path, _FinisherProcess] = {}
#: Runs whose finisher process could not start or died, and why: finished whole.
_unstreamed: dict[Path, str] = {}


class _FinisherProcess:
    """The streamed finish's process of one run (``finish_serve.py``), started once its
    events.jsonl is ``STREAM_FROM_BYTES`` long, as a helper (``helper_env.start_helper``: a
    process group of its own, below the program's CPU priority). A forked child of the traced
    process lets go of it."""

    def __init__(self, run_dir: Path) -> None:
        import os

        from mltrace.tracer.helper_env import start_helper

        self.run_dir = run_dir
        self._proc = start_helper("mltrace.finish_serve", str(run_dir))
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        """In a forked child: closes its copies of the pipes, touching nothing else."""
        from mltrace.tracer.helper_env import forget_helper

        forget_helper(self._proc)

    def seal(self, sealed_ns: int, open_ns: int | None) -> bool:
        """Tells the process that every event ending by ``sealed_ns`` is written and no span
        running began before ``open_ns``; False where it is gone."""
        return self._send({"seal": sealed_ns, "open": open_ns})

    def _send(self, obj: dict[str, Any]) -> bool:
        import json

        stdin = self._proc.stdin
        if stdin is None:
            return False
        try:
            stdin.write(json.dumps(obj, default=str).encode() + b"\n")
            stdin.flush()
        except (OSError, ValueError):
            return False
        return True

    def finalize(self, meta: dict[str, Any], phase: Callable[[str], None] | None) -> Run | None:
        """Has the process finish the run; the run (``meta`` updated in place to what it wrote),
        or None where it could not, or said nothing for ``SILENCE_S`` (the run is then finished
        whole, and run.json's ``finish.why`` says why). Interrupted (a signal during the finish), it kills the process: the run stays
        as streamed."""
        say = phase or (lambda step: None)
        answer: dict[str, Any] = {}
        try:
            if self._send({"finish": meta}):
                for answer in self._answers():
                    if "phase" not in answer:
                        break
                    say(str(answer["phase"]))
        except BaseException:
            self._proc.kill()
            raise
        finally:
            self.discard()
        if "done" not in answer:
            why = answer.get("fallback") or f"the finisher process ended without an answer (status {self._proc.returncode})"
            meta["finish"] = {"streamed": False, "why": str(why)}
            return None
        meta.clear()
        meta.update(answer["done"])
        return store.load_run(self.run_dir, verify_table=False)  # the table the process has just written

    def _answers(self) -> Iterator[dict[str, Any]]:
        """The process's answer lines, until its output ends or it says nothing for ``SILENCE_S``
        (then it is killed)."""
        import os
        import select

        from mltrace.run.jsoncodec import loads

        stdout = self._proc.stdout
        if stdout is None:
            return
        fd, pending = stdout.fileno(), b""
        while True:
            ready, _, _ = select.select([fd], [], [], SILENCE_S)
            if not ready:
                self._proc.kill()
                return
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                obj = loads(line)
                if isinstance(obj, dict):
                    yield obj

    def discard(self, timeout_s: float = 5.0) -> None:
        """Ends the process (its input closed: it removes its temporary files) and reaps it; the
        temporary files of one that died are removed here."""
        from mltrace.tracer.helper_env import end_helper

        end_helper(self._proc, timeout_s)
        for leftover in self.run_dir.glob(store.STREAMED_TEMPORARY):
            leftover.unlink(missing_ok=True)


def seal_run(run_dir: Path, sealed_ns: int, open_ns: int | None = None) -> None:
    """Tells the run's finisher process that every event ending by ``sealed_ns`` (session
    time) is written and that no span still running began before ``open_ns`` (None: none
    runs), starting the process once events.jsonl is ``STREAM_FROM_BYTES`` long
    (``MLTRACE_FINISH_STREAM=0``: never)."""
    stream = _streams.get(run_dir)
    if stream is None:
        from_bytes = _stream_from_bytes()
        if sealed_ns <= 0 or run_dir in _unstreamed or from_bytes is None:
            return
        try:
            if (run_dir / store.EVENTS_FILE).stat().st_size < from_bytes:
                return
            stream = _streams[run_dir] = _FinisherProcess(run_dir)
        except OSError as exc:
            _unstreamed[run_dir] = f"the finisher process could not start ({exc})"
            return
    if not stream.seal(sealed_ns, open_ns):
        _streams.pop(run_dir, None)
        _unstreamed[run_dir] = "the finisher process ended while the program ran"
        stream.discard(timeout_s=1.0)


def _stream_from_bytes() -> int | None:
    """The size of events.jsonl from which a run is finished a part at a time
    (``MLTRACE_FINISH_STREAM``: 1 or unset, ``STREAM_FROM_BYTES``; a larger number, that many
    bytes); None: never (0, or a value that is not a number)."""
    from mltrace.settings import FINISH_STREAM

    text = (FINISH_STREAM.get() or "1").strip()
    if not text.isdigit() or int(text) == 0:
        return None
    return STREAM_FROM_BYTES if int(text) == 1 else int(text)


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

    def seal(self, run_dir: Path, sealed_ns: int, open_ns: int | None = None) -> None:
        """Every event ending by ``sealed_ns`` is written, no running span began before ``open_ns`` (``seal_run``)."""
        seal_run(run_dir, sealed_ns, open_ns)

    def print_summary(self, run_dir: Path) -> None:
        """Prints the finished run's summary (``print_summary``)."""
        print_summary(run_dir)
