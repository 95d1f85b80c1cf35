"""Real torch.nn models with deterministic output, for end-to-end tests."""

import sys

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x))) + x


class Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU())
        self.blocks = nn.Sequential(Block(8), Block(8))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def main() -> None:
    torch.manual_seed(0)
    cnn = Cnn().eval()
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 3, 16, 16)
    tokens = torch.randn(2, 5, 32)
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    for _ in range(iters):
        y = cnn(x)
        z = enc(tokens)  # grad enabled: the encoder runs its submodules (no fast path)
    print("cnn", round(float(y.detach().sum()), 3), tuple(y.shape))
    print("enc", round(float(z.detach().abs().sum()), 1), tuple(z.shape))


if __name__ == "__main__":
    main()
