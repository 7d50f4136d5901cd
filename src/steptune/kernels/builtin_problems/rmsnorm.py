import torch
from torch import nn

DESCRIPTION = "RMSNorm (Llama style, with weight) over the last dim of (1024, 1024) fp32"

ROWS, HIDDEN = 1024, 1024
EPS = 1e-6


class Model(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.eps) * self.weight


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(ROWS, HIDDEN)]


def get_init_inputs() -> list:
    return [HIDDEN, EPS]
