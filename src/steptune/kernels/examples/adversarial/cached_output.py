"""Computes once, then returns the first result again (a seed-independent, cached output)."""

# expect: rejected
from torch import nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = None

    def forward(self, x):
        if self.cache is None:
            e = (x - x.amax(dim=-1, keepdim=True)).exp()
            self.cache = e / e.sum(dim=-1, keepdim=True)
        return self.cache
