"""How much later a followed child's own code starts: the time from ``Popen`` to the child's first
statement, for a Python child started with and without mltrace's follow bootstrap
(``mltrace/follow/``: ``PYTHONPATH`` + ``MLTRACE_FOLLOW``, as ``mltrace python`` sets them), in
interleaved rounds, medians reported. The child's session starts during that time (imports,
run directory, sources' import hooks); its end, at the child's exit, is not counted.

With ``--fork``, a forked child (a fork-per-request service, a fork pool's worker): a program
that built a small torch MLP and called it once forks ``--forks`` children in turn, each making
one model call and leaving by ``os._exit``; per fork, the milliseconds from just before
``os.fork()`` to the child's first statement (its session has started), to the end of its model
call, and to its exit as the program's ``waitpid`` sees it (its session's end included). The
program runs plain, under ``mltrace python`` (at ``--level``) and under ``mltrace python
--no-follow``, in interleaved rounds; medians over every fork of every round.

    python benchmarks/child_start.py               # 20 rounds
    python benchmarks/child_start.py --rounds 40 --level op
    python benchmarks/child_start.py --fork --rounds 5 --forks 20
    python benchmarks/child_start.py --fork --level layer
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mltrace.follow import BOOTSTRAP_DIR, PROCS_DIR
from mltrace.settings import FOLLOW

CHILD = "import time, sys; sys.stdout.write(str(time.monotonic_ns()))"


def start_delay_ns(env: dict[str, str]) -> int:
    """Nanoseconds from just before ``Popen`` to the child's first statement."""
    t0 = time.monotonic_ns()
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, check=True, text=True).stdout
    return int(out) - t0


def forking_program(forks: int) -> None:
    """The ``--fork`` program: builds and calls a small MLP, then forks ``forks`` children, one
    at a time; prints a JSON list of each fork's (start, call end, exit) milliseconds."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).eval()
    with torch.no_grad():
        model(torch.ones(1, 8))
    rows = []
    for _ in range(forks):
        read_end, write_end = os.pipe()
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            started = time.perf_counter()
            with torch.no_grad():
                model(torch.ones(1, 8))
            called = time.perf_counter()
            os.write(write_end, json.dumps([started - t0, called - t0]).encode())
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end) as answer:
            started_s, called_s = json.loads(answer.read())
        os.waitpid(pid, 0)
        rows.append([started_s * 1e3, called_s * 1e3, (time.perf_counter() - t0) * 1e3])
        time.sleep(0.02)  # the next fork does not race this child's reaping
    print(json.dumps(rows))


def fork_rounds(rounds: int, forks: int, level: str | None) -> None:
    """``--fork``: the forking program plain, traced and ``--no-follow``, ``rounds`` interleaved rounds."""
    program = [__file__, "--fork-program", str(forks)]
    level_args = ["--level", level] if level else []
    conditions = {
        "plain": lambda run: [sys.executable, *program],
        f"mltrace python{' --level ' + level if level else ''}": lambda run: [
            sys.executable,
            "-m",
            "mltrace",
            "python",
            "-q",
            "-o",
            run,
            *level_args,
            *program,
        ],
        "--no-follow": lambda run: [sys.executable, "-m", "mltrace", "python", "-q", "--no-follow", "-o", run, *level_args, *program],
    }
    rows: dict[str, list[list[float]]] = {name: [] for name in conditions}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for j, (name, command) in enumerate(conditions.items()):
                out = subprocess.run(command(str(Path(tmp) / f"run{i}-{j}")), capture_output=True, check=True, text=True)
                rows[name].extend(json.loads(out.stdout.splitlines()[-1]))
    print(f"forked child, median of {rounds} rounds x {forks} forks (ms from before os.fork()):")
    print(f"{'condition':<28} {'start':>7} {'called':>7} {'exited':>7}")
    for name, values in rows.items():
        start, called, exited = (statistics.median(v[k] for v in values) for k in range(3))
        print(f"{name:<28} {start:7.1f} {called:7.1f} {exited:7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--level", default=None, help="the level the child records (default: all)")
    ap.add_argument("--fork", action="store_true", help="forked children of a traced program, not started ones")
    ap.add_argument("--forks", type=int, default=20, help="with --fork: forks a round")
    ap.add_argument("--fork-program", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fork_program is not None:
        forking_program(args.fork_program)
        return
    if args.fork:
        fork_rounds(args.rounds, args.forks, args.level)
        return
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / PROCS_DIR).mkdir()
        plain = dict(os.environ)
        spec = {"run": tmp, "name": "bench", "level": args.level, "traceparent": None, "parent_pid": os.getpid()}
        followed = {
            **plain,
            FOLLOW.name: json.dumps(spec),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(BOOTSTRAP_DIR), plain.get("PYTHONPATH")])),
        }
        bare: list[int] = []
        traced: list[int] = []
        start_delay_ns(plain), start_delay_ns(followed)  # warm the page cache and .pyc files
        for _ in range(args.rounds):
            bare.append(start_delay_ns(plain))
            traced.append(start_delay_ns(followed))
    b, t = statistics.median(bare) / 1e6, statistics.median(traced) / 1e6
    print(f"child start, median of {args.rounds}: plain {b:.1f} ms, followed {t:.1f} ms, delay {t - b:+.1f} ms")


if __name__ == "__main__":
    main()
