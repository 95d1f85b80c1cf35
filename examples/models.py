"""Example models built from torch.nn layers, random weights, no downloads.

``resnet_small()`` is a ResNet-18-shaped CNN; ``encoder()`` a BERT-base-shaped
Transformer encoder (fewer layers by default so the demo runs in seconds).
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """A ResNet-18-style classifier (stem, four stages of two blocks, head)."""

    def __init__(self, widths: tuple[int, ...] = (64, 128, 256, 512), num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 7, 2, 3, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        stages = []
        cin = widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w)))
            cin = w
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


class TextEncoder(nn.Module):
    """Token embedding + ``nn.TransformerEncoder`` + pooled classifier."""

    def __init__(self, vocab: int = 30522, d_model: int = 768, heads: int = 12, layers: int = 4, ff: int = 3072) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens))
        return self.head(self.norm(h[:, 0]))


def resnet_small() -> ResNet:
    return ResNet().eval()


def encoder(layers: int = 4) -> TextEncoder:
    return TextEncoder(layers=layers).eval()
