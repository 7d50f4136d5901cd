"""Allocates without bound."""

# expect: resource_limit
import torch
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        hoard = []
        while True:
            hoard.append(torch.ones(64 * 2**20))
