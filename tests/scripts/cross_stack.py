"""The example CNN and transformer at small sizes, with deterministic output."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

import torch  # noqa: E402
from models import encoder, resnet_small  # noqa: E402

torch.manual_seed(0)
cnn = resnet_small()
enc = encoder(layers=2)
with torch.inference_mode():
    y = cnn(torch.randn(1, 3, 64, 64))
    z = enc(torch.randint(0, 30522, (1, 16)))
print("cnn", tuple(y.shape), int(y.argmax()))
print("enc", tuple(z.shape))
