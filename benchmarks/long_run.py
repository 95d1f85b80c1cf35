"""A long run traced at the default level: wall time, the time from the program's end to its
exit, and peak memory, under the defaults and the alternatives they replaced.

Runs, in a child process, a 2-layer LSTM word model (10,000 tokens, 200 units, as
pytorch/examples' word_language_model) sampling ``--steps`` words one at a time, or with
``--tiny N`` N calls of a tiny MLP (the issue's 200,000-call case): plain, then under
``mltrace python`` in each of ``--conditions``: ``default`` (torch.profiler in cycles of
0.1 s, each converted by the converter process, and the run finished a part at a time while
it runs, ``finish_stream.py``), ``unstreamed`` (``MLTRACE_FINISH_STREAM=0``: all of it
finished at the end), ``cycles2`` (2 s cycles, unstreamed: the defaults before),
``thread`` (cycles converted on a thread of the traced process) and ``whole``
(``MLTRACE_OP_CYCLE_S=0``: torch.profiler held whole). For each it prints the child's wall
time, the loop's own time and CPU time (of the traced process: on a loaded machine the CPU
times compare better than the wall times), the CPU time of the child and its children
(``wait4``: the helper processes' too), the child's peak resident memory and, traced, the
spans, the time from the loop's end to the child's exit, and the converter's and finisher's
peak resident memory. With ``--finish``, it runs the end of an unstreamed run
(``finalize_run``) again on a copy of its run directory and prints each of its phases' time.

    python benchmarks/long_run.py                         # 1000 steps, every condition
    python benchmarks/long_run.py --conditions default,unstreamed --rounds 3
    python benchmarks/long_run.py --tiny 200000 --conditions default
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import sys, time
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(1)

    class WordModel(nn.Module):
        def __init__(self, ntoken=10000, ninp=200, nhid=200, nlayers=2):
            super().__init__()
            self.encoder = nn.Embedding(ntoken, ninp)
            self.rnn = nn.LSTM(ninp, nhid, nlayers)
            self.decoder = nn.Linear(nhid, ntoken)
            self.drop = nn.Dropout(0.2)

        def forward(self, x, h):
            out, h = self.rnn(self.drop(self.encoder(x)), h)
            return self.decoder(self.drop(out)), h

    model = WordModel().eval()
    h = (torch.zeros(2, 1, 200), torch.zeros(2, 1, 200))
    x = torch.randint(10000, (1, 1))
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for _ in range({steps}):
            out, h = model(x, h)
            x.fill_(torch.multinomial(out.squeeze().exp(), 1)[0])
    print("RESULT", time.perf_counter() - t0, time.time(), time.process_time() - c0, flush=True)
    """
)


TINY = textwrap.dedent(
    """
    import sys, time
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    x = torch.randn(1, 8)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for _ in range({steps}):
            model(x)
    print("RESULT", time.perf_counter() - t0, time.time(), time.process_time() - c0, flush=True)
    """
)


def run_child(args: list[str], env: dict[str, str]) -> dict[str, float]:
    """Runs one child; returns its wall (s), loop (s), the CPU time of its process in the loop
    (s: every thread of it, not the converter process), the time after the loop (s), the CPU
    time of it and the children it waited for (s: the converter process's included) and its
    peak RSS (MB)."""
    t0 = time.time()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    loop = loop_end = loop_cpu = 0.0
    for line in proc.stdout:
        if line.startswith(b"RESULT"):
            _, a, b, c = line.split()
            loop, loop_end, loop_cpu = float(a), float(b), float(c)
    _, _, usage = os.wait4(proc.pid, 0)
    end = time.time()
    return {
        "wall_s": end - t0,
        "loop_s": loop,
        "loop_cpu_s": loop_cpu,
        "after_loop_s": end - loop_end,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,
    }


def finish_phases(run_dir: Path) -> list[tuple[str, float]]:
    """Runs ``finalize_run`` on a copy of ``run_dir``; returns (phase, seconds) in order."""
    from mltrace.finish import finalize_run

    copy = run_dir.with_name(run_dir.name + "-finish")
    shutil.copytree(run_dir, copy)
    meta = json.loads((copy / "run.json").read_text())
    marks: list[tuple[str, float]] = []
    finalize_run(copy, meta, lambda step: marks.append((step, time.perf_counter())))
    marks.append(("end", time.perf_counter()))
    return [(marks[i][0], marks[i + 1][1] - marks[i][1]) for i in range(len(marks) - 1)]


