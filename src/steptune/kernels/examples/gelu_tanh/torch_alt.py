"""GELU (tanh) as x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), from elementwise torch ops."""

import math

import torch
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = (2.0 * math.sqrt(2.0 / math.pi)) * (x + 0.044715 * x * x * x)
        return x * torch.sigmoid(u)
