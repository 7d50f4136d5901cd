import torch
import torch.nn.functional as F
from torch import nn

DESCRIPTION = "SwiGLU gate silu(a) * b over two (1024, 1024) fp32 tensors"

ROWS, COLS = 1024, 1024


class Model(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.silu(a) * b


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(ROWS, COLS), torch.randn(ROWS, COLS)]


def get_init_inputs() -> list:
    return []
