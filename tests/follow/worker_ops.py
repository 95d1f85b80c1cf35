"""A DataLoader whose 2 workers run torch ops on each item (started by the multiprocessing
context named by argv[1], default fork), a forked child that runs the same ops, and one model
call in the program's process. Exits 0."""

import multiprocessing as mp
import sys

import torch
from torch.utils.data import DataLoader, Dataset


class Items(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.ones(4) * i


def ops():
    (torch.ones(4) * 2).sum()


def main():
    model = torch.nn.Linear(4, 4).eval()
    with torch.no_grad():
        context = sys.argv[1] if len(sys.argv) > 1 else "fork"
        for x in DataLoader(Items(), batch_size=2, num_workers=2, multiprocessing_context=context):
            model(x)
    child = mp.get_context("fork").Process(target=ops)
    child.start()
    child.join()
    return child.exitcode


if __name__ == "__main__":
    sys.exit(main())
