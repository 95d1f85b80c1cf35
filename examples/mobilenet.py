"""A MobileNetV2-style CNN built from torch.nn layers, and a benchmarkable inference script.

The model: a strided 3x3 stem, inverted-residual blocks (1x1 expansion,
depthwise 3x3 convolution with ``groups = channels``, linear 1x1 projection,
residual connection when shapes allow), a 1x1 head, global pooling and a
linear classifier. Random weights, no downloads.

As a script it follows mltrace's benchmark protocol (``mltrace.bench.scenario()``),
so ``mltrace bench`` can sweep it::

    python examples/mobilenet.py --iters 5
    mltrace python --level layer examples/mobilenet.py
    mltrace bench --batch 1,4 --precision fp32,bf16,int8 --threads 1,2 examples/mobilenet.py
    mltrace bench --leveled -n 20 examples/mobilenet.py

Precision: fp16/bf16 cast the model and input; int8 applies PyTorch's dynamic
quantization, which covers the Linear classifier only (convolutions stay fp32).
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
from torch import nn

#: (expansion t, output channels c, repeats n, first stride s) per stage, as in MobileNetV2.
SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


def _make_divisible(v: float, divisor: int = 8) -> int:
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


class ConvBNAct(nn.Sequential):
    """Convolution, batch norm and ReLU6 (no activation when ``act`` is False)."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1, act: bool = True) -> None:
        layers: list[nn.Module] = [
            nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
        ]
        if act:
            layers.append(nn.ReLU6(inplace=True))
        super().__init__(*layers)


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise (3x3, one group per channel), project (1x1, linear)."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.use_residual = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(ConvBNAct(cin, hidden, kernel=1))
        layers.append(ConvBNAct(hidden, hidden, kernel=3, stride=stride, groups=hidden))
        layers.append(ConvBNAct(hidden, cout, kernel=1, act=False))
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        return x + out if self.use_residual else out


class MobileNetV2(nn.Module):
    """A MobileNetV2-style classifier (width multiplier ``width``)."""

    def __init__(self, num_classes: int = 1000, width: float = 1.0) -> None:
        super().__init__()
        cin = _make_divisible(32 * width)
        last = _make_divisible(1280 * max(1.0, width))
        blocks: list[nn.Module] = [ConvBNAct(3, cin, stride=2)]
        for t, c, n, s in SETTINGS:
            cout = _make_divisible(c * width)
            for i in range(n):
                blocks.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        blocks.append(ConvBNAct(cin, last, kernel=1))
        self.features = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v2(num_classes: int = 1000, width: float = 1.0) -> MobileNetV2:
    """A MobileNetV2-style model in eval mode, random weights."""
    return MobileNetV2(num_classes, width).eval()


def main() -> int:
    from mltrace.bench import scenario

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=5, help="model calls (MLTRACE_ITERS overrides)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--width", type=float, default=1.0, help="width multiplier")
    args = parser.parse_args()
    sc = scenario()
    sc.apply_threads()
    torch.manual_seed(0)
    model: nn.Module = mobilenet_v2(width=args.width)
    dtype = sc.torch_dtype()
    if sc.precision == "int8":
        with warnings.catch_warnings():  # torch.ao.quantization is deprecated in favour of torchao, not installed here
            warnings.simplefilter("ignore")
            model = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    else:
        model = model.to(dtype)
    images = torch.randn(sc.batch, 3, args.image_size, args.image_size).to(dtype)
    with torch.inference_mode():
        for _ in range(sc.iters_or(args.iters)):
            logits = model(images)
    print(f"mobilenet_v2 batch {sc.batch} {sc.precision}: logits {tuple(logits.shape)}, top class {int(logits.float().argmax(1)[0])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
