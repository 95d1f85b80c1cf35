"""How long ``mltrace report`` takes on a run of 1,000,000 spans (budget: 3 s).

Builds a synthetic run directory, as a finished run leaves it (events.jsonl and
the span table spans.bin), shaped like a real PyTorch run traced at every
CPU level — per model call: containers and leaf layers, each leaf with a
top-level op, nested ops (about 7 ops per layer, as in a real ResNet trace) and
sometimes a library call, with the attributes the sources write (shapes,
dtypes, source locations, FLOPs) — then times the
command a user types, ``python -m mltrace report RUN``, end to end in a fresh
process (interpreter start, imports, load, analysis, rendering), several times.
Peaks are measured once beforehand into a temporary cache, as on any machine
after its first report.

    python benchmarks/report_1m.py                 # 1,000,000 spans, 3 repeats
    python benchmarks/report_1m.py --spans 200000 --repeats 1
    python benchmarks/report_1m.py --keep /tmp/run1m --json out.json
    python benchmarks/report_1m.py --without-table   # also: a run with no span table

Prints the time the end of a run spends writing the span table, the phases
measured in-process (load, analyze, render) and the end-to-end times; exits 1
when the median end-to-end time is over the budget. ``--without-table`` also
times the first report of a run that has no span table (runs recorded before
the table existed): it reads events.jsonl and writes the table.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mltrace.analysis.bottleneck import analyze
from mltrace.analysis.peaks import cpu_peaks, peaks_for_run
from mltrace.run.events import Span, Track
from mltrace.run.levels import Level
from mltrace.run.metadata import base_metadata
from mltrace.run.store import EVENTS_FILE, TABLE_FILE, EventWriter, Run, load_run, write_meta, write_table
from mltrace.settings import CACHE_DIR
from mltrace.viewers.terminal import render_report

BUDGET_S = 3.0
_FILE = "/usr/lib/python3/site-packages/torch/nn/modules/"

# (layer type, params, op chain, FLOP/elem or 0, library call or "")
_LEAVES = [
    (
        "Conv2d",
        36_928,
        ["aten::conv2d", "aten::convolution", "aten::_convolution", "aten::mkldnn_convolution"],
        2 * 576,
        "oneDNN convolution jit:avx512_core",
    ),
    ("BatchNorm2d", 128, ["aten::batch_norm", "aten::_batch_norm_impl_index", "aten::native_batch_norm"], 0, ""),
    ("ReLU", 0, ["aten::relu", "aten::clamp_min"], 0, ""),
    ("Linear", 262_656, ["aten::linear", "aten::addmm"], 2 * 512, "MKL SGEMM"),
    ("LayerNorm", 1024, ["aten::layer_norm", "aten::native_layer_norm"], 0, ""),
]


def _layer_attrs(path: str, ltype: str, params: int) -> dict[str, Any]:
    shape = [8, 64, 32, 32]
    return {
        "ml.framework": "pytorch",
        "ml.layer.type": ltype,
        "ml.layer.params": params,
        "code.file.path": _FILE + ltype.lower() + ".py",
        "code.line.number": 100 + len(ltype),
        "code.function.name": f"{ltype}.forward",
        "ml.layer.path": path,
        "ml.input.shapes": [shape],
        "ml.input.dtypes": ["float32"],
        "ml.output.shapes": [shape],
        "ml.output.dtypes": ["float32"],
    }


def _op_attrs(name: str, ext: int, flops: int) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "ml.framework": "pytorch",
        "ml.op.name": name,
        "ml.input.shapes": [[8, 64, 32, 32], [64, 64, 3, 3], [], [], []],
        "ml.input.dtypes": ["float", "float", "ScalarList", "ScalarList", "Scalar"],
        "kineto.external_id": ext,
    }
    if flops:
        attrs["ml.flops"] = flops
    return attrs


def build_run(run_dir: Path, spans: int) -> tuple[int, float]:
    """Writes a run directory of about ``spans`` spans, as a finished run leaves it.

    Returns the exact span count and the seconds spent writing the span table.
    """
    run_dir.mkdir(parents=True, exist_ok=False)
    meta = base_metadata(["python", "infer.py"], "synthetic-1m")
    meta["complete"] = True
    write_meta(run_dir, meta)
    writer = EventWriter(run_dir / EVENTS_FILE)
    track = Track(1, "thread", "MainThread", os.getpid(), os.getpid())
    writer.write(tracks=[track])
    every: list[Span] = []
    batch: list[Span] = []
    next_id = 0
    t = 0
    written = 0

    def new_id() -> int:
        nonlocal next_id
        next_id += 1
        return next_id

    while written < spans:
        model_id, model_start = new_id(), t
        t += 2_000
        for block in range(4):
            block_id, block_start = new_id(), t
            path = f"layers.{block}"
            t += 500
            for j, (ltype, params, chain, flop_per, lib) in enumerate(_LEAVES):
                leaf_id, leaf_start = new_id(), t
                t += 3_000
                parent = leaf_id
                opened: list[tuple[int, int, int, str]] = []
                for depth, op in enumerate(chain):
                    oid = new_id()
                    opened.append((oid, parent, t, op))
                    parent = oid
                    t += 400 + 100 * depth
                # The small ops every real op calls inside (allocation, views).
                for small in ("aten::empty", "aten::as_strided", "aten::view", "aten::resize_"):
                    batch.append(Span(new_id(), parent, Level.OP, small, t, t + 800, 1, _op_attrs(small, next_id, 0)))
                    t += 1_000
                if lib:
                    batch.append(Span(new_id(), parent, Level.LIBRARY, lib, t, t + 20_000, 1, {"ml.library.name": lib.split()[0]}))
                    t += 20_500
                else:
                    t += 4_000
                for depth, (oid, pid, start, op) in enumerate(reversed(opened)):
                    flops = 8 * 64 * 32 * 32 * flop_per if depth == len(opened) - 1 and flop_per else 0
                    batch.append(Span(oid, pid, Level.OP, op, start, t, 1, _op_attrs(op, oid, flops)))
                    t += 300
                t += 2_000
                batch.append(
                    Span(leaf_id, block_id, Level.LAYER, f"{path}.{j}", leaf_start, t, 1, _layer_attrs(f"{path}.{j}", ltype, params))
                )
                t += 1_000
            batch.append(Span(block_id, model_id, Level.LAYER, path, block_start, t, 1, _layer_attrs(path, "Block", 0)))
            t += 500
        batch.append(Span(model_id, None, Level.MODEL, "ResNetish", model_start, t, 1, _layer_attrs("", "ResNetish", 0)))
        t += 50_000
        written = next_id
        if len(batch) >= 20_000:
            writer.write(spans=batch)
            every += batch
            batch = []
    writer.write(spans=batch)
    every += batch
    writer.close()
    t0 = time.perf_counter()
    write_table(run_dir, Run(run_dir, meta, tracks={track.id: track}, spans=every))
    return next_id, time.perf_counter() - t0


def in_process_phases(run_dir: Path) -> dict[str, float]:
    """Seconds for each phase of the report, in this process, with the command's GC setting."""
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        run = load_run(run_dir)
        t1 = time.perf_counter()
        peaks = peaks_for_run(run.meta, False)
        analysis = analyze(run, peaks)
        t2 = time.perf_counter()
        render_report(run, analysis, top=15, file=io.StringIO())
        t3 = time.perf_counter()
    finally:
        gc.enable()
    return {"load_s": t1 - t0, "analyze_s": t2 - t1, "render_s": t3 - t2}


