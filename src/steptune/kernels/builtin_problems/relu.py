import torch
from torch import nn

DESCRIPTION = "ReLU over a (2048, 1024) fp32 tensor"

ROWS, COLS = 2048, 1024


class Model(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(ROWS, COLS)]


def get_init_inputs() -> list:
    return []
