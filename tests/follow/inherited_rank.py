"""A process that torchrun's environment names a rank (RANK, WORLD_SIZE, LOCAL_RANK, set by
the test) starts children that inherit that environment: a forked and a spawned
multiprocessing child, a DataLoader worker and a Python subprocess, each running torch.
Prints the DataLoader's sum (6) and exits 0."""

import multiprocessing as mp
import subprocess
import sys

import torch
from torch.utils.data import DataLoader


def infer():
    with torch.no_grad():
        torch.nn.Linear(2, 2)(torch.ones(1, 2))


if __name__ == "__main__":
    for method in ("fork", "spawn"):
        child = mp.get_context(method).Process(target=infer)
        child.start()
        child.join()
    print(sum(int(batch.sum()) for batch in DataLoader(list(range(4)), batch_size=2, num_workers=1)))
    subprocess.run([sys.executable, "-c", "import torch; torch.nn.Linear(2, 2)(torch.ones(1, 2))"], check=True)
    infer()
