"""``mltrace.profile(output=argv[1])`` around 3 inferences of a small torch model, with
``otlp=argv[2]`` where given (else the environment decides). Prints ``ran`` inside the profiled
region and waits there for a line on stdin (so the live export sends while it runs); exits 0."""

import sys

import torch

import mltrace

model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
options = {"otlp": sys.argv[2]} if len(sys.argv) > 2 else {}
with torch.no_grad(), mltrace.profile(output=sys.argv[1], **options):
    for _ in range(3):
        model(torch.ones(2, 8))
    print("ran", flush=True)
    sys.stdin.readline()
