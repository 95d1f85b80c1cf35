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
import os
import sys
from pathlib import Path
from typing import Any

from mltrace._version import __version__
from mltrace.errors import UsageError
from mltrace.run import store
from mltrace.run.store import Run
from mltrace.tracer.levels import HIERARCHY, Level
from mltrace.tracer.sources.kineto import KinetoEvents, kineto_to_events, load_kineto_json
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


def _devices(trace: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for d in trace.get("deviceProperties") or ():
        if not isinstance(d, dict):
            continue
        out.append(
            {
                "id": d.get("id"),
                "name": d.get("name"),
                "total_memory_bytes": d.get("totalGlobalMem"),
                "compute_capability": f"{d.get('computeMajor')}.{d.get('computeMinor')}" if "computeMajor" in d else None,
                "sm_count": d.get("numSms"),
            }
        )
    return out


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
    versions = {
        k: trace[k] for k in ("schemaVersion", "cupti_version", "cuda_runtime_version", "cuda_driver_version") if k in trace
    }
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


def import_kineto(path: str | os.PathLike[str], run_dir: str | os.PathLike[str]) -> Path:
    """Creates a run directory from a Kineto trace (``.json`` or ``.json.gz``).

    Writes run.json and events.jsonl, then finalizes the run with
    ``mltrace.tracer.finalize.finalize_run`` (correlation passes, Perfetto
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

    from mltrace.tracer.session import prepare_run_dir

    prepare_run_dir(dest)
    run = Run(
        path=dest,
        meta=meta,
        tracks={t.id: t for t in result.tracks},
        spans=result.spans,
        instants=result.instants,
        flows=result.flows,
    )
    try:
        store.write_meta(dest, meta)
        store.write_events_atomically(dest / store.EVENTS_FILE, run)
    except OSError as exc:
        raise UsageError(f"cannot write {dest}: {exc.strerror or exc}") from None
    try:
        from mltrace.tracer.finalize import finalize_run

        finalize_run(dest, meta)
    except Exception as exc:  # the raw events stay readable; say why the run is not complete
        if os.environ.get("MLTRACE_DEBUG"):
            raise
        meta["complete"] = False
        meta["errors"].append(f"finalize failed: {exc}")
        store.write_meta(dest, meta)
        sys.stderr.write(f"mltrace: warning: could not finalize {dest} ({exc}); its events are not correlated\n")
    return dest
