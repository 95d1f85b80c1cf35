"""Self-attention through F.scaled_dot_product_attention (CPU flash attention: parallel SGEMMs)."""

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


torch.manual_seed(0)
model = nn.Sequential(Attention(), Attention()).eval()
with torch.inference_mode():
    for _ in range(3):
        y = model(torch.randn(1, 128, 256))
print("attention", tuple(y.shape))
