import torch
import torch.nn.functional as F
from torch import nn

DESCRIPTION = "GELU, tanh approximation, over a (1024, 1024) fp32 tensor"

ROWS, COLS = 1024, 1024


class Model(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(ROWS, COLS)]


def get_init_inputs() -> list:
    return []
