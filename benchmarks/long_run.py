"""A long run traced at the default level: wall time, the time from the program's end to its
exit, and peak memory, under the defaults and the alternatives they replaced.

Runs, in a child process, a 2-layer LSTM word model (10,000 tokens, 200 units, as
pytorch/examples' word_language_model) sampling ``--steps`` words one at a time, or with
``--tiny N`` N calls of a tiny MLP (the issue's 200,000-call case): plain, then under
``mltrace python`` in each of ``--conditions``: ``default`` (torch.profiler in cycles of
0.5 s, each converted by the converter process, and the run finished a part at a time while
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
    python benchmarks/long_run.py --conditions default,unstreamed
    python benchmarks/long_run.py --tiny 200000 --conditions default
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--tiny", type=int, default=0, metavar="N", help="N calls of a tiny MLP instead of the decode loop")
    parser.add_argument("--finish", action="store_true", help="time the finish's phases again on the cycles' run")
    parser.add_argument(
        "--conditions",
        default="default,unstreamed,cycles2,whole",
        help="comma-separated, of: default (0.5 s cycles, streamed finish), unstreamed (MLTRACE_FINISH_STREAM=0), "
        "cycles2 (2 s cycles, unstreamed: the finish before the streamed one), thread (the converter on a thread), "
        "whole (MLTRACE_OP_CYCLE_S=0)",
    )
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "decode.py"
        script.write_text(TINY.format(steps=args.tiny) if args.tiny else CHILD.format(steps=args.steps))
        base = {k: v for k, v in os.environ.items() if not k.startswith("MLTRACE_")}
        plain = run_child([sys.executable, str(script)], base)
        print(f"plain: {json.dumps({k: round(v, 2) for k, v in plain.items()})}")
        known = {
            "default": ("traced, the defaults (0.5 s cycles, streamed finish)", {}),
            "unstreamed": ("traced, MLTRACE_FINISH_STREAM=0", {"MLTRACE_FINISH_STREAM": "0"}),
            "cycles2": ("traced, 2 s cycles, MLTRACE_FINISH_STREAM=0", {"MLTRACE_OP_CYCLE_S": "2", "MLTRACE_FINISH_STREAM": "0"}),
            "thread": ("traced, converter thread", {"MLTRACE_OP_CONVERTER": "0"}),
            "whole": ("traced, MLTRACE_OP_CYCLE_S=0", {"MLTRACE_OP_CYCLE_S": "0"}),
        }
        conditions = [known[name.strip()] for name in args.conditions.split(",") if name.strip()]
        for label, extra in conditions:
            out = Path(tmp) / label.replace(" ", "_").replace(",", "").replace("=", "")
            cmd = [sys.executable, "-m", "mltrace", "python", "-q", "-o", str(out), str(script)]
            row = run_child(cmd, {**base, **extra})
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
            print(f"{label}: {json.dumps({k: round(v, 2) for k, v in row.items()})}")
            if args.finish and not finish and extra.get("MLTRACE_OP_CONVERTER") != "0":
                phases = ", ".join(f"{step}: {seconds:.2f} s" for step, seconds in finish_phases(out))
                print(f"  the finish again on it: {phases}")


if __name__ == "__main__":
    main()
