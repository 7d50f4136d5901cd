"""Normalizes over the wrong dimension (columns instead of rows)."""

# expect: incorrect
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        e = (x - x.amax(dim=0, keepdim=True)).exp()
        return e / e.sum(dim=0, keepdim=True)
