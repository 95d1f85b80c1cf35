"""``import_kineto``: a torch.profiler (Kineto) trace file → an mltrace run directory.

Clock of an imported run: session ns **are** Unix-epoch ns. Kineto stamps
events with ``ts`` µs (``ts * 1000 + baseTimeNanoseconds`` = epoch ns, or
epoch µs directly in traces older than ``baseTimeNanoseconds``), and there
is no monotonic reading to anchor to, so the run's anchor is the identity
(``anchor_monotonic_ns = anchor_epoch_ns = 0``) and every conversion through
it is exact. A trace whose timestamps are neither (clock ``"relative"`` in
the stats) keeps its own origin; run.json says so under ``limitations``.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from mltrace._version import __version__
from mltrace.errors import UsageError
from mltrace.formats.kineto import KinetoEvents, kineto_to_events, load_kineto_json
from mltrace.run import store
from mltrace.run.events import Track
from mltrace.run.levels import HIERARCHY, Level
from mltrace.run.store import Run
from mltrace.settings import DEBUG
from mltrace.tracer.tracks import TrackRegistry

SOURCE_NAME = "kineto-import"


def _check_destination(run_dir: Path) -> None:
    if run_dir.exists():
        if not run_dir.is_dir():
            raise UsageError(f"output {run_dir} exists and is not a directory")
        if any(run_dir.iterdir()):
            raise UsageError(f"output directory {run_dir} is not empty (choose a new one)")


def _levels(result: KinetoEvents) -> dict[str, dict[str, Any]]:
    """run.json's ``levels``, in the session's shape: what the trace holds, and why not."""
    present = {s.level for s in result.spans}
    why_not = {
        Level.MODEL: "no nn.Module frames in the trace (record with with_stack=True, with_modules=True)",
        Level.LAYER: "no nn.Module frames in the trace (record with with_stack=True, with_modules=True)",
        Level.OP: "no cpu_op events in the trace",
        Level.LIBRARY: "Kineto records no library calls; kernels carry ml.library.name instead",
        Level.KERNEL: "no GPU activity or CUDA API events in the trace (recorded without ProfilerActivity.CUDA?)",
    }
    out: dict[str, dict[str, Any]] = {}
    for lv in HIERARCHY:
        recorded = lv in present
        out[lv.label] = {
            "requested": True,
            "recorded": recorded,
            "sources": [SOURCE_NAME] if recorded else [],
            "reason": None if recorded else why_not[lv],
        }
    return out


def _scalar(value: Any) -> str | int | float | bool | None:
    """``value`` where it is text, a 64-bit integer, a finite number or a boolean, else None: a
    trace's device facts go to run.json as they are, and only these are facts."""
    if isinstance(value, bool) or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value if -(1 << 63) <= value < (1 << 63) else None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return None


