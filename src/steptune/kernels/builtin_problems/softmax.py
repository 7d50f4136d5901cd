import torch
from torch import nn

DESCRIPTION = "Softmax over the rows of a (1024, 1024) fp32 tensor"

ROWS, COLS = 1024, 1024


class Model(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(ROWS, COLS) * 4]


def get_init_inputs() -> list:
    return []
