"""The streamed finish's own cost: a raw run (traced, never finished) replayed through
``finish_stream.StreamedFinish`` as the finisher process would see it, events.jsonl growing line
by line and a seal every 0.25 s of session time, then the finish's end.

The raw run is made once per ``--workload`` (``tiny``: calls of a 3-layer MLP, as
``long_run.py --tiny``; ``decode``: the LSTM word model's decode loop) by tracing it at the
default level with ``MLTRACE_FINISH_STREAM=0`` and killing it by SIGKILL after its calls, and kept
in ``--keep`` to be replayed again. Prints the CPU time of the segments per span written and the
end's wall time by phase, median of ``--rounds`` replays; ``--profile`` prints cProfile's top
functions of one replay instead.

    python benchmarks/finish_replay.py --workload tiny --calls 20000 --keep /tmp/raw-tiny
    python benchmarks/finish_replay.py --keep /tmp/raw-tiny --rounds 3
    python benchmarks/finish_replay.py --keep /tmp/raw-tiny --profile
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from long_run import CHILD, TINY  # noqa: E402

SEAL_STEP_NS = 250_000_000
KILL = "\nimport os, signal, time\ntime.sleep(1.5)\nos.kill(os.getpid(), signal.SIGKILL)\n"


def make_raw(workload: str, calls: int, dest: Path) -> None:
    """Traces the workload unfinished into ``dest`` (its run directory as the program died)."""
    script = dest.parent / f"{workload}.py"
    script.write_text((TINY if workload == "tiny" else CHILD).format(steps=calls) + KILL)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLTRACE_")}
    env["MLTRACE_FINISH_STREAM"] = "0"
    cmd = [sys.executable, "-m", "mltrace", "python", "-q", "-o", str(dest), str(script)]
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    if not (dest / "events.jsonl").is_file():
        raise SystemExit(f"finish_replay: tracing the {workload} workload wrote no events.jsonl")


def _line_times(raw: Path, lines: list[bytes]) -> tuple[list[int], list[int]]:
    """Each events.jsonl line's latest time and earliest span end (session ns)."""
    from mltrace.run import store
    from mltrace.run.store import Run

    meta = store.read_meta(raw)
    templates: dict[int, tuple[str, dict[str, object]]] = {}
    latest, earliest = [], []
    for line in lines:
        part = Run(raw, meta)
        store.decode_batch(part, line, templates)
        times = [s.end_ns for s in part.spans] + [i.ts_ns for i in part.instants] + [c.ts_ns for c in part.counters]
        latest.append(max(times, default=0))
        earliest.append(min((s.end_ns for s in part.spans), default=1 << 62))
    return latest, earliest


def _open_at(spans: list[object], t: int) -> int | None:
    from mltrace.run.levels import Level

    held = (Level.USER, Level.MODEL, Level.LAYER)
    return min((s.start_ns for s in spans if s.level in held and s.start_ns <= t < s.end_ns), default=None)  # type: ignore[attr-defined]


def replay(raw: Path, work: Path, profile: cProfile.Profile | None = None) -> dict[str, float]:
    """One replay of ``raw`` in ``work``; the segments' CPU time per span (µs) and the end's phases (s)."""
    from mltrace.finish_stream import StreamedFinish
    from mltrace.run import store

    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(raw, work)
    lines = (raw / "events.jsonl").read_bytes().split(b"\n")[:-1]
    latest, earliest = _line_times(raw, lines)
    spans = store.load_run(raw).spans
    first, last = min(s.start_ns for s in spans), max(s.end_ns for s in spans)
    seals = [(t, _open_at(spans, t)) for t in range(first + SEAL_STEP_NS, last + 1_200_000_000, SEAL_STEP_NS)]
    del spans
    meta = json.loads(json.dumps(store.read_meta(raw)))
    events = work / "events.jsonl"
    events.write_bytes(b"")
    finish = StreamedFinish(work)
    written, busy = 0, 0.0
    for t, open_ns in seals:
        with open(events, "ab") as out:
            while written < len(lines) and latest[written] <= t:
                out.write(lines[written] + b"\n")
                written += 1
        sealed = min(t, min(earliest[written:], default=1 << 62) - 1)  # no span arrives late
        c0 = time.process_time()
        if profile is not None:
            profile.enable()
        finish.seal(sealed, open_ns)
        if profile is not None:
            profile.disable()
        busy += time.process_time() - c0
    with open(events, "ab") as out:
        out.writelines(line + b"\n" for line in lines[written:])
    marks: list[tuple[str, float]] = []
    t0 = time.perf_counter()
    if profile is not None:
        profile.enable()
    done = finish.finalize(meta, lambda step: marks.append((step.split(" ")[0], time.perf_counter())))
    if profile is not None:
        profile.disable()
    marks.append(("end", time.perf_counter()))
    if done is None:
        raise SystemExit(f"finish_replay: the streamed finish fell back: {finish.broken}")
    row = {"spans": float(finish.spans_done), "segments": float(finish.segments), "us_per_span": 1e6 * busy / max(finish.spans_done, 1)}
    row["end_s"] = marks[-1][1] - t0
    for (step, at), (_, nxt) in zip(marks, marks[1:]):
        row[f"{step}_s"] = row.get(f"{step}_s", 0.0) + nxt - at
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("tiny", "decode"), default="tiny")
    parser.add_argument("--calls", type=int, default=20000, help="model calls (tiny) or decode steps (decode)")
    parser.add_argument("--keep", type=Path, help="where the raw run is kept (made there if absent)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="cProfile one replay, top 40 by cumulative time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw = args.keep or Path(tmp) / "raw" / "run"
        if not (raw / "events.jsonl").is_file():
            raw.parent.mkdir(parents=True, exist_ok=True)
            make_raw(args.workload, args.calls, raw)
        if args.profile:
            profile = cProfile.Profile()
            print(json.dumps(replay(raw, Path(tmp) / "work", profile)))
            pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
            return
        rows = [replay(raw, Path(tmp) / "work") for _ in range(args.rounds)]
        for row in rows:
            print(json.dumps({k: round(v, 3) for k, v in row.items()}))
        if len(rows) > 1:
            print("median:", json.dumps({k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}))


if __name__ == "__main__":
    main()
