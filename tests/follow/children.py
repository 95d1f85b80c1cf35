"""A program whose children run inferences: one each by fork, spawn and forkserver, one by
``subprocess`` running Python, one DataLoader with 2 workers, and a spawn pool of 2 (each
worker runs one inference in its initializer). Prints each result; exits with status 3."""

import multiprocessing as mp
import subprocess
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset


def infer(tag):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)).eval()
    with torch.no_grad():
        value = float(model(torch.ones(1, 4)).sum())
    print(f"{tag} {value:.5f}", flush=True)


def main():
    infer("main")
    for method in ("fork", "spawn", "forkserver"):
        child = mp.get_context(method).Process(target=infer, args=(method,))
        child.start()
        child.join()
    subprocess.run([sys.executable, "-c", "import children; children.infer('subprocess')"], check=True, cwd=sys.path[0])
    data = DataLoader(TensorDataset(torch.ones(4, 4)), batch_size=1, num_workers=2)
    print("batches", sum(1 for _ in data), flush=True)
    pool = mp.get_context("spawn").Pool(2, initializer=infer, initargs=("pool",))
    pool.close()
    pool.join()
    return 3


if __name__ == "__main__":
    sys.exit(main())
