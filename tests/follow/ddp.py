"""One inference per rank and an all_reduce of the results over gloo (run under torchrun)."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)).eval()
with torch.no_grad():
    total = model(torch.ones(1, 4) * (rank + 1)).sum().reshape(1)
    dist.all_reduce(total)
print(f"rank {rank}: {total.item():.5f}", flush=True)
dist.destroy_process_group()
