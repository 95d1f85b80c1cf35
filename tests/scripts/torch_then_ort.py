"""A PyTorch model called N times (argv[1]: a calibration pass, say), exported to ONNX, then
run N more times by ONNX Runtime: two frameworks' model calls in one program."""

import os
import sys
import tempfile

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

calls = int(sys.argv[1])
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, 10)).eval()
x = torch.randn(1, 3, 16, 16)
with torch.inference_mode():
    for i in range(calls):
        print("torch", i, int(model(x).argmax()))
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "model.onnx")
    torch.onnx.export(model, (x,), path, dynamo=False, input_names=["x"])
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for i in range(calls):
        (logits,) = session.run(None, {"x": x.numpy()})
        print("ort", i, int(np.argmax(logits)))