KNOWN = {
    "default": ("traced, the defaults (0.1 s cycles, streamed finish)", {}),
    "unstreamed": ("traced, MLTRACE_FINISH_STREAM=0", {"MLTRACE_FINISH_STREAM": "0"}),
    "cycles2": ("traced, 2 s cycles, MLTRACE_FINISH_STREAM=0", {"MLTRACE_OP_CYCLE_S": "2", "MLTRACE_FINISH_STREAM": "0"}),
    "cycles025": ("traced, 0.25 s cycles, streamed finish", {"MLTRACE_OP_CYCLE_S": "0.25"}),
    "thread": ("traced, converter thread", {"MLTRACE_OP_CONVERTER": "0"}),
    "whole": ("traced, MLTRACE_OP_CYCLE_S=0", {"MLTRACE_OP_CYCLE_S": "0"}),
}


def traced_row(script: Path, out: Path, env: dict[str, str]) -> dict[str, float]:
    """One traced child's figures (``run_child``) and its run's spans, cycles and helper processes' peaks."""
    row = run_child([sys.executable, "-m", "mltrace", "python", "-q", "-o", str(out), str(script)], env)
    meta = json.loads((out / "run.json").read_text())
    row["spans"] = meta["summary"]["spans"]
    row["cycles"] = meta.get("torch_profiler", {}).get("cycles", 0)
    converter = meta.get("torch_profiler", {}).get("converter_process")
    if converter:
        row["converter_peak_rss_mb"] = converter["peak_rss_kb"] / 1024
    finish = meta.get("finish") or {}
    if finish:
        row["segments"] = finish.get("streamed_segments", 0)
        row["finisher_peak_rss_mb"] = finish.get("peak_rss_kb", 0) / 1024
    waited = meta.get("torch_profiler", {}).get("waited_for_conversion_s")
    if waited:
        row["waited_for_conversion_s"] = waited
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--tiny", type=int, default=0, metavar="N", help="N calls of a tiny MLP instead of the decode loop")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every condition, interleaved; medians are printed last")
    parser.add_argument("--finish", action="store_true", help="time the finish's phases again on an unstreamed run")
    parser.add_argument(
        "--conditions",
        default="default,unstreamed,cycles2,whole",
        help="comma-separated, of: default (0.1 s cycles, streamed finish), unstreamed (MLTRACE_FINISH_STREAM=0), "
        "cycles2 (2 s cycles, unstreamed: the finish before the streamed one), cycles025 (0.25 s cycles, the default before), "
        "thread (the converter on a thread), whole (MLTRACE_OP_CYCLE_S=0)",
    )
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    names = [name.strip() for name in args.conditions.split(",") if name.strip()]
    rows: dict[str, list[dict[str, float]]] = {"plain": [], **{name: [] for name in names}}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "decode.py"
        script.write_text(TINY.format(steps=args.tiny) if args.tiny else CHILD.format(steps=args.steps))
        base = {k: v for k, v in os.environ.items() if not k.startswith("MLTRACE_")}
        for round_no in range(args.rounds):
            rows["plain"].append(run_child([sys.executable, str(script)], base))
            print(f"plain: {json.dumps({k: round(v, 2) for k, v in rows['plain'][-1].items()})}", flush=True)
            for name in names:
                label, extra = KNOWN[name]
                out = Path(tmp) / f"{name}-{round_no}"
                rows[name].append(traced_row(script, out, {**base, **extra}))
                print(f"{label}: {json.dumps({k: round(v, 2) for k, v in rows[name][-1].items()})}", flush=True)
                if args.finish and name != "default" and extra.get("MLTRACE_OP_CONVERTER") != "0":
                    phases = ", ".join(f"{step}: {seconds:.2f} s" for step, seconds in finish_phases(out))
                    print(f"  the finish again on it: {phases}")
                shutil.rmtree(out, ignore_errors=True)
    if args.rounds > 1:
        print(f"medians of {args.rounds} rounds:")
        for name, got in rows.items():
            keys = got[0].keys()
            print(f"  {name}: {json.dumps({k: round(statistics.median(r.get(k, 0) for r in got), 2) for k in keys})}")


if __name__ == "__main__":
    main()
