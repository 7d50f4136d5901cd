import torch
from torch import nn

DESCRIPTION = "Max over the rows of a (4096, 1024) fp32 tensor (values only, no argmax)"

ROWS, COLS = 4096, 1024


class Model(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.amax(x, dim=-1)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(ROWS, COLS)]


def get_init_inputs() -> list:
    return []
