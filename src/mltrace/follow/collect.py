"""The parent's finish: waits briefly for followed children still writing, then merges every
child's events into the run before the correlator passes, and names every process (and every
child that could not be followed) in run.json."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mltrace.follow import IDLE_PREFIX, PROCS_DIR, UNFOLLOWED_PREFIX

#: How long the finish waits, in all, for children that are still running (s).
WAIT_S = 3.0


def finish_parent(run_dir: Path, meta: dict[str, Any], phase: Callable[[str], None] | None = None, *, redact: bool = True) -> None:
    """The parent session's finish (``Session.finish``): ``finalize_run`` with the children's
    events merged in; their folders and notes, then ``procs/`` itself, are removed once the
    merged run is written. ``redact``: the session's ``ProfileOptions.redact``, applied to the
    command lines of the notes (a child's own session redacts its own)."""
    from mltrace.finish import finalize_run
    from mltrace.follow.child import describe

    meta.setdefault("process", {"pid": os.getpid()}).update(describe())
    procs = run_dir / PROCS_DIR
    (phase or (lambda step: None))("waiting for the followed processes")
    children = wait_for_children(procs)
    merged: list[Path] = []

    def extend(run: Any) -> Any:
        notes = _notes(procs, IDLE_PREFIX) + _notes(procs, UNFOLLOWED_PREFIX)  # listed first: a later one is kept
        merged_run = merge_children(run, children, meta, redact=redact)
        merged.extend([c for c in children if not _running(c)] + notes)  # a running child still writes in its own
        return merged_run

    def own_process(run: Any) -> None:  # no child to merge: the run's own process
        meta["processes"] = [_entry(meta, run.span_count, finished=True)]

    if children or _notes(procs, IDLE_PREFIX) or _notes(procs, UNFOLLOWED_PREFIX):
        finalize_run(run_dir, meta, phase, extend=extend)
    else:
        finalize_run(run_dir, meta, phase, describe=own_process)
    for path in merged:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    try:
        procs.rmdir()  # kept where a child still running wrote there since
    except OSError:
        pass


def wait_for_children(procs: Path, wait_s: float = WAIT_S) -> list[Path]:
    """The children's folders, once each has finished its trace or ended, or ``wait_s`` passed."""
    if not procs.is_dir():
        return []
    deadline = time.monotonic() + wait_s
    while True:
        children = sorted((p for p in procs.iterdir() if p.is_dir()), key=_pid_of)
        running = [c for c in children if _running(c)]
        if not running or time.monotonic() >= deadline:
            return children
        time.sleep(0.02)


def merge_children(run: Any, children: list[Path], meta: dict[str, Any], *, redact: bool = True) -> Any:
    """``run`` with each child's events appended (``run/merge.py``); run.json's ``processes``
    lists every process, ``unfollowed`` every child that could not be followed. With ``redact``
    the notes' command lines are redacted (``run/redact.redact_command``), as the run's own is."""
    from mltrace.run.merge import RunMerger
    from mltrace.run.redact import redact_command
    from mltrace.run.store import RunError, load_run

    merger = RunMerger(run)
    processes = [_entry(meta, run.span_count, finished=True)]
    limitations = meta.setdefault("limitations", [])
    for child in children:
        try:
            loaded = load_run(child)
        except RunError as exc:
            limitations.append(f"the followed process {child.name} left no readable trace ({exc})")
            continue
        finished = bool(loaded.meta.get("follow", {}).get("finished"))
        renamed = merger.add(loaded, 0, pid=_pid_of(child))
        entry = _entry(loaded.meta, loaded.span_count, finished, pid=_pid_of(child))
        if entry.get("pid") in renamed:  # the pid its spans carry (the OTLP export finds its parent span by it)
            entry["pid"] = renamed[entry["pid"]]
        if not finished:
            entry["running"] = _running(child)
        processes.append(entry)
        if not finished and entry["running"]:
            limitations.append(
                f"process {entry['pid']} ({entry['role']}) was still running when the run ended: the run has what it had "
                f"streamed; it finishes its own trace in {PROCS_DIR}/{child.name}"
            )
        elif not finished:
            limitations.append(
                f"process {entry['pid']} ({entry['role']}) had not finished its trace when the run ended (killed): it has what it streamed"
            )
    notes = {prefix: read_notes(run.path / PROCS_DIR, prefix) for prefix in (IDLE_PREFIX, UNFOLLOWED_PREFIX)}
    for note in notes[IDLE_PREFIX] + notes[UNFOLLOWED_PREFIX]:
        if redact and isinstance(note.get("argv"), list):
            note["argv"] = redact_command([str(arg) for arg in note["argv"]])
    for note in notes[IDLE_PREFIX]:
        pid = merger.add_process(int(note.get("pid") or 0), "MainThread")
        processes.append(
            {
                "pid": pid,
                "ppid": note.get("ppid"),
                "role": f"pid {pid}",
                "command": note.get("argv"),
                "spans": 0,
                "finished": True,
                "note": note.get("reason"),
            }
        )
    _unrank_inherited(processes)
    meta["processes"] = processes
    unfollowed = notes[UNFOLLOWED_PREFIX]
    if unfollowed:
        meta["unfollowed"] = unfollowed
        for note in unfollowed:
            limitations.append(
                f"process {note.get('pid')} ({' '.join(map(str, note.get('argv', [])))}) was not followed: {note.get('reason')}"
            )
    return merger.run()


def _unrank_inherited(processes: list[dict[str, Any]]) -> None:
    """Takes the rank facts off a process that has them from torchrun's environment alone where
    a process it descends from in the run has the same rank: it inherited the environment (a
    rank's ``subprocess`` child), it is no rank of its own; its role ``rank N`` becomes ``pid P``."""
    by_pid = {p.get("pid"): p for p in processes}
    for process in processes:
        facts = process.get("distributed")
        if not isinstance(facts, dict) or facts.get("source") != "environment":
            continue
        ancestor, seen = by_pid.get(process.get("ppid")), {process.get("pid")}
        while ancestor is not None and ancestor.get("pid") not in seen:
            theirs = ancestor.get("distributed")
            if isinstance(theirs, dict) and theirs.get("rank") == facts.get("rank"):
                del process["distributed"]
                if process.get("role") == f"rank {facts.get('rank')}":
                    process["role"] = f"pid {process.get('pid')}"
                break
            seen.add(ancestor.get("pid"))
            ancestor = by_pid.get(ancestor.get("ppid"))


def _entry(meta: dict[str, Any], spans: int, finished: bool, pid: int | None = None) -> dict[str, Any]:
    """A process's entry in run.json's ``processes``; ``pid`` stands in for one its run.json
    lacks (a child whose run.json has no process facts: they are written at its session's
    start, ``Session.start_meta``)."""
    process = dict(meta.get("process") or {})
    if pid is not None:
        process.setdefault("pid", pid)
    pid = process.get("pid")
    process.setdefault("role", f"pid {pid}")
    process["command"] = meta.get("command")
    process["spans"] = spans
    process["finished"] = finished
    return process


def read_notes(procs: Path, prefix: str) -> list[dict[str, Any]]:
    """The notes of the children that could not be followed (``procs/unfollowed-<pid>.json``) or
    recorded nothing (``procs/process-<pid>.json``)."""
    notes = []
    for path in _notes(procs, prefix):
        try:
            note = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(note, dict):
            notes.append(note)
    return notes


def _notes(procs: Path, prefix: str) -> list[Path]:
    """The note files ``read_notes`` reads."""
    return sorted(procs.glob(f"{prefix}*.json")) if procs.is_dir() else []


def _pid_of(child: Path) -> int:
    head = child.name.split("-", 1)[0]
    return int(head) if head.isdigit() else 0


def _running(child: Path) -> bool:
    """Whether the child of folder ``child`` runs and has not finished its trace."""
    return not _finished(child) and _alive(_pid_of(child))


def _finished(child: Path) -> bool:
    try:
        meta = json.loads((child / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and bool((meta.get("follow") or {}).get("finished"))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