def end_to_end(run_dir: Path, env: dict[str, str]) -> float:
    """Wall seconds of ``python -m mltrace report RUN`` in a fresh process."""
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "mltrace", "report", str(run_dir)], env=env, capture_output=True, timeout=600)
    elapsed = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"mltrace report failed ({res.returncode}): {res.stderr.decode()[-2000:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", metavar="DIR", help="build the run here and keep it (must not exist)")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--without-table", action="store_true", help="also time a report of the run without its span table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mltrace-report-1m-") as tmp:
        run_dir = Path(args.keep) if args.keep else Path(tmp) / "run"
        t0 = time.perf_counter()
        gc.disable()  # as at the end of a run: millions of objects, no cycles
        try:
            count, table_s = build_run(run_dir, args.spans)
        finally:
            gc.enable()
        size = (run_dir / EVENTS_FILE).stat().st_size
        table_size = (run_dir / TABLE_FILE).stat().st_size
        print(f"built {count:,} spans ({size / 1e6:.0f} MB of events) in {time.perf_counter() - t0:.1f} s: {run_dir}")
        print(f"span table: written in {table_s:.1f} s ({table_size / 1e6:.0f} MB)")
        env = dict(os.environ, **{CACHE_DIR.name: str(Path(tmp) / "cache")})
        os.environ[CACHE_DIR.name] = env[CACHE_DIR.name]
        cpu_peaks()  # measured once, as on any machine after its first report
        phases = in_process_phases(run_dir)
        print("in-process: " + ", ".join(f"{k[:-2]} {v:.2f} s" for k, v in phases.items()))
        times = [end_to_end(run_dir, env) for _ in range(args.repeats)]
        median = statistics.median(times)
        without: float | None = None
        if args.without_table:
            (run_dir / TABLE_FILE).unlink()
            without = end_to_end(run_dir, env)
            print(f"first report of the run without its span table (reads events.jsonl, writes the table): {without:.2f} s")
        verdict = "within" if median <= BUDGET_S else "OVER"
        each = ", ".join(f"{x:.2f}" for x in times)
        print(f"mltrace report, end to end: median {median:.2f} s of {each} — {verdict} the {BUDGET_S:.0f} s budget")
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "spans": count,
                        "events_bytes": size,
                        "table_bytes": table_size,
                        "table_write_s": table_s,
                        **phases,
                        "end_to_end_s": times,
                        "median_s": median,
                        "without_table_s": without,
                        "budget_s": BUDGET_S,
                    },
                    indent=2,
                )
                + "\n"
            )
    return 0 if median <= BUDGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
