"""Starts a worker that calls a small torch model, then dies by SIGKILL before its trace is
finished; prints the worker's exit code. The worker is a multiprocessing child forked from the
script (no argument) or, with the argument ``exec``, this script run by ``subprocess`` with the
argument ``worker``."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import torch


def work() -> None:
    model = torch.nn.Linear(4, 4)
    for _ in range(20):
        model(torch.randn(1, 4))
        time.sleep(0.05)  # past two flushes: the worker's run directory has streamed events
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    if sys.argv[1:] == ["worker"]:
        work()
    elif sys.argv[1:] == ["exec"]:
        print("worker exit code", subprocess.run([sys.executable, __file__, "worker"]).returncode, flush=True)
    else:
        worker = mp.get_context("fork").Process(target=work)
        worker.start()
        worker.join()
        print("worker exit code", worker.exitcode, flush=True)
