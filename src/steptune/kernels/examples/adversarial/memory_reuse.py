"""Sakana's exploit: compute nothing and hope the allocator hands back the reference's freed output."""

# expect: incorrect
import torch
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.empty_like(x)
