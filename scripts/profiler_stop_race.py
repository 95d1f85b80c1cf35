"""torch.profiler stopped while other threads run torch ops: how often the process crashes.

Each trial is a child process in which three threads run small torch ops in a loop (no
profiler range, no span: a producer thread) while the main thread starts, stops and exports
a CPU profiler with ``record_shapes`` ``--switches`` times, as mltrace's op-level cycles do.
``all-threads`` profiles every thread (``profile_all_threads``), ``one-thread`` the main
thread alone (what the cycles after the first use while every model call comes from the
main thread, ``tracer/sources/torch_ops.py``). Prints, per mode, the trials that ended with
a signal (SIGSEGV, SIGABRT) or hung past ``--timeout`` out of ``--trials``.

    python scripts/profiler_stop_race.py --trials 4 --switches 3000 --timeout 300
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import os, sys, tempfile, threading
    import torch
    from torch.autograd.profiler import profile
    from torch._C._profiler import _ExperimentalConfig

    torch.set_num_threads(1)
    stop = threading.Event()

    def producer():
        a, b = torch.randn(64, 64), torch.randn(256, 256)
        while not stop.is_set():
            (a @ a).relu_()
            b @ b
            torch.add(a, 1)

    threads = [threading.Thread(target=producer) for _ in range(3)]
    for t in threads:
        t.start()
    config = _ExperimentalConfig(profile_all_threads=True) if sys.argv[1] == "all-threads" else _ExperimentalConfig(trace_only=True)
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    for _ in range(int(sys.argv[2])):
        prof = profile(use_cpu=True, use_kineto=True, record_shapes=True, experimental_config=config)
        prof.__enter__()
        x = torch.randn(32, 32)
        for _ in range(20):
            x = x @ x.T / 32
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(path)
        del prof
    stop.set()
    for t in threads:
        t.join()
    """
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--switches", type=int, default=3000)
    parser.add_argument("--timeout", type=float, default=600, help="seconds a trial may take")
    args = parser.parse_args()
    for mode in ("all-threads", "one-thread"):
        ended: list[str] = []
        for _ in range(args.trials):
            ended.append(_trial(mode, args.switches, args.timeout))
        failed = sum(code != "0" for code in ended)
        print(f"{mode}: {failed} of {args.trials} trials crashed or hung ({', '.join(ended)}), {args.switches} switches a trial")


def _trial(mode: str, switches: int, timeout: float) -> str:
    """One child's end: its exit status, the signal that ended it, or "hung" past ``timeout``."""
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, mode, str(switches)], capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "hung"
    return signal.Signals(-done.returncode).name if done.returncode < 0 else str(done.returncode)


if __name__ == "__main__":
    main()
