"""The example CNN, called N times (argv[1]) with a print after each call, deterministic output."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

import torch  # noqa: E402
from models import resnet_small  # noqa: E402

torch.manual_seed(0)
cnn = resnet_small().eval()
x = torch.randn(1, 3, 64, 64)
with torch.inference_mode():
    for i in range(int(sys.argv[1])):
        print("call", i, int(cnn(x).argmax()))
