"""Returns the row sums of exp (one value per row) instead of the normalized matrix."""

# expect: incorrect
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        return (x - x.amax(dim=-1, keepdim=True)).exp().sum(dim=-1)
