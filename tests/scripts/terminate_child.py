"""Forks a multiprocessing worker that waits, terminates it (SIGTERM) and prints its exit code."""

import multiprocessing as mp
import time


def wait() -> None:
    time.sleep(60)


if __name__ == "__main__":
    ctx = mp.get_context("fork")
    for _ in range(2):
        worker = ctx.Process(target=wait)
        worker.start()
        time.sleep(0.5)
        worker.terminate()
        worker.join()
        print("worker exit code", worker.exitcode, flush=True)
