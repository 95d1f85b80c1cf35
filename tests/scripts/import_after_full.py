"""Three user spans, a pause for the flusher, then torch imported and a module called."""

import time

import mltrace

for i in range(3):
    with mltrace.span(f"s{i}"):
        pass
time.sleep(1.0)

import torch  # noqa: E402

print(tuple(torch.nn.Linear(2, 3)(torch.ones(1, 2)).shape))