def _devices(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """run.json's ``devices``: each ``deviceProperties`` entry's facts (values of another shape
    are left out, so a malformed entry cannot make run.json unwritable)."""
    found = trace.get("deviceProperties")
    out = []
    for d in found if isinstance(found, list) else ():
        if not isinstance(d, dict):
            continue
        major, minor = _scalar(d.get("computeMajor")), _scalar(d.get("computeMinor"))
        out.append(
            {
                "id": _scalar(d.get("id")),
                "name": _scalar(d.get("name")),
                "total_memory_bytes": _scalar(d.get("totalGlobalMem")),
                "compute_capability": f"{major}.{minor}" if major is not None else None,
                "sm_count": _scalar(d.get("numSms")),
            }
        )
    return out


#: Perfetto holds a process or thread id in 32 bits (signed).
_ID_RANGE = range(0, 1 << 31)


def fit_thread_ids(tracks: list[Track]) -> list[str]:
    """Gives tracks whose pid or tid Perfetto cannot hold (beyond 31 bits, or negative) the
    highest ids free below 2**31, the same one for the same id; returns what was changed, for
    run.json's ``limitations``."""
    used = {t.pid for t in tracks} | {t.tid for t in tracks}
    given: dict[int, int] = {}
    free = (1 << 31) - 1
    for track in tracks:
        for field in ("pid", "tid"):
            value = getattr(track, field)
            if value is None or value in _ID_RANGE:
                continue
            if value not in given:
                while free in used:
                    free -= 1
                given[value] = free
                used.add(free)
            setattr(track, field, given[value])
    return [f"thread or process id {k} does not fit in 31 bits (Perfetto's): shown as {v}" for k, v in given.items()]


def build_meta(path: Path, trace: dict[str, Any], result: KinetoEvents, name: str | None = None) -> dict[str, Any]:
    """run.json of an imported Kineto trace (``complete`` is False until finalized).

    Host facts are the recording host's as far as the trace tells them,
    never the importing machine's.
    """
    starts = [s.start_ns for s in result.spans]
    ends = [s.end_ns for s in result.spans]
    stats = result.stats
    limitations: list[str] = []
    if stats.clock == "relative":
        limitations.append("the trace has no baseTimeNanoseconds and no epoch timestamps: times keep the trace's own origin")
    if not any(s.level in (Level.MODEL, Level.LAYER) for s in result.spans):
        limitations.append("imported trace: no model or layer spans (Kineto has them only with with_stack and with_modules)")
    versions = {k: trace[k] for k in ("schemaVersion", "cupti_version", "cuda_runtime_version", "cuda_driver_version") if k in trace}
    try:
        size = path.stat().st_size
    except OSError:
        size = None
    meta: dict[str, Any] = {
        "format": "mltrace-run",
        "format_version": store.FORMAT_VERSION,
        "mltrace_version": __version__,
        "name": name or path.name.split(".")[0],
        "imported": True,
        "source": {"format": "kineto", "file": str(path.resolve()), "bytes": size, "trace_name": trace.get("traceName")},
        "command": ["mltrace", "import", str(path)],
        "cwd": os.getcwd(),
        "host": {"hostname": trace.get("host_name")} if trace.get("host_name") else {},
        "versions": {"kineto": versions} if versions else {},
        "devices": _devices(trace),
        "clock": {
            "domain": "UNIX_EPOCH" if stats.clock != "relative" else "TRACE_RELATIVE",
            "unit": "ns",
            "anchor_monotonic_ns": 0,
            "anchor_epoch_ns": 0,
            "anchor_uncertainty_ns": 0,
            "kineto_clock": stats.clock,
            "kineto_base_time_ns": stats.base_time_ns,
        },
        "levels": _levels(result),
        "started_at_epoch_ns": min(starts) if starts else 0,
        "stopped_at_epoch_ns": max(ends) if ends else 0,
        "duration_ns": (max(ends) - min(starts)) if starts else 0,
        "kineto": stats.as_dict(),
        "limitations": limitations,
        "errors": [],
        "complete": False,
    }
    if isinstance(trace.get("distributedInfo"), dict):
        meta["distributed"] = trace["distributedInfo"]
    return meta


def _remove_written(dest: Path, existed: bool) -> None:
    """Takes back what a failed import wrote: the directory it made, or what it put in the
    empty one it was given."""
    if not existed:
        shutil.rmtree(dest, ignore_errors=True)
        return
    for child in dest.iterdir():
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def import_kineto(path: str | os.PathLike[str], run_dir: str | os.PathLike[str]) -> Path:
    """Creates a run directory from a Kineto trace (``.json`` or ``.json.gz``).

    Writes run.json and events.jsonl, then finalizes the run with
    ``mltrace.finish.finalize_run`` (correlation passes, Perfetto
    trace, summary, ``complete: true``). If finalizing fails, the
    uncorrelated events stay, run.json records the error with
    ``complete: false``, and a warning is printed.

    Args:
        path: the trace file.
        run_dir: the run directory to create; it must be absent or empty.

    Returns:
        The run directory.

    Raises:
        UsageError: if ``run_dir`` exists and is not an empty directory, or
            cannot be written.
        RunError: if the trace cannot be read (nothing is created then).
    """
    src = Path(path)
    dest = Path(run_dir)
    _check_destination(dest)
    trace = load_kineto_json(src)
    ids = itertools.count(1)
    result = kineto_to_events(trace, TrackRegistry(pid=0), lambda: next(ids), lambda epoch_ns: epoch_ns)
    meta = build_meta(src, trace, result)
    meta["limitations"].extend(fit_thread_ids(result.tracks))

    from mltrace.tracer.session import prepare_run_dir

    existed = dest.exists()
    prepare_run_dir(dest)
    run = Run(
        path=dest,
        meta=meta,
        tracks={t.id: t for t in result.tracks},
        spans=result.spans,
        instants=result.instants,
        counters=result.counters,
        flows=result.flows,
    )
    try:
        store.write_meta(dest, meta)
        store.write_events_atomically(dest / store.EVENTS_FILE, run)
    except BaseException as exc:
        _remove_written(dest, existed)
        if isinstance(exc, OSError):
            raise UsageError(f"cannot write {dest}: {exc.strerror or exc}") from None
        raise
    try:
        from mltrace.finish import finalize_run

        finalize_run(dest, meta)
    except Exception as exc:  # the raw events stay readable; say why the run is not complete
        if DEBUG.get():
            raise
        meta["complete"] = False
        meta["errors"].append(f"finalize failed: {exc}")
        store.write_meta(dest, meta)
        sys.stderr.write(f"mltrace: warning: could not finalize {dest} ({exc}); its events are not correlated\n")
    return dest
