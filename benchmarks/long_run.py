"""A long decode loop traced at the default level: wall time and peak memory, the op level in
cycles and whole.

Runs a 2-layer LSTM word model (10,000 tokens, 200 units, as pytorch/examples'
word_language_model) sampling ``--steps`` words one at a time in a child process:
plain; under ``mltrace python`` (every level, the op level streamed in cycles of 2 s,
``MLTRACE_OP_CYCLE_S=2``); and with ``MLTRACE_OP_CYCLE_S=0`` (torch.profiler held whole until
the end, the default). For each
it prints the child's wall time, the loop's own time, the child's peak resident
memory (from ``wait4``) and, traced, the spans and the time from the loop's end to
the child's exit. With ``--finish``, it then runs the end of a run (``finalize_run``)
again on a copy of the cycles' run directory and prints each of its phases' time.

    python benchmarks/long_run.py                 # 1000 steps
    python benchmarks/long_run.py --steps 3000
    python benchmarks/long_run.py --finish        # and the finish's phases
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
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range({steps}):
            out, h = model(x, h)
            x.fill_(torch.multinomial(out.squeeze().exp(), 1)[0])
    print("RESULT", time.perf_counter() - t0, time.time(), flush=True)
    """
)


def run_child(args: list[str], env: dict[str, str]) -> dict[str, float]:
    """Runs one child; returns its wall (s), loop (s), time after the loop (s) and peak RSS (MB)."""
    t0 = time.time()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    loop = loop_end = 0.0
    for line in proc.stdout:
        if line.startswith(b"RESULT"):
            _, a, b = line.split()
            loop, loop_end = float(a), float(b)
    _, _, usage = os.wait4(proc.pid, 0)
    end = time.time()
    return {"wall_s": end - t0, "loop_s": loop, "after_loop_s": end - loop_end, "peak_rss_mb": usage.ru_maxrss / 1024}


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
    parser.add_argument("--finish", action="store_true", help="time the finish's phases again on the cycles' run")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "decode.py"
        script.write_text(CHILD.format(steps=args.steps))
        base = {k: v for k, v in os.environ.items() if not k.startswith("MLTRACE_")}
        plain = run_child([sys.executable, str(script)], base)
        print(f"plain: {json.dumps({k: round(v, 2) for k, v in plain.items()})}")
        conditions = (
            ("traced, op level in cycles", {"MLTRACE_OP_CYCLE_S": "2"}),
            ("traced, MLTRACE_OP_CYCLE_S=0", {"MLTRACE_OP_CYCLE_S": "0"}),
        )
        for label, extra in conditions:
            out = Path(tmp) / label.replace(" ", "_").replace(",", "").replace("=", "")
            cmd = [sys.executable, "-m", "mltrace", "python", "-q", "-o", str(out), str(script)]
            row = run_child(cmd, {**base, **extra})
            meta = json.loads((out / "run.json").read_text())
            row["spans"] = meta["summary"]["spans"]
            row["cycles"] = meta.get("torch_profiler", {}).get("cycles", 0)
            print(f"{label}: {json.dumps({k: round(v, 2) for k, v in row.items()})}")
            if args.finish and not extra:
                phases = ", ".join(f"{step}: {seconds:.2f} s" for step, seconds in finish_phases(out))
                print(f"  the finish again on it: {phases}")


if __name__ == "__main__":
    main()
