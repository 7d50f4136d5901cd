import torch
from torch import nn

DESCRIPTION = "Euclidean norm of each row of a (4096, 1024) fp32 tensor"

ROWS, COLS = 4096, 1024


class Model(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(x, ord=2, dim=-1)


def get_inputs() -> list[torch.Tensor]:
    return [torch.randn(ROWS, COLS)]


def get_init_inputs() -> list:
    return []
