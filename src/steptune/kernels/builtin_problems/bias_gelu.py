import torch
import torch.nn.functional as F
from torch import nn

DESCRIPTION = "Bias add then GELU (tanh) over (1024, 1024) fp32, bias a (1024,) parameter"

ROWS, FEATURES = 1024, 1024


class Model(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x + self.bias, approximate="tanh")


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(ROWS, FEATURES)]


def get_init_inputs() -> list:
    return [FEATURES]
