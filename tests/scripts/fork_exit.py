"""Forks children that run inferences and leave in the ways a program leaves, for the hard-stop
tests: ``fork_exit.py STATUS`` forks a child that calls the model, prints through C stdio (kept
in C's buffer when stdout is a pipe) and leaves with ``sys.exit(STATUS)``, then a second child
that returns from a function and leaves with ``sys.exit(0)`` from a thread-free state; the
parent prints each child's status. ``fork_exit.py profile`` does the same inside
``mltrace.profile()`` (no ``mltrace python``), and forks once more after the profile ended."""

import ctypes
import os
import sys

import torch

model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())


def child(status: int) -> None:
    for _ in range(3):
        model(torch.randn(1, 4))
    libc = ctypes.CDLL(None)
    libc.printf(b"child %d wrote through C stdio\n", status)
    print(f"child {status} done", flush=True)
    sys.exit(status)


def fork_and_wait(status: int) -> None:
    pid = os.fork()
    if pid == 0:
        child(status)
    _, raw = os.waitpid(pid, 0)
    print(f"parent: child status {os.waitstatus_to_exitcode(raw)}", flush=True)


def main() -> None:
    model(torch.randn(1, 4))
    if sys.argv[1] == "profile":
        import mltrace

        with mltrace.profile(output=sys.argv[2], summary=False):
            model(torch.randn(1, 4))
            fork_and_wait(5)
        fork_and_wait(6)
    else:
        fork_and_wait(int(sys.argv[1]))
        fork_and_wait(0)
    model(torch.randn(1, 4))
    print("parent done", flush=True)


main()
