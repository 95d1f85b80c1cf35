"""What keeping stdout a terminal costs the default level (the library level's fd tap).

Where fd 1 is a terminal, the fd tap reads it through a pseudo-terminal (so the program still
sees a terminal) and its Python loop; elsewhere through a pipe and its C loop. On a terminal C's
stdout is line-buffered, so the libraries write every verbose line on its own. This runs one
program three ways in interleaved rounds, each under util-linux ``script`` (a terminal):

- plain: ``python prog.py`` on the terminal;
- terminal: ``mltrace python prog.py`` on the terminal (the pseudo-terminal tap);
- file: ``mltrace python prog.py > file`` (stdout no terminal: the pipe tap).

The program times its own loop (``time.perf_counter``) and writes the seconds to a file, so
start-up and mltrace's finish are left out. Prints each way's median and its ratio to plain.

    python benchmarks/terminal_tap.py                 # an 8-conv CNN, 300 inferences
    python benchmarks/terminal_tap.py --work lines    # 200,000 printed lines
"""

from __future__ import annotations

import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
from harness import rotation

PROGRAMS = {
    "cnn": """
import sys, time, torch
from torch import nn
torch.set_num_threads(1)
net = nn.Sequential(*[m for _ in range(8) for m in (nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())]).eval()
x = torch.randn(1, 16, 32, 32)
with torch.no_grad():
    for _ in range(20):
        net(x)
    t0 = time.perf_counter()
    for _ in range(300):
        net(x)
open(sys.argv[1], "w").write(str(time.perf_counter() - t0))
""",
    "lines": """
import sys, time, torch
torch.nn.Linear(4, 4)(torch.randn(1, 4))
t0 = time.perf_counter()
for i in range(200_000):
    print("line %d" % i)
sys.stdout.flush()
open(sys.argv[1], "w").write(str(time.perf_counter() - t0))
""",
}
WAYS = ("plain", "terminal", "file")


def _command(way: str, prog: Path, seconds: Path, home: Path) -> str:
    """The shell command ``script`` runs for ``way``."""
    mltrace = [sys.executable, "-m", "mltrace", "python", "-q", "-o", str(home / f"run-{way}")]
    argv = [sys.executable] if way == "plain" else mltrace
    cmd = shlex.join([*argv, str(prog), str(seconds)])
    return f"{cmd} > {shlex.quote(str(home / 'out.txt'))}" if way == "file" else cmd


def _one(way: str, prog: Path, home: Path) -> float:
    """The program's own loop time (s) in one run of ``way``."""
    seconds = home / "seconds.txt"
    shutil.rmtree(home / f"run-{way}", ignore_errors=True)
    script = ["script", "-q", "-e", "-c", _command(way, prog, seconds, home), "/dev/null"]
    done = subprocess.run(script, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"terminal_tap: {way} run failed ({done.returncode}): {done.stderr.decode()[-300:]}")
    return float(seconds.read_text())


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--work", choices=sorted(PROGRAMS), default="cnn", help="what the program does (default: cnn)")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    harness.add_json(p)
    args = p.parse_args()
    if shutil.which("script") is None:
        print("terminal_tap: needs util-linux's `script` (it gives the runs a terminal)", file=sys.stderr)
        return 2
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        prog = home / "prog.py"
        prog.write_text(PROGRAMS[args.work])
        for i in range(args.rounds):
            for way in rotation(WAYS, i):
                times[way].append(_one(way, prog, home))
            print(f"round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
    plain = statistics.median(times["plain"])
    print(f"{args.work}: the program's loop, median of {args.rounds} runs each; load {harness.loadavg()}")
    for way in WAYS:
        med = statistics.median(times[way])
        print(f"  {way:9s} {med:7.3f} s  ({min(times[way]):.3f}-{max(times[way]):.3f})  {med / plain:5.2f}x plain")
    harness.write_json(args.json, {"work": args.work, "seconds": times})
    return 0


if __name__ == "__main__":
    sys.exit(main())
