import torch
import torch.nn.functional as F
from torch import nn

DESCRIPTION = "LayerNorm over the last dim of (2048, 1024) fp32, random affine weight and bias"

ROWS, HIDDEN = 2048, 1024
EPS = 1e-5


class Model(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.randn(hidden))
        self.bias = nn.Parameter(torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(ROWS, HIDDEN) * 2 + 0.5]


def get_init_inputs() -> list:
    return [HIDDEN, EPS]
