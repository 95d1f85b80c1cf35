"""How the end of a run grows with its length: the full CPU trace of more and more inferences.

Runs the example CNN (or encoder) at ``--level library`` (model, layer, op and
library spans) for each number of inferences given, and times the session's
``stop()`` and, inside it, each correlator pass, so a pass that grows faster
than the run shows. Per run: spans, library calls, stop time and the passes'
times, each also per 1,000 spans.

    python benchmarks/stop_scale.py                       # CNN: 25, 100 and 400 inferences
    python benchmarks/stop_scale.py --model encoder --inferences 10,40
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import torch

import mltrace
import mltrace.tracer.passes as passes
from mltrace.run.store import Run


def timed_pipeline(times: dict[str, float]) -> Callable[[], list[Callable[[Run], Run]]]:
    """``default_pipeline`` whose passes add their seconds to ``times``."""
    original = passes.default_pipeline

    def pipeline() -> list[Callable[[Run], Run]]:
        def timed(p: Callable[[Run], Run]) -> Callable[[Run], Run]:
            def run_pass(run: Run) -> Run:
                t0 = time.perf_counter()
                try:
                    return p(run)
                finally:
                    times[p.__name__] = times.get(p.__name__, 0.0) + time.perf_counter() - t0

            return run_pass

        return [timed(p) for p in original()]

    return pipeline


def measure(fn: Callable[[], Any], inferences: int) -> dict[str, Any]:
    times: dict[str, float] = {}
    saved = passes.default_pipeline
    passes.default_pipeline = timed_pipeline(times)  # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            session = mltrace.profile(output=run_dir, summary=False, level="library")
            session.__enter__()
            try:
                for _ in range(inferences):
                    fn()
            finally:
                t0 = time.perf_counter()
                session.__exit__(None, None, None)
                stop_s = time.perf_counter() - t0
            meta = json.loads((run_dir / "run.json").read_text())
    finally:
        passes.default_pipeline = saved
    summary = meta.get("summary") or {}
    info = (meta.get("sources_info") or {}).get("cpu.library") or {}
    return {
        "inferences": inferences,
        "spans": summary.get("spans") or summary.get("span_count"),
        "library_lines": info.get("lines"),
        "stop_s": stop_s,
        "passes_s": times,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("cnn", "encoder"), default="cnn")
    parser.add_argument("--inferences", default="25,100,400", help="comma list of run lengths (default 25,100,400)")
    args = parser.parse_args()
    try:
        lengths = [int(n) for n in args.inferences.split(",") if n]
    except ValueError:
        parser.error(f"--inferences takes whole numbers, not {args.inferences!r}")
    if not lengths or min(lengths) < 1:
        parser.error("--inferences needs at least one length of 1 or more")
    work = harness.example_model(args.model)
    with torch.inference_mode():
        harness.time_calls(work, 0, warm=3)
        results = []
        for n in lengths:
            print(f"{n} inferences ...", file=sys.stderr, flush=True)
            results.append(measure(work, n))
    print(f"{args.model}, torch {torch.__version__}, --level library")
    for r in results:
        spans = r["spans"] or 0
        per_k = f" ({1e3 * r['stop_s'] / spans * 1e3:.1f} ms per 1,000 spans)" if spans else ""
        print(f"{r['inferences']:6} inferences: {spans:,} spans, {r['library_lines']} library lines, stop {r['stop_s']:.2f} s{per_k}")
        for name, s in sorted(r["passes_s"].items(), key=lambda kv: -kv[1]):
            print(f"         {name:26} {s:8.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
