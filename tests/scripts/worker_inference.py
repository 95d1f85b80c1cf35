"""The example CNN, called N times (argv[1]) on one worker thread only, as a server's request
handler would; the main thread prints each result."""

import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

import torch  # noqa: E402
from models import resnet_small  # noqa: E402

torch.manual_seed(0)
cnn = resnet_small().eval()
x = torch.randn(1, 3, 64, 64)
results: list[int] = []


def serve() -> None:
    with torch.inference_mode():
        for _ in range(int(sys.argv[1])):
            results.append(int(cnn(x).argmax()))


worker = threading.Thread(target=serve, name="inference-worker")
worker.start()
worker.join()
for i, r in enumerate(results):
    print("call", i, r)
