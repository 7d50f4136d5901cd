import torch
from torch import nn

DESCRIPTION = "Sum over the first dim (down the columns) of a (4096, 1024) fp32 tensor"

ROWS, COLS = 4096, 1024


class Model(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=0)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(ROWS, COLS)]


def get_init_inputs() -> list:
    return []
